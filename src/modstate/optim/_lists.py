"""Arithmetic on lists of leaves, the building blocks of the optimizers in `modstate.optim`.

An optimizer step is a handful of elementwise operations applied to every leaf of a tree. `LeafOps`
runs each of them in one of two forms that give the same numbers:

- eager (no functorch transform, no autograd recording): one `torch._foreach_*` kernel over the
  list, in place when the list is the step's own (an intermediate it allocated, or a buffer the
  caller donated). On the CPU a `_foreach_*` kernel applies the very single-tensor op that
  `torch.optim` applies, so the numbers are `torch.optim`'s.
- functional (under `vmap` / `grad`, or when autograd records): one out-of-place op per leaf, so
  autograd and the batching rules see ordinary ops. A scalar may then be a 0-dim tensor (a
  learnable or per-member hyperparameter); the op is spelled out in the order the fused kernel
  computes it (``addcdiv``: ``x + (value * y) / z``), with the scalar cast to the leaf's dtype as
  the kernel casts it.

`own=True` says the first list belongs to the step (fresh or donated), so it may be written over.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import cast

import torch
from torch import Tensor

from modstate._core.torch_facts import foreach_allowed, functorch_active

Scalar = float | int | Tensor
Leaves = list[Tensor]


def safe_sqrt(x: Tensor) -> Tensor:
    """``sqrt(x)`` whose gradient at ``x == 0`` is 0 instead of ``inf`` (``0 * inf`` is NaN).

    The forward value is `torch.sqrt`'s bit for bit (``sqrt(0) == 0``); only the backward at exact
    zeros changes, which keeps meta-gradients through Adam-like steps finite where a gradient
    element is exactly zero. Plain ops only, so it composes with every functorch transform.
    """
    nonzero = x != 0
    return torch.where(nonzero, torch.sqrt(torch.where(nonzero, x, 1)), 0)


def _all_cpu(xs: Leaves) -> bool:
    """Whether writing results into `xs` with ``out=`` pays: on the CPU the `_foreach_` kernels
    loop over the leaves anyway, and reusing an intermediate saves allocating (and
    page-faulting) one tree's worth of memory."""
    return all(x.device.type == "cpu" for x in xs)


def _number(value: Scalar) -> float:
    """A scalar of the eager form, which is always a Python number (a tensor hyperparameter
    selects the functional form)."""
    return cast(float, value)


_HALF = (torch.float16, torch.bfloat16)


def _rounded(value: float, dtype: torch.dtype) -> float:
    """`value` rounded to `dtype`, as an in-place ``_foreach_mul_`` rounds its scalar."""
    return torch.tensor(value, dtype=dtype).item()


def _as_dtype(value: Tensor, like: Tensor) -> Tensor:
    """A tensor hyperparameter in the leaf's dtype, as a fused kernel casts its scalar; a
    per-member one (1-D: one value per member of a stacked leaf) laid along the leaf's first
    dim, the member dim, so that member i computes with value i."""
    value = _along_members(value, like)
    return value if value.dtype == like.dtype else value.to(like.dtype)


def _along_members(value: Tensor, like: Tensor) -> Tensor:
    # (members,) -> (members, 1, ..., 1): broadcasting aligns trailing dims, members lead.
    return value.reshape(-1, *(1,) * (like.dim() - 1)) if value.dim() == 1 else value


