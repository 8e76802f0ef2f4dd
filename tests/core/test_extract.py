import pytest
import torch
from hypothesis import given, settings
from torch import nn

import modstate as ms

from zoo import CASE_IDS, CASES, Counter, SharedBlock, TiedLM, WithExtraState, module_trees


def test_leaves_are_the_modules_own_objects():
    model = nn.Sequential(nn.Linear(3, 4), nn.ReLU(), nn.BatchNorm1d(4))
    tree = ms.extract(model)
    assert list(tree) == ["0", "2"]  # the ReLU holds no state
    assert list(tree["2"]) == [
        "weight",
        "bias",
        "running_mean",
        "running_var",
        "num_batches_tracked",
    ]
    assert tree["0"]["weight"] is model[0].weight
    assert tree["2"]["running_mean"] is model[2].running_mean


def test_non_persistent_buffers_are_included_and_buffers_false_drops_buffers():
    module = WithExtraState()
    assert set(ms.extract(module)) == {"linear", "offset", "scratch"}
    assert set(ms.flatten(ms.extract(module, buffers=False))) == {"linear.weight", "linear.bias"}
    assert "scratch" not in ms.extract(module, use_state_dict=True)


def test_shared_submodule_appears_once_and_tied_tensor_at_every_path():
    assert set(ms.extract(SharedBlock())) == {"block", "out"}
    lm = TiedLM()
    tree = ms.extract(lm)
    assert tree["head"]["weight"] is tree["embed"]["weight"] is lm.embed.weight


def test_detach_keeps_ties_and_shares_storage():
    lm = TiedLM()
    tree = ms.extract(lm, detach=True)
    assert tree["head"]["weight"] is tree["embed"]["weight"]
    assert not tree["embed"]["weight"].requires_grad
    assert tree["embed"]["weight"].data_ptr() == lm.embed.weight.data_ptr()


def test_extract_sees_changes_to_the_module():
    model = nn.Sequential(nn.Linear(2, 2))
    first = ms.extract(model)
    model[0].weight = nn.Parameter(torch.zeros(2, 2))
    model[0].register_buffer("mask", torch.ones(2))
    model.append(nn.Linear(2, 1))
    second = ms.extract(model)
    assert second["0"]["weight"] is model[0].weight is not first["0"]["weight"]
    assert ms.flatten(second).keys() == {"0.weight", "0.bias", "0.mask", "1.weight", "1.bias"}


@pytest.mark.parametrize("case", CASES, ids=CASE_IDS)
def test_use_state_dict_is_exactly_state_dict(case):
    module = case.make()
    module(case.input())  # lazy and power-iteration state settle in the first call
    expected = module.state_dict(keep_vars=True)
    flat = ms.flatten(ms.extract(module, use_state_dict=True))
    assert list(flat) == list(expected)
    for key, value in expected.items():
        if isinstance(value, torch.Tensor):
            assert torch.equal(flat[key], value), key
        else:
            assert flat[key] == value, key


def test_use_state_dict_runs_state_dict_hooks_at_their_real_prefix():
    seen = []

    def renaming_hook(module, state_dict, prefix, local_metadata):
        seen.append(prefix)
        state_dict[prefix + "renamed"] = state_dict.pop(prefix + "weight") * 2

    model = nn.Sequential(nn.Sequential(nn.Linear(2, 2)))
    model[0][0]._register_state_dict_hook(renaming_hook)
    tree = ms.extract(model, use_state_dict=True)
    assert seen == ["0.0."]
    assert torch.equal(tree["0"]["0"]["renamed"], model[0][0].weight * 2)
    assert "weight" not in tree["0"]["0"]
    assert tree["0"]["0"]["bias"] is model[0][0].bias


def test_extra_state_is_an_opaque_leaf():
    tree = ms.extract(WithExtraState(), use_state_dict=True)
    assert tree["_extra_state"] == {"calls": 0, "note": "opaque"}


def test_torchscript_is_refused():
    with pytest.raises(TypeError, match="TorchScript"):
        ms.extract(torch.jit.script(nn.Linear(2, 2)))


