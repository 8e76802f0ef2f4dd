"""The seam between ``torch.vmap`` and the batched kernels: members in, members out.

Inside the ensemble's ``torch.vmap``, a layer receives one member's view of its input: a
``BatchedTensor`` whose hidden dim ``bdim`` holds every member. A kernel takes the tensor inside
(`members_of`), computes every member at once on the stacked weights with ordinary torch
ops, and hands the result back as one member's view again (`as_member_view`). While it
computes, the vmap layer is set aside (`VmapSetAside`): the kernel's ops then run as plain
ops on plain tensors, recorded by autograd (or by an outer ``torch.func`` transform) as the ops
they are, and random ops draw as written (vmap would otherwise batch them a second time).

This is what ``torch.autograd.Function``'s ``vmap`` staticmethod does; measured, going through it
costs about 250 µs a call against 6 µs here, more than the layers it would speed up. The price is
four private functions of ``torch._C._functorch``, used nowhere else in modstate.

The ensemble's own vmap level is kept in a context variable for the duration of its forward
(`ensemble_level`), so that a kernel knows which batch dim is the member dim and a layer
run outside an ensemble's forward is recognized as such. Context variables are per thread.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from contextvars import ContextVar
from typing import Any

from torch import Tensor
from torch._C._functorch import (
    _add_batch_dim,
    _unwrap_batched,
    maybe_current_level,
    pop_dynamic_layer_stack,
    push_dynamic_layer_stack,
)

__all__ = [
    "VmapSetAside",
    "as_member_view",
    "ensemble_level",
    "maybe_current_level",
    "members_of",
    "running",
]

_RUNNING: ContextVar[tuple[object, int] | None] = ContextVar("modstate_ensemble", default=None)


@contextlib.contextmanager
def running(owner: object) -> Iterator[int]:
    """Marks the code inside as ``owner``'s forward, at the vmap level running now (the
    ensemble's own ``torch.vmap``, entered just outside); yields that level."""
    level = maybe_current_level()
    assert level is not None, "running() is entered inside the ensemble's torch.vmap"
    token = _RUNNING.set((owner, level))
    try:
        yield level
    finally:
        _RUNNING.reset(token)


def ensemble_level(owner: object) -> int | None:
    """The vmap level of ``owner``'s forward when a kernel of ``owner`` runs inside it (and no
    other transform was entered since); None otherwise."""
    active = _RUNNING.get()
    if active is None or active[0] is not owner or maybe_current_level() != active[1]:
        return None
    return active[1]


def members_of(value: Any, level: int) -> tuple[Any, int | None]:
    """``(tensor, bdim)``: the tensor holding every member of ``value`` and the dim that counts
    the members, or ``(value, None)`` when ``value`` is the same for every member (not batched at
    ``level``: a shared input, a constant)."""
    if not isinstance(value, Tensor):
        return value, None
    tensor, bdim = _unwrap_batched(value, level)
    return tensor, bdim


def as_member_view(tensor: Tensor, bdim: int, level: int) -> Tensor:
    """One member's view of ``tensor``, whose dim ``bdim`` counts the members."""
    return _add_batch_dim(tensor, bdim, level)


class VmapSetAside:
    """``with VmapSetAside():`` runs the code inside one transform level lower: plain ops on
    plain tensors, as a ``torch.autograd.Function``'s ``vmap`` rule runs. (A class rather than a
    generator: it is entered once per layer per call.)"""

    __slots__ = ("layer",)

    def __enter__(self) -> None:
        self.layer = pop_dynamic_layer_stack()

    def __exit__(self, *exc: object) -> None:
        push_dynamic_layer_stack(self.layer)
