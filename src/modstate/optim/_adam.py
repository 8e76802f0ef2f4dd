"""`Adam`: Adam and AdamW on trees, numerically `torch.optim.Adam` / `torch.optim.AdamW`."""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from modstate.optim._base import AdamLike, Betas, LearningRate
from modstate.optim._lists import Scalar
from modstate.optim._run import Run


@dataclass(frozen=True)
class Adam(AdamLike):
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

    Attributes:
        lr: the learning rate: a number, a 0-dim tensor or a schedule.
        betas: ``(beta1, beta2)``, the decay rates of the moment estimates.
        eps: the term added to the denominator.
        weight_decay: the weight decay factor.
        amsgrad: whether the maximum of the second moment estimates is kept.
        maximize: whether the objective is ascended.
        decoupled_weight_decay: whether weight decay is decoupled (AdamW style).
        foreach: torch.optim's multi-tensor path (True), single-tensor one (False), default (None).
        fused: whether torch's fused kernel runs the step.

    Example:
        >>> modstate.optim.adamw() == Adam(weight_decay=1e-2, decoupled_weight_decay=True)
        True
    """

    name = "adam"
    has_fused = True

    amsgrad: bool = False
    maximize: bool = False
    decoupled_weight_decay: bool = False

    @property
    def buffer_names(self) -> tuple[str, ...]:
        names = ("exp_avg", "exp_avg_sq")
        return (*names, "max_exp_avg_sq") if self.amsgrad else names

    def _update(self, run: Run) -> dict[str, Tensor]:
        h, ops, t = run.hyper, run.ops, run.count
        lr, eps = h["lr"], h["eps"]
        beta1, beta2 = h["betas"]
        run.begin(self.maximize, decoupled_weight_decay=self.decoupled_weight_decay)
        g, own = run.g, run.own_buffers
        m = ops.lerp(run.buffers["exp_avg"], g, 1 - beta1, own=own)
        v = ops.square_average(run.buffers["exp_avg_sq"], g, beta2, own=own)
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

    def _fused_update(self, run: Run) -> dict[str, Tensor]:
        h = run.hyper
        beta1, beta2 = h["betas"]
        kernel = torch._fused_adamw_ if self.decoupled_weight_decay else torch._fused_adam_
        for p, g, (m, v, *v_max), steps in run.fused_groups(self.buffer_names):
            kernel(
                p, g, m, v, v_max[0] if v_max else [], steps,
                lr=h["lr"], beta1=beta1, beta2=beta2, weight_decay=h["weight_decay"],
                eps=h["eps"], amsgrad=self.amsgrad, maximize=self.maximize,
            )  # fmt: skip
        return {}


def adam(
    lr: LearningRate = 1e-3,
    betas: Betas = (0.9, 0.999),
    eps: Scalar = 1e-8,
    weight_decay: Scalar = 0,
    amsgrad: bool = False,
    *,
    maximize: bool = False,
    foreach: bool | None = None,
    fused: bool | None = None,
    decoupled_weight_decay: bool = False,
) -> Adam:
    """Adam, with `torch.optim.Adam`'s arguments and numbers.

    Args:
        lr: learning rate: a number, a 0-dim tensor, or a schedule (`modstate.optim.schedules`).
        betas: the decay rates ``(beta1, beta2)`` of the first and second moment estimates.
        eps: added to the denominator for numerical stability.
        weight_decay: L2 penalty added to the gradient (decoupled, as AdamW, with
            `decoupled_weight_decay`).
        amsgrad: keep the maximum of the second moment estimates (AMSGrad).
        maximize: ascend the objective instead of descending it.
        foreach: torch.optim's flag: True, False or None ("Kernels" in `modstate.optim`).
        fused: torch.optim's flag: True runs its fused kernel, the fastest on the CPU.
        decoupled_weight_decay: decay the weights directly (AdamW) instead of an L2 penalty.

    Returns:
        An `Adam`, whose state holds ``exp_avg`` and ``exp_avg_sq`` (and ``max_exp_avg_sq``
            with `amsgrad`).

    Raises:
        ValueError: lr, eps or weight_decay below 0, a beta outside [0, 1), or both
            flags True.
        TypeError: a hyperparameter that is neither a number nor a 0-dim tensor.

    Example:
        >>> opt = adam(lr=0.1)
        >>> params = {"w": torch.zeros(2)}
        >>> params, state = opt.step(params, {"w": torch.tensor([1.0, -1.0])}, opt.init(params))
        >>> params["w"]
        tensor([-0.1000,  0.1000])
    """
    return Adam(**locals())  # the arguments are the fields, by name


def adamw(
    lr: LearningRate = 1e-3,
    betas: Betas = (0.9, 0.999),
    eps: Scalar = 1e-8,
    weight_decay: Scalar = 1e-2,
    amsgrad: bool = False,
    *,
    maximize: bool = False,
    foreach: bool | None = None,
    fused: bool | None = None,
) -> Adam:
    """AdamW (decoupled weight decay), with `torch.optim.AdamW`'s arguments and numbers.

    Args:
        lr: learning rate: a number, a 0-dim tensor, or a schedule (`modstate.optim.schedules`).
        betas: the decay rates ``(beta1, beta2)`` of the first and second moment estimates.
        eps: added to the denominator for numerical stability.
        weight_decay: decoupled weight decay: ``p = p * (1 - lr * weight_decay)`` each step.
        amsgrad: keep the maximum of the second moment estimates (AMSGrad).
        maximize: ascend the objective instead of descending it.
        foreach: torch.optim's flag: True, False or None ("Kernels" in `modstate.optim`).
        fused: torch.optim's flag: True runs its fused kernel, the fastest on the CPU.

    Returns:
        An `Adam` with ``decoupled_weight_decay=True``: `adam`'s optimizer, AdamW's decay.

    Raises:
        ValueError: lr, eps or weight_decay below 0, a beta outside [0, 1), or both
            flags True.
        TypeError: a hyperparameter that is neither a number nor a 0-dim tensor.

    Example:
        >>> opt = adamw(lr=0.1, weight_decay=0.5)
        >>> params = {"w": torch.ones(1)}
        >>> params, state = opt.step(params, {"w": torch.ones(1)}, opt.init(params))
        >>> params["w"]  # 1 * (1 - 0.1 * 0.5) - 0.1
        tensor([0.8500])
    """
    # The arguments are the fields, by name; AdamW is Adam with the decay decoupled.
    return Adam(decoupled_weight_decay=True, **locals())
