"""What stack_modules, vmap_call and Ensemble refuse before running, and what they keep."""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

import modstate as ms


def mlp():
    return nn.Sequential(nn.Linear(3, 4), nn.BatchNorm1d(4), nn.Linear(4, 2)).eval()


def seeded(factory, n):
    torch.manual_seed(0)
    return [factory() for _ in range(n)]


# -- torch.fx graph modules -----------------------------------------------------------------------


def test_graph_modules_with_the_same_code_stack_though_fx_makes_a_class_per_copy():
    gm = torch.fx.symbolic_trace(mlp())
    twin = copy.deepcopy(gm)
    assert type(gm) is not type(twin)
    stacked = ms.stack_modules([gm, twin])
    assert stacked["0"]["weight"].shape == (2, 4, 3)
    x = torch.randn(5, 3)
    ensemble = ms.Ensemble([gm, twin], route="batched")
    torch.testing.assert_close(ensemble(x), torch.stack([gm(x), twin(x)]))


def test_graph_modules_with_different_code_are_refused():
    gm = torch.fx.symbolic_trace(mlp())
    other = torch.fx.symbolic_trace(
        nn.Sequential(nn.Linear(3, 4), nn.BatchNorm1d(4), nn.Linear(4, 2))
    )
    other.graph.call_function(torch.relu, (next(iter(other.graph.nodes)),))  # dead code is code
    other.recompile()
    with pytest.raises(
        TypeError, match="the root: module 1 and module 0 are torch.fx GraphModules"
    ):
        ms.stack_modules([gm, other])


def test_classes_with_one_name_are_told_apart_by_their_module():
    class Linear(nn.Linear):  # same __name__ as torch.nn.Linear
        pass

    with pytest.raises(TypeError, match=r"test_checks.*Linear there, module 0 a torch\.nn"):
        ms.stack_modules([nn.Linear(2, 2), Linear(2, 2)])


# -- the template keeps the original's flags -------------------------------------------------------


class ReInit(nn.Module):
    """Its ``__deepcopy__`` re-runs ``__init__``, as torchvision's feature extractors do: the copy
    comes back in training mode with every parameter trainable."""

    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(3, 4)
        self.norm = nn.BatchNorm1d(4)

    def forward(self, x):
        return self.norm(self.lin(x))

    def __deepcopy__(self, memo):
        fresh = ReInit()
        fresh.load_state_dict(self.state_dict())
        return fresh


def test_the_ensemble_template_has_the_originals_flags_whatever_deepcopy_does():
    models = seeded(ReInit, 3)
    for m in models:
        m.eval()
        m.lin.bias.requires_grad_(False)
    assert copy.deepcopy(models[0]).training  # what the class's copy does by itself
    ensemble = ms.Ensemble(models, route="batched")
    x = torch.randn(5, 3)
    torch.testing.assert_close(ensemble(x), torch.stack([m(x) for m in models]))
    member = ensemble.member(1)
    assert not member.training and not member.norm.training
    assert not member.lin.bias.requires_grad and member.lin.weight.requires_grad


# -- stack_modules refuses what it cannot keep -----------------------------------------------------


def test_mixed_requires_grad_at_a_path_is_refused_and_the_fix_works():
    models = seeded(mlp, 3)
    models[2][0].weight.requires_grad_(False)
    with pytest.raises(ValueError, match=r"'0\.weight': requires_grad is False in module 2, True"):
        ms.stack_modules(models)
    for m in models:  # the fix the message suggests: freeze it everywhere
        m[0].weight.requires_grad_(False)
    assert not ms.stack_modules(models)["0"]["weight"].requires_grad


def test_uninitialized_lazy_parameters_are_refused_and_the_fix_works():
    models = seeded(lambda: nn.Sequential(nn.LazyLinear(4), nn.ReLU()), 2)
    with pytest.raises(
        ValueError, match=r"stack_modules: '0\.weight': not initialized yet in module 0"
    ):
        ms.stack_modules(models)
    for m in models:  # the fix the message suggests: run each once
        m(torch.randn(1, 3))
    assert ms.stack_modules(models)["0"]["weight"].shape == (2, 4, 3)


# -- vmap_call checks member counts before running -------------------------------------------------


