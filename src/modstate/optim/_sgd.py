"""`SGD`: stochastic gradient descent with momentum on trees, numerically `torch.optim.SGD`."""

from __future__ import annotations

from dataclasses import dataclass

from torch import Tensor

from modstate.optim._base import LearningRate, Optimizer, Run
from modstate.optim._lists import Scalar, is_zero
from modstate.optim._tree import check_hyperparameter


@dataclass(frozen=True)
class SGD(Optimizer):
    """Pure SGD; build it with `modstate.optim.sgd`.

    For each leaf with a gradient ``g`` (``-g`` if `maximize`), as `torch.optim.SGD` computes it::

        g = g + weight_decay * p
        b = g                                   (first step)
        b = momentum * b + (1 - dampening) * g  (later steps)
        g = g + momentum * b   if nesterov else   b
        p = p - lr * g

    The state is ``{"step": 0-dim tensor, "momentum_buffer": tree}``; the buffer is left out when
    `momentum` is the number 0.
    """

    name = "sgd"

    lr: LearningRate = 1e-3
    momentum: Scalar = 0.0
    dampening: Scalar = 0.0
    weight_decay: Scalar = 0.0
    nesterov: bool = False
    maximize: bool = False

    def __post_init__(self) -> None:
        if not callable(self.lr) or isinstance(self.lr, Tensor):
            check_hyperparameter("lr", self.lr, low=0.0)
        check_hyperparameter("momentum", self.momentum, low=0.0)
        check_hyperparameter("dampening", self.dampening, low=-float("inf"))
        check_hyperparameter("weight_decay", self.weight_decay, low=0.0)
        if self.nesterov and (is_zero(self.momentum) or not is_zero(self.dampening)):
            raise ValueError("Nesterov momentum requires a momentum and zero dampening")

    @property
    def buffer_names(self) -> tuple[str, ...]:
        return () if is_zero(self.momentum) else ("momentum_buffer",)

    def update(self, run: Run) -> dict[str, Tensor]:
        h, ops = run.hyper, run.ops
        run.maximize_and_decay(self.maximize, h["weight_decay"])
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
