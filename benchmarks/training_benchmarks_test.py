"""Training steps with state that is carried, not trained (BatchNorm), and the ensemble forward.

Issue 9's three targets, each timed with the ``compare`` fixture (warmed up, interleaved rounds):

- ``training step: ensemble ...`` (three cases, one per modstate way): one step
  (forward, backward, Adam) of 8 members ``64→128(BN)→128(BN)→10`` on a shared batch of 64, in
  train mode. Peers: a loop over 8 ordinary modules with one ``torch.optim.Adam`` over all their
  parameters (T), and ``torch.func`` (``vmap(grad(functional_call))`` with the buffers cloned
  and returned, the way ``torch.func`` must do it for train-mode BatchNorm, then
  ``torch.optim.Adam`` on the stacked tensors). modstate is functional, as ``grad`` of
  ``ms.apply`` on an ``ms.Ensemble`` (batched kernels) or as ``vmap(grad(ms.apply))`` on one
  member's module, each followed by ``ms.optim.adam`` on the stacked trees; or stateful, as
  ``ms.Ensemble`` + ``torch.optim.Adam``. Targets: functional and module ≤ 0.30 T.
- ``training step: single model``: ``grad`` of ``ms.apply`` + ``ms.optim.adam`` against the
  stateful ``loss.backward(); opt.step()``. Target ≤ 1.15×.
- ``ensemble forward: compute-bound``: ``ms.Ensemble`` of 32 ``64→256→256→10`` on a batch of 128
  (no grad) against the hand-written ``baddbmm`` chain. Target ≤ 1.05×.

Every implementation is first checked to compute the same step as the loop of modules.
"""

from __future__ import annotations

import copy
from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn
from torch.func import functional_call, grad, stack_module_state

import modstate as ms

MEMBERS, BATCH, LR = 8, 64, 1e-3
LOOP = "loop of 8 modules + torch.optim.Adam"
TORCH_FUNC = "torch.func: vmap(grad(functional_call)) + torch.optim.Adam"


def bn_mlp() -> nn.Sequential:
    return nn.Sequential(
        nn.Linear(64, 128),
        nn.BatchNorm1d(128),
        nn.ReLU(),
        nn.Linear(128, 128),
        nn.BatchNorm1d(128),
        nn.ReLU(),
        nn.Linear(128, 10),
    )


def members() -> list[nn.Module]:
    torch.manual_seed(0)
    return [bn_mlp() for _ in range(MEMBERS)]


def data() -> tuple[torch.Tensor, torch.Tensor]:
    torch.manual_seed(1)
    return torch.randn(BATCH, 64), torch.randint(0, 10, (BATCH,))


def loop_step(models: list[nn.Module], x: torch.Tensor, y: torch.Tensor) -> Callable[[], Any]:
    params = [p for m in models for p in m.parameters()]
    opt = torch.optim.Adam(params, lr=LR)

    def step() -> None:
        opt.zero_grad(set_to_none=True)
        loss = sum(F.cross_entropy(m(x), y) for m in models)
        loss.backward()
        opt.step()

    return step


def torch_func_step(models: list[nn.Module], x: torch.Tensor, y: torch.Tensor):
    params, buffers = stack_module_state(models)
    base = copy.deepcopy(models[0]).to("meta")
    opt = torch.optim.Adam(params.values(), lr=LR)
    holder = {"buffers": buffers}

    def loss(p: dict, b: dict) -> tuple[torch.Tensor, dict]:
        b = {k: v.clone() for k, v in b.items()}  # BatchNorm writes into them
        return F.cross_entropy(functional_call(base, (p, b), (x,)), y), b

    vmapped = torch.vmap(grad(loss, has_aux=True))

    def step() -> None:
        detached = {k: v.detach() for k, v in params.items()}
        grads, holder["buffers"] = vmapped(detached, holder["buffers"])
        for k, v in params.items():
            v.grad = grads[k]
        opt.step()

    return step, params, holder


def functional_step(models: list[nn.Module], x: torch.Tensor, y: torch.Tensor):
    """``vmap(grad(ms.apply))`` for the gradients and new statistics of every member, then one
    ``ms.optim.adam`` step on the stacked trees: Adam is elementwise and the members share their
    step count, so that is each member's own step, run as one foreach kernel per operation."""
    model = models[0]
    params = ms.stack([ms.split(m, detach=True)[0] for m in models])
    state = ms.stack([ms.split(m, detach=True)[1] for m in models])
    opt = ms.optim.adam(lr=LR)
    holder = {"params": params, "state": state, "opt": opt.init(params)}

    def loss(p: dict, s: dict) -> tuple[torch.Tensor, dict]:
        out, new_state = ms.apply(model, p, s, x)
        return F.cross_entropy(out, y), new_state

    grads_and_state = torch.vmap(grad(loss, has_aux=True))

    def step() -> None:
        grads, holder["state"] = grads_and_state(holder["params"], holder["state"])
        holder["params"], holder["opt"] = opt.step(holder["params"], grads, holder["opt"])

    return step, holder


