"""`SGD`: stochastic gradient descent with momentum on trees, numerically `torch.optim.SGD`."""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from modstate.optim._base import ElementwiseOptimizer, LearningRate
from modstate.optim._checks import check_hyperparameter, check_lr, is_zero
from modstate.optim._lists import Scalar
from modstate.optim._run import Run


@dataclass(frozen=True)
class SGD(ElementwiseOptimizer):
    """Pure SGD; build it with `modstate.optim.sgd`.

    For each leaf with a gradient ``g`` (``-g`` if `maximize`), as `torch.optim.SGD` computes it::

        g = g + weight_decay * p
        b = g                                   (first step)
        b = momentum * b + (1 - dampening) * g  (later steps)
        g = g + momentum * b   if nesterov else   b
        p = p - lr * g

    The state is ``{"step": 0-dim tensor, "momentum_buffer": tree}``; the buffer is left out when
    `momentum` is the number 0.

    Attributes:
        lr: the learning rate: a number, a 0-dim tensor or a schedule.
        momentum: the momentum factor.
        dampening: the dampening of the momentum.
        weight_decay: the weight decay factor.
        nesterov: whether Nesterov momentum is used.
        maximize: whether the objective is ascended.
        foreach: torch.optim's multi-tensor path (True), single-tensor one (False), default (None).
        fused: whether torch's fused kernel runs the step.

    Example:
        >>> SGD(lr=0.1).buffer_names  # momentum is the number 0: no momentum buffer
        ()
    """

    name = "sgd"
    has_fused = True

    lr: LearningRate = 1e-3
    momentum: Scalar = 0.0
    dampening: Scalar = 0.0
    weight_decay: Scalar = 0.0
    nesterov: bool = False
    maximize: bool = False

    def __post_init__(self) -> None:
        super().__post_init__()
        check_lr(self.name, self.lr)
        check_hyperparameter(self.name, "momentum", self.momentum, low=0.0)
        check_hyperparameter(self.name, "dampening", self.dampening, low=-float("inf"))
        check_hyperparameter(self.name, "weight_decay", self.weight_decay, low=0.0)
        if self.nesterov and (is_zero(self.momentum) or not is_zero(self.dampening)):
            raise ValueError(
                "sgd: 'nesterov': Nesterov momentum requires a momentum and zero dampening; "
                "pass momentum > 0 and dampening=0, or nesterov=False"
            )

    @property
    def buffer_names(self) -> tuple[str, ...]:
        return () if is_zero(self.momentum) else ("momentum_buffer",)

    def _update(self, run: Run) -> dict[str, Tensor]:
        h, ops = run.hyper, run.ops
        run.begin(self.maximize)
        if not is_zero(self.momentum):
            momentum = h["momentum"]
            b = run.buffers["momentum_buffer"]
            first = run.first
            if first is True:
                # torch.optim starts the buffer as a copy of the gradient.
                b = ops.copy_into(b, run.g) if run.own_buffers else ops.clone(run.g)
            else:
                later = ops.add(
                    ops.mul(b, momentum, own=run.own_buffers), run.g, 1 - h["dampening"], own=True
                )
                b = later if first is False else ops.where(first, run.g, later)
            run.buffers["momentum_buffer"] = b
            if self.nesterov:
                run.g = ops.add(run.g, b, momentum, own=run.own_g)
            else:
                run.g = b
        run.p = ops.add(run.p, run.g, -h["lr"], own=run.own_p)
        return {}

    def _fused_update(self, run: Run) -> dict[str, Tensor]:
        h = run.hyper
        for p, g, buffers, _ in run.fused_groups(self.buffer_names):
            momentum_buffers = buffers[0] if buffers else []
            torch._fused_sgd_(
                p, g, momentum_buffers,
                weight_decay=h["weight_decay"], momentum=h["momentum"], lr=h["lr"],
                dampening=h["dampening"], nesterov=self.nesterov, maximize=self.maximize,
                is_first_step=bool(run.first) and bool(momentum_buffers),
            )  # fmt: skip
        return {}


def sgd(
    lr: LearningRate = 1e-3,
    momentum: Scalar = 0,
    dampening: Scalar = 0,
    weight_decay: Scalar = 0,
    nesterov: bool = False,
    *,
    maximize: bool = False,
    foreach: bool | None = None,
    fused: bool | None = None,
) -> SGD:
    """Stochastic gradient descent, with `torch.optim.SGD`'s arguments and numbers.

    Args:
        lr: learning rate: a number, a 0-dim tensor, or a schedule (`modstate.optim.schedules`).
        momentum: momentum factor; with the number 0 the state keeps no momentum buffer.
        dampening: dampening of the momentum.
        weight_decay: L2 penalty, added to the gradient.
        nesterov: Nesterov momentum (needs a momentum and zero dampening).
        maximize: ascend the objective instead of descending it.
        foreach: torch.optim's flag: True, False or None ("Kernels" in `modstate.optim`).
        fused: torch.optim's flag: True runs its fused kernel, the fastest on the CPU.

    Returns:
        An `SGD`, whose state holds a ``momentum_buffer`` unless `momentum` is the number 0.

    Raises:
        ValueError: lr, momentum or weight_decay below 0, `nesterov` without a momentum
            or with dampening, or both flags True.
        TypeError: a hyperparameter that is neither a number nor a 0-dim tensor.

    Example:
        >>> opt = sgd(lr=0.1, momentum=0.9)
        >>> params = {"w": torch.ones(2)}
        >>> state = opt.init(params)
        >>> params, state = opt.step(params, {"w": torch.ones(2)}, state)
        >>> params["w"]
        tensor([0.9000, 0.9000])
    """
    return SGD(**locals())  # the arguments are the fields, by name
