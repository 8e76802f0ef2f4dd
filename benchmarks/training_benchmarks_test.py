"""Training steps: a model with state that is carried, not trained (BatchNorm), alone and as an
8-member ensemble, functional (``ms.grad`` + ``ms.optim``) beside ``backward()`` + ``torch.optim``
in each of torch's three configurations; and the ensemble forward.

Timed with the ``compare`` fixture (warmed up, interleaved rounds). Each case first checks, by
itself (so under ``-k`` too), that every implementation computes modstate's step: one step from
the same start, then all params and buffers (BatchNorm's statistics) compared, bit for bit where
the same kernels run, else within ``ATOL``/``RTOL``.

- ``training step: single model``: ``ms.grad`` of ``ms.apply`` (plain autograd, no functorch
  dispatch) + ``ms.optim.adam(fused=True)`` donated, beside ``loss.backward()`` +
  ``torch.optim.Adam`` with ``foreach=True``, ``foreach=False`` and ``fused=True``; the same step
  with ``torch.func.grad`` is shown too. Target (issue 18): <= 1.1 x the fastest torch step.
- ``training step: ensemble ...``: one step (forward, backward, Adam) of 8 members
  ``64→128(BN)→128(BN)→10`` on a shared batch of 64, in train mode. T is a loop over 8 ordinary
  modules with one ``torch.optim.Adam`` (torch's default configuration) over all their
  parameters; the loop with ``fused=True`` and ``foreach=True`` is shown beside it, and
  ``torch.func`` (``vmap(grad(functional_call))`` with the buffers cloned and returned, as
  ``torch.func`` must do it for train-mode BatchNorm, then ``torch.optim.Adam``). modstate is
  stateful (``ms.Ensemble`` + ``torch.optim.Adam(fused=True)``) or functional (``ms.grad`` of
  ``ms.apply`` on the ``ms.Ensemble``, whose stacked tensors are its own parameters, so plain
  autograd runs its batched kernels, + ``ms.optim.adam(fused=True)`` donated); and the
  ``torch.vmap(ms.grad(ms.apply))`` form on one member's module over stacked trees (one plain
  backward for every member, the ensemble's kernels inside; with ``torch.func.grad`` too).
  Beside the latter, a reference: the ``ms.grad(apply(Ensemble))`` step plus one ``torch.vmap``
  that computes nothing over trees of the same shapes, the least a step inside ``torch.vmap``
  can cost. Targets: <= 0.30 T.
- ``ensemble forward: compute-bound``: ``ms.Ensemble`` of 32 ``64→256→256→10`` on a batch of 128
  (no grad) against the hand-written ``baddbmm`` chain. Target <= 1.05x.

At the end the run prints the ratios as a Markdown table::

    python -m pytest benchmarks/training_benchmarks_test.py -p no:cacheprovider -q
"""

from __future__ import annotations

import copy
from collections.abc import Callable

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.func import functional_call, grad, stack_module_state

import modstate as ms
from _tables import show, us
from _timing import assert_same_trees, flat

MEMBERS, BATCH, LR = 8, 64, 1e-3
LOOP = "loop of 8 modules + torch.optim.Adam"
TORCH_FUNC = "torch.func: vmap(grad(functional_call)) + torch.optim.Adam"
ADAM_FLAGS = {"foreach=True": {"foreach": True}, "foreach=False": {"foreach": False}}
ADAM_FLAGS["fused=True"] = {"fused": True}
ROWS: dict[str, dict[str, str]] = {}
# Batched kernels (one bmm for all members) and Adam kernels other than modstate's fused one sum
# and round in another order, so the last bits differ: measured at most 1.1e-8 apart after one
# step (params ~0.1, moved by lr=1e-3). Adam's first step is about lr * sign(grad), so a wrong
# gradient sign or a wrong forward (BatchNorm statistics) shows; a wrong gradient scale does not.
# Where a gradient is within rounding of zero, its last bits decide that step anywhere in
# [-lr, lr] (lr * g / (|g| + eps), eps = 1e-8): measured, 2 of the 65,536 first-layer weights of
# the ensemble, whose gradients are about 3e-9. So at most FEW_ELEMENTS of a tensor's elements
# may differ by up to 2 * lr; a wrong forward or gradient moves most of them. The biases of the
# Linear layers right before a BatchNorm (ROUNDING_ONLY) have no gradient but rounding: the
# BatchNorm subtracts their batch mean. Any two ways of summing give them other noise, which
# Adam turns into steps of about +-lr; those are checked to stay within 2 * lr.
ATOL, RTOL = 1e-6, 1e-5
FEW_ELEMENTS = 1e-3
ROUNDING_ONLY = {"0.bias", "3.bias"}
Step = Callable[[], None]
Read = Callable[[], dict[str, torch.Tensor]]  # params and buffers, stacked over the members


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