def functional_ensemble_step(models: list[nn.Module], x: torch.Tensor, y: torch.Tensor):
    """``grad`` of ``ms.apply`` on an ``ms.Ensemble`` (its batched kernels run every member, no
    vmap) with the stacked trees as params and state, then ``ms.optim.adam`` on them."""
    ensemble = ms.Ensemble(models)
    params, state = ms.split(ensemble, detach=True)
    opt = ms.optim.adam(lr=LR)
    holder = {"params": params, "state": state, "opt": opt.init(params)}
    targets = y.expand(MEMBERS, -1).reshape(-1)

    def loss(p: dict, s: dict) -> tuple[torch.Tensor, dict]:
        out, new_state = ms.apply(ensemble, p, s, x)
        return F.cross_entropy(out.reshape(-1, 10), targets, reduction="sum") / BATCH, new_state

    grads_and_state = grad(loss, has_aux=True)

    def step() -> None:
        grads, holder["state"] = grads_and_state(holder["params"], holder["state"])
        holder["params"], holder["opt"] = opt.step(holder["params"], grads, holder["opt"])

    return step, holder


def ensemble_step(models: list[nn.Module], x: torch.Tensor, y: torch.Tensor):
    ensemble = ms.Ensemble(models)
    opt = torch.optim.Adam(ensemble.parameters(), lr=LR)
    targets = y.expand(MEMBERS, -1).reshape(-1)

    def step() -> None:
        opt.zero_grad(set_to_none=True)
        out = ensemble(x)  # (members, batch, 10)
        # The sum over members of each member's mean loss, as the loop computes it.
        loss = F.cross_entropy(out.reshape(-1, 10), targets, reduction="sum") / BATCH
        loss.backward()
        opt.step()

    return step, ensemble


def _check_one_step_matches_the_loop(x: torch.Tensor, y: torch.Tensor) -> None:
    reference = members()
    loop_step(reference, x, y)()
    expected = ms.stack([ms.extract(m, detach=True) for m in reference])

    step, holder = functional_step(members(), x, y)
    step()
    got = ms.tree.combine(holder["params"], holder["state"])
    step_tf, params_tf, holder_tf = torch_func_step(members(), x, y)
    step_tf()
    step_ens, ensemble = ensemble_step(members(), x, y)
    step_ens()
    step_fe, holder_fe = functional_ensemble_step(members(), x, y)
    step_fe()
    got_fe = ms.flatten(ms.tree.combine(holder_fe["params"], holder_fe["state"]))
    for path, want in ms.flatten(expected).items():
        torch.testing.assert_close(ms.flatten(got)[path], want, atol=1e-5, rtol=1e-4)
        from_torch_func = params_tf.get(path, holder_tf["buffers"].get(path))
        torch.testing.assert_close(from_torch_func, want, atol=1e-5, rtol=1e-4)
        torch.testing.assert_close(
            ms.flatten(ms.extract(ensemble))[f"stacked.{path}"], want, atol=1e-5, rtol=1e-4
        )
        torch.testing.assert_close(got_fe[f"stacked.{path}"], want, atol=1e-5, rtol=1e-4)


def test_ensemble_training_step_functional(compare) -> None:
    x, y = data()
    _check_one_step_matches_the_loop(x, y)
    compare(
        "training step: ensemble functional, grad(apply(Ensemble)) (8 x 64-128(BN)-128(BN)-10)",
        {
            "modstate": functional_ensemble_step(members(), x, y)[0],
            LOOP: loop_step(members(), x, y),
            TORCH_FUNC: torch_func_step(members(), x, y)[0],
        },
    )


def test_ensemble_training_step_functional_vmap(compare) -> None:
    x, y = data()
    compare(
        "training step: ensemble functional, vmap(grad(apply)) (8 x 64-128(BN)-128(BN)-10)",
        {
            "modstate": functional_step(members(), x, y)[0],
            LOOP: loop_step(members(), x, y),
            TORCH_FUNC: torch_func_step(members(), x, y)[0],
        },
    )


def test_ensemble_training_step_module(compare) -> None:
    x, y = data()
    compare(
        "training step: ensemble module (8 x 64-128(BN)-128(BN)-10, batch 64)",
        {
            "modstate": ensemble_step(members(), x, y)[0],
            LOOP: loop_step(members(), x, y),
            TORCH_FUNC: torch_func_step(members(), x, y)[0],
        },
    )


