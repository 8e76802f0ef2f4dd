"""The ``Ensemble`` module (``ensemble/_ensemble.py``): every zoo model and random module trees
run as ensembles, training with ``torch.optim``, ``state_dict``, copies, members, and its
signature and documentation."""

from __future__ import annotations

import copy
import inspect
import io

import pytest
import torch
from hypothesis import given, settings
from torch import nn

import modstate as ms

from members import ATOL, cnn, loop, mlp, seeded
from zoo import CASE_IDS, CASES, assert_unchanged, module_trees, snapshot


@pytest.mark.parametrize("case", CASES, ids=CASE_IDS)
def test_every_zoo_model_runs_as_an_ensemble(case):
    models = [case.make(seed) for seed in range(3)]
    x = case.input()
    expected = loop(models, x)
    base = models[0]
    before = snapshot(base)
    torch.testing.assert_close(
        ms.vmap_call(base, ms.stack_modules(models), x), expected, atol=ATOL, rtol=0
    )
    assert_unchanged(base, before)
    ensemble = ms.Ensemble(models, route="batched")
    torch.testing.assert_close(ensemble(x), expected, atol=ATOL, rtol=0)
    torch.testing.assert_close(ensemble.member(1)(x), models[1](x), atol=ATOL, rtol=0)
    assert_unchanged(base, before)


@settings(max_examples=15, deadline=None)
@given(tree=module_trees())
def test_random_module_trees_run_as_ensembles(tree):
    build, width = tree
    models = [build(seed) for seed in range(2)]
    x = torch.randn(3, width)
    expected = loop(models, x)
    stacked = ms.stack_modules(models)
    for path, leaf in ms.flatten(ms.extract(models[0])).items():  # ties stay ties
        tied = [p for p, other in ms.flatten(ms.extract(models[0])).items() if other is leaf]
        assert all(ms.flatten(stacked)[p] is ms.flatten(stacked)[path] for p in tied)
    if stacked:
        out = ms.vmap_call(models[0], stacked, x)
        torch.testing.assert_close(out, expected, atol=ATOL, rtol=0)
    else:  # no state and a shared input: vmap_call cannot tell how many members there are
        with pytest.raises(ValueError, match="how many members"):
            ms.vmap_call(models[0], stacked, x)
    torch.testing.assert_close(ms.Ensemble(models, route="batched")(x), expected, atol=ATOL, rtol=0)


def test_ensemble_trains_with_torch_optim():
    torch.manual_seed(0)
    ensemble = ms.Ensemble.from_factory(mlp, 4, route="batched")
    models_before = [copy.deepcopy(m) for m in ensemble.members()]
    optimizer = torch.optim.Adam(ensemble.parameters(), lr=1e-2)
    x, y = torch.randn(32, 5), torch.randn(32, 3)
    losses = []
    for _ in range(30):
        optimizer.zero_grad()
        loss = (ensemble(x) - y).square().mean()
        loss.backward()
        optimizer.step()
        losses.append(loss.item())
    assert losses[-1] < 0.7 * losses[0]
    trained = ensemble.members()
    assert not torch.equal(trained[0][0].weight, models_before[0][0].weight)
    torch.testing.assert_close(torch.stack([m(x) for m in trained]), ensemble(x), atol=ATOL, rtol=0)


def test_state_dict_round_trips_and_uses_the_models_paths():
    models = seeded(cnn, 2)
    ensemble = ms.Ensemble(models, route="batched")
    state = ensemble.state_dict()
    assert list(state) == [f"stacked.{key}" for key in models[0].state_dict()]
    assert state["stacked.0.weight"].shape == (2, 4, 3, 3, 3)
    buffer = io.BytesIO()
    torch.save(state, buffer)
    buffer.seek(0)
    other = ms.Ensemble(seeded(cnn, 2, seed=1), route="batched").eval()
    other.load_state_dict(torch.load(buffer))
    x = torch.randn(2, 3, 8, 8)
    torch.testing.assert_close(other(x), ensemble.eval()(x), atol=ATOL, rtol=0)
    assert ms.flatten(ensemble.tree()).keys() == ms.flatten(ms.extract(models[0])).keys()
    assert ensemble.tree()["0"]["weight"] is ensemble.stacked.get_submodule("0").weight


