"""One optimizer step on 4x ``nn.Linear(512, 512)`` (8 leaves, 1.05 M parameters), for every
optimizer of ``modstate.optim``, beside ``torch.optim``'s three configurations, in one process
(the ``compare`` fixture: warmed up, interleaved rounds).

Two groups per optimizer:

- ``optim step: <name>, donated``: ``opt.step(..., donate=True)`` (in place, as ``torch.optim``
  steps) in each configuration modstate has (``foreach=True``, ``foreach=False``, and
  ``fused=True`` where torch has a fused kernel), beside ``torch.optim`` with ``foreach=True``,
  ``foreach=False`` and ``fused=True``. The ``modstate`` entry is the fused step where there is
  one, else the single-tensor one.
- ``optim step: <name>, pure``: the pure step (new trees out, no input written) in each
  modstate configuration, beside the same ``torch.optim`` configurations and the **allocation
  floor**: allocating and first-touching the trees the step returns (``torch.empty_like`` +
  ``fill_``, params and every buffer), which no pure step can avoid. A second floor makes the
  same trees while the last call's are still held, as a pure loop must (its inputs live until
  its outputs replace them); here the allocator cannot hand freed memory back, and the first
  touch costs page faults (1.5-2x the plain floor, measured on the 2-core CPU machine).
  Where torch has a fused kernel, a **reference** row too: the pure fused step written by hand
  (copy the params and buffers, count the step, run torch's in-place fused kernel on the
  copies; checked bit for bit against modstate's pure fused step), so the method's own cost
  shows apart from modstate's bookkeeping.

Targets (issue 18): best modstate donated <= 1.05 x best torch.optim; pure <= 1.2 x (best
torch.optim + allocation floor). At the end the run prints both ratios per optimizer as a
Markdown table (``-s`` not needed)::

    python -m pytest benchmarks/optim_benchmarks_test.py -p no:cacheprovider -q
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest
import torch
from torch import nn

import modstate as ms
from _tables import show, us
from _timing import assert_same_trees
from modstate import optim

MODEL = "4x Linear(512,512)"
TORCH_FLAGS = {"foreach=True": {"foreach": True}, "foreach=False": {"foreach": False}}
FUSED = {"fused=True": {"fused": True}}

# name: (modstate factory, torch.optim class, kwargs for both, has fused kernels, buffers)
CASES: dict[str, tuple[Callable[..., Any], type, dict[str, Any], bool, int]] = {
    "sgd-momentum": (optim.sgd, torch.optim.SGD, {"lr": 1e-3, "momentum": 0.9}, True, 1),
    "adam": (optim.adam, torch.optim.Adam, {"lr": 1e-3}, True, 2),
    "adamw": (optim.adamw, torch.optim.AdamW, {"lr": 1e-3, "weight_decay": 1e-2}, True, 2),
    "rmsprop": (optim.rmsprop, torch.optim.RMSprop, {"lr": 1e-3}, False, 1),
    "adagrad": (optim.adagrad, torch.optim.Adagrad, {"lr": 1e-2}, True, 1),
    "adamax": (optim.adamax, torch.optim.Adamax, {"lr": 2e-3}, False, 2),
    "nadam": (optim.nadam, torch.optim.NAdam, {"lr": 2e-3}, False, 2),
    "radam": (optim.radam, torch.optim.RAdam, {"lr": 1e-3}, False, 2),
    "adadelta": (optim.adadelta, torch.optim.Adadelta, {"lr": 1.0}, False, 2),
}
ROWS: dict[str, dict[str, Any]] = {}


def make_model() -> nn.Module:
    torch.manual_seed(0)
    model = nn.Sequential(*(nn.Linear(512, 512) for _ in range(4)))
    for param in model.parameters():
        param.grad = torch.randn_like(param) * 1e-2
    return model


def flag_sets(case: str) -> dict[str, dict[str, bool]]:
    return {**TORCH_FLAGS, **(FUSED if CASES[case][3] else {})}


Step = Callable[[], None]
Read = Callable[[], dict[str, Any]]
WARM_STEPS = 3  # past the first steps, which some optimizers treat apart


def torch_step(case: str, flags: dict[str, bool]) -> tuple[Step, Read]:
    """torch.optim's step on its own model, after ``WARM_STEPS`` steps; and a reader of its
    params and state, laid out as modstate's: ``{"params": ..., "state": {"exp_avg": ...}}``."""
    _, torch_class, kwargs, _, _ = CASES[case]
    model = make_model()
    opt = torch_class(model.parameters(), **kwargs, **flags)
    for _ in range(WARM_STEPS):
        opt.step()

    def read() -> dict[str, Any]:
        named = dict(model.named_parameters())
        state: dict[str, Any] = {}
        for name, param in named.items():
            for key, value in opt.state[param].items():
                if value.dim() == 0:  # step and nadam's mu_product: one per param in torch
                    state[key] = value
                else:
                    state.setdefault(key, {})[name] = value
        return {"params": {name: p.detach() for name, p in named.items()}, "state": state}

    return opt.step, read


