"""The public API as a typed user's code calls it: pytest runs this file, and ``.ci/typecheck.py``
checks it with mypy and pyright against modstate's annotations (``make typecheck``).

Every call here is an ordinary use with ordinary Python values (float learning rates and alphas,
``pathlib.Path`` file names); an annotation that refused one would fail the type check.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
from torch import nn

import modstate as ms
from modstate import checkpoint, optim
from modstate.typing import Optimizer, Tree, TreeArg


def make_model() -> nn.Sequential:
    return nn.Sequential(nn.Linear(3, 4), nn.ReLU(), nn.Linear(4, 1))


def test_core_calls_type_check_and_run() -> None:
    model, other = make_model(), make_model()
    tree = ms.extract(model)
    params = ms.extract(other, detach=True)
    flat = ms.flatten(params)
    assert ms.flatten(ms.unflatten(flat)).keys() == flat.keys()
    x = torch.randn(5, 3)
    with ms.inject(model, params):
        inside = model(x)
    expected = other(x)  # the module's own forward with those values
    assert torch.equal(inside, expected) and torch.equal(ms.call(model, params, x), expected)
    old = ms.swap(model, params)
    ms.swap(model, old)
    ms.load(model, params, strict=True)
    assert ms.extract(model)["0"]["weight"] is tree["0"]["weight"]


def test_ensembles_type_check_and_run() -> None:
    models = [make_model() for _ in range(3)]
    stacked = ms.stack_modules(models)
    assert len(ms.unstack(ms.stack([ms.extract(m) for m in models]))) == 3
    out = ms.vmap_call(models[0], stacked, torch.randn(2, 3))
    ensemble = ms.Ensemble.from_factory(make_model, 3)
    member: nn.Module = ensemble.member(0)
    assert out.shape == (3, 2, 1) and isinstance(member, nn.Sequential)


def test_tree_operations_take_plain_numbers() -> None:
    params = ms.extract(make_model(), detach=True)
    grads = ms.tree.zeros_like(params)
    params = ms.tree.add(params, grads, alpha=-0.1)
    params = ms.tree.sub(params, grads, alpha=0.5)
    ema = ms.tree.lerp(ms.tree.clone(params), params, 1 - 0.999)
    scaled = ms.tree.mul(ema, 2.0)
    first = ms.tree.select(scaled, "0.*")
    summary = ms.tree.summary(first)
    assert "0.weight" in str(summary)


def test_optimizers_take_float_hyperparameters(tmp_path: Path) -> None:
    model = make_model()
    params = ms.extract(model, detach=True)
    grads = ms.tree.map(torch.ones_like, params)
    for opt in (optim.sgd(lr=0.1, momentum=0.9), optim.adam(lr=1e-3), optim.adamw(lr=1e-3)):
        state = opt.init(params)
        params, state = opt.step(params, grads, state)
    torch_opt = torch.optim.Adam(model.parameters(), lr=1e-3)
    saved = optim.optimizer_state(torch_opt, model)
    optim.load_optimizer_state(torch.optim.Adam(model.parameters(), lr=1e-3), model, saved)
    checkpoint.save(params, tmp_path / "params.safetensors")
    loaded = checkpoint.load(tmp_path / "params.safetensors", device="cpu")
    assert torch.equal(loaded["0"]["weight"], params["0"]["weight"])


def test_functional_state_and_optimizer_helpers_type_check_and_run() -> None:
    model = nn.Sequential(nn.Linear(3, 4), nn.BatchNorm1d(4), nn.Linear(4, 1)).train()
    params, state = ms.split(model, detach=True)
    x = torch.randn(8, 3)
    out, new_state = ms.apply(model, params, state, x)
    assert out.shape == (8, 1) and new_state.keys() == state.keys()
    trainable, rest = ms.tree.partition(ms.extract(model), ms.tree.is_trainable)
    assert ms.flatten(ms.tree.combine(trainable, rest)).keys() == model.state_dict().keys()
    grads = ms.tree.map(torch.ones_like, params)
    clipped, norm = optim.clip_grad_norm(grads, max_norm=1.0)
    opt = optim.masked(optim.sgd(lr=0.1), "0.*")
    params, _ = opt.step(params, clipped, opt.init(params))
    assert float(norm) > 1.0


def train_step(params: Tree, grads: Tree, opt: Optimizer, state: dict[str, Any]) -> Tree:
    """A user's helper typed with modstate.typing: any optimizer, masked ones included."""
    new_params, _ = opt.step(params, grads, state)
    return new_params


def test_the_typing_module_annotates_a_users_code() -> None:
    model = make_model()
    params: Tree = ms.extract(model, detach=True)
    grads = ms.tree.map(torch.ones_like, params)
    optimizers: list[Optimizer] = [optim.adam(lr=1e-3), optim.masked(optim.sgd(lr=0.1), "0.*")]
    for opt in optimizers:
        params = train_step(params, grads, opt, opt.init(params))
    halves: TreeArg = ms.tree.partition(params, ms.tree.is_float)
    assert ms.call(model, halves, torch.randn(2, 3)).shape == (2, 1)
