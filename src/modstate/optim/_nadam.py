"""`NAdam` on trees, numerically `torch.optim.NAdam`."""

from __future__ import annotations

from dataclasses import dataclass

from torch import Tensor

from modstate.optim._base import AdamLike, Betas, LearningRate
from modstate.optim._checks import check_hyperparameter
from modstate.optim._lists import Scalar
from modstate.optim._run import Run
from modstate.optim._tree import read_number


@dataclass(frozen=True)
class NAdam(AdamLike):
    """Pure NAdam (Adam with Nesterov momentum); build it with `modstate.optim.nadam`.

    For each leaf with a gradient ``g`` (``-g`` if `maximize`), at step ``t`` (from 1), after
    the weight decay (``p = p * (1 - lr * weight_decay)`` with `decoupled_weight_decay`, else
    ``g = g + weight_decay * p``), in `torch.optim.NAdam`'s order::

        mu_t = beta1 * (1 - 0.5 * 0.96 ** (t * momentum_decay));  P = P * mu_t
        m = lerp(m, g, 1 - beta1);  v = beta2 * v + (1 - beta2) * g * g
        d = sqrt(v / (1 - beta2**t)) + eps
        p = p - lr * (1 - mu_t) / (1 - P) * g / d - lr * mu_{t+1} / (1 - P * mu_{t+1}) * m / d

    The state is ``{"step", "mu_product", "exp_avg", "exp_avg_sq"}``; ``mu_product`` (``P``) is
    a 0-dim tensor shared by all leaves, as the step counter is.

    Attributes:
        lr: the learning rate: a number, a 0-dim tensor or a schedule.
        betas: ``(beta1, beta2)``, the decay rates of the moment estimates.
        eps: the term added to the denominator.
        weight_decay: the weight decay factor.
        momentum_decay: the momentum decay (``psi``).
        decoupled_weight_decay: whether weight decay is decoupled (AdamW style).
        maximize: whether the objective is ascended.
        foreach: torch.optim's multi-tensor path (True), single-tensor one (False), default (None).
        fused: whether torch's fused kernel runs the step.

    Example:
        >>> NAdam(lr=0.1).momentum_decay  # torch.optim.NAdam's default
        0.004
    """

    name = "nadam"
    scalar_names = ("mu_product",)

    lr: LearningRate = 2e-3
    momentum_decay: Scalar = 4e-3
    decoupled_weight_decay: bool = False
    maximize: bool = False

    def __post_init__(self) -> None:
        super().__post_init__()
        check_hyperparameter(self.name, "momentum_decay", self.momentum_decay, low=0.0)

    @property
    def buffer_names(self) -> tuple[str, ...]:
        return ("exp_avg", "exp_avg_sq")

    def _mu_product(self, run: Run, mu: Scalar) -> Tensor:
        """This step's product of the momentum factors, computed once per step (a step that
        runs its update chunk by chunk asks for it once per chunk)."""
        found = run.once.get("mu_product")
        if found is not None:
            return found
        product = run.scalars["mu_product"]
        if run.donated:
            product.mul_(mu)
        elif isinstance(mu, Tensor):
            # As the kernel does with a number: the factor in the product's dtype first.
            product = product * mu.to(product.dtype)
        else:
            product = product * mu
        run.once["mu_product"] = product
        return product

    def _update(self, run: Run) -> dict[str, Tensor]:
        h, ops, own, t = run.hyper, run.ops, run.own_buffers, run.count
        lr, eps, momentum_decay = h["lr"], h["eps"], h["momentum_decay"]
        beta1, beta2 = h["betas"]
        bias_correction2 = 1 - beta2**t
        run.begin(self.maximize, decoupled_weight_decay=self.decoupled_weight_decay)
        mu = beta1 * (1.0 - 0.5 * (0.96 ** (t * momentum_decay)))
        mu_next = beta1 * (1.0 - 0.5 * (0.96 ** ((t + 1) * momentum_decay)))
        mu_product = self._mu_product(run, mu)
        g = run.g
        exp_avg = ops.lerp(run.buffers["exp_avg"], g, 1 - beta1, own=own)
        exp_avg_sq = ops.square_average(run.buffers["exp_avg_sq"], g, beta2, own=own)
        run.buffers["exp_avg"], run.buffers["exp_avg_sq"] = exp_avg, exp_avg_sq
        if run.multi_tensor:  # torch.optim's multi-tensor order: sqrt(v) / sqrt(1 - beta2**t)
            denom = ops.div(ops.sqrt(exp_avg_sq), bias_correction2**0.5, own=True)
        else:
            denom = ops.sqrt(ops.div(exp_avg_sq, bias_correction2), own=True)
        denom = ops.add_scalar(denom, eps, own=True)

        product = read_number(mu_product)
        product_value: Scalar = mu_product if product is None else product
        if isinstance(product_value, Tensor) and isinstance(t, Tensor):
            product_value = product_value.to(t.dtype)
        mu_product_next = product_value * mu_next
        run.p = ops.addcdiv(
            run.p, g, denom, -lr * (1.0 - mu) / (1.0 - product_value), own=run.own_p
        )
        run.p = ops.addcdiv(
            run.p, exp_avg, denom, (-lr * mu_next) / (1.0 - mu_product_next), own=True
        )
        return {"mu_product": mu_product}


def nadam(
    lr: LearningRate = 2e-3,
    betas: Betas = (0.9, 0.999),
    eps: Scalar = 1e-8,
    weight_decay: Scalar = 0,
    momentum_decay: Scalar = 4e-3,
    decoupled_weight_decay: bool = False,
    *,
    maximize: bool = False,
    foreach: bool | None = None,
) -> NAdam:
    """NAdam (Adam with Nesterov momentum), with `torch.optim.NAdam`'s arguments and numbers.

    Args:
        lr: learning rate: a number, a 0-dim tensor, or a schedule (`modstate.optim.schedules`).
        betas: ``(beta1, beta2)``: beta1 decays the momentum, on the schedule that
            `momentum_decay` sets; beta2 decays the second moment estimate.
        eps: added to the denominator for numerical stability.
        weight_decay: L2 penalty added to the gradient (decoupled with
            `decoupled_weight_decay`).
        momentum_decay: the momentum schedule's decay.
        decoupled_weight_decay: decay the weights directly (as AdamW) instead of an L2 penalty.
        maximize: ascend the objective instead of descending it.
        foreach: torch.optim's flag: True, False or None ("Kernels" in `modstate.optim`).

    Returns:
        An `NAdam`, whose state holds the momentum product ``mu_product`` and both moments.

    Raises:
        ValueError: lr, eps, weight_decay or momentum_decay below 0, or a beta outside
            [0, 1).
        TypeError: a hyperparameter that is neither a number nor a 0-dim tensor.

    Example:
        >>> opt = nadam(lr=0.1)
        >>> params = {"w": torch.zeros(1)}
        >>> params, state = opt.step(params, {"w": torch.ones(1)}, opt.init(params))
        >>> params["w"]
        tensor([-0.1056])
    """
    return NAdam(**locals())  # the arguments are the fields, by name
