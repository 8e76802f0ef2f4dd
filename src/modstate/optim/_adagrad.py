"""`Adagrad` on trees, numerically `torch.optim.Adagrad` (dense gradients)."""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from modstate.optim._base import ElementwiseOptimizer, LearningRate
from modstate.optim._checks import check_hyperparameter, check_lr
from modstate.optim._lists import Scalar
from modstate.optim._run import Run


@dataclass(frozen=True)
class Adagrad(ElementwiseOptimizer):
    """Pure Adagrad; build it with `modstate.optim.adagrad`.

    For each leaf with a gradient ``g`` (``-g`` if `maximize`), at step ``t`` (from 1), in
    `torch.optim.Adagrad`'s order::

        g = g + weight_decay * p
        s = s + g * g                       (s starts at initial_accumulator_value)
        p = p - lr / (1 + (t - 1) * lr_decay) * g / (sqrt(s) + eps)

    The state is ``{"step", "sum"}``.

    Attributes:
        lr: the learning rate: a number, a 0-dim tensor or a schedule.
        lr_decay: the learning rate decay.
        weight_decay: the weight decay factor.
        initial_accumulator_value: the starting value of the sum of squares.
        eps: the term added to the denominator.
        maximize: whether the objective is ascended.
        foreach: torch.optim's multi-tensor path (True), single-tensor one (False), default (None).
        fused: whether torch's fused kernel runs the step.

    Example:
        >>> Adagrad(lr=0.1, lr_decay=0.5) == modstate.optim.adagrad(0.1, 0.5)  # torch's order
        True
    """

    name = "adagrad"
    has_fused = True

    lr: LearningRate = 1e-2
    lr_decay: Scalar = 0.0
    weight_decay: Scalar = 0.0
    initial_accumulator_value: float = 0.0
    eps: Scalar = 1e-10
    maximize: bool = False

    def __post_init__(self) -> None:
        super().__post_init__()
        check_lr(self.name, self.lr)
        check_hyperparameter(self.name, "lr_decay", self.lr_decay, low=0.0)
        check_hyperparameter(self.name, "weight_decay", self.weight_decay, low=0.0)
        check_hyperparameter(
            self.name, "initial_accumulator_value", self.initial_accumulator_value, low=0.0
        )
        check_hyperparameter(self.name, "eps", self.eps, low=0.0)

    @property
    def buffer_names(self) -> tuple[str, ...]:
        return ("sum",)

    def _fill(self, name: str, leaf: Tensor) -> Tensor:
        value: float | complex = self.initial_accumulator_value
        if leaf.is_complex():
            value = complex(value, value)
        return torch.full_like(leaf, value, memory_format=torch.preserve_format)

    def _update(self, run: Run) -> dict[str, Tensor]:
        h, ops = run.hyper, run.ops
        clr = h["lr"] / (1 + (run.count - 1) * h["lr_decay"])
        run.begin(self.maximize)
        g = run.g
        state_sum = ops.addcmul(run.buffers["sum"], g, g, 1, own=run.own_buffers)
        run.buffers["sum"] = state_sum
        std = ops.add_scalar(ops.sqrt(state_sum), h["eps"], own=True)
        if run.multi_tensor:
            # torch.optim's multi-tensor order: the step size multiplies the gradient first.
            minus_clr = -h["lr"] / (1 + (run.count - 1) * h["lr_decay"])
            numerator = ops.mul(g, minus_clr, own=run.own_g, in_place_in_torch=run.own_g)
            run.p = ops.addcdiv(run.p, numerator, std, own=run.own_p, into_zs=True)
        else:
            run.p = ops.addcdiv(run.p, g, std, -clr, own=run.own_p, into_zs=True)
        return {}

    def _fused_update(self, run: Run) -> dict[str, Tensor]:
        h = run.hyper
        for p, g, (state_sum,), steps in run.fused_groups(self.buffer_names):
            torch._fused_adagrad_(
                p, g, state_sum, steps,
                lr=h["lr"], lr_decay=h["lr_decay"], weight_decay=h["weight_decay"],
                eps=h["eps"], maximize=self.maximize,
            )  # fmt: skip
        return {}


def adagrad(
    lr: LearningRate = 1e-2,
    lr_decay: Scalar = 0,
    weight_decay: Scalar = 0,
    initial_accumulator_value: float = 0,
    eps: Scalar = 1e-10,
    *,
    maximize: bool = False,
    foreach: bool | None = None,
    fused: bool | None = None,
) -> Adagrad:
    """Adagrad, with `torch.optim.Adagrad`'s arguments and numbers (dense gradients).

    Args:
        lr: learning rate: a number, a 0-dim tensor, or a schedule (`modstate.optim.schedules`).
        lr_decay: learning-rate decay: step ``t`` uses ``lr / (1 + (t - 1) * lr_decay)``.
        weight_decay: L2 penalty, added to the gradient.
        initial_accumulator_value: the starting value of the sum of squared gradients.
        eps: added to the denominator for numerical stability.
        maximize: ascend the objective instead of descending it.
        foreach: torch.optim's flag: True, False or None ("Kernels" in `modstate.optim`).
        fused: torch.optim's flag: True runs its fused kernel, the fastest on the CPU.

    Returns:
        An `Adagrad`, whose state holds the running ``sum`` of squared gradients.

    Raises:
        ValueError: lr, lr_decay, weight_decay, initial_accumulator_value or eps below
            0, or both flags True.
        TypeError: a hyperparameter that is neither a number nor a 0-dim tensor.

    Example:
        >>> opt = adagrad(lr=0.5)
        >>> params = {"w": torch.zeros(2)}
        >>> params, state = opt.step(params, {"w": torch.tensor([2.0, -1.0])}, opt.init(params))
        >>> params["w"]
        tensor([-0.5000,  0.5000])
    """
    return Adagrad(**locals())  # the arguments are the fields, by name
