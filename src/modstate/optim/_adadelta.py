"""`Adadelta` on trees, numerically `torch.optim.Adadelta`."""

from __future__ import annotations

from dataclasses import dataclass

from torch import Tensor

from modstate.optim._base import ElementwiseOptimizer, LearningRate
from modstate.optim._checks import check_hyperparameter, check_lr
from modstate.optim._lists import Scalar
from modstate.optim._run import Run


@dataclass(frozen=True)
class Adadelta(ElementwiseOptimizer):
    """Pure Adadelta; build it with `modstate.optim.adadelta`.

    For each leaf with a gradient ``g`` (``-g`` if `maximize`), in `torch.optim.Adadelta`'s
    order::

        g = g + weight_decay * p
        s = rho * s + (1 - rho) * g * g
        d = sqrt(a + eps) / sqrt(s + eps) * g
        a = rho * a + (1 - rho) * d * d
        p = p - lr * d

    The state is ``{"step", "square_avg", "acc_delta"}``.

    Attributes:
        lr: the scale of the update: a number, a 0-dim tensor or a schedule.
        rho: the decay rate of the running averages.
        eps: the term added inside both square roots.
        weight_decay: the weight decay factor.
        maximize: whether the objective is ascended.
        foreach: torch.optim's multi-tensor path (True), single-tensor one (False), default (None).
        fused: whether torch's fused kernel runs the step.

    Example:
        >>> Adadelta().lr  # a scale of the update, so 1.0 by default, as in torch.optim
        1.0
    """

    name = "adadelta"

    lr: LearningRate = 1.0
    rho: Scalar = 0.9
    eps: Scalar = 1e-6
    weight_decay: Scalar = 0.0
    maximize: bool = False

    def __post_init__(self) -> None:
        super().__post_init__()
        check_lr(self.name, self.lr)
        check_hyperparameter(self.name, "rho", self.rho, low=0.0, high=1.0, high_inclusive=True)
        check_hyperparameter(self.name, "eps", self.eps, low=0.0)
        check_hyperparameter(self.name, "weight_decay", self.weight_decay, low=0.0)

    @property
    def buffer_names(self) -> tuple[str, ...]:
        return ("square_avg", "acc_delta")

    def _update(self, run: Run) -> dict[str, Tensor]:
        h, ops, own = run.hyper, run.ops, run.own_buffers
        lr, rho, eps = h["lr"], h["rho"], h["eps"]
        run.begin(self.maximize)
        g = run.g
        square_avg = ops.square_average(run.buffers["square_avg"], g, rho, own=own)
        std = ops.sqrt(ops.add_scalar(square_avg, eps), own=True)
        delta = ops.sqrt(ops.add_scalar(run.buffers["acc_delta"], eps), own=True)
        delta = ops.mul_each(ops.div_each(delta, std, own=True), g, own=True)
        acc_delta = ops.square_average(run.buffers["acc_delta"], delta, rho, own=own)
        run.buffers["square_avg"], run.buffers["acc_delta"] = square_avg, acc_delta
        run.p = ops.add(run.p, delta, -lr, own=run.own_p, into=std)
        return {}


def adadelta(
    lr: LearningRate = 1.0,
    rho: Scalar = 0.9,
    eps: Scalar = 1e-6,
    weight_decay: Scalar = 0,
    *,
    maximize: bool = False,
    foreach: bool | None = None,
) -> Adadelta:
    """Adadelta, with `torch.optim.Adadelta`'s arguments and numbers.

    Args:
        lr: scales the update: a number, a 0-dim tensor, or a schedule.
        rho: decay rate of the running averages.
        eps: added inside the square roots for numerical stability.
        weight_decay: L2 penalty, added to the gradient.
        maximize: ascend the objective instead of descending it.
        foreach: torch.optim's flag: True, False or None ("Kernels" in `modstate.optim`).

    Returns:
        An `Adadelta`, whose state holds ``square_avg`` and ``acc_delta``.

    Raises:
        ValueError: lr, eps or weight_decay below 0, or rho outside [0, 1].
        TypeError: a hyperparameter that is neither a number nor a 0-dim tensor.

    Example:
        >>> opt = adadelta()
        >>> params = {"w": torch.zeros(1)}
        >>> params, state = opt.step(params, {"w": torch.ones(1)}, opt.init(params))
        >>> params["w"]  # -sqrt(eps) / sqrt(0.1 + eps)
        tensor([-0.0032])
    """
    return Adadelta(**locals())  # the arguments are the fields, by name
