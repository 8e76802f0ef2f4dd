"""The public schedule builders, with torch's argument names and checks."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Literal

from modstate.optim.schedules._kinds import (
    Constant,
    Cosine,
    Exponential,
    LinearWarmup,
    MultiStep,
    OneCycle,
    Step,
    WarmupCosine,
)


def constant(lr: float, factor: float = 1.0, total_iters: int = 0) -> Constant:
    """``lr * factor`` for the first `total_iters` steps, then `lr` (torch's ``ConstantLR``).

    With the defaults, simply `lr` at every step.

    Args:
        lr: the base learning rate.
        factor: the multiplier of the first `total_iters` steps.
        total_iters: how many steps use ``lr * factor``.

    Returns:
        A schedule: ``schedule(steps_taken)`` is the next step's learning rate.

    Example:
        >>> s = constant(0.1, factor=0.5, total_iters=2)
        >>> [s(t) for t in range(4)]
        [0.05, 0.05, 0.1, 0.1]
    """
    return Constant(lr, factor, total_iters)


def step(lr: float, step_size: int, gamma: float = 0.1) -> Step:
    """`lr` multiplied by `gamma` every `step_size` steps (torch's ``StepLR``).

    Args:
        lr: the base learning rate.
        step_size: how many steps between two decays.
        gamma: the decay factor.

    Returns:
        A schedule: ``schedule(steps_taken)`` is the next step's learning rate.

    Raises:
        ValueError: `step_size` is not positive.

    Example:
        >>> s = step(1.0, step_size=2, gamma=0.5)
        >>> [s(t) for t in range(5)]
        [1.0, 1.0, 0.5, 0.5, 0.25]
    """
    if step_size <= 0:
        raise ValueError(f"step: 'step_size': {step_size}; pass a positive number of steps")
    return Step(lr, step_size, gamma)


def multistep(lr: float, milestones: Sequence[int], gamma: float = 0.1) -> MultiStep:
    """`lr` multiplied by `gamma` at each milestone step (torch's ``MultiStepLR``).

    Args:
        lr: the base learning rate.
        milestones: the step counts at which the rate decays (a repeated one decays twice).
        gamma: the decay factor.

    Returns:
        A schedule: ``schedule(steps_taken)`` is the next step's learning rate.

    Example:
        >>> s = multistep(1.0, milestones=[1, 3], gamma=0.5)
        >>> [s(t) for t in range(4)]
        [1.0, 0.5, 0.5, 0.25]
    """
    return MultiStep(lr, tuple(sorted(milestones)), gamma)


def exponential(lr: float, gamma: float) -> Exponential:
    """`lr` multiplied by `gamma` at every step (torch's ``ExponentialLR``).

    Args:
        lr: the base learning rate.
        gamma: the decay factor of each step.

    Returns:
        A schedule: ``schedule(steps_taken)`` is the next step's learning rate.

    Example:
        >>> s = exponential(1.0, gamma=0.5)
        >>> [s(t) for t in range(3)]
        [1.0, 0.5, 0.25]
    """
    return Exponential(lr, gamma)


def cosine(lr: float, T_max: int, eta_min: float = 0.0) -> Cosine:
    """Cosine annealing from `lr` to `eta_min` over `T_max` steps (``CosineAnnealingLR``).

    Args:
        lr: the base (largest) learning rate.
        T_max: the half-period, in steps.
        eta_min: the smallest learning rate.

    Returns:
        A schedule: ``schedule(steps_taken)`` is the next step's learning rate.

    Raises:
        ValueError: `T_max` is not positive.

    Example:
        >>> s = cosine(1.0, T_max=2)
        >>> [round(s(t), 6) for t in range(3)]
        [1.0, 0.5, 0.0]
    """
    if T_max <= 0:
        raise ValueError(f"cosine: 'T_max': {T_max}; pass a positive number of steps")
    return Cosine(lr, T_max, eta_min)


def linear_warmup(
    lr: float, start_factor: float = 1.0 / 3, end_factor: float = 1.0, total_iters: int = 5
) -> LinearWarmup:
    """From ``lr * start_factor`` linearly to ``lr * end_factor`` over `total_iters` steps,
    then constant (torch's ``LinearLR``).

    Args:
        lr: the base learning rate.
        start_factor: the multiplier of the first step, in (0, 1].
        end_factor: the multiplier after `total_iters` steps, in [0, 1].
        total_iters: the length of the ramp, in steps.

    Returns:
        A schedule: ``schedule(steps_taken)`` is the next step's learning rate.

    Raises:
        ValueError: a factor out of its range (as torch's ``LinearLR``).

    Example:
        >>> s = linear_warmup(1.0, start_factor=0.25, total_iters=3)
        >>> [round(s(t), 6) for t in range(5)]
        [0.25, 0.5, 0.75, 1.0, 1.0]
    """
    if not 0 < start_factor <= 1:
        raise ValueError(f"linear_warmup: 'start_factor': {start_factor}; pass a factor in (0, 1]")
    if not 0 <= end_factor <= 1:
        raise ValueError(f"linear_warmup: 'end_factor': {end_factor}; pass a factor in [0, 1]")
    return LinearWarmup(lr, start_factor, end_factor, total_iters)


def warmup_cosine(
    lr: float,
    warmup_iters: int,
    T_max: int,
    start_factor: float = 1.0 / 3,
    eta_min: float = 0.0,
) -> WarmupCosine:
    """A linear warm-up for `warmup_iters` steps, then cosine annealing over `T_max` steps:
    torch's ``SequentialLR([LinearLR(start_factor, total_iters=warmup_iters),
    CosineAnnealingLR(T_max, eta_min)], milestones=[warmup_iters])``.

    Args:
        lr: the learning rate at the end of the warm-up (the cosine's largest).
        warmup_iters: the length of the warm-up, in steps.
        T_max: the cosine's half-period, in steps.
        start_factor: the warm-up's first multiplier, in (0, 1].
        eta_min: the cosine's smallest learning rate.

    Returns:
        A schedule: ``schedule(steps_taken)`` is the next step's learning rate.

    Raises:
        ValueError: `warmup_iters` or `T_max` is not positive, or `start_factor` is out of
            (0, 1].

    Example:
        >>> s = warmup_cosine(1.0, warmup_iters=2, T_max=2, start_factor=0.5)
        >>> [round(s(t), 6) for t in range(5)]
        [0.5, 0.75, 1.0, 0.5, 0.0]
    """
    if warmup_iters <= 0:
        raise ValueError(
            f"warmup_cosine: 'warmup_iters': {warmup_iters}; pass a positive number of steps"
        )
    return WarmupCosine(
        linear_warmup(lr, start_factor, 1.0, warmup_iters), cosine(lr, T_max, eta_min), warmup_iters
    )


def onecycle(
    max_lr: float,
    total_steps: int,
    pct_start: float = 0.3,
    anneal_strategy: Literal["cos", "linear"] = "cos",
    div_factor: float = 25.0,
    final_div_factor: float = 1e4,
    three_phase: bool = False,
) -> OneCycle:
    """The 1cycle policy's learning rate (torch's ``OneCycleLR``; momentum is not cycled).

    Args:
        max_lr: the peak learning rate.
        total_steps: the number of steps of the whole cycle.
        pct_start: the fraction of the steps spent rising.
        anneal_strategy: ``"cos"`` or ``"linear"``.
        div_factor: the first learning rate is ``max_lr / div_factor``.
        final_div_factor: the last is ``max_lr / div_factor / final_div_factor``.
        three_phase: torch's three-phase variant.

    Returns:
        A schedule: ``schedule(steps_taken)`` is the next step's learning rate.

    Raises:
        ValueError: `total_steps` is not positive or `anneal_strategy` is unknown; a step
            past `total_steps` is asked for.

    Example:
        >>> s = onecycle(1.0, total_steps=10)
        >>> round(s(0), 8), s(2), round(s(9), 8)
        (0.04, 1.0, 4e-06)
    """
    if total_steps <= 0:
        raise ValueError(f"onecycle: 'total_steps': {total_steps}; pass a positive number")
    if anneal_strategy not in ("cos", "linear"):
        raise ValueError(
            f"onecycle: 'anneal_strategy': {anneal_strategy!r}; pass 'cos' or 'linear'"
        )
    return OneCycle(
        max_lr,
        total_steps,
        float(pct_start),
        anneal_strategy,
        div_factor,
        final_div_factor,
        three_phase,
    )