def test_an_input_with_another_member_count_is_named_with_both_counts():
    models = seeded(mlp, 4)
    stacked = ms.stack_modules(models)
    with pytest.raises(ValueError, match=r"input 1 has 3 members along dim 0 .* 4 members"):
        ms.vmap_call(models[0], stacked, torch.randn(4, 5, 3), torch.randn(3, 5), in_dims=(0, 0))
    x = torch.randn(3, 5, 3)
    with pytest.raises(ValueError, match=r"^vmap_call: input 0 has 3 members .* or in_dims=None"):
        ms.vmap_call(models[0], stacked, x, in_dims=0)
    x = torch.randn(4, 5, 3)  # the fix: one slice per member
    out = ms.vmap_call(models[0], stacked, x, in_dims=0)
    torch.testing.assert_close(
        out, torch.stack([m(x[i]) for i, m in enumerate(models)]), atol=1e-5, rtol=0
    )
    ensemble = ms.Ensemble(models, in_dims=0, route="batched")
    with pytest.raises(ValueError, match="input 0 has 3 members along dim 0.*the ensemble has 4"):
        ensemble(torch.randn(3, 5, 3))


def test_a_leaf_with_another_member_count_is_named_with_both_counts():
    models = seeded(mlp, 4)
    stacked = ms.stack_modules(models)
    stacked["2"]["bias"] = stacked["2"]["bias"][:3]
    with pytest.raises(
        ValueError, match=r"vmap_call: '2\.bias': 3 members along dim 0, '0\.bias' has 4"
    ):
        ms.vmap_call(models[0], stacked, torch.randn(5, 3))


def test_an_unstacked_tree_is_recognized_and_the_fix_works():
    model = mlp()
    tree = ms.extract(model)
    with pytest.raises(ValueError, match="the tree is not stacked.*ms.stack"):
        ms.vmap_call(model, tree, torch.randn(5, 3))
    out = ms.vmap_call(model, ms.stack([tree]), torch.randn(5, 3))
    assert out.shape == (1, 5, 2)


def test_a_member_shape_that_is_not_the_modules_is_named():
    model = mlp()
    stacked = ms.stack_modules([model, copy.deepcopy(model)])
    stacked["0"]["weight"] = torch.zeros(2, 4, 5)
    with pytest.raises(ValueError, match=r"'0\.weight'.*each member holds \(4, 5\).*\(4, 3\)"):
        ms.vmap_call(model, stacked, torch.randn(5, 3))


def test_one_randomness_default_for_vmap_call_and_ensemble():
    models = seeded(lambda: nn.Sequential(nn.Linear(3, 8), nn.Dropout(0.5)).train(), 2)
    stacked = ms.stack_modules(models)
    x = torch.ones(4, 3)
    with pytest.raises(RuntimeError, match="randomness"):
        ms.vmap_call(models[0], stacked, x)
    with pytest.raises(RuntimeError, match="randomness"):
        ms.Ensemble(models, route="batched")(x)
    assert ms.Ensemble(models, route="batched").randomness == "error"
    out = ms.vmap_call(models[0], stacked, x, randomness="different")
    assert not torch.equal(out[0] == 0, out[1] == 0)


class NoisyBlock(nn.Module):
    """Dropout inside a forward of its own (as in Hugging Face layers): it runs under vmap, so
    torch's vmap error, which speaks of vmap's flags, is what the user meets first."""

    def __init__(self) -> None:
        super().__init__()
        self.linear = nn.Linear(3, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return nn.functional.dropout(self.linear(x), 0.5, self.training)


def test_a_random_op_under_vmap_names_the_fix_for_ensemble_and_vmap_call_and_it_works():
    models = seeded(lambda: NoisyBlock().train(), 2)
    x = torch.ones(4, 3)
    with pytest.raises(RuntimeError, match="randomness error mode") as refused:
        ms.Ensemble(models, route="batched")(x)
    note = "\n".join(refused.value.__notes__)
    assert "ms.Ensemble(models, randomness='different')" in note
    out = ms.Ensemble(models, randomness="different", route="batched")(x)  # the fix the note names
    assert not torch.equal(out[0] == 0, out[1] == 0)

    stacked = ms.stack_modules(models)
    with pytest.raises(RuntimeError, match="randomness error mode") as refused:
        ms.vmap_call(models[0], stacked, x)
    assert "ms.vmap_call(module, stacked, x, randomness='different')" in "\n".join(
        refused.value.__notes__
    )
    assert ms.vmap_call(models[0], stacked, x, randomness="different").shape == (2, 4, 8)
