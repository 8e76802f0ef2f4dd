import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

import modstate as ms

keys = st.text("abc_0", min_size=1, max_size=3)
trees = st.recursive(
    st.builds(torch.zeros, st.integers(0, 2)),
    lambda children: st.dictionaries(keys, children, min_size=1, max_size=3),
    max_leaves=12,
).filter(lambda t: isinstance(t, dict))


@given(trees)
def test_unflatten_undoes_flatten(tree):
    flat = ms.flatten(tree)
    assert ms.flatten(ms.unflatten(flat)) == flat
    assert all(isinstance(v, torch.Tensor) for v in flat.values())


def test_flatten_keeps_state_dict_order():
    model = torch.nn.Sequential(torch.nn.Linear(2, 2), torch.nn.BatchNorm1d(2))
    assert list(ms.flatten(ms.extract(model))) == list(model.state_dict())


def test_extra_state_dicts_are_leaves():
    tree = {"block": {"weight": torch.ones(1), "_extra_state": {"calls": 3}}}
    assert ms.flatten(tree) == {
        "block.weight": tree["block"]["weight"],
        "block._extra_state": {"calls": 3},
    }
    assert ms.unflatten(ms.flatten(tree))["block"]["_extra_state"] == {"calls": 3}


def test_unflatten_refuses_a_leaf_that_is_also_a_prefix():
    with pytest.raises(ValueError, match="'a.b'"):
        ms.unflatten({"a": torch.ones(1), "a.b": torch.ones(1)})
    with pytest.raises(ValueError, match="'a'"):
        ms.unflatten({"a.b": torch.ones(1), "a": torch.ones(1)})


# -- flat state_dict()-style trees (issue 22, item 5) ------------------------------------------


def bn_model() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(3, 4), torch.nn.BatchNorm1d(4)).eval()


def test_a_flat_state_dict_is_a_tree_a_dotted_key_is_the_path_it_spells():
    model, other = bn_model(), bn_model()
    torch.nn.init.ones_(other[0].weight)
    x = torch.randn(5, 3)
    assert torch.equal(ms.call(model, other.state_dict(), x), other(x))
    mixed = {"0.weight": other[0].weight, "0": {"bias": other[0].bias}, "1": other[1].state_dict()}
    assert torch.equal(ms.call(model, mixed, x), other(x))  # both forms in one tree
    ms.load(model, other.state_dict())
    assert torch.equal(model[0].weight, other[0].weight)


def test_a_path_given_both_flat_and_nested_is_refused_naming_it():
    from zoo import assert_unchanged, forward_with, snapshot

    model = bn_model()
    tree = ms.extract(model, copy=True)
    tree["0.weight"] = torch.zeros(4, 3)  # also at tree["0"]["weight"]: which one is meant?
    before = snapshot(model)
    pattern = r"'0\.weight': given twice in one tree, as a dotted key and nested; "
    with pytest.raises(ValueError, match="^call: " + pattern):
        ms.call(model, tree, torch.randn(2, 3))
    with pytest.raises(ValueError, match="^load: " + pattern):
        ms.load(model, tree)
    with pytest.raises(ValueError, match="^inject: " + pattern):
        ms.inject(model, tree, strict=False).__enter__()
    with pytest.raises(ValueError, match="^swap: " + pattern):
        ms.swap(model, tree, use_state_dict=True)
    with pytest.raises(ValueError, match=r"^flatten: '0\.weight': given twice"):
        ms.flatten(tree)
    assert_unchanged(model, before)
    del tree["0"]["weight"]  # the fix: each path once
    x = torch.ones(1, 3)
    expected = forward_with(model, tree, x)  # the zeroed weight is the one used
    assert torch.equal(ms.call(model, tree, x), expected)
    assert torch.equal(ms.call_partial(model, tree, x), expected)
    assert not torch.equal(model(x), expected)
