"""`Adagrad` on trees, numerically `torch.optim.Adagrad` (dense gradients)."""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from modstate.optim._adam import check_lr
from modstate.optim._base import LearningRate, Optimizer, Run
from modstate.optim._lists import Scalar
from modstate.optim._tree import check_hyperparameter


@dataclass(frozen=True)
class Adagrad(Optimizer):
    """Pure Adagrad; build it with `modstate.optim.adagrad`.

    For each leaf with a gradient ``g`` (``-g`` if `maximize`), at step ``t`` (from 1), in
    `torch.optim.Adagrad`'s order::

        g = g + weight_decay * p
        s = s + g * g                       (s starts at initial_accumulator_value)
        p = p - lr / (1 + (t - 1) * lr_decay) * g / (sqrt(s) + eps)

    The state is ``{"step", "sum"}``.
    """

    name = "adagrad"

    lr: LearningRate = 1e-2
    lr_decay: Scalar = 0.0
    weight_decay: Scalar = 0.0
    initial_accumulator_value: float = 0.0
    eps: Scalar = 1e-10
    maximize: bool = False

    def __post_init__(self) -> None:
        check_lr(self.lr)
        check_hyperparameter("lr_decay", self.lr_decay, low=0.0)
        check_hyperparameter("weight_decay", self.weight_decay, low=0.0)
        check_hyperparameter("initial_accumulator_value", self.initial_accumulator_value, low=0.0)
        check_hyperparameter("eps", self.eps, low=0.0)

    @property
    def buffer_names(self) -> tuple[str, ...]:
        return ("sum",)

    def fill(self, name: str, leaf: Tensor) -> Tensor:
        value = self.initial_accumulator_value
        if leaf.is_complex():
            value = complex(value, value)
        return torch.full_like(leaf, value, memory_format=torch.preserve_format)

    def update(self, run: Run) -> dict[str, Tensor]:
        h, ops = run.hyper, run.ops
        clr = h["lr"] / (1 + (run.count - 1) * h["lr_decay"])
        run.maximize_and_decay(self.maximize, h["weight_decay"])
        g = run.g
        state_sum = ops.addcmul(run.buffers["sum"], g, g, 1, own=run.own_buffers)
        run.buffers["sum"] = state_sum
        std = ops.add_scalar(ops.sqrt(state_sum), h["eps"], own=True)
        run.p = ops.addcdiv(run.p, g, std, -clr, own=run.own_p, into_zs=True)
        return {}
