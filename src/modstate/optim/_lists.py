"""Arithmetic on lists of leaves, the building blocks of the optimizers in `modstate.optim`.

An optimizer step is a handful of elementwise operations applied to every leaf of a tree. `LeafOps`
runs each of them either as one `torch._foreach_*` kernel for the whole list, or as one ordinary
torch op per leaf. Both give the same numbers: the per-leaf form calls the single-tensor version
of the very op the `_foreach_*` kernel applies.

The `_foreach_*` kernels have no batching rule (`torch.vmap`) and their overloads that take a
tensor scalar cannot be differentiated, so `LeafOps.for_step` picks them only when neither a
functorch transform nor autograd is involved. Their in-place forms are then used on intermediates
the step itself allocated (``fresh=True``), never on a caller's tensor.
"""

from __future__ import annotations

from collections.abc import Iterable
from numbers import Number

import torch
from torch import Tensor

Scalar = float | int | Tensor
Leaves = list[Tensor]


def is_zero(value: Scalar) -> bool:
    """True for a Python number equal to 0; a tensor is never known to be zero (no device sync)."""
    return isinstance(value, Number) and value == 0


class LeafOps:
    """Elementwise ops on lists of tensors, as `_foreach_*` kernels or as one op per leaf.

    A scalar argument is a Python number or a 0-dim tensor (possibly batched under `vmap`, possibly
    requiring grad). ``fresh=True`` promises that the first list was allocated by the current step,
    so the `_foreach_*` form may overwrite it instead of allocating another list.
    """

    __slots__ = ("foreach",)

    def __init__(self, foreach: bool) -> None:
        self.foreach = foreach

    @classmethod
    def for_step(cls, tensors: Iterable[Tensor], scalars: Iterable[object]) -> LeafOps:
        """`_foreach_*` kernels unless a functorch transform is active or autograd must record."""
        if torch._C._are_functorch_transforms_active():
            return cls(foreach=False)
        if torch.is_grad_enabled():
            if any(isinstance(s, Tensor) and s.requires_grad for s in scalars):
                return cls(foreach=False)
            if any(t.requires_grad for t in tensors):
                return cls(foreach=False)
        return cls(foreach=True)

    def neg(self, xs: Leaves) -> Leaves:
        if self.foreach:
            return list(torch._foreach_neg(xs))
        return [torch.neg(x) for x in xs]

    def scale(self, xs: Leaves, s: Scalar, *, fresh: bool = False) -> Leaves:
        """``x * s``."""
        if self.foreach:
            if fresh:
                torch._foreach_mul_(xs, s)
                return xs
            return list(torch._foreach_mul(xs, s))
        return [torch.mul(x, s) for x in xs]

    def add_scalar(self, xs: Leaves, s: Scalar, *, fresh: bool = False) -> Leaves:
        """``x + s``."""
        if self.foreach:
            if fresh:
                torch._foreach_add_(xs, s)
                return xs
            return list(torch._foreach_add(xs, s))
        return [torch.add(x, s) for x in xs]

    def add_scaled(self, xs: Leaves, ys: Leaves, alpha: Scalar, *, fresh: bool = False) -> Leaves:
        """``x + alpha * y``."""
        if isinstance(alpha, Tensor):
            # `alpha=` takes only numbers: scale first, in both forms, so both round alike.
            return self.add_scaled(xs, self.scale(ys, alpha), 1, fresh=fresh)
        if self.foreach:
            if fresh:
                torch._foreach_add_(xs, ys, alpha=alpha)
                return xs
            return list(torch._foreach_add(xs, ys, alpha=alpha))
        return [torch.add(x, y, alpha=alpha) for x, y in zip(xs, ys)]

    def lerp(self, xs: Leaves, ys: Leaves, weight: Scalar) -> Leaves:
        """``x + weight * (y - x)``, with `torch.lerp`'s rounding."""
        if self.foreach and not isinstance(weight, Tensor):
            return list(torch._foreach_lerp(xs, ys, weight))
        if isinstance(weight, Tensor):
            # torch.lerp wants the weight in the leaf's dtype; a 0-dim tensor is exact enough.
            return [torch.lerp(x, y, weight.to(x.dtype)) for x, y in zip(xs, ys)]
        return [torch.lerp(x, y, weight) for x, y in zip(xs, ys)]

    def addcmul(
        self, xs: Leaves, ys: Leaves, zs: Leaves, value: Scalar, *, fresh: bool = False
    ) -> Leaves:
        """``x + value * y * z``."""
        if isinstance(value, Tensor):
            return self.addcmul(xs, self.scale(ys, value), zs, 1, fresh=fresh)
        if self.foreach:
            if fresh:
                torch._foreach_addcmul_(xs, ys, zs, value)
                return xs
            return list(torch._foreach_addcmul(xs, ys, zs, value))
        return [torch.addcmul(x, y, z, value=value) for x, y, z in zip(xs, ys, zs)]

    def addcdiv(
        self,
        xs: Leaves,
        ys: Leaves,
        zs: Leaves,
        value: Scalar,
        *,
        fresh: bool = False,
        into_zs: bool = False,
    ) -> Leaves:
        """``x + value * y / z``; ``into_zs`` promises `zs` fresh, so it may be written over."""
        if isinstance(value, Tensor):
            return self.add_scaled(xs, self.div(ys, zs), value, fresh=fresh)
        if self.foreach:
            if fresh:
                torch._foreach_addcdiv_(xs, ys, zs, value)
                return xs
            if into_zs and all(z.device.type == "cpu" for z in zs):
                # On CPU the _foreach_ kernels loop over the leaves anyway, and writing over the
                # intermediate saves allocating (and page-faulting) one tree's worth of memory.
                return [torch.addcdiv(x, y, z, value=value, out=z) for x, y, z in zip(xs, ys, zs)]
            return list(torch._foreach_addcdiv(xs, ys, zs, value))
        return [torch.addcdiv(x, y, z, value=value) for x, y, z in zip(xs, ys, zs)]

    def div(self, xs: Leaves, ys: Leaves) -> Leaves:
        if self.foreach:
            return list(torch._foreach_div(xs, ys))
        return [torch.div(x, y) for x, y in zip(xs, ys)]

    def sqrt(self, xs: Leaves) -> Leaves:
        if self.foreach:
            return list(torch._foreach_sqrt(xs))
        return [torch.sqrt(x) for x in xs]

    def maximum(self, xs: Leaves, ys: Leaves) -> Leaves:
        if self.foreach:
            return list(torch._foreach_maximum(xs, ys))
        return [torch.maximum(x, y) for x, y in zip(xs, ys)]
