"""`Adam`: Adam and AdamW on trees, numerically `torch.optim.Adam` / `torch.optim.AdamW`."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from torch import Tensor

from modstate.optim._lists import LeafOps, Scalar, is_zero
from modstate.optim._tree import (
    StepLeaves,
    bias_corrections,
    check_hyperparameter,
    init_buffers,
    new_step_counter,
    read_count,
)


@dataclass(frozen=True)
class Adam:
    """Pure Adam (or AdamW with `decoupled_weight_decay`); build it with `modstate.optim.adam`
    or `modstate.optim.adamw`.

    For each leaf with a gradient ``g`` (``-g`` if `maximize`), at step ``t`` (counting from 1),
    as `torch.optim.Adam` computes it::

        p = p * (1 - lr * weight_decay)   if decoupled_weight_decay (AdamW)
        g = g + weight_decay * p          otherwise
        m = lerp(m, g, 1 - beta1)
        v = beta2 * v + (1 - beta2) * g * g
        v_max = max(v_max, v)             if amsgrad, and v_max replaces v below
        p = p - lr / (1 - beta1**t) * m / (sqrt(v) / sqrt(1 - beta2**t) + eps)

    The state is ``{"step", "exp_avg", "exp_avg_sq"}`` plus ``"max_exp_avg_sq"`` with amsgrad.
    """

    lr: Scalar = 1e-3
    betas: tuple[Scalar, Scalar] = (0.9, 0.999)
    eps: Scalar = 1e-8
    weight_decay: Scalar = 0.0
    amsgrad: bool = False
    maximize: bool = False
    decoupled_weight_decay: bool = False

    def __post_init__(self) -> None:
        check_hyperparameter("lr", self.lr, low=0.0)
        if not isinstance(self.betas, (tuple, list)) or len(self.betas) != 2:
            raise ValueError(f"betas must be a pair (beta1, beta2), got {self.betas!r}")
        object.__setattr__(self, "betas", tuple(self.betas))
        check_hyperparameter("beta1", self.betas[0], low=0.0, high=1.0)
        check_hyperparameter("beta2", self.betas[1], low=0.0, high=1.0)
        check_hyperparameter("eps", self.eps, low=0.0)
        check_hyperparameter("weight_decay", self.weight_decay, low=0.0)

    @property
    def _buffer_names(self) -> tuple[str, ...]:
        names = ("exp_avg", "exp_avg_sq")
        return (*names, "max_exp_avg_sq") if self.amsgrad else names

    @property
    def _name(self) -> str:
        return "adamw" if self.decoupled_weight_decay else "adam"

    def init(self, params: Any) -> dict[str, Any]:
        """The state before the first step: a zero step counter and zero moment trees."""
        return {"step": new_step_counter(), **init_buffers(params, self._buffer_names)}

    def step(self, params: Any, grads: Any, state: dict[str, Any]) -> tuple[Any, dict[str, Any]]:
        """One Adam step: returns ``(new_params, new_state)`` and changes none of its inputs.

        Leaves whose gradient is None keep their param and moments (the same objects); the step
        counter is shared by all leaves and counts every call.
        """
        leaves = StepLeaves(params, grads, state, self._buffer_names, self._name)
        if not leaves.active:
            return leaves.unchanged()
        beta1, beta2 = self.betas
        lr, eps, weight_decay = self.lr, self.eps, self.weight_decay
        ops = LeafOps.for_step(
            [*leaves.tensors(), leaves.step], (lr, beta1, beta2, eps, weight_decay)
        )
        p = leaves.gather(leaves.params)
        g = leaves.gather(leaves.grads)
        decay: Scalar = 1  # AdamW's factor on p
        g_fresh = False
        if self.maximize:
            g, g_fresh = ops.neg(g), True
        if not is_zero(weight_decay):
            if self.decoupled_weight_decay:
                decay = 1 - lr * weight_decay
            else:
                g, g_fresh = ops.add_scaled(g, p, weight_decay, fresh=g_fresh), True

        m = ops.lerp(leaves.gather(leaves.buffers["exp_avg"]), g, 1 - beta1)
        v = ops.scale(leaves.gather(leaves.buffers["exp_avg_sq"]), beta2)
        v = ops.addcmul(v, g, g, 1 - beta2, fresh=True)
        new_state = {
            "step": leaves.step + 1,
            "exp_avg": leaves.rebuild(leaves.buffers["exp_avg"], m),
            "exp_avg_sq": leaves.rebuild(leaves.buffers["exp_avg_sq"], v),
        }
        if self.amsgrad:
            v = ops.maximum(leaves.gather(leaves.buffers["max_exp_avg_sq"]), v)
            new_state["max_exp_avg_sq"] = leaves.rebuild(leaves.buffers["max_exp_avg_sq"], v)

        count = read_count(leaves.step)
        bc1, bc2 = bias_corrections(
            (beta1, beta2), new_state["step"], None if count is None else count + 1, leaves.device
        )
        # torch.optim: p - lr / bc1 * m / (sqrt(v) / sqrt(bc2) + eps). Multiplying through by
        # sqrt(bc2) gives the same value with one pass less over the leaves:
        # p - (lr * sqrt(bc2) / bc1) * m / (sqrt(v) + eps * sqrt(bc2)).
        bc2_sqrt = bc2**0.5
        denom = ops.add_scalar(ops.sqrt(v), eps * bc2_sqrt, fresh=True)
        step_size = -lr * bc2_sqrt / bc1
        if isinstance(decay, Tensor) or decay == 0:
            p = ops.scale(p, decay)
            new_p = ops.addcdiv(p, m, denom, step_size, fresh=True)
        else:
            # decay * p + step_size * m / denom, computed as decay * (p + ...) so that it can be
            # written over denom instead of allocating a decayed copy of p.
            new_p = ops.addcdiv(p, m, denom, step_size / decay, into_zs=True)
            if decay != 1:
                new_p = ops.scale(new_p, decay, fresh=True)
        return leaves.rebuild(leaves.params, new_p), new_state