@settings(max_examples=25, deadline=None)
@given(module_trees())
def test_random_trees_extract_like_state_dict(factory):
    build, _ = factory
    module = build()
    flat = ms.flatten(ms.extract(module))
    assert list(flat) == list(module.state_dict())  # tied paths included, same order
    named = dict(module.named_parameters(remove_duplicate=False))
    named |= dict(module.named_buffers(remove_duplicate=False))
    for path, leaf in flat.items():
        assert leaf is named[path]


def test_counter_module_has_its_buffer():
    assert ms.extract(Counter())["count"].dtype == torch.long


# -- which leaves share memory with the module (issue 22, item 3) ------------------------------


def test_copy_gives_a_snapshot_that_stays_while_the_model_trains():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(3, 4), nn.BatchNorm1d(4), nn.Linear(4, 1))
    shared = ms.extract(model, detach=True)
    snapshot = ms.extract(model, copy=True)
    start = ms.tree.clone(snapshot)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    for _ in range(3):
        model(torch.randn(8, 3)).square().mean().backward()
        opt.step()
        opt.zero_grad()
    for path, leaf in ms.flatten(snapshot).items():
        assert torch.equal(leaf, ms.flatten(start)[path]), path  # the snapshot stayed
        assert not leaf.requires_grad
    # detach=True shares storage: it followed the model (issue 22's trap), copy=True did not.
    assert torch.equal(shared["0"]["weight"], model[0].weight)
    assert not torch.equal(snapshot["0"]["weight"], model[0].weight)


def test_copy_keeps_ties_one_copy_at_every_path():
    lm = TiedLM()
    tree = ms.extract(lm, copy=True)
    assert tree["embed"]["weight"] is tree["head"]["weight"]
    assert tree["embed"]["weight"].data_ptr() != lm.embed.weight.data_ptr()


def test_a_call_in_train_mode_on_a_copy_leaves_the_models_counter_alone():
    """issue 22: ``ms.call(model, (ema, ints), x)`` in train mode with ``ints`` taken with
    ``detach=True`` advanced the model's own ``num_batches_tracked`` through shared storage."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(3, 4), nn.BatchNorm1d(4))  # train mode
    x = torch.randn(8, 3)

    floats, ints = ms.tree.partition(ms.extract(model, detach=True), ms.tree.is_float)
    ms.call(model, (floats, ints), x)
    assert int(model[1].num_batches_tracked) == 1  # the trap: storage shared with the model

    floats, ints = ms.tree.partition(ms.extract(model, copy=True), ms.tree.is_float)
    running_mean = model[1].running_mean.clone()
    ms.call(model, (floats, ints), x)
    assert int(model[1].num_batches_tracked) == 1  # the documented recipe: the copy moved ...
    assert int(ints["1"]["num_batches_tracked"]) == 2
    assert torch.equal(model[1].running_mean, running_mean)  # ... the model did not


@pytest.mark.parametrize("given", ["state_dict", "tree"])
def test_a_state_dict_or_a_tree_is_refused_naming_unflatten_and_the_fix_works(given):
    model = nn.Sequential(nn.Linear(3, 4), nn.BatchNorm1d(4))
    value = model.state_dict() if given == "state_dict" else ms.extract(model)
    with pytest.raises(
        TypeError, match=r"^extract: got an? (OrderedDict|dict) \(a state dict"
    ) as info:
        ms.extract(value)  # type: ignore[arg-type]
    message = str(info.value)
    assert "takes the module itself: ms.extract(model)" in message
    assert "ms.unflatten(state_dict)" in message

    tree = ms.unflatten(model.state_dict())  # the fix for a state dict
    expected = ms.extract(model, use_state_dict=True, detach=True)
    assert ms.flatten(tree).keys() == ms.flatten(expected).keys()
    for path, leaf in ms.flatten(tree).items():
        assert torch.equal(leaf, ms.flatten(expected)[path])
    x = torch.randn(5, 3)
    assert torch.equal(ms.call(model.eval(), tree, x), model(x))  # and it is a tree modstate takes
    assert ms.extract(model)["0"]["weight"] is model[0].weight  # the fix for the tree: the module


def test_anything_else_is_refused_naming_the_module():
    with pytest.raises(
        TypeError, match=r"^extract: got a list, not an nn\.Module; pass the module"
    ):
        ms.extract([nn.Linear(2, 2)])  # type: ignore[arg-type]