def start(case: str, flags: dict[str, bool]) -> tuple[Any, Any, Any, dict[str, Any]]:
    """modstate's optimizer for `case` with `flags`, and the params, gradients and state its
    steps start from (the same values in every implementation: `make_model`)."""
    factory, _, kwargs, _, _ = CASES[case]
    model = make_model()
    params = ms.tree.clone(ms.extract(model, detach=True))
    grads = ms.unflatten({name: p.grad for name, p in model.named_parameters()})
    opt = factory(**kwargs, **flags)
    return opt, params, grads, opt.init(params)


def modstate_step(case: str, flags: dict[str, bool], *, donate: bool) -> tuple[Step, Read]:
    """modstate's step, after ``WARM_STEPS`` steps from the same values; and a reader."""
    opt, params, grads, state = start(case, flags)
    carry = [params, state]

    def step() -> None:
        carry[0], carry[1] = opt.step(carry[0], grads, carry[1], donate=donate)

    for _ in range(WARM_STEPS):
        step()
    return step, lambda: {"params": carry[0], "state": carry[1]}


def check_same_steps(case: str, steps: dict[str, tuple[Step, Read]], flags: dict) -> None:
    """Each torch.optim configuration and modstate's same configuration hold the same params
    and state after the warm-up steps and one more: bit for bit, as tests/optim checks over
    100 steps (same flags, same op order). Across flags torch's own kernels differ in the last
    bits, so each pair is compared, not every entry with one."""
    for name in flags:
        torch_entry, ours = steps[f"torch.optim ({name})"], steps[f"modstate ({name})"]
        for run, _ in (torch_entry, ours):
            run()
        expected, got = torch_entry[1](), ours[1]()
        if "step" not in expected["state"]:  # torch's SGD counts no steps; modstate's does
            got = {**got, "state": {k: v for k, v in got["state"].items() if k != "step"}}
        assert_same_trees(expected, got, what=f"{case}, {name}: modstate vs torch.optim")


def allocation_floor(case: str, *, inputs_alive: bool = False) -> Callable[[], object]:
    """Allocate and first-touch what a pure step returns: params and every buffer tree.

    With `inputs_alive`, the trees of the last call are still held while the new ones are
    made, and dropped after, as in a pure loop (``params, state = opt.step(params, ...)``: the
    step's inputs live until its outputs replace them), so the allocator cannot hand the same
    memory back; the target's floor is the plain one."""
    leaves = [p.detach() for p in make_model().parameters()]
    trees = 1 + CASES[case][4]
    held: list[list[torch.Tensor]] = [[]]

    def allocate() -> list[torch.Tensor]:
        return [torch.empty_like(leaf).fill_(1.0) for _ in range(trees) for leaf in leaves]

    def allocate_while_held() -> None:
        held[0] = allocate()

    return allocate_while_held if inputs_alive else allocate