def stacked_state(models: list[nn.Module]) -> dict[str, torch.Tensor]:
    """Every member's state_dict, stacked path by path: what each implementation is read as."""
    dicts = [m.state_dict() for m in models]
    return {path: torch.stack([d[path] for d in dicts]) for path in dicts[0]}


def unstacked(tree: dict, prefix: str = "stacked.") -> dict[str, torch.Tensor]:
    """An Ensemble's flat tree with its ``stacked.`` prefix dropped: the loop's paths."""
    return {path.removeprefix(prefix): leaf for path, leaf in flat(tree).items()}


def check_one_step(case: str, impls: dict[str, tuple[Step, Read]], bitwise=()) -> dict[str, Step]:
    """One step of each implementation from the same start, then each one's params and buffers
    against modstate's: within ATOL/RTOL, bit for bit for those in ``bitwise``. The steps, for
    timing."""
    for step, _ in impls.values():
        step()
    expected = impls["modstate"][1]()
    for impl, (_, read) in impls.items():
        what = f"{case}: {impl} vs modstate"
        if impl in bitwise:
            assert_same_trees(expected, read(), what=what)
        else:
            assert_same_step(expected, read(), what=what)
    return {impl: step for impl, (step, _) in impls.items()}


def assert_same_step(expected: dict, actual: dict, *, what: str) -> None:
    """The same paths; each leaf within ATOL/RTOL but for at most FEW_ELEMENTS of its elements,
    which stay within 2 * LR (see ATOL)."""
    assert expected.keys() == actual.keys(), f"{what}: paths differ"
    for path, want in expected.items():
        got = actual[path]
        assert got.shape == want.shape and got.dtype == want.dtype, f"{what}: at {path!r}"
        if not want.is_floating_point():
            assert torch.equal(got, want), f"{what}: at {path!r}"
            continue
        if path in ROUNDING_ONLY:
            most = (got - want).abs().max().item()
            assert most <= 2 * LR, f"{what}: at {path!r}, apart by {most:.3g}"
            continue
        apart = ~torch.isclose(got, want, rtol=RTOL, atol=ATOL)
        if apart.any():
            share, most = apart.float().mean().item(), (got - want).abs().max().item()
            assert share <= FEW_ELEMENTS and most <= 2 * LR, (
                f"{what}: at {path!r}, {apart.sum().item()} of {want.numel()} elements apart, "
                f"by up to {most:.3g}"
            )


def loop_step(
    models: list[nn.Module], x: torch.Tensor, y: torch.Tensor, **flags: bool
) -> tuple[Step, Read]:
    params = [p for m in models for p in m.parameters()]
    opt = torch.optim.Adam(params, lr=LR, **flags)

    def step() -> None:
        opt.zero_grad(set_to_none=True)
        loss = sum(F.cross_entropy(m(x), y) for m in models)
        loss.backward()
        opt.step()

    return step, lambda: stacked_state(models)


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

    return step, lambda: {**params, **holder["buffers"]}


def stacked_halves(models: list[nn.Module]) -> tuple[dict, dict]:
    """The members' ``split`` halves (params, state), each stacked over the members."""
    halves = [ms.split(m, detach=True) for m in models]
    return ms.stack([h[0] for h in halves]), ms.stack([h[1] for h in halves])


def functional_vmap_step(
    models: list[nn.Module], x: torch.Tensor, y: torch.Tensor, gradient: Callable = ms.grad
):
    """``vmap(grad(ms.apply))`` for the gradients and new statistics of every member, then one
    ``ms.optim.adam`` step on the stacked trees: Adam is elementwise and the members share their
    step count, so that is each member's own step. With ``ms.grad`` (the default), one plain
    backward runs for every member and ``ms.apply`` runs the ensemble's batched kernels; with
    ``torch.func.grad``, torch.func's per-op dispatch and vmap's rules run."""
    model = models[0]
    params, state = stacked_halves(models)
    opt = ms.optim.adam(lr=LR, fused=True)
    holder = {"params": params, "state": state, "opt": opt.init(params)}

    def loss(p: dict, s: dict) -> tuple[torch.Tensor, dict]:
        out, new_state = ms.apply(model, p, s, x)
        return F.cross_entropy(out, y), new_state

    grads_and_state = torch.vmap(gradient(loss, has_aux=True))

    def step() -> None:
        grads, holder["state"] = grads_and_state(holder["params"], holder["state"])
        holder["params"], holder["opt"] = opt.step(
            holder["params"], grads, holder["opt"], donate=True
        )

    return step, lambda: {**flat(holder["params"]), **flat(holder["state"])}


