"""The loop route: each member run by itself, on views of the stacked tensors, outputs stacked.

In eager mode each thread keeps one copy of the template per member (`MemberCopies`, sharing
the template's modules' code and settings) whose slots hold ``unbind`` views of the stacked
tensors; each member is then a plain call of its copy. Gradients reach the stacked parameters
through the views, and a BatchNorm in training updates the stacked statistics in place. The
views are put back into the slots before each call (so a ``forward`` that reassigns a buffer
changes nothing the next call sees, as with ``modstate.call``). Without autograd they are made
again only when a stacked tensor changes (another object or storage, another shape: ``.to()``,
``load_state_dict``, a stateless call on the ensemble); with autograd recording, at every call,
for autograd refuses an ``unbind`` view once its base was written in place (an optimizer's
step). The copies are this thread's own: another thread's call, or a stateless call with other
tensors, never sees them. A stateless call per member (``modstate.call``) would cost more: its
slot tables, which keep a call's tensors private to its thread, cost about 15% of a small
transformer's forward, and 3-6% of a small model's training step (a small ResNet, GPT-2's zoo
configuration and a transformer encoder, at batch 8).

While compiling or under a ``torch.func`` transform, each member runs as
``modstate.call(template, member_tree, ...)`` (`loop_forward`): its tree holds ``unbind`` views
of the stacked tensors made at every call, and no module state is written.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor, nn
from torch.utils import _pytree as pytree

from modstate._core.call import call
from modstate._core.module.anatomy import slot_at
from modstate._core.trees.flat import Layout

from ._stacked_state import sharing_copy
from ._vmap import argument_dims


def member_trees(layout: Layout, flat: list[Tensor], count: int) -> list[dict[str, Any]]:
    """Each member's tree of views into the stacked tensors ``flat`` (in ``layout``'s key
    order); a stacked tensor at several paths (a tie) gives each member one view for all."""
    views = _views(flat)
    return [layout.nest([views[id(tensor)][i] for tensor in flat]) for i in range(count)]


def loop_forward(
    template: nn.Module,
    trees: list[dict[str, Any]],
    in_dims: Any,
    args: tuple,
    kwargs: dict[str, Any],
) -> Any:
    """``template`` called on each member's tree (its slice of each mapped input), the outputs
    stacked along a new leading dim, as the batched forward returns them."""
    return _stacked_outputs(
        [call(template, tree, *own, **kwargs) for tree, own in _member_inputs(trees, in_dims, args)]
    )


class MemberCopies:
    """One thread's copies of the template, one per member, for the loop route in eager mode
    (see the module docstring)."""

    def __init__(self, template: nn.Module, layout: Layout, count: int) -> None:
        self.copies = [sharing_copy(template) for _ in range(count)]
        # (table, name) of every path's slot in each copy, in layout order
        self._slots = [
            [(slot.table, slot.name) for slot in (slot_at(copy, path) for path in layout.keys)]
            for copy in self.copies
        ]
        self._made_for: tuple[Any, ...] | None = None
        self._views: list[list[Tensor]] = []

    def __call__(self, flat: list[Tensor], in_dims: Any, args: tuple, kwargs: dict) -> Any:
        """The members' outputs stacked, each member's copy run on its views of ``flat``."""
        # with autograd recording, views made afresh: autograd refuses an unbind view once its
        # base was written in place (an optimizer's step), and a fresh one carries the gradient
        recording = torch.is_grad_enabled() and any(t.requires_grad for t in flat)
        # else what the views depend on: the stacked tensors' storage and shape (a held view
        # keeps the old storage alive, so a new tensor cannot reuse its address), and inference
        # mode, whose views may not be written outside it
        made_for = (
            None
            if recording
            else (torch.is_inference_mode_enabled(), *((t.data_ptr(), t.shape) for t in flat))
        )
        if made_for is None or made_for != self._made_for:
            made = _views(flat)
            self._views = [[made[id(t)][i] for t in flat] for i in range(len(self.copies))]
            self._made_for = made_for
        for slots, views in zip(self._slots, self._views, strict=True):
            for (table, name), view in zip(slots, views, strict=True):
                if table[name] is not view:  # a read is cheap, a slot table's write is not
                    table[name] = view
        members = _member_inputs(self.copies, in_dims, args)
        return _stacked_outputs([copy(*own, **kwargs) for copy, own in members])

    def train(self, mode: bool) -> None:
        for copy in self.copies:
            copy.train(mode)


def _views(flat: list[Tensor]) -> dict[int, tuple[Tensor, ...]]:
    views: dict[int, tuple[Tensor, ...]] = {}
    for tensor in flat:
        if id(tensor) not in views:
            views[id(tensor)] = tensor.unbind(0)
    return views


def _member_inputs(members: list[Any], in_dims: Any, args: tuple) -> list[tuple[Any, tuple]]:
    """Each member with its positional inputs (its slice of each mapped one)."""
    dims = argument_dims(in_dims, len(args), "Ensemble")
    return [
        (member, tuple(a if d is None else a.select(d, i) for a, d in zip(args, dims, strict=True)))
        for i, member in enumerate(members)
    ]


def _stacked_outputs(outputs: list[Any]) -> Any:
    leaves, spec = pytree.tree_flatten(outputs[0])
    rest = [pytree.tree_flatten(out)[0] for out in outputs[1:]]
    stacked = [
        torch.stack([leaf, *(r[k] for r in rest)]) if isinstance(leaf, Tensor) else leaf
        for k, leaf in enumerate(leaves)
    ]
    return pytree.tree_unflatten(stacked, spec)
