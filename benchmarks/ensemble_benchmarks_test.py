"""Ensemble forward speed: ``ms.Ensemble`` beside the ways people run N models today.

Every case runs N models of one architecture on a shared input, without grad, and returns the
stacked outputs. Peers: ``torch.vmap`` over ``torch.func.functional_call`` on
``torch.func.stack_module_state`` (the PyTorch tutorial's recipe), tensordict 0.15.3's
``TensorDict.from_modules`` + ``to_module`` under ``torch.vmap``, the Python loop over the models,
and, for MLPs, a hand-written ``torch.baddbmm`` chain over the stacked weights (the limit).

Two chains: with ``torch.relu`` as written by hand (and as ``nn.ReLU()`` computes it), and with
``relu_`` in place, which the Ensemble also uses after a batched Linear.

Cases: tensordict's own ``test_vmap_mlp_speed`` (two copies of ``Sequential((Linear(64, 64),
ReLU()) x 4)``, ``x = randn(1, 1, 64)``) and transformer case (two copies of
``nn.Transformer(64, nhead=4, num_encoder_layers=3, num_decoder_layers=3,
dim_feedforward=64)``, ``x = randn(1, 20, 64)``), and the issue's compute-bound (32 MLPs
64→256→256→10, batch 128) and overhead-bound (100 MLPs 3→4→4→1, batch 2) cases.

Each case is one test timed with the ``compare`` fixture: every implementation is checked
against the Ensemble's output, warmed up, then timed in interleaved rounds (first-timed variants
are slow on a busy machine; interleaving spreads that over all of them). tensordict entries are
left out, and listed by the report, when tensordict is not installed.
"""

from __future__ import annotations

import copy
import functools
import itertools
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import pytest
import torch
from torch import nn
from torch.func import functional_call, stack_module_state

import modstate as ms
from _timing import optional


@dataclass(frozen=True)
class Case:
    name: str
    build: Callable[[], nn.Module]
    count: int
    input: Callable[[], torch.Tensor]
    identical: bool = False  # tensordict's cases: one model, stacked with a copy of itself
    two_inputs: bool = False  # nn.Transformer takes (src, tgt)
    mlp: bool = True  # a Linear/ReLU stack, so the baddbmm chain applies


def mlp(*sizes: int, last_activation: bool = False) -> nn.Sequential:
    layers: list[nn.Module] = []
    for fan_in, fan_out in itertools.pairwise(sizes):
        layers += [nn.Linear(fan_in, fan_out), nn.ReLU()]
    return nn.Sequential(*(layers if last_activation else layers[:-1]))


CASES = [
    Case(
        "ensemble: tensordict vmap_mlp (2 x 4x Linear(64,64)+ReLU, x 1x1x64)",
        lambda: mlp(64, 64, 64, 64, 64, last_activation=True),
        2,
        lambda: torch.randn(1, 1, 64),
        identical=True,
    ),
    Case(
        "ensemble: tensordict transformer (2 x nn.Transformer(64, 4 heads, 3+3 layers), x 1x20x64)",
        lambda: nn.Transformer(
            64, nhead=4, num_encoder_layers=3, num_decoder_layers=3, dim_feedforward=64
        ),
        2,
        lambda: torch.randn(1, 20, 64),
        identical=True,
        two_inputs=True,
        mlp=False,
    ),
    Case(
        "ensemble: compute-bound (32 MLPs 64-256-256-10, batch 128)",
        lambda: mlp(64, 256, 256, 10),
        32,
        lambda: torch.randn(128, 64),
    ),
    Case(
        "ensemble: overhead-bound (100 MLPs 3-4-4-1, batch 2)",
        lambda: mlp(3, 4, 4, 1),
        100,
        lambda: torch.randn(2, 3),
    ),
]
tensordict = optional("tensordict")
IMPLS = [
    "modstate",
    "torch.func.functional_call",
    "tensordict",
    "tensordict expand",
    "loop",
    "baddbmm chain",
    "baddbmm chain, in-place relu",
]


def models_of(case: Case) -> list[nn.Module]:
    torch.manual_seed(0)
    if case.identical:
        first = case.build().eval()
        return [first] + [copy.deepcopy(first) for _ in range(case.count - 1)]
    return [case.build().eval() for _ in range(case.count)]