def test_to_double_and_deepcopy():
    models = seeded(cnn, 2)
    ensemble = ms.Ensemble(models, route="batched").eval()
    x = torch.randn(2, 3, 8, 8)
    expected = ensemble(x)
    assert ensemble.double() is ensemble
    assert all(p.dtype == torch.float64 for p in ensemble.parameters())
    torch.testing.assert_close(ensemble(x.double()), expected.double(), atol=ATOL, rtol=0)
    assert ensemble.member(0)[0].weight.dtype == torch.float64
    clone = copy.deepcopy(ensemble.float())
    with torch.no_grad():
        clone.stacked.get_submodule("5").bias.add_(1)
    torch.testing.assert_close(clone(x), expected + 1, atol=ATOL, rtol=0)
    torch.testing.assert_close(ensemble(x), expected, atol=ATOL, rtol=0)
    buffer = io.BytesIO()
    torch.save(ensemble, buffer)
    buffer.seek(0)
    loaded = torch.load(buffer, weights_only=False)
    torch.testing.assert_close(loaded(x), expected, atol=ATOL, rtol=0)
    with torch.no_grad():
        loaded.stacked.get_submodule("5").bias.sub_(1)
    torch.testing.assert_close(loaded(x), expected - 1, atol=ATOL, rtol=0)


def test_member_is_an_ordinary_independent_module():
    models = seeded(cnn, 3)
    for model in models:
        model[0].bias.requires_grad_(False)
    ensemble = ms.Ensemble(models, route="batched")
    member = ensemble.member(1)
    assert type(member) is nn.Sequential and member.training
    assert isinstance(member[0].weight, nn.Parameter)
    assert not member[0].bias.requires_grad and member[0].weight.requires_grad
    for key, value in member.state_dict().items():
        torch.testing.assert_close(value, models[1].state_dict()[key], msg=key)
    with torch.no_grad():
        member[0].weight.zero_()
    assert ensemble.stacked.get_submodule("0").weight[1].abs().sum() > 0
    assert member is not ensemble.member(1)
    assert [m[0].weight.sum().item() for m in ensemble.members()] == pytest.approx(
        [m[0].weight.sum().item() for m in models]
    )
    with pytest.raises(
        IndexError, match="Ensemble.member: index 3 is out of range .*; give 0 to 2"
    ):
        ensemble.member(3)


def test_ensemble_leaves_the_models_alone_and_train_eval_reach_every_layer():
    models = seeded(cnn, 2)
    before = [snapshot(m) for m in models]
    ensemble = ms.Ensemble(models, route="batched")
    ensemble(torch.randn(2, 3, 8, 8)).sum().backward()
    for model, then in zip(models, before, strict=True):
        assert_unchanged(model, then)
        assert all(p.grad is None for p in model.parameters())
    assert ensemble.eval().member(0)[1].training is False
    assert ensemble.train().member(0)[1].training is True


def test_ensemble_with_several_inputs_runs_under_vmap():
    class Pair(nn.Module):
        def __init__(self):
            super().__init__()
            self.lin = nn.Linear(3, 2)

        def forward(self, x, y):
            return self.lin(x) - y

    models = seeded(Pair, 3)
    x, y = torch.randn(4, 3), torch.randn(3, 4, 2)
    out = ms.Ensemble(models, in_dims=(None, 0), route="batched")(x, y)
    torch.testing.assert_close(
        out, torch.stack([m(x, y[i]) for i, m in enumerate(models)]), atol=ATOL, rtol=0
    )


@pytest.mark.slow
def test_compiled_ensemble_equals_eager():
    models = seeded(mlp, 3)
    x = torch.randn(4, 5)
    compiled = ms.Ensemble(models, compile=True, route="batched")
    assert "compiled" in repr(compiled)
    torch.testing.assert_close(
        compiled(x), ms.Ensemble(models, route="batched")(x), atol=ATOL, rtol=0
    )


