"""ms.load: values copied in place, meta-device modules refused, and assign=True materializing a
model built on the meta device (load_state_dict(assign=True) semantics)."""

import pytest
import torch
from torch import nn

import modstate as ms

from zoo import TiedLM, assert_unchanged, snapshot


def mlp() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(3, 4), nn.ReLU(), nn.BatchNorm1d(4), nn.Linear(4, 2))


def on_meta(factory):
    with torch.device("meta"):
        return factory()


def slots(module):
    """Every slot's object, by path (the module's own identity, meta tensors included)."""
    return {
        f"{prefix}.{name}": tensor
        for prefix, owner in module.named_modules(remove_duplicate=False)
        for table in (owner._parameters, owner._buffers)
        for name, tensor in table.items()
    }


# -- the meta device ---------------------------------------------------------------------------


def test_loading_into_a_meta_model_is_refused_naming_assign_and_the_fix_works():
    tree = ms.extract(mlp(), copy=True)
    meta = on_meta(mlp)
    before = slots(meta)
    with pytest.raises(
        ValueError, match=r"^load: '0\.weight': the module's tensor is on the meta"
    ) as info:
        ms.load(meta, tree)
    assert "assign=True" in str(info.value)
    assert slots(meta) == before  # refused before anything changed

    ms.load(meta, tree, assign=True)  # the fix the message names
    x = torch.randn(5, 3)
    reference = mlp().eval()
    assert torch.equal(meta.eval()(x), reference(x))


def test_the_meta_refusal_holds_on_the_state_dict_route_too():
    meta = on_meta(mlp)
    with pytest.raises(ValueError, match=r"load: '0\.weight'.*meta.*assign=True"):
        ms.load(meta, ms.extract(mlp()), use_state_dict=True)
    ms.load(meta, ms.extract(mlp()), use_state_dict=True, assign=True)
    assert all(t.device.type == "cpu" for t in ms.flatten(ms.extract(meta)).values())


def test_a_meta_tree_is_refused_it_holds_no_data():
    model = mlp()
    before = snapshot(model)
    for assign in (False, True):
        with pytest.raises(
            ValueError, match=r"load: '0\.weight': the tree's tensor is on the meta"
        ):
            ms.load(model, ms.extract(on_meta(mlp)), assign=assign)
    assert_unchanged(model, before)


# -- assign=True ---------------------------------------------------------------------------------


def test_assign_makes_the_trees_tensors_the_modules():
    source = mlp()
    source[2].weight.requires_grad_(False)  # a frozen parameter in the target keeps being frozen
    target = on_meta(mlp)
    target[2].weight.requires_grad_(False)
    tree = ms.extract(source, copy=True)
    ms.load(target, tree, assign=True)

    flat_tree, flat_target = ms.flatten(tree), ms.flatten(ms.extract(target))
    for path, leaf in flat_tree.items():
        now = flat_target[path]
        assert now.data_ptr() == leaf.data_ptr(), path  # no copy: the tree's memory
        if path.endswith(("weight", "bias")):
            assert type(now) is nn.Parameter, path
        else:
            assert now is leaf, path  # a buffer takes the tree's tensor itself
    assert target[0].weight.requires_grad and not target[2].weight.requires_grad
    assert not tree["0"]["weight"].requires_grad  # the tree's own tensors are left as they were


def test_a_parameter_leaf_with_the_modules_flag_goes_in_as_it_is():
    donor = nn.Linear(2, 2)
    target = on_meta(lambda: nn.Linear(2, 2))
    ms.load(target, ms.extract(donor), assign=True)
    assert target.weight is donor.weight and target.bias is donor.bias


def test_assign_keeps_ties_as_one_parameter():
    torch.manual_seed(0)
    tree = ms.extract(TiedLM(), copy=True)
    assert tree["embed"]["weight"] is tree["head"]["weight"]
    lm = on_meta(TiedLM)
    ms.load(lm, tree, assign=True)
    assert lm.head.weight is lm.embed.weight
    assert isinstance(lm.embed.weight, nn.Parameter) and lm.embed.weight.requires_grad
    # A tree that gives the tie once (as save_pretrained files do) fills the whole tie.
    once = ms.flatten(ms.extract(TiedLM(), copy=True))
    del once["head.weight"]
    lm = on_meta(TiedLM)
    ms.load(lm, ms.unflatten(once), assign=True)
    assert lm.head.weight is lm.embed.weight and lm.head.weight.device.type == "cpu"


