"""One optimizer step: ``modstate.optim`` (pure, returns new trees) against ``torch.optim`` with
``foreach=True`` (updates the parameters in place), in the same process.

The model is four ``nn.Linear(512, 512)`` (8 leaves, 1.05 M parameters) with fixed gradients.
Each group is ``"optim step: <optimizer> (4x Linear(512,512))"``; ``extra_info["impl"]`` is
``"modstate"`` or ``"torch.optim (foreach=True)"``. Target: the Adam step of modstate within 1.3x
of torch's.
"""

from __future__ import annotations

import pytest
import torch
from torch import nn

import modstate as ms
from modstate import optim

TORCH = "torch.optim (foreach=True)"
MODEL = "4x Linear(512,512)"

CASES = {
    "sgd-momentum": (
        lambda: optim.sgd(lr=1e-3, momentum=0.9),
        lambda params: torch.optim.SGD(params, lr=1e-3, momentum=0.9, foreach=True),
    ),
    "adam": (
        lambda: optim.adam(lr=1e-3),
        lambda params: torch.optim.Adam(params, lr=1e-3, foreach=True),
    ),
    "adamw": (
        lambda: optim.adamw(lr=1e-3, weight_decay=1e-2),
        lambda params: torch.optim.AdamW(params, lr=1e-3, weight_decay=1e-2, foreach=True),
    ),
}


def tag(benchmark, group: str, impl: str) -> None:
    benchmark.group = group
    benchmark.extra_info["impl"] = impl


def make_model() -> nn.Module:
    torch.manual_seed(0)
    model = nn.Sequential(*(nn.Linear(512, 512) for _ in range(4)))
    for param in model.parameters():
        param.grad = torch.randn_like(param) * 1e-2
    return model


@pytest.mark.parametrize("case", list(CASES))
def test_step_modstate(benchmark, case):
    make_opt, _ = CASES[case]
    tag(benchmark, f"optim step: {case} ({MODEL})", "modstate")
    model = make_model()
    params = ms.extract(model, detach=True)
    grads = ms.unflatten({name: p.grad for name, p in model.named_parameters()})
    opt = make_opt()
    carry = [params, opt.init(params)]

    def step() -> None:
        carry[0], carry[1] = opt.step(carry[0], grads, carry[1])

    benchmark(step)
    assert carry[1]["step"].item() >= 1


@pytest.mark.parametrize("case", list(CASES))
def test_step_torch_optim(benchmark, case):
    _, make_torch = CASES[case]
    tag(benchmark, f"optim step: {case} ({MODEL})", TORCH)
    model = make_model()
    opt = make_torch(model.parameters())
    benchmark(opt.step)
    assert opt.state[model[0].weight]