# torch's fused kernels, called as modstate's fused steps call them, with CASES's
# hyperparameters (the defaults of both libraries elsewhere): (params, grads, buffers in the
# optimizer's `buffer_names` order, one step counter per leaf) -> None, in place.
FUSED_KERNELS: dict[str, Callable[..., None]] = {
    "sgd-momentum": lambda p, g, buffers, steps: torch._fused_sgd_(
        p, g, buffers[0], weight_decay=0.0, momentum=0.9, lr=1e-3, dampening=0.0,
        nesterov=False, maximize=False, is_first_step=False,
    ),
    "adam": lambda p, g, buffers, steps: torch._fused_adam_(
        p, g, buffers[0], buffers[1], [], steps, lr=1e-3, beta1=0.9, beta2=0.999,
        weight_decay=0.0, eps=1e-8, amsgrad=False, maximize=False,
    ),
    "adamw": lambda p, g, buffers, steps: torch._fused_adamw_(
        p, g, buffers[0], buffers[1], [], steps, lr=1e-3, beta1=0.9, beta2=0.999,
        weight_decay=1e-2, eps=1e-8, amsgrad=False, maximize=False,
    ),
    "adagrad": lambda p, g, buffers, steps: torch._fused_adagrad_(
        p, g, buffers[0], steps, lr=1e-2, lr_decay=0.0, weight_decay=0.0, eps=1e-10,
        maximize=False,
    ),
}  # fmt: skip
BY_HAND = "reference: copy + torch's fused kernel, by hand"


def by_hand_pure_step(case: str) -> tuple[Step, Read]:
    """The pure fused step without modstate: copy every param and buffer, make the new step
    counter, run torch's fused kernel in place on the copies. It starts where `modstate_step`
    starts (modstate's own warm-up steps) and computes what modstate's pure fused step does."""
    opt, params, grads, state = start(case, FUSED["fused=True"])
    for _ in range(WARM_STEPS):
        params, state = opt.step(params, grads, state)
    names = opt.buffer_names
    paths = list(ms.flatten(params))
    grad_leaves = list(ms.flatten(grads).values())
    kernel = FUSED_KERNELS[case]
    carry: list[Any] = [
        list(ms.flatten(params).values()),
        [list(ms.flatten(state[name]).values()) for name in names],
        state["step"],
    ]

    def step() -> None:
        new_params = [leaf.clone() for leaf in carry[0]]
        new_buffers = [[leaf.clone() for leaf in leaves] for leaves in carry[1]]
        new_step = carry[2] + 1
        kernel(new_params, grad_leaves, new_buffers, [new_step] * len(new_params))
        carry[:] = [new_params, new_buffers, new_step]

    def read() -> dict[str, Any]:
        tree = lambda leaves: ms.unflatten(dict(zip(paths, leaves, strict=True)))  # noqa: E731
        buffers = {name: tree(leaves) for name, leaves in zip(names, carry[1], strict=True)}
        return {"params": tree(carry[0]), "state": {"step": carry[2], **buffers}}

    return step, read


def checked_steps(case: str, ours: str, *, donate: bool) -> dict[str, Step]:
    """modstate's step in each configuration (``ours`` named ``"modstate"``) and torch.optim's,
    checked to compute the same thing (`check_same_steps`)."""
    flags = flag_sets(case)
    steps = {
        f"modstate ({name})": modstate_step(case, v, donate=donate) for name, v in flags.items()
    }
    steps.update({f"torch.optim ({name})": torch_step(case, v) for name, v in flags.items()})
    check_same_steps(case, steps, flags)
    impls = {"modstate": steps.pop(f"modstate ({ours})")[0]}
    impls.update({impl: run for impl, (run, _) in steps.items()})
    return impls


def fastest(stats: dict[str, dict[str, float]], prefix: str, key: str) -> tuple[str, float]:
    impl = min((k for k in stats if k.startswith(prefix)), key=lambda k: stats[k][key])
    return impl, stats[impl][key]


