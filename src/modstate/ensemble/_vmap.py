"""Run one module with every member of a stacked tree, under ``torch.vmap``: `StackedCall`, and
the checks of a stacked tree."""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Callable
from contextlib import AbstractContextManager
from typing import Any, TypeAlias, TypeVar

import optree
import torch
from torch import Tensor, nn
from torch.nn.parameter import is_lazy

from modstate._core.call import call
from modstate._core.module.anatomy import anatomy_of
from modstate._core.trees.flat import Layout
from modstate._core.types import Tree

from ._functorch import as_member_view, maybe_current_level

InDims: TypeAlias = int | tuple[Any, ...] | list[Any] | None
"""How inputs map to members, as ``torch.vmap``'s ``in_dims`` for the positional inputs: None
shares an input, an int names its member dim, a tuple gives one entry per input."""

RANDOMNESS = ("error", "different", "same")

T = TypeVar("T")


_RANDOMNESS_FIX = (
    "modstate: a member drew random numbers (dropout in training mode, say) and randomness is "
    "'error': pass randomness='different' (an independent draw per member, like a loop over the "
    "models) or 'same' (one draw shared by all), as in ms.Ensemble(models, "
    "randomness='different') or ms.vmap_call(module, stacked, x, randomness='different'); or "
    "call .eval() to turn dropout off"
)


class StackedCall:
    """A module called for every member of a stacked tree under ``torch.vmap``, prepared once
    for the tree's paths: its distinct tensors (a tensor held at several paths, a tie, counts
    once) and how to nest them into a tree again inside the vmapped function.

    ``torch.vmap`` wraps every leaf it is given separately, so one tensor at two paths would come
    out as two tensors and the tie would be lost; passing each tensor once and nesting inside the
    vmapped function keeps it. Lists are in optree's leaf order of the tree (sorted keys).
    ``caller`` names the public function in error messages."""

    __slots__ = ("buffers", "caller", "constants", "paths", "sources", "treespec", "where")

    def __init__(self, paths: list[str], values: list[Any], buffers: set[str], caller: str) -> None:
        layout = _layout(tuple(paths))
        self.caller = caller
        self.treespec = layout.treespec
        self.paths = [paths[j] for j in layout.order]
        self.constants = [values[j] for j in layout.order]
        position: dict[int, int] = {}
        self.where: list[int | None] = []
        self.sources: list[int] = []  # flat index of each distinct tensor's first path
        for j, value in zip(layout.order, self.constants, strict=True):
            if isinstance(value, Tensor):
                index = position.setdefault(id(value), len(position))
                if index == len(self.sources):
                    self.sources.append(j)
                self.where.append(index)
            else:
                self.where.append(None)
        # Only a buffer can be reassigned by forward: where each is, to look after the call.
        self.buffers = [
            (k, path.split(".")) for k, path in enumerate(self.paths) if path in buffers
        ]

    def distinct(self, values: list[T]) -> list[T]:
        """The distinct tensors, from leaf values listed in the original path order."""
        return [values[j] for j in self.sources]

    def run(
        self,
        module: nn.Module,
        distinct: list[Tensor],
        args: tuple[Any, ...],
        kwargs: dict[str, Any],
        in_dims: InDims,
        randomness: str,
        *,
        chunk_size: int | None = None,
        count: int | None = None,
        inside: Callable[[], AbstractContextManager[Any]] | None = None,
        views_inside: bool = False,
    ) -> tuple[Any, dict[int, Tensor]]:
        """Run every member; return the stacked outputs and the buffers ``forward`` reassigned,
        stacked, keyed by their index in ``paths``. ``count``, the number of members, is needed
        only when neither the tree nor the inputs are batched (a module without state).
        ``inside()`` is entered inside the vmapped function, around the call. ``views_inside``
        makes the members' views of the stacked tensors inside the vmapped function, as vmap
        would, instead of handing vmap every tensor (whose input handling costs per tensor)."""
        where, constants, treespec, buffers = (
            self.where,
            self.constants,
            self.treespec,
            self.buffers,
        )
        arg_dims = argument_dims(in_dims, len(args), self.caller)
        self.check_counts(distinct, args, arg_dims, count)
        if not distinct and all(d is None for d in arg_dims):
            if count is None:
                raise ValueError(
                    f"{self.caller}: the stacked tree holds no tensors and every input is shared, "
                    "so nothing says how many members there are; give per-member inputs "
                    "(in_dims=0) or a stacked tree with tensors"
                )
            distinct = [torch.empty(count, 0)]  # only carries the member count into vmap
        enter = inside or contextlib.nullcontext
        carried = distinct
        if views_inside:
            # One member count carrier through vmap's input handling (which costs per tensor);
            # the member views of the stacked tensors are made inside, as vmap would make them.
            carried = [torch.empty(len(distinct[0]) if distinct else count or 0, 0)]

        def member(leaves: list[Tensor], *member_args: Any) -> tuple[Any, dict[int, Tensor]]:
            if views_inside:
                level = maybe_current_level()
                assert level is not None  # inside torch.vmap
                leaves = [as_member_view(t, 0, level) for t in distinct]
            values = [c if i is None else leaves[i] for i, c in zip(where, constants, strict=True)]
            tree: Tree = optree.tree_unflatten(treespec, values)  # type: ignore[assignment]
            with enter():
                out = call(module, tree, *member_args, **kwargs)
            reassigned = {}
            for k, keys in buffers:
                now = _leaf_at(tree, keys)
                if now is not values[k]:
                    reassigned[k] = now
            return out, reassigned

        try:
            return torch.vmap(  # type: ignore[no-any-return]
                member, in_dims=(0, *arg_dims), randomness=randomness, chunk_size=chunk_size
            )(carried, *args)
        except RuntimeError as error:
            if "randomness error mode" in str(error):
                error.add_note(_RANDOMNESS_FIX)
            raise

    def check_counts(
        self,
        distinct: list[Tensor],
        args: tuple[Any, ...],
        arg_dims: tuple[Any, ...],
        count: int | None,
    ) -> None:
        """Refuse, before vmap runs, a leaf or an input whose member count differs from the
        others', naming both and their counts."""
        first_path = None
        if count is None and distinct:
            first_path = self.paths[self.where.index(0)]
            count = distinct[0].shape[0] if distinct[0].dim() else 0
        for index, tensor in enumerate(distinct):
            members = tensor.shape[0] if tensor.dim() else 0
            if members != count:
                path = self.paths[self.where.index(index)]
                against = (
                    f"{first_path!r} has {count}" if first_path else f"the ensemble has {count}"
                )
                raise ValueError(
                    f"{self.caller}: {path!r}: {members} members along dim 0, {against}; every "
                    "leaf of a stacked tree needs the same leading member dim"
                )
        if count is None:
            return
        for position, (arg, dim) in enumerate(zip(args, arg_dims, strict=True)):
            if not isinstance(dim, int):
                continue
            for leaf in optree.tree_leaves(arg):
                if not isinstance(leaf, Tensor) or not -leaf.dim() <= dim < leaf.dim():
                    continue  # torch.vmap names inputs without that dim itself
                if leaf.shape[dim] != count:
                    source = f"(as {first_path!r} has)" if first_path else "(the ensemble's)"
                    raise ValueError(
                        f"{self.caller}: input {position} has {leaf.shape[dim]} members along dim "
                        f"{dim} (in_dims), but there are {count} members {source}; give one "
                        "slice per member, or in_dims=None to share the input"
                    )


