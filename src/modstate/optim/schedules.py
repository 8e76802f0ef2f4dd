"""Learning-rate schedules: functions of the step count, usable as an optimizer's ``lr=``.

Each schedule ``s`` maps the number of steps already taken (``0`` for the first step) to the
learning rate of the next step, and equals the matching `torch.optim.lr_scheduler` at every step,
bit for bit: ``s(t)`` is the ``lr`` that torch's optimizer uses in its ``t + 1``-th step when the
scheduler steps after every optimizer step. Arguments are named as torch's; the base learning rate
(the optimizer's ``lr`` in torch) comes first.

Several torch schedulers update the learning rate recursively (``lr = lr * gamma``), which rounds
differently from the closed form; a schedule called with a number replays that recursion (cached,
so a training loop pays O(1) per step). Called with a tensor (the step counter under `vmap`,
`grad` or `torch.compile`) it uses the closed form, equal up to rounding.

>>> opt = modstate.optim.sgd(lr=modstate.optim.schedules.step(0.1, step_size=2, gamma=0.5))
>>> params = {"w": torch.zeros(1)}
>>> state = opt.init(params)
>>> for _ in range(4):
...     params, state = opt.step(params, {"w": torch.ones(1)}, state)
>>> params["w"]  # 0.1 + 0.1 + 0.05 + 0.05
tensor([-0.3000])
"""

from __future__ import annotations

import math
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Literal

import torch
from torch import Tensor

__all__ = [
    "constant",
    "cosine",
    "exponential",
    "linear_warmup",
    "multistep",
    "onecycle",
    "step",
    "warmup_cosine",
]

Count = int | float | Tensor


def _index(count: float) -> int:
    index = int(count)
    if index != count or index < 0:
        raise ValueError(f"a schedule takes a step count >= 0, got {count!r}")
    return index


@dataclass(frozen=True)
class _Recursive:
    """A schedule torch computes recursively: ``lr_0 = first()``, ``lr_e = next(lr_{e-1}, e)``."""

    _values: list[float] = field(default_factory=list, init=False, repr=False, compare=False)

    def first(self) -> float:
        raise NotImplementedError

    def next(self, previous: float, epoch: int) -> float:
        raise NotImplementedError

    def closed_form(self, count: Tensor) -> Tensor:
        raise NotImplementedError

    def __call__(self, count: Count) -> float | Tensor:
        if isinstance(count, Tensor):
            return self.closed_form(count)
        index = _index(count)
        values = self._values
        if not values:
            values.append(self.first())
        while len(values) <= index:
            values.append(self.next(values[-1], len(values)))
        return values[index]


@dataclass(frozen=True)
class Constant(_Recursive):
    """`torch.optim.lr_scheduler.ConstantLR`; see `constant`."""

    lr: float
    factor: float = 1.0
    total_iters: int = 0

    def first(self) -> float:
        return self.lr * self.factor

    def next(self, previous: float, epoch: int) -> float:
        return previous * (1.0 / self.factor) if epoch == self.total_iters else previous

    def closed_form(self, count: Tensor) -> Tensor:
        after = torch.full_like(count, self.lr)
        return torch.where(count >= self.total_iters, after, torch.full_like(count, self.first()))


@dataclass(frozen=True)
class Step(_Recursive):
    """`torch.optim.lr_scheduler.StepLR`; see `step`."""

    lr: float
    step_size: int
    gamma: float = 0.1

    def first(self) -> float:
        return self.lr

    def next(self, previous: float, epoch: int) -> float:
        return previous * self.gamma if epoch % self.step_size == 0 else previous

    def closed_form(self, count: Tensor) -> Tensor:
        return self.lr * self.gamma ** torch.div(count, self.step_size, rounding_mode="floor")


@dataclass(frozen=True)
class MultiStep(_Recursive):
    """`torch.optim.lr_scheduler.MultiStepLR`; see `multistep`."""

    lr: float
    milestones: tuple[int, ...]
    gamma: float = 0.1

    def first(self) -> float:
        return self.lr

    def next(self, previous: float, epoch: int) -> float:
        times = Counter(self.milestones)[epoch]
        return previous * self.gamma**times if times else previous

    def closed_form(self, count: Tensor) -> Tensor:
        passed = sum((count >= m).to(count.dtype) for m in self.milestones)
        return self.lr * self.gamma**passed


@dataclass(frozen=True)
class Exponential(_Recursive):
    """`torch.optim.lr_scheduler.ExponentialLR`; see `exponential`."""

    lr: float
    gamma: float

    def first(self) -> float:
        return self.lr

    def next(self, previous: float, epoch: int) -> float:
        return previous * self.gamma

    def closed_form(self, count: Tensor) -> Tensor:
        return self.lr * self.gamma**count


