"""The schedules as torch computes them: each kind replays its `torch.optim.lr_scheduler`'s
recursion when called with a number, and uses the closed form when called with a tensor."""

from __future__ import annotations

import math
from collections import Counter
from dataclasses import dataclass, field
from typing import Literal

import torch
from torch import Tensor

Count = int | float | Tensor


def _index(count: float) -> int:
    index = int(count)
    if index != count or index < 0:
        raise ValueError(
            f"schedule: '<count>': got {count!r}; a schedule takes the number of steps taken, "
            f"an integer >= 0"
        )
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
        passed = torch.zeros_like(count)
        for milestone in self.milestones:
            passed = passed + (count >= milestone).to(count.dtype)
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
            angle = math.pi * pct
            cos_out = (torch.cos(angle) if isinstance(angle, Tensor) else math.cos(angle)) + 1
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
                f"onecycle: 'total_steps': {self.total_steps}, but step {index} was asked for; "
                f"build the schedule with total_steps covering every step of the run"
            )
        start_step = 0.0
        for i, (end_step, start_lr, end_lr) in enumerate(phases):
            if index <= end_step or i == len(phases) - 1:
                pct = (index - start_step) / (end_step - start_step)
                return self._anneal(start_lr, end_lr, pct)  # type: ignore[return-value]
            start_step = end_step
        raise AssertionError("unreachable")
