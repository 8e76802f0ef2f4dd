"""The argument checks of `modstate.optim`'s optimizers, stated once, as `torch.optim` checks them.

Every error names the optimizer and the argument, in the library's one format
``"<function>: '<argument>': <what>; <fix>"``, and is raised when the optimizer is built, before
any step runs.
"""

from __future__ import annotations

from torch import Tensor

from modstate.optim._lists import Scalar


def is_zero(value: object) -> bool:
    """Whether `value` is known to be 0 without reading a tensor: a Python number equal to 0.

    A tensor is never known to be zero: reading it may cost a device sync, and a tensor
    hyperparameter is there to be learned or batched, so the term it controls always runs.
    """
    return isinstance(value, (int, float)) and not isinstance(value, bool) and value == 0


def check_hyperparameter(
    owner: str,
    name: str,
    value: object,
    *,
    low: float,
    high: float | None = None,
    high_inclusive: bool = False,
) -> None:
    """Refuse `value` unless it is a number in torch.optim's range, a floating 0-dim tensor, or a
    floating 1-D tensor (one value per member of stacked trees; its length is checked against
    the trees at each step).

    Tensors are not range-checked (reading one may cost a device sync).
    """
    if isinstance(value, Tensor):
        if value.dim() > 1:
            raise ValueError(
                f"{owner}: '{name}': a tensor of shape {tuple(value.shape)}; a hyperparameter "
                f"is a number, a 0-dim tensor, or a 1-D tensor of one value per member of "
                f"stacked trees (an ensemble's)"
            )
        if not (value.is_floating_point() or value.is_complex()):
            raise ValueError(
                f"{owner}: '{name}': a {value.dtype} tensor; pass a floating-point 0-dim tensor "
                f"(e.g. torch.tensor({name}_value, dtype=torch.float32)) or a number"
            )
        return
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise TypeError(
            f"{owner}: '{name}': got {type(value).__name__}; pass a number or a 0-dim tensor"
        )
    above = high is not None and (value > high if high_inclusive else value >= high)
    if value < low or above:
        closing = "]" if high_inclusive else ")"
        bounds = f"in [{low}, {high}{closing}" if high is not None else f">= {low}"
        raise ValueError(
            f"{owner}: '{name}': invalid value {value} (torch.optim requires {bounds}); "
            f"pass a {name} {bounds}"
        )


def check_lr(owner: str, lr: object) -> None:
    """A learning rate: a number >= 0, a 0-dim tensor, or a schedule (any other callable)."""
    if not callable(lr) or isinstance(lr, Tensor):
        check_hyperparameter(owner, "lr", lr, low=0.0)


def check_betas(owner: str, betas: object) -> tuple[Scalar, Scalar]:
    """``(beta1, beta2)``, each in [0, 1), as a tuple."""
    if not isinstance(betas, (tuple, list)) or len(betas) != 2:
        raise ValueError(
            f"{owner}: 'betas': got {betas!r}; pass a pair (beta1, beta2) such as (0.9, 0.999)"
        )
    check_hyperparameter(owner, "beta1", betas[0], low=0.0, high=1.0)
    check_hyperparameter(owner, "beta2", betas[1], low=0.0, high=1.0)
    return (betas[0], betas[1])


def check_kernels(owner: str, foreach: object, fused: object, *, has_fused: bool) -> None:
    """`foreach` and `fused` as torch.optim takes them: None, True or False, not both True."""
    for name, flag in (("foreach", foreach), ("fused", fused)):
        if flag is not None and not isinstance(flag, bool):
            raise TypeError(
                f"{owner}: '{name}': got {type(flag).__name__}; pass None (torch's default "
                f"for the device), True or False"
            )
    if fused and not has_fused:
        raise ValueError(
            f"{owner}: 'fused': torch.optim has no fused kernel for {owner}; pass "
            f"foreach=True (one _foreach kernel per operation) or leave fused unset"
        )
    if fused and foreach:
        raise ValueError(
            f"{owner}: 'fused': fused=True and foreach=True cannot both be set (as in "
            f"torch.optim); pass one of them"
        )
