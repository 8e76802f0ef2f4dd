"""`Optimizer`: what every pure optimizer of `modstate.optim` shares.

An optimizer is a frozen dataclass of hyperparameters. `init` builds its state, `step` checks the
trees, resolves the hyperparameters for this step (a schedule for `lr` is evaluated at the step
count; a 0-dim tensor that is free to read becomes a number, so the numbers are `torch.optim`'s),
and hands a `Run` (the leaves as lists, the ops, the step count) to the optimizer's `update`.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, fields
from typing import Any, ClassVar

import torch
from torch import Tensor

from modstate.optim._lists import LeafOps, Leaves, Scalar
from modstate.optim._tree import (
    StepLeaves,
    init_buffers,
    new_scalar,
    read_number,
    scalar_dtype,
)

# A learning rate: a number, a 0-dim tensor, or a schedule (a function of the step count).
LearningRate = Scalar | Callable[[Any], Scalar]


class Run:
    """One step in progress: the leaves to update as lists, and what the update may do to them.

    `p`, `g` and `buffers` are the gathered lists; an update replaces them with new lists.
    `donated` says the caller donated params and state (honoured in eager mode only);
    `own_p` / `own_buffers` say that those lists may be written over (donated, or fresh);
    `own_g` starts False and the update sets it once `g` is an intermediate of its own.
    `scalars` holds the 0-dim state entries other than the step counter (NAdam's ``mu_product``).
    `count` is this step's number, counting from 1: a float, or a 0-dim float64 tensor when it
    cannot be read for free (under `vmap`, `grad` or `torch.compile`).
    """

    __slots__ = (
        "buffers",
        "count",
        "donated",
        "g",
        "hyper",
        "ops",
        "own_buffers",
        "own_g",
        "own_p",
        "p",
        "scalars",
    )

    def __init__(
        self,
        ops: LeafOps,
        p: Leaves,
        g: Leaves,
        buffers: dict[str, Leaves],
        count: float | Tensor,
        hyper: dict[str, Any],
        scalars: dict[str, Tensor],
        donate: bool,
    ) -> None:
        self.ops = ops
        self.p, self.g, self.buffers = p, g, buffers
        self.count = count
        self.hyper = hyper
        self.scalars = scalars
        self.donated = donate and ops.foreach
        self.own_p = self.own_buffers = self.donated
        self.own_g = False

    @property
    def first(self) -> bool | Tensor:
        """Whether this is the first step (a 0-dim bool tensor when the count is one)."""
        return self.count == 1

    def maximize_and_decay(self, maximize: bool, weight_decay: Scalar) -> None:
        """``g = -g`` if maximize; ``g = g + weight_decay * p`` (L2), as torch.optim begins."""
        if maximize:
            self.g, self.own_g = self.ops.neg(self.g), True
        if not _is_zero(weight_decay):
            self.g = self.ops.add(self.g, self.p, weight_decay, own=self.own_g)
            self.own_g = True

    def decay_params(self, lr: Scalar, weight_decay: Scalar) -> None:
        """``p = p * (1 - lr * weight_decay)``: decoupled weight decay (AdamW)."""
        if not _is_zero(weight_decay):
            self.p, self.own_p = self.ops.mul(self.p, 1 - lr * weight_decay, own=self.own_p), True


def _is_zero(value: Scalar) -> bool:
    return not isinstance(value, Tensor) and value == 0


def _resolve(value: Any, count_before: float | Tensor) -> Any:
    """A hyperparameter for this step: a schedule evaluated, a free-to-read tensor as a number."""
    if isinstance(value, tuple):
        return tuple(_resolve(item, count_before) for item in value)
    if callable(value) and not isinstance(value, Tensor):
        value = value(count_before)
    if isinstance(value, Tensor):
        number = read_number(value)
        if number is not None:
            return number
    return value


@dataclass(frozen=True)
class Optimizer:
    """Base of the pure optimizers; subclasses define the fields, buffers and `update`."""

    name: ClassVar[str] = "optimizer"
    scalar_names: ClassVar[tuple[str, ...]] = ()

    @property
    def buffer_names(self) -> tuple[str, ...]:
        """Names of the per-leaf state trees."""
        return ()

    def fill(self, name: str, leaf: Tensor) -> Tensor:
        """The initial value of buffer `name` for `leaf`: zeros unless an optimizer says else."""
        return torch.zeros_like(leaf, memory_format=torch.preserve_format)

    def update(self, run: Run) -> dict[str, Tensor]:
        """Update `run.p` and `run.buffers`; return the new scalar state (name -> 0-dim)."""
        raise NotImplementedError

    def init(self, params: Any) -> dict[str, Any]:
        """The state before the first step: a zero step counter and one tree per buffer."""
        state: dict[str, Any] = {"step": new_scalar(0.0)}
        state.update({name: new_scalar(1.0) for name in self.scalar_names})
        state.update(init_buffers(params, self.buffer_names, self.fill))
        return state

    def step(
        self, params: Any, grads: Any, state: Mapping[str, Any], *, donate: bool = False
    ) -> tuple[Any, dict[str, Any]]:
        """One step: returns ``(new_params, new_state)``.

        No input is changed, unless ``donate=True``: then the buffers of `params` and `state`
        may be reused for the outputs (the caller promises not to read them again); the numbers
        are the same either way. Leaves whose gradient is None keep their param and state (the
        same objects); the step counter is shared by all leaves and counts every call.
        """
        names = self.buffer_names
        step = self._check_state(state, names)
        leaves = StepLeaves(params, grads, state, names, self.name)
        scalars = {name: state[name] for name in self.scalar_names}
        if not leaves.active:
            new_state = {"step": step + 1, **scalars}
            new_state.update({n: leaves.rebuild(leaves.buffers[n], []) for n in names})
            return leaves.rebuild(leaves.params, []), new_state

        before = read_number(step)
        count_before: float | Tensor = (
            before
            if before is not None
            else step.to(device=leaves.device, dtype=scalar_dtype(leaves.device))
        )
        hyper = {f.name: _resolve(getattr(self, f.name), count_before) for f in fields(self)}
        ops = LeafOps.for_step(
            [*leaves.tensors(), step, *scalars.values()], [count_before, *_scalars(hyper)]
        )
        run = Run(
            ops,
            leaves.gather(leaves.params),
            leaves.gather(leaves.grads),
            {n: leaves.gather(leaves.buffers[n]) for n in names},
            count_before + 1,
            hyper,
            scalars,
            donate,
        )
        new_scalars = self.update(run)
        if run.donated:
            step.add_(1)
            new_step = step
        else:
            new_step = step + 1
        new_state = {"step": new_step, **new_scalars}
        new_state.update({n: leaves.rebuild(leaves.buffers[n], run.buffers[n]) for n in names})
        return leaves.rebuild(leaves.params, run.p), new_state

    def _check_state(self, state: Any, names: tuple[str, ...]) -> Tensor:
        if not isinstance(state, Mapping):
            raise TypeError(
                f"state must be the dict returned by {self.name}.init, got {type(state).__name__}"
            )
        expected = {"step", *self.scalar_names, *names}
        if set(state) != expected:
            raise ValueError(
                f"state has keys {sorted(state)}, but {self.name} keeps {sorted(expected)}: "
                f"pass the state made by this optimizer's init (or its last step)"
            )
        for key in ("step", *self.scalar_names):
            if not isinstance(state[key], Tensor) or state[key].dim() != 0:
                raise ValueError(f"state[{key!r}] must be a 0-dim tensor")
        return state["step"]


def _scalars(hyper: dict[str, Any]) -> list[Any]:
    found = []
    for value in hyper.values():
        if isinstance(value, (tuple, list)):
            found.extend(value)
        else:
            found.append(value)
    return found