@pytest.mark.slow
def test_torch_compile_of_a_second_ensemble_with_dynamic_false_as_the_docstring_says():
    torch.compile(ms.Ensemble(seeded(mlp, 3), route="batched"))(torch.randn(4, 5))
    # The next ensemble compiled in this process gets dynamic shapes unless told otherwise.
    convolutional = ms.Ensemble(
        seeded(lambda: nn.Sequential(nn.Conv2d(3, 4, 3), nn.BatchNorm2d(4), nn.ReLU()), 3),
        route="batched",
    ).eval()
    x = torch.randn(2, 3, 6, 6)
    compiled = torch.compile(convolutional, dynamic=False)
    torch.testing.assert_close(compiled(x), convolutional(x), atol=ATOL, rtol=0)


def test_mesh_none_is_the_one_process_ensemble():
    # Code that takes mesh from a launcher passes None on one process.
    models = seeded(mlp, 3)
    x = torch.randn(4, 5)
    torch.testing.assert_close(
        ms.Ensemble(models, mesh=None, route="batched")(x), ms.Ensemble(models, route="batched")(x)
    )
    torch.manual_seed(3)
    built = ms.Ensemble.from_factory(mlp, 3, mesh=None, route="batched")
    torch.manual_seed(3)
    torch.testing.assert_close(built(x), ms.Ensemble.from_factory(mlp, 3, route="batched")(x))


def test_options_are_checked_and_named():
    models = seeded(mlp, 2)
    with pytest.raises(ValueError, match="Ensemble: randomness='sometimes'; use one of 'error'"):
        ms.Ensemble(models, randomness="sometimes", route="batched")
    with pytest.raises(TypeError, match="Ensemble: in_dims is a str; give None, an int or a tuple"):
        ms.Ensemble(models, in_dims="0", route="batched")
    with pytest.raises(ValueError, match="Ensemble: no models; give at least one"):
        ms.Ensemble([], route="batched")
    with pytest.raises(ValueError, match="Ensemble.from_factory: n=0; give a positive int"):
        ms.Ensemble.from_factory(mlp, 0, route="batched")


def test_help_shows_the_real_signature_and_documented_options():
    signature = inspect.signature(ms.Ensemble)
    assert list(signature.parameters) == [
        "modules", "compile", "in_dims", "randomness", "fast", "mesh", "kernels", "route",
        "measure",
    ]  # fmt: skip
    assert signature.parameters["mesh"].default is None
    factory_signature = inspect.signature(ms.Ensemble.from_factory)
    assert factory_signature.parameters["mesh"].default is None
    doc = inspect.getdoc(ms.Ensemble)
    for section in ("Args:", "Raises:", "Example:"):
        assert section in doc
    for option in (
        "modules:",
        "compile:",
        "in_dims:",
        "randomness:",
        "fast:",
        "mesh:",
        "kernels:",
        "route:",
        "measure:",
    ):
        assert option in doc
    assert "BatchNorm1d/2d/3d" in doc and "_sharded" not in doc
    assert "Args:" in inspect.getdoc(ms.Ensemble.forward)  # not torch's generic forward text
    for method in ("from_factory", "member", "members", "tree", "train"):
        assert "Returns:" in inspect.getdoc(getattr(ms.Ensemble, method)), method


def test_a_stateless_call_and_torch_func_grad_go_through_an_ensemble():
    models = seeded(cnn, 3)
    ensemble = ms.Ensemble(models, route="batched").eval()
    x = torch.randn(2, 3, 8, 8)
    params = {name: p.detach() for name, p in ensemble.named_parameters()}
    rest = {name: b.detach() for name, b in ensemble.named_buffers()}

    def loss(p):
        return ms.call(ensemble, (ms.unflatten(p), ms.unflatten(rest)), x).square().sum()

    grads = torch.func.grad(loss)(params)
    ensemble(x).square().sum().backward()
    for name, parameter in ensemble.named_parameters():
        torch.testing.assert_close(grads[name], parameter.grad, atol=1e-4, rtol=1e-4, msg=name)
