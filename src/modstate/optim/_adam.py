"""`Adam`: Adam and AdamW on trees, numerically `torch.optim.Adam` / `torch.optim.AdamW`."""

from __future__ import annotations

from dataclasses import dataclass

from torch import Tensor

from modstate.optim._base import LearningRate, Optimizer, Run
from modstate.optim._lists import Scalar
from modstate.optim._tree import check_betas, check_hyperparameter


def check_lr(lr: object) -> None:
    if not callable(lr) or isinstance(lr, Tensor):
        check_hyperparameter("lr", lr, low=0.0)


@dataclass(frozen=True)
class Adam(Optimizer):
    """Pure Adam (or AdamW with `decoupled_weight_decay`); build it with `modstate.optim.adam`
    or `modstate.optim.adamw`.

    For each leaf with a gradient ``g`` (``-g`` if `maximize`), at step ``t`` (counting from 1),
    in `torch.optim.Adam`'s order of operations::

        p = p * (1 - lr * weight_decay)   if decoupled_weight_decay (AdamW)
        g = g + weight_decay * p          otherwise
        m = lerp(m, g, 1 - beta1)
        v = beta2 * v + (1 - beta2) * g * g
        v_max = max(v_max, v)             if amsgrad, and v_max replaces v below
        p = p - lr / (1 - beta1**t) * m / (sqrt(v) / sqrt(1 - beta2**t) + eps)

    The state is ``{"step", "exp_avg", "exp_avg_sq"}`` plus ``"max_exp_avg_sq"`` with amsgrad.
    """

    name = "adam"

    lr: LearningRate = 1e-3
    betas: tuple[Scalar, Scalar] = (0.9, 0.999)
    eps: Scalar = 1e-8
    weight_decay: Scalar = 0.0
    amsgrad: bool = False
    maximize: bool = False
    decoupled_weight_decay: bool = False

    def __post_init__(self) -> None:
        check_lr(self.lr)
        object.__setattr__(self, "betas", check_betas(self.betas))
        check_hyperparameter("eps", self.eps, low=0.0)
        check_hyperparameter("weight_decay", self.weight_decay, low=0.0)

    @property
    def buffer_names(self) -> tuple[str, ...]:
        names = ("exp_avg", "exp_avg_sq")
        return (*names, "max_exp_avg_sq") if self.amsgrad else names

    def update(self, run: Run) -> dict[str, Tensor]:
        h, ops, t = run.hyper, run.ops, run.count
        lr, eps, weight_decay = h["lr"], h["eps"], h["weight_decay"]
        beta1, beta2 = h["betas"]
        if self.decoupled_weight_decay:
            run.maximize_and_decay(self.maximize, 0)
            run.decay_params(lr, weight_decay)
        else:
            run.maximize_and_decay(self.maximize, weight_decay)
        g, own = run.g, run.own_buffers
        m = ops.lerp(run.buffers["exp_avg"], g, 1 - beta1, own=own)
        v = ops.addcmul(
            ops.mul(run.buffers["exp_avg_sq"], beta2, own=own), g, g, 1 - beta2, own=True
        )
        run.buffers["exp_avg"], run.buffers["exp_avg_sq"] = m, v
        if self.amsgrad:
            v = ops.maximum(run.buffers["max_exp_avg_sq"], v, own=own)
            run.buffers["max_exp_avg_sq"] = v

        bias_correction1 = 1 - beta1**t
        bias_correction2 = 1 - beta2**t
        step_size = lr / bias_correction1
        bias_correction2_sqrt = bias_correction2**0.5
        denom = ops.add_scalar(ops.div(ops.sqrt(v), bias_correction2_sqrt, own=True), eps, own=True)
        run.p = ops.addcdiv(run.p, m, denom, -step_size, own=run.own_p, into_zs=True)
        return {}
