"""modstate.optim.schedules: each equals its torch.optim.lr_scheduler at every step."""

from __future__ import annotations

import warnings

import pytest
import torch
from torch.optim import lr_scheduler

from modstate.optim import schedules

STEPS = 120
LR = 0.1

# (ours, a function building torch's scheduler on an optimizer)
CASES = {
    "constant": (
        schedules.constant(LR, factor=0.3, total_iters=7),
        lambda opt: lr_scheduler.ConstantLR(opt, factor=0.3, total_iters=7),
    ),
    "constant-plain": (schedules.constant(LR), lambda opt: lr_scheduler.ConstantLR(opt, 1.0, 0)),
    "step": (
        schedules.step(LR, step_size=7, gamma=0.7),
        lambda opt: lr_scheduler.StepLR(opt, step_size=7, gamma=0.7),
    ),
    "multistep": (
        schedules.multistep(LR, milestones=[3, 10, 10, 40], gamma=0.3),
        lambda opt: lr_scheduler.MultiStepLR(opt, milestones=[3, 10, 10, 40], gamma=0.3),
    ),
    "exponential": (
        schedules.exponential(LR, gamma=0.97),
        lambda opt: lr_scheduler.ExponentialLR(opt, gamma=0.97),
    ),
    "cosine": (
        schedules.cosine(LR, T_max=30, eta_min=0.001),
        lambda opt: lr_scheduler.CosineAnnealingLR(opt, T_max=30, eta_min=0.001),
    ),
    "linear_warmup": (
        schedules.linear_warmup(LR, start_factor=0.1, end_factor=0.9, total_iters=20),
        lambda opt: lr_scheduler.LinearLR(opt, start_factor=0.1, end_factor=0.9, total_iters=20),
    ),
    "warmup_cosine": (
        schedules.warmup_cosine(LR, warmup_iters=10, T_max=40, start_factor=0.2, eta_min=1e-4),
        lambda opt: lr_scheduler.SequentialLR(
            opt,
            [
                lr_scheduler.LinearLR(opt, start_factor=0.2, total_iters=10),
                lr_scheduler.CosineAnnealingLR(opt, T_max=40, eta_min=1e-4),
            ],
            milestones=[10],
        ),
    ),
    "onecycle": (
        schedules.onecycle(LR, total_steps=STEPS),
        lambda opt: lr_scheduler.OneCycleLR(
            opt, max_lr=LR, total_steps=STEPS, cycle_momentum=False
        ),
    ),
    "onecycle-three-phase-linear": (
        schedules.onecycle(LR, total_steps=STEPS, three_phase=True, anneal_strategy="linear"),
        lambda opt: lr_scheduler.OneCycleLR(
            opt,
            max_lr=LR,
            total_steps=STEPS,
            cycle_momentum=False,
            three_phase=True,
            anneal_strategy="linear",
        ),
    ),
}


def torch_learning_rates(make_scheduler) -> list[float]:
    """The lr torch's optimizer uses at each step, the scheduler stepping after each."""
    param = torch.nn.Parameter(torch.zeros(1))
    opt = torch.optim.SGD([param], lr=LR)
    scheduler = make_scheduler(opt)
    used = []
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        for _ in range(STEPS):
            used.append(opt.param_groups[0]["lr"])
            opt.step()
            scheduler.step()
    return used


@pytest.mark.parametrize("name", list(CASES))
def test_equal_to_torch_at_every_step(name):
    ours, make_scheduler = CASES[name]
    assert [ours(t) for t in range(STEPS)] == torch_learning_rates(make_scheduler)


@pytest.mark.parametrize("name", list(CASES))
def test_a_step_counter_tensor_gives_the_closed_form(name):
    """Under vmap / grad the count is a tensor: the closed form, equal up to rounding."""
    ours, make_scheduler = CASES[name]
    expected = torch.tensor(torch_learning_rates(make_scheduler), dtype=torch.float64)
    counts = torch.arange(STEPS, dtype=torch.float64)
    got = torch.vmap(lambda count: torch.as_tensor(ours(count), dtype=torch.float64))(counts)
    torch.testing.assert_close(got, expected, rtol=1e-12, atol=1e-15)


def test_asking_in_any_order_gives_the_same_values():
    ours = schedules.exponential(1.0, gamma=0.9)
    late = ours(50)
    assert [ours(t) for t in range(51)][-1] == late
    assert ours(3) == 1.0 * 0.9 * 0.9 * 0.9


def test_bad_arguments_are_refused():
    with pytest.raises(ValueError, match=r"^step: 'step_size': 0; pass a positive"):
        schedules.step(0.1, step_size=0)
    assert schedules.step(0.1, step_size=1)(1) == pytest.approx(0.01)  # the fix works
    with pytest.raises(ValueError, match=r"^onecycle: 'anneal_strategy': 'exp'; pass 'cos'"):
        schedules.onecycle(0.1, total_steps=10, anneal_strategy="exp")  # type: ignore[arg-type]
    assert schedules.onecycle(0.1, total_steps=10, anneal_strategy="linear")(0) > 0
    with pytest.raises(ValueError, match=r"^schedule: '<count>': got -1; .*an integer >= 0"):
        schedules.cosine(0.1, T_max=10)(-1)
    with pytest.raises(ValueError, match=r"^onecycle: 'total_steps': 10, but step 11 was asked"):
        schedules.onecycle(0.1, total_steps=10)(11)
    assert schedules.onecycle(0.1, total_steps=11)(11) > 0  # the fix: enough total_steps