@dataclass(frozen=True)
class Cosine(_Recursive):
    """`torch.optim.lr_scheduler.CosineAnnealingLR`; see `cosine`."""

    lr: float
    T_max: int
    eta_min: float = 0.0

    def first(self) -> float:
        return self.lr

    def next(self, previous: float, epoch: int) -> float:
        t_max, eta_min = self.T_max, self.eta_min
        if (epoch - 1 - t_max) % (2 * t_max) == 0:
            return previous + (self.lr - eta_min) * (1 - math.cos(math.pi / t_max)) / 2
        return (1 + math.cos(math.pi * epoch / t_max)) / (
            1 + math.cos(math.pi * (epoch - 1) / t_max)
        ) * (previous - eta_min) + eta_min

    def closed_form(self, count: Tensor) -> Tensor:
        cosine = torch.cos(math.pi * count / self.T_max)
        return self.eta_min + (self.lr - self.eta_min) * (1 + cosine) / 2


@dataclass(frozen=True)
class LinearWarmup(_Recursive):
    """`torch.optim.lr_scheduler.LinearLR`; see `linear_warmup`."""

    lr: float
    start_factor: float = 1.0 / 3
    end_factor: float = 1.0
    total_iters: int = 5

    def first(self) -> float:
        return self.lr * self.start_factor

    def next(self, previous: float, epoch: int) -> float:
        if epoch > self.total_iters:
            return previous
        start, end = self.start_factor, self.end_factor
        return previous * (
            1.0 + (end - start) / (self.total_iters * start + (epoch - 1) * (end - start))
        )

    def closed_form(self, count: Tensor) -> Tensor:
        progress = torch.clamp(count, max=self.total_iters) / self.total_iters
        return self.lr * (self.start_factor + (self.end_factor - self.start_factor) * progress)


@dataclass(frozen=True)
class WarmupCosine:
    """`SequentialLR([LinearLR, CosineAnnealingLR], milestones=[warmup_iters])`; see
    `warmup_cosine`."""

    warmup: LinearWarmup
    cosine: Cosine
    warmup_iters: int
    _values: list[float] = field(default_factory=list, init=False, repr=False, compare=False)

    def __call__(self, count: Count) -> float | Tensor:
        if isinstance(count, Tensor):
            after = self.cosine.closed_form(torch.clamp(count - self.warmup_iters, min=0))
            return torch.where(count < self.warmup_iters, self.warmup.closed_form(count), after)
        index = _index(count)
        if index < self.warmup_iters:
            return self.warmup(index)
        if index == self.warmup_iters:
            # SequentialLR restarts the cosine at its closed form for epoch 0 ...
            return self._cosine_start()
        # ... and from there the cosine's recursion goes on.
        return self._after(index - self.warmup_iters)

    def _cosine_start(self) -> float:
        eta_min = self.cosine.eta_min
        return eta_min + (self.cosine.lr - eta_min) * (1 + math.cos(0.0)) / 2

    def _after(self, epoch: int) -> float:
        values = self._values
        if not values:
            values.append(self._cosine_start())
        while len(values) <= epoch:
            values.append(self.cosine.next(values[-1], len(values)))
        return values[epoch]


@dataclass(frozen=True)
class OneCycle:
    """`torch.optim.lr_scheduler.OneCycleLR` (its learning rate); see `onecycle`."""

    max_lr: float
    total_steps: int
    pct_start: float = 0.3
    anneal_strategy: Literal["cos", "linear"] = "cos"
    div_factor: float = 25.0
    final_div_factor: float = 1e4
    three_phase: bool = False

    def _phases(self) -> list[tuple[float, float, float]]:
        """(end_step, start_lr, end_lr) for each phase, as torch lays them out."""
        initial = self.max_lr / self.div_factor
        low = initial / self.final_div_factor
        rise = float(self.pct_start * self.total_steps) - 1
        if self.three_phase:
            return [
                (rise, initial, self.max_lr),
                (float(2 * self.pct_start * self.total_steps) - 2, self.max_lr, initial),
                (self.total_steps - 1, initial, low),
            ]
        return [(rise, initial, self.max_lr), (self.total_steps - 1, self.max_lr, low)]

    def _anneal(self, start: float, end: float, pct: Count) -> float | Tensor:
        if self.anneal_strategy == "cos":
            cos_out = (torch.cos if isinstance(pct, Tensor) else math.cos)(math.pi * pct) + 1
            return end + (start - end) / 2.0 * cos_out
        return (end - start) * pct + start

    def __call__(self, count: Count) -> float | Tensor:
        phases = self._phases()
        if isinstance(count, Tensor):
            result = None
            # Phase values, chosen from the last phase back to the first.
            starts = [0.0] + [end for end, _, _ in phases[:-1]]
            for index in reversed(range(len(phases))):
                end_step, start_lr, end_lr = phases[index]
                start_step = starts[index]
                value = self._anneal(
                    start_lr, end_lr, (count - start_step) / (end_step - start_step)
                )
                result = value if result is None else torch.where(count <= end_step, value, result)
            return result  # type: ignore[return-value]
        index = _index(count)
        if index > self.total_steps:
            raise ValueError(
                f"onecycle was told total_steps={self.total_steps}, but was asked for step {index}"
            )
        start_step = 0.0
        for i, (end_step, start_lr, end_lr) in enumerate(phases):
            if index <= end_step or i == len(phases) - 1:
                pct = (index - start_step) / (end_step - start_step)
                return self._anneal(start_lr, end_lr, pct)  # type: ignore[return-value]
            start_step = end_step
        raise AssertionError("unreachable")