def check_stacked(module: nn.Module, flat: dict[str, Any]) -> None:
    """Refuse a tree whose leaves are not the module's tensors with a leading member dim; say so
    when it is an unstacked tree (leaves of the module's own shapes)."""
    slots = anatomy_of(module).by_path
    wrong = []
    for path, leaf in flat.items():
        slot = slots.get(path)
        if slot is None or not isinstance(leaf, Tensor):
            continue  # call names unknown paths and non-tensors
        mine = slot.get()
        if not is_lazy(mine) and (leaf.dim() == 0 or leaf.shape[1:] != mine.shape):
            wrong.append((path, leaf, mine))
    if not wrong:
        return
    if all(leaf.shape == mine.shape for _, leaf, mine in wrong):
        path, leaf, _ = wrong[0]
        raise ValueError(
            f"vmap_call: {path!r}: shape {tuple(leaf.shape)} is the module's own shape, so the "
            "tree is not stacked (vmap_call needs a leading member dim); stack trees with "
            "ms.stack([tree, ...]) or models with ms.stack_modules(models)"
        )
    path, leaf, mine = wrong[0]
    raise ValueError(
        f"vmap_call: {path!r}: shape {tuple(leaf.shape)} in the stacked tree, so each member "
        f"holds {tuple(leaf.shape[1:])}, but the module holds {tuple(mine.shape)} there; stack "
        "trees extracted from this module"
    )


def _leaf_at(tree: Tree, keys: list[str]) -> Any:
    node: Any = tree
    for key in keys:
        node = node[key]
    return node


@functools.lru_cache(maxsize=64)
def _layout(paths: tuple[str, ...]) -> Layout:
    return Layout(list(paths))


def argument_dims(in_dims: InDims, count: int, caller: str) -> tuple[Any, ...]:
    if in_dims is None or isinstance(in_dims, int):
        return (in_dims,) * count
    if isinstance(in_dims, (tuple, list)):
        if len(in_dims) != count:
            raise ValueError(
                f"{caller}: in_dims has {len(in_dims)} entries for {count} positional inputs; "
                "give one per input (None shares it across members)"
            )
        return tuple(in_dims)
    raise TypeError(
        f"{caller}: in_dims is a {type(in_dims).__name__}; give None, an int or a tuple"
    )
