"""`Adamax` on trees, numerically `torch.optim.Adamax`."""

from __future__ import annotations

from dataclasses import dataclass

from torch import Tensor

from modstate.optim._adam import check_lr
from modstate.optim._base import LearningRate, Optimizer, Run
from modstate.optim._lists import Scalar
from modstate.optim._tree import check_betas, check_hyperparameter


@dataclass(frozen=True)
class Adamax(Optimizer):
    """Pure Adamax (Adam with the infinity norm); build it with `modstate.optim.adamax`.

    For each leaf with a gradient ``g`` (``-g`` if `maximize`), at step ``t`` (from 1), in
    `torch.optim.Adamax`'s order::

        g = g + weight_decay * p
        m = lerp(m, g, 1 - beta1)
        u = max(beta2 * u, |g| + eps)
        p = p - lr / (1 - beta1**t) * m / u

    The state is ``{"step", "exp_avg", "exp_inf"}``.
    """

    name = "adamax"

    lr: LearningRate = 2e-3
    betas: tuple[Scalar, Scalar] = (0.9, 0.999)
    eps: Scalar = 1e-8
    weight_decay: Scalar = 0.0
    maximize: bool = False

    def __post_init__(self) -> None:
        check_lr(self.lr)
        object.__setattr__(self, "betas", check_betas(self.betas))
        check_hyperparameter("eps", self.eps, low=0.0)
        check_hyperparameter("weight_decay", self.weight_decay, low=0.0)

    @property
    def buffer_names(self) -> tuple[str, ...]:
        return ("exp_avg", "exp_inf")

    def update(self, run: Run) -> dict[str, Tensor]:
        h, ops, own = run.hyper, run.ops, run.own_buffers
        beta1, beta2 = h["betas"]
        run.maximize_and_decay(self.maximize, h["weight_decay"])
        g = run.g
        exp_avg = ops.lerp(run.buffers["exp_avg"], g, 1 - beta1, own=own)
        norm = ops.add_scalar(ops.abs(g), h["eps"], own=True)
        exp_inf = ops.maximum(ops.mul(run.buffers["exp_inf"], beta2, own=own), norm, own=True)
        run.buffers["exp_avg"], run.buffers["exp_inf"] = exp_avg, exp_inf
        clr = h["lr"] / (1 - beta1**run.count)
        run.p = ops.addcdiv(run.p, exp_avg, exp_inf, -clr, own=run.own_p)
        return {}