def runner(impl: str, case: Case, models: list[nn.Module]) -> Callable[[torch.Tensor], Any]:
    """A function of the shared input that runs every member and stacks the outputs."""
    arity = 2 if case.two_inputs else 1
    if impl == "modstate":
        ensemble = ms.Ensemble(models)
        return lambda x: ensemble(*(x,) * arity)
    if impl == "torch.func.functional_call":
        params, buffers = stack_module_state(models)
        base = copy.deepcopy(models[0]).to("meta")

        def member(p: Any, b: Any, x: torch.Tensor) -> Any:
            return functional_call(base, (p, b), (x,) * arity)

        vmapped = torch.vmap(member, in_dims=(0, 0, None))
        return lambda x: vmapped(params, buffers, x)
    if impl in ("tensordict", "tensordict expand"):
        assert tensordict is not None
        if impl == "tensordict":
            params = tensordict.TensorDict.from_modules(*models)
        else:  # tensordict's other variant: one model's state expanded to N members
            single = tensordict.TensorDict.from_module(models[0])
            params = single.expand(len(models)).to_tensordict().lock_()
        base = copy.deepcopy(models[0])  # to_module under vmap changes the module it is given

        def member_td(p: Any, x: torch.Tensor) -> Any:
            with p.to_module(base):
                return base(*(x,) * arity)

        vmapped_td = torch.vmap(member_td, in_dims=(0, None))
        return lambda x: vmapped_td(params, x)
    if impl == "loop":
        return lambda x: torch.stack([m(*(x,) * arity) for m in models])
    if impl.startswith("baddbmm chain"):
        return baddbmm_chain(models, in_place=impl.endswith("in-place relu"))
    raise AssertionError(impl)


def baddbmm_chain(
    models: list[nn.Module], in_place: bool
) -> Callable[[torch.Tensor], torch.Tensor]:
    """The hand-written batched MLP: one ``baddbmm`` per Linear on the stacked weights, then
    ``torch.relu`` (as ``nn.ReLU()`` computes it) or ``relu_`` in place."""
    relu = torch.relu_ if in_place else torch.relu
    params, _ = stack_module_state(models)
    modules = list(models[0])
    layers = [
        (params[f"{i}.weight"], params[f"{i}.bias"], isinstance(next_of(modules, i), nn.ReLU))
        for i, m in enumerate(modules)
        if isinstance(m, nn.Linear)
    ]
    count = len(models)

    def run(x: torch.Tensor) -> torch.Tensor:
        h = x.reshape(-1, x.shape[-1]).expand(count, -1, -1)
        for weight, bias, has_relu in layers:
            h = torch.baddbmm(bias.unsqueeze(1), h, weight.transpose(1, 2))
            if has_relu:
                h = relu(h)
        return h.view(count, *x.shape[:-1], h.shape[-1])

    return run


def next_of(modules: list[nn.Module], i: int) -> nn.Module | None:
    return modules[i + 1] if i + 1 < len(modules) else None


def applies(impl: str, case: Case) -> bool:
    if impl.startswith("baddbmm chain"):
        return case.mlp  # the hand-written chain covers Linear/ReLU stacks only
    if impl == "tensordict expand":
        return case.identical  # one model's state expanded: tensordict's cases only
    return True


@pytest.mark.parametrize(
    "case", CASES, ids=lambda c: c.name.split(" (")[0].removeprefix("ensemble: ")
)
def test_ensemble_forward(compare, case: Case) -> None:
    models = models_of(case)
    torch.manual_seed(1)
    x = case.input()
    wanted = [impl for impl in IMPLS if applies(impl, case)]
    missing = [impl for impl in wanted if impl.startswith("tensordict") and tensordict is None]
    impls = {}
    with torch.no_grad():
        expected = ms.Ensemble(models)(*(x,) * (2 if case.two_inputs else 1))
        for impl in wanted:
            if impl in missing:
                continue
            run = runner(impl, case, models)
            # Batched kernels sum in another order than each model's own: the last bits differ.
            torch.testing.assert_close(
                run(x), expected, atol=1e-4, rtol=1e-4, msg=lambda m, impl=impl: f"{impl}: {m}"
            )
            impls[impl] = functools.partial(run, x)
        compare(case.name, impls, missing=missing)