def vmap_passes_reference(models: list[nn.Module], x: torch.Tensor, y: torch.Tensor):
    """The ``ms.grad(apply(Ensemble))`` step, then one ``torch.vmap`` that computes nothing over
    trees shaped as the ``vmap(grad(apply))`` form's (its stacked params and state in; a tree
    like the params, one number per member and the state out): the least a step that runs
    inside ``torch.vmap`` pays on top of the Ensemble's own, torch.vmap's passes over the
    trees (its pytree walks and member views). The step is the Ensemble's, so it checks as one."""
    params, state = stacked_halves(models)
    step, read = functional_ensemble_step(models, x, y)

    def nothing(p: dict, s: dict) -> tuple[dict, tuple[torch.Tensor, dict]]:
        return p, (p["6"]["bias"][0], s)

    passes = torch.vmap(nothing)

    def run() -> None:
        step()
        passes(params, state)

    return run, read


def functional_ensemble_step(models: list[nn.Module], x: torch.Tensor, y: torch.Tensor):
    """``ms.grad`` of ``ms.apply`` on an ``ms.Ensemble``: its stacked tensors are its own
    parameters, so plain autograd runs its batched kernels for every member (no vmap, no
    functorch dispatch); then ``ms.optim.adam(fused=True)`` on the stacked trees, donated."""
    ensemble = ms.Ensemble(models)
    params, state = ms.split(ensemble, detach=True)
    opt = ms.optim.adam(lr=LR, fused=True)
    holder = {"params": params, "state": state, "opt": opt.init(params)}
    targets = y.expand(MEMBERS, -1).reshape(-1)

    def loss(p: dict, s: dict) -> tuple[torch.Tensor, dict]:
        out, new_state = ms.apply(ensemble, p, s, x)
        return F.cross_entropy(out.reshape(-1, 10), targets, reduction="sum") / BATCH, new_state

    grads_and_state = ms.grad(loss, has_aux=True)

    def step() -> None:
        grads, holder["state"] = grads_and_state(holder["params"], holder["state"])
        holder["params"], holder["opt"] = opt.step(
            holder["params"], grads, holder["opt"], donate=True
        )

    return step, lambda: {**unstacked(holder["params"]), **unstacked(holder["state"])}


def ensemble_step(models: list[nn.Module], x: torch.Tensor, y: torch.Tensor):
    ensemble = ms.Ensemble(models)
    opt = torch.optim.Adam(ensemble.parameters(), lr=LR, fused=True)
    targets = y.expand(MEMBERS, -1).reshape(-1)

    def step() -> None:
        opt.zero_grad(set_to_none=True)
        out = ensemble(x)  # (members, batch, 10)
        # The sum over members of each member's mean loss, as the loop computes it.
        loss = F.cross_entropy(out.reshape(-1, 10), targets, reduction="sum") / BATCH
        loss.backward()
        opt.step()

    return step, lambda: unstacked(ensemble.state_dict())


def _record(row: str, stats: dict[str, dict[str, float]] | None, reference: Callable) -> None:
    """Keep a table row: each entry's min, and modstate's ratio to ``reference(stats)``."""
    if stats is None:
        return
    want_min, want_median = reference(stats, "min"), reference(stats, "median")
    ROWS[row] = {
        **{impl: us(entry["min"]) for impl, entry in stats.items()},
        **{
            f"{impl}: ratio": f"{entry['min'] / want_min:.2f}x "
            f"[{entry['median'] / want_median:.2f}x]"
            for impl, entry in stats.items()
            if impl.startswith("reference")
        },
        "ratio": f"{stats['modstate']['min'] / want_min:.2f}x "
        f"[{stats['modstate']['median'] / want_median:.2f}x]",
    }


@pytest.fixture(scope="module", autouse=True)
def ratio_table(request):
    """Print the ratios of every case that ran, as Markdown, after the module."""
    yield
    if not ROWS:
        return
    lines = [
        "",
        "Training steps; times are the min over interleaved rounds (median ratio in brackets).",
        "",
    ]
    for row, entries in ROWS.items():
        lines += [f"**{row}**", "", "| implementation | time |", "|---|---|"]
        lines += [f"| {impl} | {time} |" for impl, time in entries.items() if impl != "ratio"]
        lines += [f"| **modstate ratio** | **{entries['ratio']}** |", ""]
    show(request, lines)


def _loops(x: torch.Tensor, y: torch.Tensor) -> dict[str, tuple[Step, Read]]:
    """T (the loop with torch.optim.Adam's default) and the loop with each of torch's flags."""
    loops = {LOOP: loop_step(members(), x, y)}
    loops.update(
        {
            f"{LOOP} ({name})": loop_step(members(), x, y, **flags)
            for name, flags in ADAM_FLAGS.items()
        }
    )
    return loops


def _relative_to_t(stats: dict[str, dict[str, float]], key: str) -> float:
    return stats[LOOP][key]


