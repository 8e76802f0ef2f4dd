"""`RMSprop` on trees, numerically `torch.optim.RMSprop`."""

from __future__ import annotations

from dataclasses import dataclass

from torch import Tensor

from modstate.optim._base import ElementwiseOptimizer, LearningRate
from modstate.optim._checks import check_hyperparameter, check_lr, is_zero
from modstate.optim._lists import Scalar
from modstate.optim._run import Run


@dataclass(frozen=True)
class RMSprop(ElementwiseOptimizer):
    """Pure RMSprop; build it with `modstate.optim.rmsprop`.

    For each leaf with a gradient ``g`` (``-g`` if `maximize`), in `torch.optim.RMSprop`'s order::

        g = g + weight_decay * p
        s = alpha * s + (1 - alpha) * g * g
        a = lerp(a, g, 1 - alpha)                       if centered
        d = sqrt(s - a * a) + eps   if centered   else   sqrt(s) + eps
        b = momentum * b + g / d;  p = p - lr * b       if momentum
        p = p - lr * g / d                              otherwise

    The state is ``{"step", "square_avg"}``, plus ``"momentum_buffer"`` (momentum) and
    ``"grad_avg"`` (centered).

    Attributes:
        lr: the learning rate: a number, a 0-dim tensor or a schedule.
        alpha: the smoothing constant of the squared-gradient average.
        eps: the term added to the denominator.
        weight_decay: the weight decay factor.
        momentum: the momentum factor.
        centered: whether the gradient is normalized by an estimate of its variance.
        maximize: whether the objective is ascended.
        foreach: torch.optim's multi-tensor path (True), single-tensor one (False), default (None).
        fused: whether torch's fused kernel runs the step.

    Example:
        >>> RMSprop(momentum=0.9, centered=True).buffer_names
        ('square_avg', 'momentum_buffer', 'grad_avg')
    """

    name = "rmsprop"

    lr: LearningRate = 1e-2
    alpha: Scalar = 0.99
    eps: Scalar = 1e-8
    weight_decay: Scalar = 0.0
    momentum: Scalar = 0.0
    centered: bool = False
    maximize: bool = False

    def __post_init__(self) -> None:
        super().__post_init__()
        check_lr(self.name, self.lr)
        check_hyperparameter(self.name, "alpha", self.alpha, low=0.0)
        check_hyperparameter(self.name, "eps", self.eps, low=0.0)
        check_hyperparameter(self.name, "weight_decay", self.weight_decay, low=0.0)
        check_hyperparameter(self.name, "momentum", self.momentum, low=0.0)

    @property
    def buffer_names(self) -> tuple[str, ...]:
        names = ["square_avg"]
        if not is_zero(self.momentum):
            names.append("momentum_buffer")
        if self.centered:
            names.append("grad_avg")
        return tuple(names)

    def _update(self, run: Run) -> dict[str, Tensor]:
        h, ops, own = run.hyper, run.ops, run.own_buffers
        alpha, eps = h["alpha"], h["eps"]
        run.begin(self.maximize)
        g = run.g
        square_avg = ops.square_average(run.buffers["square_avg"], g, alpha, own=own)
        run.buffers["square_avg"] = square_avg
        if self.centered:
            grad_avg = ops.lerp(run.buffers["grad_avg"], g, 1 - alpha, own=own)
            run.buffers["grad_avg"] = grad_avg
            avg = ops.sqrt(ops.addcmul(square_avg, grad_avg, grad_avg, -1), own=True)
        else:
            avg = ops.sqrt(square_avg)
        avg = ops.add_scalar(avg, eps, own=True)
        if not is_zero(self.momentum):
            buf = ops.mul(run.buffers["momentum_buffer"], h["momentum"], own=own)
            buf = ops.addcdiv(buf, g, avg, own=True)
            run.buffers["momentum_buffer"] = buf
            run.p = ops.add(run.p, buf, -h["lr"], own=run.own_p)
        else:
            run.p = ops.addcdiv(run.p, g, avg, -h["lr"], own=run.own_p, into_zs=True)
        return {}


def rmsprop(
    lr: LearningRate = 1e-2,
    alpha: Scalar = 0.99,
    eps: Scalar = 1e-8,
    weight_decay: Scalar = 0,
    momentum: Scalar = 0,
    centered: bool = False,
    *,
    maximize: bool = False,
    foreach: bool | None = None,
) -> RMSprop:
    """RMSprop, with `torch.optim.RMSprop`'s arguments and numbers.

    Args:
        lr: learning rate: a number, a 0-dim tensor, or a schedule (`modstate.optim.schedules`).
        alpha: smoothing constant of the squared-gradient average.
        eps: added to the denominator for numerical stability.
        weight_decay: L2 penalty, added to the gradient.
        momentum: momentum factor; with the number 0 the state keeps no momentum buffer.
        centered: normalize by an estimate of the gradient's variance.
        maximize: ascend the objective instead of descending it.
        foreach: torch.optim's flag: True, False or None ("Kernels" in `modstate.optim`).

    Returns:
        An `RMSprop`, whose state holds ``square_avg`` (and ``momentum_buffer``,
            ``grad_avg`` when they are asked for).

    Raises:
        ValueError: lr, alpha, eps, weight_decay or momentum below 0.
        TypeError: a hyperparameter that is neither a number nor a 0-dim tensor.

    Example:
        >>> opt = rmsprop(lr=0.01)
        >>> params = {"w": torch.zeros(2)}
        >>> params, state = opt.step(params, {"w": torch.tensor([1.0, -1.0])}, opt.init(params))
        >>> params["w"]  # -0.01 * g / sqrt(0.01 * g * g)
        tensor([-0.1000,  0.1000])
    """
    return RMSprop(**locals())  # the arguments are the fields, by name
