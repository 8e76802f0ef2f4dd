"""A tree and a module of which one carries a wrapper's prefix: the error names the wrapper and
the fixes, and each fix works."""

import pytest
import torch
from torch import nn
from torch.nn.modules.utils import consume_prefix_in_state_dict_if_present

import modstate as ms

from zoo import assert_unchanged, snapshot


def model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(3, 4), nn.ReLU(), nn.Linear(4, 2))


def compiled(inner: nn.Module) -> nn.Module:
    # The eager backend: Dynamo traces as torch.compile always does, without Inductor's codegen
    # (the keys, _orig_mod.*, are the wrapper's, whatever the backend).
    return torch.compile(inner, backend="eager")


WRAPPERS = {
    "_orig_mod": (compiled, r"torch\.compile \(an OptimizedModule\)"),
    "module": (nn.DataParallel, r"DistributedDataParallel or DataParallel"),
}


@pytest.mark.parametrize("prefix", list(WRAPPERS))
def test_a_wrappers_tree_into_the_plain_model_names_the_wrapper_and_the_prefix_comes_off(prefix):
    wrap, wrapper = WRAPPERS[prefix]
    plain, x = model(), torch.randn(5, 3)
    wrapped_tree = ms.extract(wrap(model()), copy=True)  # keys {prefix}.0.weight, ...
    assert list(wrapped_tree) == [prefix]
    before = snapshot(plain)
    with pytest.raises(
        KeyError,
        match=rf"^call: '{prefix}\.0\.weight': the tree's paths start with '{prefix}\.', as those "
        rf"of a model wrapped by {wrapper} do, and the module's do not; strip the prefix: "
        rf"tree = ms\.unflatten\(tree\)\['{prefix}'\]",
    ) as info:
        ms.call(plain, wrapped_tree, x)
    assert f"consume_prefix_in_state_dict_if_present(state_dict, '{prefix}.')" in str(info.value)
    assert_unchanged(plain, before)

    expected = model()(x)
    assert torch.equal(ms.call(plain, ms.unflatten(wrapped_tree)[prefix], x), expected)
    state_dict = wrap(model()).state_dict()  # flat, the form checkpoints of wrappers take
    assert torch.equal(ms.call(plain, ms.unflatten(state_dict)[prefix], x), expected)
    with pytest.raises(KeyError, match=rf"^load: '{prefix}\.0\.weight': the tree's paths start"):
        ms.load(plain, state_dict, use_state_dict=True)  # through load_state_dict's hooks too
    consume_prefix_in_state_dict_if_present(state_dict, f"{prefix}.")  # torch's fix, in place
    ms.load(plain, state_dict)
    assert torch.equal(plain(x), expected)


@pytest.mark.parametrize("prefix", list(WRAPPERS))
def test_a_plain_tree_into_the_wrapper_names_the_wrapper_and_the_prefix_goes_on(prefix):
    wrap, wrapper = WRAPPERS[prefix]
    wrapped, x = wrap(model()), torch.randn(5, 3)
    tree = ms.extract(model(), copy=True)
    with pytest.raises(
        KeyError,
        match=rf"^call: '0\.weight': the module is wrapped by {wrapper}: its paths start with "
        rf"'{prefix}\.', the tree's do not; give the tree to the model inside, wrapped\.{prefix} "
        rf"\(e\.g\. ms\.call\(wrapped\.{prefix}, tree, x\)\), or add the prefix: "
        rf"\{{'{prefix}': tree\}}",
    ):
        ms.call(wrapped, tree, x)
    expected = model()(x)
    assert torch.equal(ms.call(getattr(wrapped, prefix), tree, x), expected)
    assert torch.equal(ms.call(wrapped, {prefix: tree}, x), expected)  # runs the wrapper
    with ms.inject(wrapped, {prefix: ms.flatten(tree)}):  # a flat state dict nests alike
        assert torch.equal(wrapped(x), expected)
