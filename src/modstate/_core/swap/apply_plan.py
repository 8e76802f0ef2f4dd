"""apply's fast route: ``(params, state)`` read by a plan made once per pair of structures.

A training loop hands ``apply`` trees of the same structures at every step. Walking them path by
path, and rebuilding ``new_state`` by another walk, cost more than the swap itself on small
models. An `ApplyPlan` reads both trees with `TreeReader`s (a few C-level passes), knows which
leaf fills which slot of the module's plan and which leaves are buffers (copied before the call),
and builds ``new_state`` in ``state``'s structure from a flat list.

The plan keeps no module: the modules that own the buffers are held by weak references, since
the plans live as long as the module's anatomy, which lives as long as the module.
"""

from __future__ import annotations

import operator
import weakref
from collections.abc import Mapping
from itertools import repeat
from typing import Any

from torch import Tensor, nn

from modstate._core.module.anatomy import Anatomy
from modstate._core.torch_facts import version
from modstate._core.trees.readers import TreeReader

_MOST_PLANS = 8  # pairs of structures remembered per module; a loop uses one
_is = operator.is_


class ApplyPlan:
    """How to read ``(params, state)`` of one pair of structures (see the module docstring).

    ``order[position]`` is the index, in ``params``' leaves followed by ``state``'s, of the leaf
    that fills that plan position; ``buffers`` lists each buffer leaf of ``state`` as ``(index,
    position, owner)``, ``owner`` a weak reference to the module holding it (None: the root).
    ``fits`` is False when the trees are not two disjoint halves of the module's paths with every
    buffer in ``state``: the general route then runs, or names the error."""

    __slots__ = ("buffers", "fits", "nones", "order", "params_reader", "state_reader")

    def __init__(self, anatomy: Anatomy, module: nn.Module, params: dict, state: dict) -> None:
        self.params_reader = TreeReader(params)
        self.state_reader = TreeReader(state)
        position_of = {slot.path: i for i, slot in enumerate(anatomy.ordered)}
        buffer_paths = {slot.path for slot in anatomy.slots if slot.is_buffer}
        owners = buffer_owners(module)
        order: list[int | None] = [None] * len(position_of)
        self.buffers: list[tuple[int, int, weakref.ref[nn.Module] | None]] = []
        nones: list[tuple[bool, ...]] = []
        fits = True
        offset = 0
        for reader, tree, is_state in (
            (self.params_reader, params, False),
            (self.state_reader, state, True),
        ):
            leaves = reader.read(tree)[0]  # type: ignore[index]
            nones.append(tuple(map(_is, leaves, repeat(None))))
            for i, (path, leaf) in enumerate(zip(reader.paths, leaves, strict=True)):
                if leaf is None:
                    continue
                position = position_of.get(path)
                if position is None or order[position] is not None:
                    fits = False
                    continue
                if path in buffer_paths:
                    if not is_state:
                        fits = False  # a buffer in params: the general route refuses it
                        continue
                    owner = owners[path]
                    self.buffers.append(
                        (offset + i, position, None if owner is module else weakref.ref(owner))
                    )
                order[position] = offset + i
            offset += len(leaves)
        self.fits = (
            fits
            and all(index is not None for index in order)
            and self.params_reader.paths_are_distinct()
            and self.state_reader.paths_are_distinct()
        )
        self.order: list[int] = order  # type: ignore[assignment]
        self.nones = tuple(nones)  # per tree, which of its leaves are None holes

    def read(self, params: Mapping[str, Any], state: Mapping[str, Any]) -> list[Any] | None:
        """``params``' leaves followed by ``state``'s, or None if either is shaped otherwise
        than this plan's (a hole filled, or a leaf left out, included)."""
        read_params = self.params_reader.read(params)
        read_state = self.state_reader.read(state)
        if read_params is None or read_state is None:
            return None
        leaves = read_params[0] + read_state[0]
        if (
            tuple(map(_is, read_params[0], repeat(None))) != self.nones[0]
            or tuple(map(_is, read_state[0], repeat(None))) != self.nones[1]
        ):
            return None
        return leaves


_plans: weakref.WeakKeyDictionary[Anatomy, list[ApplyPlan]] = weakref.WeakKeyDictionary()


def plan_for(
    anatomy: Anatomy, module: nn.Module, params: dict, state: Mapping[str, Any]
) -> tuple[ApplyPlan, list[Any]] | None:
    """The plan for these structures with the trees' leaves (see `ApplyPlan.read`), or None
    when they do not take the fast route."""
    if type(state) is not dict:
        return None
    known = _plans.get(anatomy)
    if known is None:
        known = _plans.setdefault(anatomy, [])
    for plan in known:
        leaves = plan.read(params, state)
        if leaves is not None:
            break
    else:
        try:
            plan = ApplyPlan(anatomy, module, params, state)
        except TypeError:  # a key that is not a string: the general route says what is wrong
            return None
        leaves = plan.read(params, state)
        if len(known) >= _MOST_PLANS:
            del known[0]
        known.append(plan)
    if not plan.fits or leaves is None:
        return None
    return plan, leaves


def copy_buffers(
    plan: ApplyPlan, leaves: list[Any], module: nn.Module
) -> list[tuple[int, int, Tensor, int, bool]]:
    """Replace each buffer leaf by a clone, in place; per clone ``(index, position, clone, its
    version, whether its owner is in training mode)``. The version is read only in eval mode
    (0 in training mode): a training owner's copies come back whatever it did to them."""
    copies = []
    for index, position, owner in plan.buffers:
        leaf = leaves[index]
        if isinstance(leaf, Tensor):
            copy = leaf.clone()
            leaves[index] = copy
            holder = module if owner is None else owner()
            training = holder is None or holder.training  # a holder gone: assume it wrote
            copies.append((index, position, copy, 0 if training else version(copy), training))
    return copies


def buffer_owners(module: nn.Module) -> dict[str, nn.Module]:
    """The module that holds each buffer, by path (a shared module, or buffer, at each path)."""
    return {
        f"{prefix}.{name}" if prefix else name: owner
        for prefix, owner in module.named_modules(remove_duplicate=False)
        for name, _ in owner.named_buffers(recurse=False, remove_duplicate=False)
    }
