"""One optimizer step on 4x ``nn.Linear(512, 512)`` (8 leaves, 1.05 M parameters), for every
optimizer of ``modstate.optim``, interleaved with its peers in one process (the ``compare``
fixture).

Two groups per optimizer:

- ``optim step: <name>, donated (...)``: ``opt.step(params, grads, state, donate=True)``, which
  writes over its inputs as ``torch.optim`` does; peers ``torch.optim (foreach=True)``,
  ``torch.optim (fused=True)`` where torch has a fused CPU kernel (it computes in another order,
  so it is a speed reference, not a numbers reference), ``torch.optim (foreach=False)`` (torch's
  default on the CPU: the numbers modstate reproduces, op for op) and ``torchopt (inplace=True)``.
- ``optim step: <name> (...)``: the pure step, new trees out; peers ``torch.optim
  (foreach=True)`` and ``torchopt (inplace=False)``.

Targets (issue 11): donated <= 1.0x ``torch.optim (foreach=True)``, pure <= 1.1x.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest
import torch
from torch import nn

import modstate as ms
from modstate import optim

try:
    import torchopt
except ImportError:  # torchopt is in the `bench` extra; the suite runs without it
    torchopt = None

MODEL = "4x Linear(512,512)"

# name: (modstate factory, torch.optim class, kwargs for both, fused on CPU, torchopt factory)
CASES: dict[str, tuple[Callable[..., Any], type, dict[str, Any], bool, str | None]] = {
    "sgd-momentum": (optim.sgd, torch.optim.SGD, {"lr": 1e-3, "momentum": 0.9}, True, "sgd"),
    "adam": (optim.adam, torch.optim.Adam, {"lr": 1e-3}, True, "adam"),
    "adamw": (optim.adamw, torch.optim.AdamW, {"lr": 1e-3, "weight_decay": 1e-2}, True, "adamw"),
    "rmsprop": (optim.rmsprop, torch.optim.RMSprop, {"lr": 1e-3}, False, "rmsprop"),
    "adagrad": (optim.adagrad, torch.optim.Adagrad, {"lr": 1e-2}, True, "adagrad"),
    "adamax": (optim.adamax, torch.optim.Adamax, {"lr": 2e-3}, False, "adamax"),
    "nadam": (optim.nadam, torch.optim.NAdam, {"lr": 2e-3}, False, None),
    "radam": (optim.radam, torch.optim.RAdam, {"lr": 1e-3}, False, "radam"),
    "adadelta": (optim.adadelta, torch.optim.Adadelta, {"lr": 1.0}, False, "adadelta"),
}


def make_model() -> nn.Module:
    torch.manual_seed(0)
    model = nn.Sequential(*(nn.Linear(512, 512) for _ in range(4)))
    for param in model.parameters():
        param.grad = torch.randn_like(param) * 1e-2
    return model


def torch_step(case: str, **flags: bool) -> Callable[[], None]:
    _, torch_class, kwargs, _, _ = CASES[case]
    model = make_model()
    opt = torch_class(model.parameters(), **kwargs, **flags)
    return opt.step


def modstate_step(case: str, *, donate: bool) -> Callable[[], None]:
    factory, _, kwargs, _, _ = CASES[case]
    model = make_model()
    params = ms.tree.clone(ms.extract(model, detach=True))
    grads = ms.unflatten({name: p.grad for name, p in model.named_parameters()})
    opt = factory(**kwargs)
    carry = [params, opt.init(params)]

    def step() -> None:
        carry[0], carry[1] = opt.step(carry[0], grads, carry[1], donate=donate)

    return step


def torchopt_step(case: str, *, inplace: bool) -> Callable[[], None]:
    _, _, kwargs, _, name = CASES[case]
    model = make_model()
    params = ms.tree.clone(ms.extract(model, detach=True))
    grads = ms.unflatten({n: p.grad for n, p in model.named_parameters()})
    opt = getattr(torchopt, name)(**kwargs)
    carry = [params, opt.init(params)]

    def step() -> None:
        updates, carry[1] = opt.update(grads, carry[1], params=carry[0], inplace=inplace)
        carry[0] = torchopt.apply_updates(carry[0], updates, inplace=inplace)

    return step


@pytest.mark.parametrize("case", list(CASES))
def test_step_donated(compare, case):
    impls = {
        "modstate": modstate_step(case, donate=True),
        "torch.optim (foreach=True)": torch_step(case, foreach=True),
    }
    if CASES[case][3]:
        impls["torch.optim (fused=True)"] = torch_step(case, fused=True)
    # torch's default on the CPU, whose numbers modstate reproduces (same ops in the same order).
    impls["torch.optim (foreach=False)"] = torch_step(case, foreach=False)
    if torchopt is not None and CASES[case][4] is not None:
        impls["torchopt (inplace=True)"] = torchopt_step(case, inplace=True)
    compare(f"optim step: {case}, donated ({MODEL})", impls)


@pytest.mark.parametrize("case", list(CASES))
def test_step_pure(compare, case):
    impls = {
        "modstate": modstate_step(case, donate=False),
        "torch.optim (foreach=True)": torch_step(case, foreach=True),
    }
    if torchopt is not None and CASES[case][4] is not None:
        impls["torchopt (inplace=False)"] = torchopt_step(case, inplace=False)
    compare(f"optim step: {case} ({MODEL})", impls)
