"""What every batched kernel is made of: where the stacked tensors live, and the kernel contract.

A kernel is built once per layer of the template, from the layer and a `KernelContext`,
and then called as ``kernel(x, bdim)`` on plain tensors: ``x`` holds every member's input along
dim ``bdim`` (or is the same input for every member when ``bdim`` is None), and the kernel returns
``(out, out_bdim)`` with every member's output along ``out_bdim``, or None when this call's input
has no batched form here (the caller then runs the layer's own ``forward`` under vmap). Kernels
keep no tensors: they read the stacked tensors from their `Home` at every call, so
``.to()``, ``load_state_dict`` and a stateless call on the ensemble are seen at once.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Protocol

import torch
from torch import Tensor, nn

from .forms import LayerForms


class Home:
    """Where one stacked tensor lives: ``table[name]``, ``table`` being an owner's
    ``_parameters`` or ``_buffers`` in the ensemble's ``stacked`` mirror."""

    __slots__ = ("name", "table")

    def __init__(self, table: dict[str, Tensor | None], name: str) -> None:
        self.table = table
        self.name = name

    def get(self) -> Tensor:
        tensor = self.table[self.name]
        assert tensor is not None
        return tensor


class KernelContext:
    """What building a kernel needs: the member count, vmap's randomness mode, the home of
    the stacked form of each of the template's tensors (by the template tensor's ``id``), and
    the user's declared kernels (``Ensemble(..., kernels=...)``: a class of theirs mapped to the
    torch class it computes as), and the ensemble's measured forms (``forms.py``), which every
    runner and chain of one ensemble share."""

    def __init__(
        self,
        count: int,
        randomness: str,
        homes: dict[int, Home],
        kernels: Mapping[type, type[nn.Module]] | None = None,
        forms: LayerForms | None = None,
    ) -> None:
        self.count = count
        self.randomness = randomness
        self._homes = homes
        self.kernels: Mapping[type, type[nn.Module]] = kernels or {}
        self.forms = forms if forms is not None else LayerForms(measure=False)

    def home(self, tensor: Tensor | nn.Module | None) -> Home:
        """The home of the stacked form of the template's ``tensor``.

        Raises:
            NotStacked: ``tensor`` is none of the template's parameters and buffers (a weight
                that a hook computes, as legacy ``weight_norm`` and ``spectral_norm`` do).
        """
        home = self._homes.get(id(tensor))
        if home is None:
            raise NotStacked(tensor)
        return home

    def maybe_home(self, tensor: Tensor | nn.Module | None) -> Home | None:
        """`home`, or None when the layer holds None there (a Linear without bias)."""
        return None if tensor is None else self.home(tensor)


class NotStacked(LookupError):
    """A kernel was to read a tensor that is none of the layer's parameters and buffers."""


class Kernel(Protocol):
    """A layer's batched form (see the module docstring)."""

    route: str
    """What the plan shows for this layer: the batched computation it runs."""

    fresh: bool
    """Whether the output is a new tensor that the kernel's backward does not keep, so that an
    activation right after it may work in place (used by the chain of a ``Sequential``)."""

    def __call__(self, x: Tensor, bdim: int | None) -> tuple[Tensor, int] | None: ...


class NoKernel:
    """A layer whose type has a kernel, but not with these settings; ``reason`` says why (the
    plan shows it)."""

    __slots__ = ("reason",)

    def __init__(self, reason: str) -> None:
        self.reason = reason

    def __repr__(self) -> str:
        return f"NoKernel({self.reason!r})"


def member_front(x: Tensor, bdim: int | None, count: int) -> Tensor:
    """``x`` with its member dim first: moved there, or made by expanding a shared input."""
    if bdim is None:
        return x.expand(count, *x.shape)
    return x if bdim == 0 else x.movedim(bdim, 0)


def channels_side_by_side(x: Tensor, bdim: int | None, count: int) -> Tensor:
    """``(batch, members * channels, ...)``: every member's channels next to each other, the
    layout of a grouped convolution with one group per member. Free when ``x`` comes from one
    (member dim 1 of ``(batch, members, channels, ...)``), one copy otherwise."""
    if bdim is None:
        x = x.unsqueeze(1).expand(x.shape[0], count, *x.shape[1:])
    elif bdim != 1:
        x = x.movedim(bdim, 1)
    return x.reshape(x.shape[0], -1, *x.shape[3:])


_UNTRACKED_VIEW = torch.ops.aten._unsafe_view.default


def fresh_view(out: Tensor, *shape: int) -> Tensor:
    """``out.view(*shape)`` for the output of a `fresh <Kernel.fresh>` kernel, made so that an
    in-place op on the result is as cheap as on ``out`` itself.

    An in-place op on a view of a tensor that requires grad (the ReLU after a BatchNorm in a
    ``Sequential``, which the chain runs in place) makes autograd rewrite the view's history:
    in backward the gradient is then cloned and copied back through the view's base once more.
    Measured on an 8-member BatchNorm MLP's training step on a 2-core CPU: 5-7% of the step.
    Here nothing but the result holds ``out`` (it is new and the kernel's backward does not
    keep it), so the result may own its history: ``aten._unsafe_view``, the reshape torch's own
    ``matmul`` uses for that reason. Without autograd, or when ``out`` is itself a view of
    something else, it is a plain ``view``. (In a model's own ``forward``, vmap writes an
    in-place op on an output whose member dim is not first through a view of its own: see
    `fresh_members_first`.)"""
    if out.requires_grad and out._base is None:
        return _UNTRACKED_VIEW(out, shape)
    return out.view(shape)


def fresh_members_first(out: Tensor, bdim: int) -> Tensor:
    """``out.movedim(bdim, 0)`` for the output of a `fresh <Kernel.fresh>` kernel, made as
    `fresh_view` makes its reshape: an in-place op on the result costs what it costs on ``out``.

    Inside an ensemble's forward, vmap writes an in-place op (torchvision's
    ``ReLU(inplace=True)``, ``out += identity``) into a tensor whose member dim is not first
    through a view that moves it there, and autograd then rewrites that view's history (a clone
    and a copy of the gradient in backward). With the member dim first already, vmap writes into
    the result itself. The memory is not moved: the members stay side by side, as the next
    convolution or BatchNorm reads them."""
    moved = out.movedim(bdim, 0)
    if out.requires_grad and out._base is None:
        return _UNTRACKED_VIEW(moved, moved.shape)
    return moved
