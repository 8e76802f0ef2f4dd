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
