"""`SGD`: stochastic gradient descent with momentum on trees, numerically `torch.optim.SGD`."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor

from modstate.optim._lists import LeafOps, Scalar, is_zero
from modstate.optim._tree import (
    StepLeaves,
    check_hyperparameter,
    init_buffers,
    new_step_counter,
    read_count,
)


@dataclass(frozen=True)
class SGD:
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

    lr: Scalar
    momentum: Scalar = 0.0
    dampening: Scalar = 0.0
    nesterov: bool = False
    weight_decay: Scalar = 0.0
    maximize: bool = False

    def __post_init__(self) -> None:
        check_hyperparameter("lr", self.lr, low=0.0)
        check_hyperparameter("momentum", self.momentum, low=0.0)
        check_hyperparameter("dampening", self.dampening, low=-float("inf"))
        check_hyperparameter("weight_decay", self.weight_decay, low=0.0)
        if self.nesterov and (is_zero(self.momentum) or not is_zero(self.dampening)):
            raise ValueError("Nesterov momentum requires a momentum and zero dampening")

    def _grad_coefficient(self, leaves: StepLeaves) -> Scalar:
        """1 on the first step, ``1 - dampening`` after."""
        if is_zero(self.dampening):
            return 1
        count = read_count(leaves.step)
        if count is not None and not isinstance(self.dampening, Tensor):
            return 1 if count == 0 else 1 - self.dampening
        first = (leaves.step == 0).to(leaves.device)
        return torch.where(first, 1.0, 1 - self.dampening)

    @property
    def _buffer_names(self) -> tuple[str, ...]:
        return () if is_zero(self.momentum) else ("momentum_buffer",)

    def init(self, params: Any) -> dict[str, Any]:
        """The state before the first step: a zero step counter and zero momentum buffers."""
        return {"step": new_step_counter(), **init_buffers(params, self._buffer_names)}

    def step(self, params: Any, grads: Any, state: dict[str, Any]) -> tuple[Any, dict[str, Any]]:
        """One SGD step: returns ``(new_params, new_state)`` and changes none of its inputs.

        Leaves whose gradient is None keep their param and momentum buffer (the same objects).
        """
        leaves = StepLeaves(params, grads, state, self._buffer_names, "sgd")
        if not leaves.active:
            return leaves.unchanged()
        hyper = (self.lr, self.momentum, self.dampening, self.weight_decay)
        ops = LeafOps.for_step([*leaves.tensors(), leaves.step], hyper)
        p = leaves.gather(leaves.params)
        g = leaves.gather(leaves.grads)
        g_fresh = False
        if self.maximize:
            g, g_fresh = ops.neg(g), True
        if not is_zero(self.weight_decay):
            g, g_fresh = ops.add_scaled(g, p, self.weight_decay, fresh=g_fresh), True

        new_state: dict[str, Any] = {"step": leaves.step + 1}
        if not is_zero(self.momentum):
            # The zero-initialized buffer makes the first step's `b = g` the general formula
            # with a gradient coefficient of 1 instead of (1 - dampening).
            grad_coefficient = self._grad_coefficient(leaves)
            b = leaves.gather(leaves.buffers["momentum_buffer"])
            b = ops.add_scaled(ops.scale(b, self.momentum), g, grad_coefficient, fresh=True)
            new_state["momentum_buffer"] = leaves.rebuild(leaves.buffers["momentum_buffer"], b)
            g = ops.add_scaled(g, b, self.momentum, fresh=g_fresh) if self.nesterov else b
        new_params = ops.add_scaled(p, g, -self.lr)
        return leaves.rebuild(leaves.params, new_params), new_state
