"""A hyperparameter sweep in one ensemble: a 1-D hyperparameter holds one value per member.

For stacked trees (an `Ensemble`'s, `ms.stack_modules`'), member i steps with element i, as a
separate run of that member with that value would. The per-member form is the functional one
(one op per leaf, the value laid along the member dim), so it equals the separate run bit for
bit where torch.optim's eager kernel computes the same ops (RMSprop, Adagrad, Adadelta, RAdam),
and within float32 rounding where its kernel fuses them differently (Adam, AdamW, SGD, NAdam,
Adamax: measured below 2e-7 relative).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest
import torch
from torch import nn

import modstate as ms

MEMBERS = 3
LRS = [1e-3, 1e-2, 1e-1]
STEPS = 10

FACTORIES: dict[str, Callable[[Any], Any]] = {
    "adam": lambda lr: ms.optim.adam(lr=lr, weight_decay=0.01, amsgrad=True),
    "adamw": lambda lr: ms.optim.adamw(lr=lr),
    "sgd": lambda lr: ms.optim.sgd(lr=lr, momentum=0.9, nesterov=True),
    "rmsprop": lambda lr: ms.optim.rmsprop(lr=lr, centered=True),
    "adagrad": lambda lr: ms.optim.adagrad(lr=lr),
    "adadelta": lambda lr: ms.optim.adadelta(lr=lr),
    "adamax": lambda lr: ms.optim.adamax(lr=lr),
    "nadam": lambda lr: ms.optim.nadam(lr=lr),
    "radam": lambda lr: ms.optim.radam(lr=lr),
}
BIT_EQUAL = {"rmsprop", "adagrad", "radam"}


def assert_within(got: torch.Tensor, want: torch.Tensor, rtol: float = 1e-6) -> None:
    """Equal to ``rtol`` relative to the tensor's largest magnitude (an element near 0 may
    differ more relative to itself: float32 rounding of a sum whose terms cancel)."""
    assert (got - want).abs().max() <= rtol * want.abs().max()


def stacked_members() -> dict:
    torch.manual_seed(0)
    members = [nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 1)) for _ in range(MEMBERS)]
    return ms.tree.detach(ms.stack_modules(members))


def gradients(stacked: dict) -> list[dict]:
    torch.manual_seed(1)
    return [ms.tree.map(torch.randn_like, stacked) for _ in range(STEPS)]


def member(tree: dict, i: int) -> dict:
    return ms.tree.map(lambda leaf: leaf[i], tree)


def run(opt: Any, params: dict, grads: list[dict]) -> dict:
    state = opt.init(params)
    for g in grads:
        params, state = opt.step(params, g, state)
    return params


@pytest.mark.parametrize("name", list(FACTORIES))
def test_member_i_steps_with_element_i(name: str) -> None:
    stacked, make = stacked_members(), FACTORIES[name]
    grads = gradients(stacked)
    swept = run(make(torch.tensor(LRS)), stacked, grads)
    for i, lr in enumerate(LRS):
        alone = run(make(lr), member(stacked, i), [member(g, i) for g in grads])
        for path, want in ms.flatten(alone).items():
            got = ms.flatten(swept)[path][i]
            if name in BIT_EQUAL:
                assert torch.equal(got, want), path
            else:
                assert_within(got, want)


def test_betas_and_a_schedule_may_be_per_member_too() -> None:
    stacked = stacked_members()
    grads = gradients(stacked)
    # float64, as Python's numbers are: the bias corrections 1 - beta**t then round as
    # torch.optim's do (float32 betas would compute them in float32)
    betas = (
        torch.tensor([0.8, 0.9, 0.95], dtype=torch.float64),
        torch.tensor([0.99, 0.999, 0.9999], dtype=torch.float64),
    )
    # a schedule of the step count that returns one value per member
    warmup = torch.tensor(LRS)

    def schedule(count: Any) -> torch.Tensor:
        return warmup * torch.clamp(torch.as_tensor(count + 1) / 5, max=1.0)

    swept = run(ms.optim.adam(lr=schedule, betas=betas), stacked, grads)
    for i in range(MEMBERS):
        one_beta = (float(betas[0][i]), float(betas[1][i]))

        def schedule_i(count: Any, i: int = i) -> Any:
            return schedule(count)[i]

        alone = run(
            ms.optim.adam(lr=schedule_i, betas=one_beta),
            member(stacked, i),
            [member(g, i) for g in grads],
        )
        for path, want in ms.flatten(alone).items():
            assert_within(ms.flatten(swept)[path][i], want)


def test_a_count_that_is_not_the_members_is_refused_naming_the_path_and_the_fix() -> None:
    stacked = stacked_members()
    opt = ms.optim.adam(lr=torch.tensor([1e-3, 1e-2]))  # two values, three members
    state = opt.init(stacked)
    grads = gradients(stacked)[0]
    with pytest.raises(
        ValueError, match=r"adam\.step: '0\.(bias|weight)': lr holds 2 values, one per "
    ):
        opt.step(stacked, grads, state)
    # the fix the message names: one value per member (or one value for all)
    fixed = ms.optim.adam(lr=torch.tensor([1e-3, 1e-2, 1e-1]))
    params, _ = fixed.step(stacked, grads, fixed.init(stacked))
    assert ms.flatten(params).keys() == ms.flatten(stacked).keys()
    one_for_all = ms.optim.adam(lr=1e-3)
    one_for_all.step(stacked, grads, one_for_all.init(stacked))


def test_more_than_one_dim_is_refused_when_built() -> None:
    with pytest.raises(ValueError, match=r"adam: 'lr': a tensor of shape \(3, 1\)"):
        ms.optim.adam(lr=torch.ones(3, 1))


def test_an_ensemble_trains_a_sweep_in_one_step() -> None:
    torch.manual_seed(0)
    ens = ms.Ensemble([nn.Linear(4, 1) for _ in range(MEMBERS)])
    params, state = ms.split(ens, detach=True)
    opt = ms.optim.sgd(lr=torch.tensor(LRS))
    x, y = torch.randn(8, 4), torch.randn(8, 1)

    def loss(p: Any) -> torch.Tensor:
        out, _ = ms.apply(ens, p, state, x)
        return ((out - y) ** 2).sum()

    grads = ms.grad(loss)(params)
    new, _ = opt.step(params, grads, opt.init(params))
    for i, lr in enumerate(LRS):
        for path, leaf in ms.flatten(new).items():
            want = ms.flatten(params)[path][i] - lr * ms.flatten(grads)[path][i]
            torch.testing.assert_close(leaf[i], want, rtol=1e-6, atol=1e-7)
