"""`Adadelta` on trees, numerically `torch.optim.Adadelta`."""

from __future__ import annotations

from dataclasses import dataclass

from torch import Tensor

from modstate.optim._adam import check_lr
from modstate.optim._base import LearningRate, Optimizer, Run
from modstate.optim._lists import Scalar
from modstate.optim._tree import check_hyperparameter


@dataclass(frozen=True)
class Adadelta(Optimizer):
    """Pure Adadelta; build it with `modstate.optim.adadelta`.

    For each leaf with a gradient ``g`` (``-g`` if `maximize`), in `torch.optim.Adadelta`'s
    order::

        g = g + weight_decay * p
        s = rho * s + (1 - rho) * g * g
        d = sqrt(a + eps) / sqrt(s + eps) * g
        a = rho * a + (1 - rho) * d * d
        p = p - lr * d

    The state is ``{"step", "square_avg", "acc_delta"}``.
    """

    name = "adadelta"

    lr: LearningRate = 1.0
    rho: Scalar = 0.9
    eps: Scalar = 1e-6
    weight_decay: Scalar = 0.0
    maximize: bool = False

    def __post_init__(self) -> None:
        check_lr(self.lr)
        check_hyperparameter("rho", self.rho, low=0.0, high=1.0 + 1e-12)
        check_hyperparameter("eps", self.eps, low=0.0)
        check_hyperparameter("weight_decay", self.weight_decay, low=0.0)

    @property
    def buffer_names(self) -> tuple[str, ...]:
        return ("square_avg", "acc_delta")

    def update(self, run: Run) -> dict[str, Tensor]:
        h, ops, own = run.hyper, run.ops, run.own_buffers
        rho, eps = h["rho"], h["eps"]
        run.maximize_and_decay(self.maximize, h["weight_decay"])
        g = run.g
        square_avg = ops.mul(run.buffers["square_avg"], rho, own=own)
        square_avg = ops.addcmul(square_avg, g, g, 1 - rho, own=True)
        std = ops.sqrt(ops.add_scalar(square_avg, eps), own=True)
        delta = ops.sqrt(ops.add_scalar(run.buffers["acc_delta"], eps), own=True)
        delta = ops.mul_each(ops.div_each(delta, std, own=True), g, own=True)
        acc_delta = ops.mul(run.buffers["acc_delta"], rho, own=own)
        acc_delta = ops.addcmul(acc_delta, delta, delta, 1 - rho, own=True)
        run.buffers["square_avg"], run.buffers["acc_delta"] = square_avg, acc_delta
        run.p = ops.add(run.p, delta, -h["lr"], own=run.own_p)
        return {}
