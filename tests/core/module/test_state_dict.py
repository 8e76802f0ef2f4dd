"""The state_dict bridge: trees that go through the module's own load_state_dict hooks."""

import pytest
import torch
from torch import nn
from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper

import modstate as ms

from zoo import WithExtraState, assert_unchanged, snapshot


def test_weight_norm_accepts_its_legacy_keys():
    layer = nn.utils.parametrizations.weight_norm(nn.Linear(3, 4))
    g, v, bias = torch.rand(4, 1) + 0.5, torch.randn(4, 3), torch.randn(4)
    legacy = {"weight_g": g, "weight_v": v, "bias": bias}  # what the old weight_norm saved
    x = torch.randn(2, 3)
    expected = x @ (g * v / v.norm(dim=1, keepdim=True)).T + bias
    before = snapshot(layer)
    with ms.inject(layer, legacy, use_state_dict=True):
        assert layer.parametrizations.weight.original0 is g  # no copy: the tree's own tensor
        assert torch.allclose(layer(x), expected, atol=1e-6)
    assert_unchanged(layer, before)
    ms.load(layer, legacy, use_state_dict=True)
    assert torch.allclose(layer(x), expected, atol=1e-6)


def test_a_pre_hook_that_renames_a_legacy_key_at_its_real_prefix():
    prefixes = []

    def rename_gamma(state_dict, prefix, *args):
        prefixes.append(prefix)
        if prefix + "gamma" in state_dict:
            state_dict[prefix + "weight"] = state_dict.pop(prefix + "gamma")

    model = nn.Sequential(nn.Linear(2, 2), nn.LayerNorm(2))
    model[1]._register_load_state_dict_pre_hook(rename_gamma)
    tree = ms.extract(model, detach=True)
    gamma = torch.full((2,), 3.0)
    tree["1"] = {"gamma": gamma, "bias": tree["1"]["bias"]}
    with ms.inject(model, tree, use_state_dict=True):
        assert model[1].weight is gamma
    assert prefixes == ["1."]
    with pytest.raises(KeyError, match="'1.gamma'"):
        with ms.inject(model, tree):  # without the hooks the legacy key is unknown
            pass


def test_gradients_flow_through_the_state_dict_route():
    layer = nn.utils.parametrizations.weight_norm(nn.Linear(3, 1))
    g = torch.ones(1, 1, requires_grad=True)
    v = torch.randn(1, 3, requires_grad=True)
    with ms.inject(
        layer, {"weight_g": g, "weight_v": v, "bias": torch.zeros(1)}, use_state_dict=True
    ):
        layer(torch.randn(4, 3)).sum().backward()
    assert g.grad is not None and v.grad is not None


def test_lazy_module_materializes_under_load_and_stays_lazy_under_inject():
    x = torch.randn(4, 3)
    tree = {"weight": torch.randn(2, 3), "bias": torch.randn(2)}
    lazy = nn.LazyLinear(2)
    before = snapshot(lazy)
    with ms.inject(lazy, tree, use_state_dict=True):
        assert torch.allclose(lazy(x), x @ tree["weight"].T + tree["bias"])
    assert_unchanged(lazy, before)
    assert isinstance(lazy, nn.LazyLinear) and nn.parameter.is_lazy(lazy.weight)

    ms.load(lazy, tree, use_state_dict=True)  # as load_state_dict does: materialize, then copy
    assert not nn.parameter.is_lazy(lazy.weight)
    assert torch.equal(lazy.weight, tree["weight"]) and lazy.weight is not tree["weight"]