class LeafOps:
    """Elementwise ops on lists of tensors, as `_foreach_*` kernels or as one op per leaf."""

    __slots__ = ("foreach", "multi_tensor")

    def __init__(self, foreach: bool, *, multi_tensor: bool = False) -> None:
        self.foreach = foreach
        # torch.optim's multi-tensor order: its scalar multiplications are in-place _foreach_
        # kernels, which on half-precision leaves round the scalar to the leaf's dtype first.
        self.multi_tensor = multi_tensor

    @staticmethod
    def differentiable(tensors: Iterable[Tensor], scalars: Iterable[object]) -> bool:
        """Whether a step must take the differentiable form: a functorch transform is active,
        autograd must record, or a scalar is a tensor (learnable, batched, or not free to read)."""
        if any(isinstance(s, Tensor) for s in scalars):
            return True
        if not torch.is_grad_enabled() and not functorch_active():
            return False  # nothing can record: no need to look at every tensor
        return not foreach_allowed(tensors)

    def clone(self, xs: Leaves) -> Leaves:
        if self.foreach:
            return [x.clone() for x in xs]
        return [torch.clone(x) for x in xs]

    def neg(self, xs: Leaves, *, own: bool = False) -> Leaves:
        if self.foreach:
            if own:
                torch._foreach_neg_(xs)
                return xs
            return list(torch._foreach_neg(xs))
        return [torch.neg(x) for x in xs]

    def abs(self, xs: Leaves) -> Leaves:
        if self.foreach:
            return list(torch._foreach_abs(xs))
        return [torch.abs(x) for x in xs]

    def mul(
        self, xs: Leaves, s: Scalar, *, own: bool = False, in_place_in_torch: bool = True
    ) -> Leaves:
        """``x * s`` for a scalar `s`, with the rounding of the torch.optim op it stands for:
        in the multi-tensor order an in-place ``_foreach_mul_`` (unless `in_place_in_torch` is
        False), in the single-tensor order ``Tensor.mul_``. They differ on half-precision
        leaves only, where the in-place foreach kernel multiplies by the scalar rounded to the
        leaf's dtype."""
        if self.foreach:
            number = _number(s)
            half = [x.dtype in _HALF for x in xs]
            if any(half):
                if self.multi_tensor and in_place_in_torch:
                    factors = [
                        _rounded(number, x.dtype) if h else number
                        for x, h in zip(xs, half, strict=True)
                    ]
                    if own:
                        torch._foreach_mul_(xs, factors)
                        return xs
                    return list(torch._foreach_mul(xs, factors))
                if own:  # Tensor.mul_'s rounding, which the in-place foreach kernel lacks here
                    for x in xs:
                        x.mul_(number)
                    return xs
            if own:
                torch._foreach_mul_(xs, number)
                return xs
            return list(torch._foreach_mul(xs, number))
        if isinstance(s, Tensor):
            return [torch.mul(x, _as_dtype(s, x)) for x in xs]
        return [torch.mul(x, s) for x in xs]

    def mul_each(self, xs: Leaves, ys: Leaves, *, own: bool = False) -> Leaves:
        """``x * y`` leaf by leaf."""
        if self.foreach:
            if own:
                torch._foreach_mul_(xs, ys)
                return xs
            return list(torch._foreach_mul(xs, ys))
        return [torch.mul(x, y) for x, y in zip(xs, ys, strict=True)]

    def div(self, xs: Leaves, s: Scalar, *, own: bool = False) -> Leaves:
        """``x / s`` for a scalar `s`."""
        if self.foreach:
            if own:
                torch._foreach_div_(xs, s)
                return xs
            return list(torch._foreach_div(xs, s))
        if isinstance(s, Tensor):
            return [torch.div(x, _as_dtype(s, x)) for x in xs]
        return [torch.div(x, s) for x in xs]

    def div_each(self, xs: Leaves, ys: Leaves, *, own: bool = False) -> Leaves:
        """``x / y`` leaf by leaf."""
        if self.foreach:
            if own:
                torch._foreach_div_(xs, ys)
                return xs
            return list(torch._foreach_div(xs, ys))
        return [torch.div(x, y) for x, y in zip(xs, ys, strict=True)]

    def reciprocal(self, xs: Leaves, *, own: bool = False) -> Leaves:
        if self.foreach:
            if own:
                torch._foreach_reciprocal_(xs)
                return xs
            return list(torch._foreach_reciprocal(xs))
        return [torch.reciprocal(x) for x in xs]

    def add_scalar(self, xs: Leaves, s: Scalar, *, own: bool = False) -> Leaves:
        """``x + s``."""
        if self.foreach:
            if own:
                torch._foreach_add_(xs, s)
                return xs
            return list(torch._foreach_add(xs, s))
        if isinstance(s, Tensor):
            return [torch.add(x, _as_dtype(s, x)) for x in xs]
        return [torch.add(x, s) for x in xs]

    def add(
        self,
        xs: Leaves,
        ys: Leaves,
        alpha: Scalar = 1,
        *,
        own: bool = False,
        into: Leaves | None = None,
    ) -> Leaves:
        """``x + alpha * y``; ``into``: a list of the step's own to hold the result (eager)."""
        if self.foreach:
            number = _number(alpha)
            if own:
                torch._foreach_add_(xs, ys, alpha=number)
                return xs
            if into is not None and _all_cpu(into):
                return [
                    torch.add(x, y, alpha=number, out=o)
                    for x, y, o in zip(xs, ys, into, strict=True)
                ]
            return list(torch._foreach_add(xs, ys, alpha=number))
        if isinstance(alpha, Tensor):
            # `alpha=` takes numbers only; torch.optim's differentiable path multiplies too.
            return [
                torch.add(x, torch.mul(y, _as_dtype(alpha, y))) for x, y in zip(xs, ys, strict=True)
            ]
        return [torch.add(x, y, alpha=alpha) for x, y in zip(xs, ys, strict=True)]

    def lerp(self, xs: Leaves, ys: Leaves, weight: Scalar, *, own: bool = False) -> Leaves:
        """``x + weight * (y - x)``, with `torch.lerp`'s rounding."""
        if self.foreach:
            if own:
                torch._foreach_lerp_(xs, ys, _number(weight))
                return xs
            return list(torch._foreach_lerp(xs, ys, _number(weight)))
        if isinstance(weight, Tensor):
            return [torch.lerp(x, y, _as_dtype(weight, x)) for x, y in zip(xs, ys, strict=True)]
        return [torch.lerp(x, y, weight) for x, y in zip(xs, ys, strict=True)]

    def addcmul(
        self, xs: Leaves, ys: Leaves, zs: Leaves, value: Scalar = 1, *, own: bool = False
    ) -> Leaves:
        """``x + value * y * z``."""
        if self.foreach:
            if own:
                torch._foreach_addcmul_(xs, ys, zs, value)
                return xs
            return list(torch._foreach_addcmul(xs, ys, zs, value))
        if isinstance(value, Tensor):
            return [
                torch.add(x, torch.mul(torch.mul(y, _as_dtype(value, y)), z))
                for x, y, z in zip(xs, ys, zs, strict=True)
            ]
        return [torch.addcmul(x, y, z, value=value) for x, y, z in zip(xs, ys, zs, strict=True)]

    def square_average(self, avg: Leaves, xs: Leaves, decay: Scalar, *, own: bool) -> Leaves:
        """``decay * avg + (1 - decay) * x * x``, as torch.optim computes every running average
        of squares (Adam's ``exp_avg_sq``, RMSprop's ``square_avg``, ...): a ``mul`` by `decay`,
        then an ``addcmul``, so the rounding is torch's."""
        return self.addcmul(self.mul(avg, decay, own=own), xs, xs, 1 - decay, own=True)

    def addcdiv(
        self,
        xs: Leaves,
        ys: Leaves,
        zs: Leaves,
        value: Scalar = 1,
        *,
        own: bool = False,
        into_zs: bool = False,
        into: Leaves | None = None,
    ) -> Leaves:
        """``x + value * y / z``; ``into_zs`` says `zs` is the step's own, so it may hold the
        result; ``into`` names another list of the step's own for it (eager form)."""
        if self.foreach:
            if own:
                torch._foreach_addcdiv_(xs, ys, zs, value)
                return xs
            out = zs if into_zs else into
            if out is not None and _all_cpu(out):
                return [
                    torch.addcdiv(x, y, z, value=_number(value), out=o)
                    for x, y, z, o in zip(xs, ys, zs, out, strict=True)
                ]
            return list(torch._foreach_addcdiv(xs, ys, zs, value))
        if isinstance(value, Tensor):
            return [
                torch.add(x, torch.div(torch.mul(y, _as_dtype(value, y)), z))
                for x, y, z in zip(xs, ys, zs, strict=True)
            ]
        return [torch.addcdiv(x, y, z, value=value) for x, y, z in zip(xs, ys, zs, strict=True)]

    def sqrt(self, xs: Leaves, *, own: bool = False) -> Leaves:
        """``sqrt(x)``; in the functional form with a finite gradient at 0 (`safe_sqrt`)."""
        if self.foreach:
            if own:
                torch._foreach_sqrt_(xs)
                return xs
            return list(torch._foreach_sqrt(xs))
        return [safe_sqrt(x) for x in xs]

    def maximum(self, xs: Leaves, ys: Leaves, *, own: bool = False) -> Leaves:
        if self.foreach:
            if own:
                for x, y in zip(xs, ys, strict=True):
                    torch.maximum(x, y, out=x)
                return xs
            return list(torch._foreach_maximum(xs, ys))
        return [torch.maximum(x, y) for x, y in zip(xs, ys, strict=True)]

    def where(self, condition: Tensor, xs: Leaves, ys: Leaves) -> Leaves:
        """`xs` where the 0-dim (or per-member 1-D) `condition` holds, else `ys` (functional form
        only)."""
        return [
            torch.where(_along_members(condition, x).to(x.device), x, y)
            for x, y in zip(xs, ys, strict=True)
        ]

    def copy_into(self, xs: Leaves, ys: Leaves) -> Leaves:
        """`ys` written into the step's own `xs` (eager) or a copy of `ys` (functional)."""
        if self.foreach:
            torch._foreach_copy_(xs, ys)
            return xs
        return [torch.clone(y) for y in ys]