@pytest.fixture(scope="module", autouse=True)
def ratio_table(request):
    """Print the ratios of every optimizer that ran, as a Markdown table, after the module."""
    yield
    if not ROWS:
        return
    lines = [
        "",
        f"Optimizer step, {MODEL}; times are the min over interleaved rounds (median ratio in "
        "brackets).",
        "",
        "| optimizer | torch foreach=True | torch foreach=False | torch fused=True "
        "| modstate donated (best) | donated / best torch | allocation floor | modstate pure "
        "| pure / (best torch + floor) | floor, last trees alive | pure / (best torch + that) "
        "| copy + fused kernel by hand, / (best torch + floor) |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for case, row in ROWS.items():
        lines.append(
            f"| {case} | {row.get('torch foreach=True', '–')} | {row.get('torch foreach=False', '–')}"
            f" | {row.get('torch fused=True', '–')} | {row.get('donated', '–')}"
            f" | {row.get('donated ratio', '–')} | {row.get('floor', '–')}"
            f" | {row.get('pure', '–')} | {row.get('pure ratio', '–')}"
            f" | {row.get('held floor', '–')} | {row.get('held ratio', '–')}"
            f" | {row.get('by hand', '–')} |"
        )
    show(request, lines)


@pytest.mark.parametrize("case", list(CASES))
def test_step_donated(compare, case):
    flags = flag_sets(case)
    ours = "fused=True" if "fused=True" in flags else "foreach=False"
    impls = checked_steps(case, ours, donate=True)
    stats = compare(f"optim step: {case}, donated ({MODEL})", impls)
    if stats is None:
        return
    row = ROWS.setdefault(case, {})
    for name in flags:
        row[f"torch {name}"] = us(stats[f"torch.optim ({name})"]["min"])
    impl, ms_min = fastest(stats, "modstate", "min")
    _, torch_min = fastest(stats, "torch.optim", "min")
    _, ms_median = fastest(stats, "modstate", "median")
    _, torch_median = fastest(stats, "torch.optim", "median")
    label = ours if impl == "modstate" else impl[len("modstate (") : -1]
    row["donated"] = f"{us(ms_min)} ({label})"
    row["donated ratio"] = f"{ms_min / torch_min:.2f}x [{ms_median / torch_median:.2f}x]"


@pytest.mark.parametrize("case", list(CASES))
def test_step_pure(compare, case):
    flags = flag_sets(case)
    ours = "fused=True" if "fused=True" in flags else "foreach=False"
    floor_name = "allocation floor (empty_like + fill of the returned trees)"
    held_name = "allocation floor, the last trees alive (as in a pure loop)"
    impls = checked_steps(case, ours, donate=False)
    if case in FUSED_KERNELS:
        by_hand, ours_fused = (
            by_hand_pure_step(case),
            modstate_step(case, FUSED["fused=True"], donate=False),
        )
        for run, _ in (by_hand, ours_fused):
            run()
        assert_same_trees(ours_fused[1](), by_hand[1](), what=f"{case}: modstate pure vs by hand")
        impls[BY_HAND] = by_hand[0]
    impls[floor_name] = allocation_floor(case)  # floors, not steps: nothing to check
    impls[held_name] = allocation_floor(case, inputs_alive=True)
    stats = compare(f"optim step: {case}, pure ({MODEL})", impls)
    if stats is None:
        return
    row = ROWS.setdefault(case, {})
    floor = stats[floor_name]
    impl, pure_min = fastest(stats, "modstate", "min")
    _, pure_median = fastest(stats, "modstate", "median")
    _, torch_min = fastest(stats, "torch.optim", "min")
    _, torch_median = fastest(stats, "torch.optim", "median")
    label = ours if impl == "modstate" else impl[len("modstate (") : -1]
    row["floor"] = us(floor["min"])
    row["pure"] = f"{us(pure_min)} ({label})"
    row["pure ratio"] = (
        f"{pure_min / (torch_min + floor['min']):.2f}x "
        f"[{pure_median / (torch_median + floor['median']):.2f}x]"
    )
    held = stats[held_name]
    row["held floor"] = us(held["min"])
    row["held ratio"] = f"{pure_min / (torch_min + held['min']):.2f}x"
    if BY_HAND in stats:
        hand = stats[BY_HAND]
        row["by hand"] = (
            f"{us(hand['min'])}: {hand['min'] / (torch_min + floor['min']):.2f}x "
            f"[{hand['median'] / (torch_median + floor['median']):.2f}x]"
        )
