"""`RAdam` on trees, numerically `torch.optim.RAdam`."""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from modstate.optim._base import AdamLike, Betas, LearningRate
from modstate.optim._lists import Leaves, Scalar
from modstate.optim._run import Run


@dataclass(frozen=True)
class RAdam(AdamLike):
    """Pure RAdam (rectified Adam); build it with `modstate.optim.radam`.

    For each leaf with a gradient ``g`` (``-g`` if `maximize`), at step ``t`` (from 1), in
    `torch.optim.RAdam`'s order::

        p = p * (1 - lr * weight_decay)   if decoupled_weight_decay
        g = g + weight_decay * p          otherwise
        m = lerp(m, g, 1 - beta1);  v = beta2 * v + (1 - beta2) * g * g
        rho_inf = 2 / (1 - beta2) - 1;  rho_t = rho_inf - 2 t beta2**t / (1 - beta2**t)
        u = m / (1 - beta1**t) * lr
        u = u * sqrt(1 - beta2**t) / (sqrt(v) + eps) * rect(rho_t)   if rho_t > 5
        p = p - u

    The state is ``{"step", "exp_avg", "exp_avg_sq"}``.

    Attributes:
        lr: the learning rate: a number, a 0-dim tensor or a schedule.
        betas: ``(beta1, beta2)``, the decay rates of the moment estimates.
        eps: the term added to the denominator.
        weight_decay: the weight decay factor.
        decoupled_weight_decay: whether weight decay is decoupled (AdamW style).
        maximize: whether the objective is ascended.
        foreach: torch.optim's multi-tensor path (True), single-tensor one (False), default (None).
        fused: whether torch's fused kernel runs the step.

    Example:
        >>> RAdam().buffer_names  # Adam's moments: the rectification needs no state
        ('exp_avg', 'exp_avg_sq')
    """

    name = "radam"

    decoupled_weight_decay: bool = False
    maximize: bool = False

    @property
    def buffer_names(self) -> tuple[str, ...]:
        return ("exp_avg", "exp_avg_sq")

    def _update(self, run: Run) -> dict[str, Tensor]:
        h, ops, own, t = run.hyper, run.ops, run.own_buffers, run.count
        lr, eps = h["lr"], h["eps"]
        beta1, beta2 = h["betas"]
        run.begin(self.maximize, decoupled_weight_decay=self.decoupled_weight_decay)
        g = run.g
        exp_avg = ops.lerp(run.buffers["exp_avg"], g, 1 - beta1, own=own)
        exp_avg_sq = ops.square_average(run.buffers["exp_avg_sq"], g, beta2, own=own)
        run.buffers["exp_avg"], run.buffers["exp_avg_sq"] = exp_avg, exp_avg_sq
        if run.multi_tensor:
            run.p = self._multi_tensor_update(run, exp_avg, exp_avg_sq)
            return {}

        bias_correction1 = 1 - beta1**t
        bias_correction2 = 1 - beta2**t
        rho_inf = 2 / (1 - beta2) - 1
        rho_t = rho_inf - 2 * t * (beta2**t) / bias_correction2
        rectify = rho_t > 5.0
        if isinstance(rectify, Tensor):
            # Both branches, chosen per member; the rectifier sees a safe rho where unused so
            # that its square root gives no NaN gradient.
            rho_t = torch.where(rectify, rho_t, 6.0)
        update = ops.mul(ops.div(exp_avg, bias_correction1), lr, own=True)
        spare = None  # an intermediate of the step's own, free to hold the new params
        if rectify is not False:
            rect = (
                (rho_t - 4) * (rho_t - 2) * rho_inf / ((rho_inf - 4) * (rho_inf - 2) * rho_t)
            ) ** 0.5
            adaptive = ops.add_scalar(ops.sqrt(exp_avg_sq), eps, own=True)
            adaptive = ops.mul(ops.reciprocal(adaptive, own=True), bias_correction2**0.5, own=True)
            rectified = ops.mul(ops.mul_each(update, adaptive, own=rectify is True), rect, own=True)
            update = rectified if rectify is True else ops.where(rectify, rectified, update)
            spare = adaptive
        run.p = ops.add(run.p, update, -1.0, own=run.own_p, into=spare)
        return {}

    @staticmethod
    def _multi_tensor_update(run: Run, exp_avg: Leaves, exp_avg_sq: Leaves) -> Leaves:
        """The new params in torch.optim's multi-tensor order (an eager step: `t` is a number):
        ``p + m * u`` with ``u = 1 / ((sqrt(v) + eps) / (sqrt(1 - beta2**t) * -lr * rect /
        (1 - beta1**t))) - lr * unrectified / (1 - beta1**t)``, where exactly one of `rect` and
        `unrectified` is non-zero."""
        h, ops, t = run.hyper, run.ops, float(run.count)
        lr, (beta1, beta2) = h["lr"], h["betas"]
        rho_inf = 2 / (1 - beta2) - 1
        rho_t = rho_inf - 2 * t * (beta2**t) / (1 - beta2**t)
        rect = 0.0
        if rho_t > 5:
            rect = (
                (rho_t - 4) * (rho_t - 2) * rho_inf / ((rho_inf - 4) * (rho_inf - 2) * rho_t)
            ) ** 0.5
        unrectified = 0 if rect > 0 else 1.0
        bias_correction1 = 1 - beta1**t
        unrectified_step = (lr * unrectified / bias_correction1) * -1
        rectified_step = ((1 - beta2**t) ** 0.5) * (lr * rect / bias_correction1) * -1
        scale = ops.add_scalar(ops.sqrt(exp_avg_sq), h["eps"], own=True)
        scale = ops.reciprocal(ops.div(scale, rectified_step, own=True), own=True)
        scale = ops.add_scalar(scale, unrectified_step, own=True)
        return ops.addcmul(run.p, exp_avg, scale, own=run.own_p)


def radam(
    lr: LearningRate = 1e-3,
    betas: Betas = (0.9, 0.999),
    eps: Scalar = 1e-8,
    weight_decay: Scalar = 0,
    decoupled_weight_decay: bool = False,
    *,
    maximize: bool = False,
    foreach: bool | None = None,
) -> RAdam:
    """RAdam (rectified Adam), with `torch.optim.RAdam`'s arguments and numbers.

    Args:
        lr: learning rate: a number, a 0-dim tensor, or a schedule (`modstate.optim.schedules`).
        betas: the decay rates ``(beta1, beta2)`` of the moment estimates; beta2 also sets
            when the variance rectification starts (``rho_t > 5``).
        eps: added to the denominator for numerical stability.
        weight_decay: L2 penalty added to the gradient (decoupled with
            `decoupled_weight_decay`).
        decoupled_weight_decay: decay the weights directly (as AdamW) instead of an L2 penalty.
        maximize: ascend the objective instead of descending it.
        foreach: torch.optim's flag: True, False or None ("Kernels" in `modstate.optim`).

    Returns:
        An `RAdam`, whose state holds ``exp_avg`` and ``exp_avg_sq``, as Adam's.

    Raises:
        ValueError: lr, eps or weight_decay below 0 or a beta outside [0, 1).
        TypeError: a hyperparameter that is neither a number nor a 0-dim tensor.

    Example:
        >>> opt = radam(lr=0.1)
        >>> params = {"w": torch.zeros(1)}
        >>> params, state = opt.step(params, {"w": torch.ones(1)}, opt.init(params))
        >>> params["w"]  # the first steps are momentum SGD (rho_t <= 5)
        tensor([-0.1000])
    """
    return RAdam(**locals())  # the arguments are the fields, by name