def test_checkpoint_wrapper_keys_round_trip_without_the_wrapper_prefix():
    torch.manual_seed(0)
    wrapped = nn.Sequential(checkpoint_wrapper(nn.Linear(3, 4)), nn.ReLU())
    plain = nn.Sequential(nn.Linear(3, 4), nn.ReLU())
    tree = ms.extract(plain, detach=True)
    assert set(ms.flatten(ms.extract(wrapped, use_state_dict=True))) == {"0.weight", "0.bias"}
    assert "_checkpoint_wrapped_module" in ms.extract(wrapped)["0"]
    x = torch.randn(2, 3)
    with ms.inject(wrapped, tree, use_state_dict=True):
        assert torch.equal(wrapped(x), plain(x))
    ms.load(wrapped, tree, use_state_dict=True)
    assert torch.equal(wrapped(x), plain(x))


def test_extra_state_is_set_inside_and_restored_after():
    module = WithExtraState()
    module.calls = 2
    tree = ms.extract(module, use_state_dict=True)
    tree["_extra_state"] = {"calls": 40, "note": "opaque"}
    with ms.inject(module, tree, use_state_dict=True):
        assert module.calls == 40
    assert module.calls == 2
    old = ms.swap(module, tree, use_state_dict=True)
    assert module.calls == 40 and old["_extra_state"] == {"calls": 2, "note": "opaque"}
    ms.load(module, {**tree, "_extra_state": {"calls": 7}}, use_state_dict=True)
    assert module.calls == 7


def test_post_hooks_see_and_may_clear_missing_keys():
    model = nn.Sequential(nn.Linear(2, 2), nn.Linear(2, 2))

    def optional_second_layer(module, incompatible):
        incompatible.missing_keys[:] = [
            k for k in incompatible.missing_keys if not k.startswith("1.")
        ]

    model.register_load_state_dict_post_hook(optional_second_layer)
    first_only = {"0": ms.extract(model, detach=True)["0"]}
    with ms.inject(model, first_only, use_state_dict=True):
        pass
    with pytest.raises(KeyError, match="'1.weight'"):
        with ms.inject(model, first_only):
            pass


def test_batchnorm_without_num_batches_tracked_is_accepted_as_load_state_dict_does():
    norm = nn.BatchNorm1d(3)
    own = dict(norm.state_dict(keep_vars=True))
    tree = {key: value + 1 for key, value in own.items() if key != "num_batches_tracked"}
    norm.load_state_dict(tree)  # torch accepts it ...
    ms.load(norm, tree, use_state_dict=True)  # ... and so do we
    with ms.inject(norm, tree, use_state_dict=True):
        inside = dict(norm.state_dict(keep_vars=True))
        assert all(inside[key] is value for key, value in tree.items())
        # the missing counter keeps the module's own, as load_state_dict's BatchNorm hook does
        assert inside["num_batches_tracked"] is own["num_batches_tracked"]
    after = dict(norm.state_dict(keep_vars=True))
    assert list(after) == list(own) and all(after[key] is own[key] for key in own)


def test_swap_through_state_dict_returns_the_old_tree_by_state_dict_keys():
    wrapped = nn.Sequential(checkpoint_wrapper(nn.Linear(3, 4)))
    own = wrapped[0]._checkpoint_wrapped_module.weight
    new = ms.extract(nn.Sequential(nn.Linear(3, 4)), detach=True)
    old = ms.swap(wrapped, new, use_state_dict=True)
    assert wrapped[0]._checkpoint_wrapped_module.weight is new["0"]["weight"]
    assert old["0"]["_checkpoint_wrapped_module"]["weight"] is own
    ms.swap(wrapped, old)
    assert wrapped[0]._checkpoint_wrapped_module.weight is own


def test_modules_with_their_own_load_from_state_dict_are_refused_by_inject():
    class Custom(nn.Linear):
        def _load_from_state_dict(self, *args, **kwargs):
            super()._load_from_state_dict(*args, **kwargs)

    model = nn.Sequential(Custom(2, 2))
    tree = ms.extract(model, detach=True)
    with pytest.raises(NotImplementedError, match="'0'.*Custom"):
        with ms.inject(model, tree, use_state_dict=True):
            pass
    ms.load(model, ms.extract(nn.Sequential(nn.Linear(2, 2))), use_state_dict=True)  # load can