def test_assign_runs_every_check_before_changing_anything():
    meta = on_meta(mlp)
    before = slots(meta)
    good = ms.extract(mlp(), copy=True)

    wrong_shape = ms.flatten(good)
    wrong_shape["3.bias"] = torch.zeros(7)  # the last path: everything before it would pass
    with pytest.raises(ValueError, match=r"load: '3\.bias': shape \(7,\) in the tree, \(2,\)"):
        ms.load(meta, ms.unflatten(wrong_shape), assign=True)
    with pytest.raises(ValueError, match=r"load: '3\.bias': shape"):
        ms.load(meta, ms.unflatten(wrong_shape), assign=True, strict=False)

    missing = ms.flatten(good)
    del missing["3.bias"]
    with pytest.raises(KeyError, match=r"load: '3\.bias': the tree has no tensor there"):
        ms.load(meta, ms.unflatten(missing), assign=True)

    integer = ms.flatten(good)
    integer["3.bias"] = torch.zeros(2, dtype=torch.long)
    with pytest.raises(TypeError, match=r"load: '3\.bias': dtype torch\.int64 in the tree"):
        ms.load(meta, ms.unflatten(integer), assign=True)
    with pytest.raises(TypeError, match=r"load: '3\.bias': a torch\.int64 tensor cannot become"):
        ms.load(meta, ms.unflatten(integer), assign=True, strict=False)
    assert slots(meta) == before


def test_assign_with_strict_false_takes_a_partial_tree_and_the_trees_dtype():
    target = mlp()
    kept = target[3].weight
    partial = {"0": {"weight": torch.ones(4, 3, dtype=torch.float64)}}
    ms.load(target, partial, assign=True, strict=False)
    assert target[0].weight.dtype == torch.float64  # as load_state_dict(assign=True)
    assert target[0].weight.data_ptr() == partial["0"]["weight"].data_ptr()
    assert target[3].weight is kept


def test_assign_through_state_dict_hooks_as_load_state_dict_does():
    class Renamed(nn.Module):
        """A module whose load pre-hook renames a legacy key."""

        def __init__(self) -> None:
            super().__init__()
            self.lin = nn.Linear(2, 2)
            self._register_load_state_dict_pre_hook(self._rename)

        @staticmethod
        def _rename(state_dict, prefix, *args):
            old = prefix + "lin.w"
            if old in state_dict:
                state_dict[prefix + "lin.weight"] = state_dict.pop(old)

    donor = nn.Linear(2, 2)
    tree = {"lin": {"w": donor.weight.detach().clone(), "bias": donor.bias.detach().clone()}}
    target = on_meta(Renamed)
    ms.load(target, tree, use_state_dict=True, assign=True)
    assert target.lin.weight.data_ptr() == tree["lin"]["w"].data_ptr()
    assert isinstance(target.lin.weight, nn.Parameter) and target.lin.weight.requires_grad

    reference = on_meta(Renamed)
    reference.load_state_dict(ms.flatten(tree), assign=True)
    x = torch.randn(3, 2)
    assert torch.equal(target.lin(x), reference.lin(x))


def test_a_model_loaded_with_assign_trains():
    target = on_meta(mlp)
    ms.load(target, ms.extract(mlp(), copy=True), assign=True)
    opt = torch.optim.SGD(target.parameters(), lr=0.1)  # made after the load, as with torch
    before = target[0].weight.detach().clone()
    target(torch.randn(8, 3)).square().mean().backward()
    opt.step()
    assert not torch.equal(target[0].weight, before)


# -- copying loads -----------------------------------------------------------------------------


def test_load_shape_error_says_the_tree_is_another_models_and_that_model_loads_it():
    def five_outputs() -> nn.Module:
        torch.manual_seed(1)
        return nn.Sequential(nn.Linear(3, 4), nn.ReLU(), nn.BatchNorm1d(4), nn.Linear(4, 5))

    model = mlp()
    tree = ms.extract(five_outputs(), copy=True)
    before = snapshot(model)
    for strict in (True, False):
        with pytest.raises(
            ValueError,
            match=r"^load: '3\.weight': shape \(5, 4\) in the tree, \(2, 4\) in the module, and "
            r"1 more .*the tree is another model's.*build the model the tree was taken from",
        ) as info:
            ms.load(model, tree, strict=strict)
        assert "strict=False" not in str(info.value)  # load never takes other shapes
        assert "ms.swap" not in str(info.value)  # which would run another architecture
    assert_unchanged(model, before)
    owner = five_outputs()
    ms.load(owner, tree)  # the fix the message names
    assert torch.equal(owner[3].weight, tree["3"]["weight"])


def test_load_dtype_error_names_strict_false_and_it_casts():
    model = mlp()
    tree = ms.tree.to(ms.extract(mlp(), copy=True), torch.float64)
    with pytest.raises(
        TypeError, match=r"^load: '0\.weight': dtype torch\.float64.*strict=False casts"
    ):
        ms.load(model, tree)
    ms.load(model, tree, strict=False)
    assert model[0].weight.dtype == torch.float32
    assert torch.equal(model[0].weight, tree["0"]["weight"].float())