def compare_with_the_stateful_step(
    compare,
    name: str,
    model: nn.Module,
    batch: tuple[torch.Tensor, torch.Tensor],
    functional: Callable[[], None],
    holder: dict,
) -> None:
    """One step of ``functional`` (updating ``holder``'s params and state) must equal
    ``loss.backward(); torch.optim.Adam.step()`` on a copy of ``model`` with the same ``batch``;
    then both are timed."""
    x, y = batch
    stateful_model = copy.deepcopy(model)
    torch_opt = torch.optim.Adam(stateful_model.parameters(), lr=LR)

    def stateful() -> None:
        torch_opt.zero_grad(set_to_none=True)
        F.cross_entropy(stateful_model(x), y).backward()
        torch_opt.step()

    functional()
    stateful()
    got = ms.flatten(ms.tree.combine(holder["params"], holder["state"]))
    for path, want in ms.flatten(ms.extract(stateful_model)).items():
        torch.testing.assert_close(got[path].detach(), want.detach(), atol=1e-6, rtol=1e-5)
    compare(name, {"modstate": functional, "torch: backward + torch.optim.Adam": stateful})


def test_single_model_training_step(compare) -> None:
    x, y = data()
    torch.manual_seed(0)
    model = bn_mlp()
    params, state = ms.split(model, detach=True)
    opt = ms.optim.adam(lr=LR)
    holder = {"params": params, "state": state, "opt": opt.init(params)}

    def loss(p: dict, s: dict) -> tuple[torch.Tensor, dict]:
        out, new_state = ms.apply(model, p, s, x)
        return F.cross_entropy(out, y), new_state

    def functional() -> None:
        grads, holder["state"] = grad(loss, has_aux=True)(holder["params"], holder["state"])
        holder["params"], holder["opt"] = opt.step(holder["params"], grads, holder["opt"])

    compare_with_the_stateful_step(
        compare,
        "training step: single model (64-128(BN)-128(BN)-10, batch 64)",
        model,
        (x, y),
        functional,
        holder,
    )


def test_single_model_training_step_with_autograd(compare) -> None:
    """The same step with ``torch.autograd.grad`` over ``ms.apply`` (params that require grad)
    instead of ``torch.func.grad``, whose per-op dispatch dominates on a model this small."""
    x, y = data()
    torch.manual_seed(0)
    model = bn_mlp()
    params, state = ms.split(model, detach=True)
    opt = ms.optim.adam(lr=LR)
    holder = {"params": ms.tree.map(torch.Tensor.requires_grad_, params), "state": state}
    holder["opt"] = opt.init(holder["params"])

    def functional() -> None:
        leaves = list(ms.flatten(holder["params"]).values())
        out, holder["state"] = ms.apply(model, holder["params"], holder["state"], x)
        grads = ms.unflatten(
            dict(
                zip(
                    ms.flatten(holder["params"]),
                    torch.autograd.grad(F.cross_entropy(out, y), leaves),
                )
            )
        )
        with torch.no_grad():
            new_params, holder["opt"] = opt.step(holder["params"], grads, holder["opt"])
        holder["params"] = ms.tree.map(torch.Tensor.requires_grad_, new_params)

    compare_with_the_stateful_step(
        compare,
        "training step: single model, autograd.grad(apply) (64-128(BN)-128(BN)-10, batch 64)",
        model,
        (x, y),
        functional,
        holder,
    )


def baddbmm_chain(models: list[nn.Module]) -> Callable[[torch.Tensor], torch.Tensor]:
    params, _ = stack_module_state(models)
    linears = [i for i, m in enumerate(models[0]) if isinstance(m, nn.Linear)]
    layers = [(params[f"{i}.weight"].detach(), params[f"{i}.bias"].detach()) for i in linears]
    count = len(models)

    def run(x: torch.Tensor) -> torch.Tensor:
        h = x.expand(count, -1, -1)
        for index, (weight, bias) in enumerate(layers):
            h = torch.baddbmm(bias.unsqueeze(1), h, weight.transpose(1, 2))
            if index < len(layers) - 1:
                h = torch.relu(h)
        return h

    return run


def test_ensemble_forward_compute_bound(compare) -> None:
    torch.manual_seed(0)
    models = [
        nn.Sequential(
            nn.Linear(64, 256), nn.ReLU(), nn.Linear(256, 256), nn.ReLU(), nn.Linear(256, 10)
        )
        for _ in range(32)
    ]
    x = torch.randn(128, 64)
    ensemble = ms.Ensemble(models)
    chain = baddbmm_chain(models)
    with torch.no_grad():
        torch.testing.assert_close(ensemble(x), chain(x), atol=1e-5, rtol=1e-5)

    def modstate_forward() -> torch.Tensor:
        with torch.no_grad():
            return ensemble(x)

    def chain_forward() -> torch.Tensor:
        with torch.no_grad():
            return chain(x)

    compare(
        "ensemble forward: compute-bound (32 x 64-256-256-10, batch 128)",
        {"modstate": modstate_forward, "baddbmm chain": chain_forward},
    )
