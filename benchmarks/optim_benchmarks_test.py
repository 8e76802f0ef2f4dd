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
  ``fill_``, params and every buffer), which no pure step can avoid.

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


def torch_step(case: str, flags: dict[str, bool]) -> Callable[[], None]:
    _, torch_class, kwargs, _, _ = CASES[case]
    model = make_model()
    return torch_class(model.parameters(), **kwargs, **flags).step


def modstate_step(case: str, flags: dict[str, bool], *, donate: bool) -> Callable[[], None]:
    factory, _, kwargs, _, _ = CASES[case]
    model = make_model()
    params = ms.tree.clone(ms.extract(model, detach=True))
    grads = ms.unflatten({name: p.grad for name, p in model.named_parameters()})
    opt = factory(**kwargs, **flags)
    carry = [params, opt.init(params)]
    for _ in range(3):  # past the first steps, which some optimizers treat apart
        carry[0], carry[1] = opt.step(carry[0], grads, carry[1], donate=donate)

    def step() -> None:
        carry[0], carry[1] = opt.step(carry[0], grads, carry[1], donate=donate)

    return step


def allocation_floor(case: str) -> Callable[[], list[torch.Tensor]]:
    """Allocate and first-touch what a pure step returns: params and every buffer tree."""
    leaves = [p.detach() for p in make_model().parameters()]
    trees = 1 + CASES[case][4]

    def allocate() -> list[torch.Tensor]:
        return [torch.empty_like(leaf).fill_(1.0) for _ in range(trees) for leaf in leaves]

    return allocate


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
        "| pure / (best torch + floor) |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for case, row in ROWS.items():
        lines.append(
            f"| {case} | {row.get('torch foreach=True', '–')} | {row.get('torch foreach=False', '–')}"
            f" | {row.get('torch fused=True', '–')} | {row.get('donated', '–')}"
            f" | {row.get('donated ratio', '–')} | {row.get('floor', '–')}"
            f" | {row.get('pure', '–')} | {row.get('pure ratio', '–')} |"
        )
    show(request, lines)


@pytest.mark.parametrize("case", list(CASES))
def test_step_donated(compare, case):
    flags = flag_sets(case)
    ours = "fused=True" if "fused=True" in flags else "foreach=False"
    impls = {"modstate": modstate_step(case, flags[ours], donate=True)}
    impls.update(
        {
            f"modstate ({name})": modstate_step(case, value, donate=True)
            for name, value in flags.items()
            if name != ours
        }
    )
    impls.update(
        {f"torch.optim ({name})": torch_step(case, value) for name, value in flags.items()}
    )
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
    impls = {"modstate": modstate_step(case, flags[ours], donate=False)}
    impls.update(
        {
            f"modstate ({name})": modstate_step(case, value, donate=False)
            for name, value in flags.items()
            if name != ours
        }
    )
    impls[floor_name] = allocation_floor(case)
    impls.update(
        {f"torch.optim ({name})": torch_step(case, value) for name, value in flags.items()}
    )
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
