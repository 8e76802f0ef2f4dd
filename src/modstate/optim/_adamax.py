"""`Adamax` on trees, numerically `torch.optim.Adamax`."""

from __future__ import annotations

from dataclasses import dataclass

from torch import Tensor

from modstate.optim._base import AdamLike, Betas, LearningRate
from modstate.optim._lists import Scalar
from modstate.optim._run import Run


@dataclass(frozen=True)
class Adamax(AdamLike):
    """Pure Adamax (Adam with the infinity norm); build it with `modstate.optim.adamax`.

    For each leaf with a gradient ``g`` (``-g`` if `maximize`), at step ``t`` (from 1), in
    `torch.optim.Adamax`'s order::

        g = g + weight_decay * p
        m = lerp(m, g, 1 - beta1)
        u = max(beta2 * u, |g| + eps)
        p = p - lr / (1 - beta1**t) * m / u

    The state is ``{"step", "exp_avg", "exp_inf"}``.

    Attributes:
        lr: the learning rate: a number, a 0-dim tensor or a schedule.
        betas: ``(beta1, beta2)``: the decay rates of the first moment and of the infinity norm.
        eps: the term added to ``|g|`` in the infinity norm.
        weight_decay: the weight decay factor.
        maximize: whether the objective is ascended.
        foreach: torch.optim's multi-tensor path (True), single-tensor one (False), default (None).
        fused: whether torch's fused kernel runs the step.

    Example:
        >>> Adamax(betas=(0.9, 0.99)).buffer_names
        ('exp_avg', 'exp_inf')
    """

    name = "adamax"

    lr: LearningRate = 2e-3
    maximize: bool = False

    @property
    def buffer_names(self) -> tuple[str, ...]:
        return ("exp_avg", "exp_inf")

    def _update(self, run: Run) -> dict[str, Tensor]:
        h, ops, own = run.hyper, run.ops, run.own_buffers
        beta1, beta2 = h["betas"]
        run.begin(self.maximize)
        g = run.g
        exp_avg = ops.lerp(run.buffers["exp_avg"], g, 1 - beta1, own=own)
        norm = ops.add_scalar(ops.abs(g), h["eps"], own=True)
        exp_inf = ops.maximum(ops.mul(run.buffers["exp_inf"], beta2, own=own), norm, own=True)
        run.buffers["exp_avg"], run.buffers["exp_inf"] = exp_avg, exp_inf
        clr = h["lr"] / (1 - beta1**run.count)
        run.p = ops.addcdiv(run.p, exp_avg, exp_inf, -clr, own=run.own_p, into=norm)
        return {}


def adamax(
    lr: LearningRate = 2e-3,
    betas: Betas = (0.9, 0.999),
    eps: Scalar = 1e-8,
    weight_decay: Scalar = 0,
    *,
    maximize: bool = False,
    foreach: bool | None = None,
) -> Adamax:
    """Adamax (Adam with the infinity norm), with `torch.optim.Adamax`'s arguments and numbers.

    Args:
        lr: learning rate: a number, a 0-dim tensor, or a schedule (`modstate.optim.schedules`).
        betas: the decay rates ``(beta1, beta2)`` of the first moment and the infinity norm.
        eps: added to the denominator for numerical stability.
        weight_decay: L2 penalty, added to the gradient.
        maximize: ascend the objective instead of descending it.
        foreach: torch.optim's flag: True, False or None ("Kernels" in `modstate.optim`).

    Returns:
        An `Adamax`, whose state holds ``exp_avg`` and the infinity norm ``exp_inf``.

    Raises:
        ValueError: lr, eps or weight_decay below 0 or a beta outside [0, 1) (Adamax's
            second beta decays the infinity norm).
        TypeError: a hyperparameter that is neither a number nor a 0-dim tensor.

    Example:
        >>> opt = adamax(lr=0.1)
        >>> params = {"w": torch.zeros(2)}
        >>> params, state = opt.step(params, {"w": torch.tensor([1.0, -1.0])}, opt.init(params))
        >>> params["w"]
        tensor([-0.1000,  0.1000])
    """
    return Adamax(**locals())  # the arguments are the fields, by name