def constant(lr: float, factor: float = 1.0, total_iters: int = 0) -> Constant:
    """``lr * factor`` for the first `total_iters` steps, then `lr` (torch's ``ConstantLR``).

    With the defaults, simply `lr` at every step.

    >>> s = constant(0.1, factor=0.5, total_iters=2)
    >>> [s(t) for t in range(4)]
    [0.05, 0.05, 0.1, 0.1]
    """
    return Constant(lr, factor, total_iters)


def step(lr: float, step_size: int, gamma: float = 0.1) -> Step:
    """`lr` multiplied by `gamma` every `step_size` steps (torch's ``StepLR``).

    >>> s = step(1.0, step_size=2, gamma=0.5)
    >>> [s(t) for t in range(5)]
    [1.0, 1.0, 0.5, 0.5, 0.25]
    """
    if step_size <= 0:
        raise ValueError(f"step_size must be positive, got {step_size}")
    return Step(lr, step_size, gamma)


def multistep(lr: float, milestones: Sequence[int], gamma: float = 0.1) -> MultiStep:
    """`lr` multiplied by `gamma` at each milestone step (torch's ``MultiStepLR``).

    >>> s = multistep(1.0, milestones=[1, 3], gamma=0.5)
    >>> [s(t) for t in range(4)]
    [1.0, 0.5, 0.5, 0.25]
    """
    return MultiStep(lr, tuple(sorted(milestones)), gamma)


def exponential(lr: float, gamma: float) -> Exponential:
    """`lr` multiplied by `gamma` at every step (torch's ``ExponentialLR``).

    >>> s = exponential(1.0, gamma=0.5)
    >>> [s(t) for t in range(3)]
    [1.0, 0.5, 0.25]
    """
    return Exponential(lr, gamma)


def cosine(lr: float, T_max: int, eta_min: float = 0.0) -> Cosine:
    """Cosine annealing from `lr` to `eta_min` over `T_max` steps (``CosineAnnealingLR``).

    >>> s = cosine(1.0, T_max=2)
    >>> [round(s(t), 6) for t in range(3)]
    [1.0, 0.5, 0.0]
    """
    if T_max <= 0:
        raise ValueError(f"T_max must be positive, got {T_max}")
    return Cosine(lr, T_max, eta_min)


def linear_warmup(
    lr: float, start_factor: float = 1.0 / 3, end_factor: float = 1.0, total_iters: int = 5
) -> LinearWarmup:
    """From ``lr * start_factor`` linearly to ``lr * end_factor`` over `total_iters` steps,
    then constant (torch's ``LinearLR``).

    >>> s = linear_warmup(1.0, start_factor=0.25, total_iters=3)
    >>> [round(s(t), 6) for t in range(5)]
    [0.25, 0.5, 0.75, 1.0, 1.0]
    """
    if not 0 < start_factor <= 1 or not 0 <= end_factor <= 1:
        raise ValueError(
            f"start_factor must be in (0, 1] and end_factor in [0, 1], got {start_factor}, "
            f"{end_factor}"
        )
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

    >>> s = warmup_cosine(1.0, warmup_iters=2, T_max=2, start_factor=0.5)
    >>> [round(s(t), 6) for t in range(5)]
    [0.5, 0.75, 1.0, 0.5, 0.0]
    """
    if warmup_iters <= 0:
        raise ValueError(f"warmup_iters must be positive, got {warmup_iters}")
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

    >>> s = onecycle(1.0, total_steps=10)
    >>> round(s(0), 8), s(2), round(s(9), 8)
    (0.04, 1.0, 4e-06)
    """
    if total_steps <= 0:
        raise ValueError(f"total_steps must be positive, got {total_steps}")
    if anneal_strategy not in ("cos", "linear"):
        raise ValueError(f"anneal_strategy must be 'cos' or 'linear', got {anneal_strategy!r}")
    return OneCycle(
        max_lr,
        total_steps,
        float(pct_start),
        anneal_strategy,
        div_factor,
        final_div_factor,
        three_phase,
    )