ENSEMBLE = "(8 x 64-128(BN)-128(BN)-10, batch 64)"
VMAP_PASSES = "reference: ms.grad(apply(Ensemble)) step + torch.vmap's passes over the trees"


def test_ensemble_training_step_functional(compare) -> None:
    x, y = data()
    name = f"training step: ensemble functional, ms.grad(apply(Ensemble)) + adam {ENSEMBLE}"
    impls = {
        "modstate": functional_ensemble_step(members(), x, y),
        **_loops(x, y),
        TORCH_FUNC: torch_func_step(members(), x, y),
    }
    stats = compare(name, check_one_step(name, impls))
    _record(f"{name}: modstate / T", stats, _relative_to_t)


def test_ensemble_training_step_functional_vmap(compare) -> None:
    x, y = data()
    name = f"training step: ensemble functional, vmap(grad(apply)) + adam {ENSEMBLE}"
    impls = {
        "modstate": functional_vmap_step(members(), x, y),
        "modstate with torch.func.grad": functional_vmap_step(members(), x, y, grad),
        LOOP: loop_step(members(), x, y),
        TORCH_FUNC: torch_func_step(members(), x, y),
        VMAP_PASSES: vmap_passes_reference(members(), x, y),
    }
    stats = compare(name, check_one_step(name, impls))
    _record(f"{name}: modstate / T", stats, _relative_to_t)


def test_ensemble_training_step_module(compare) -> None:
    x, y = data()
    name = f"training step: ensemble module, Ensemble + torch.optim.Adam(fused=True) {ENSEMBLE}"
    impls = {
        "modstate": ensemble_step(members(), x, y),
        **_loops(x, y),
        TORCH_FUNC: torch_func_step(members(), x, y),
    }
    stats = compare(name, check_one_step(name, impls))
    _record(f"{name}: modstate / T", stats, _relative_to_t)


def stateful_step(model: nn.Module, batch: tuple[torch.Tensor, torch.Tensor], **flags: bool):
    """``loss.backward(); torch.optim.Adam(**flags).step()`` on a copy of ``model``."""
    x, y = batch
    stateful_model = copy.deepcopy(model)
    torch_opt = torch.optim.Adam(stateful_model.parameters(), lr=LR, **flags)

    def stateful() -> None:
        torch_opt.zero_grad(set_to_none=True)
        F.cross_entropy(stateful_model(x), y).backward()
        torch_opt.step()

    return stateful, stateful_model.state_dict


def functional_single_step(model: nn.Module, batch, gradient: Callable):
    """``gradient`` (``ms.grad`` or ``torch.func.grad``) of ``ms.apply``, then
    ``ms.optim.adam(fused=True)``, donated."""
    x, y = batch
    params, state = ms.split(model, detach=True)
    params, state = ms.tree.clone(params), ms.tree.clone(state)
    opt = ms.optim.adam(lr=LR, fused=True)
    holder = {"params": params, "state": state, "opt": opt.init(params)}

    def loss(p: dict, s: dict) -> tuple[torch.Tensor, dict]:
        out, new_state = ms.apply(model, p, s, x)
        return F.cross_entropy(out, y), new_state

    grads_and_state = gradient(loss, has_aux=True)

    def functional() -> None:
        grads, holder["state"] = grads_and_state(holder["params"], holder["state"])
        holder["params"], holder["opt"] = opt.step(
            holder["params"], grads, holder["opt"], donate=True
        )

    return functional, lambda: {**flat(holder["params"]), **flat(holder["state"])}


def _fastest_torch(stats: dict[str, dict[str, float]], key: str) -> float:
    return min(entry[key] for impl, entry in stats.items() if impl.startswith("torch: "))


def test_single_model_training_step(compare) -> None:
    batch = data()
    torch.manual_seed(0)
    model = bn_mlp()
    name = "training step: single model (64-128(BN)-128(BN)-10, batch 64)"
    impls = {
        "modstate": functional_single_step(model, batch, ms.grad),
        "modstate with torch.func.grad": functional_single_step(model, batch, grad),
    }
    for label, flags in ADAM_FLAGS.items():
        impls[f"torch: backward + torch.optim.Adam ({label})"] = stateful_step(
            model, batch, **flags
        )
    # The same gradient ops and the same fused Adam kernel as torch's fused=True: bit for bit.
    same_kernel = (
        "modstate with torch.func.grad",
        "torch: backward + torch.optim.Adam (fused=True)",
    )
    stats = compare(name, check_one_step(name, impls, bitwise=same_kernel))
    _record(
        f"{name}: modstate (ms.grad + adam fused, donated) / fastest torch", stats, _fastest_torch
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
    with torch.no_grad():  # one bmm for all members against baddbmm: summed in another order
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
