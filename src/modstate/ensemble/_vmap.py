"""Run one module with every member of a stacked tree, under ``torch.vmap``."""

from __future__ import annotations

import functools
from typing import Any

import optree
import torch
from torch import Tensor, nn
from torch.nn.parameter import is_lazy

from modstate._core.anatomy import anatomy_of, buffer_paths
from modstate._core.call import call
from modstate._core.flat import Layout, flatten, unflatten
from modstate._core.torch_facts import write_back
from modstate._core.types import Tree

InDims = int | None | tuple[Any, ...] | list[Any]


def vmap_call(
    module: nn.Module,
    stacked: Tree,
    /,
    *args: Any,
    in_dims: InDims = None,
    randomness: str = "error",
    chunk_size: int | None = None,
    **kwargs: Any,
) -> Any:
    """Run ``module`` once per member of ``stacked`` and return the stacked outputs (dim 0).

    In essence ``torch.vmap(lambda tree, *a: ms.call(module, tree, *a, **kwargs), in_dims=(0,
    *in_dims))(stacked, *args)``. ``in_dims=None``: every member sees the same inputs;
    ``in_dims=0``: each positional input has one slice per member along dim 0; a tuple gives one
    entry per positional input, as in ``torch.vmap`` (``None`` shares that input). Keyword
    arguments are shared by every member. ``randomness`` (``"error"``, ``"different"``,
    ``"same"``) and ``chunk_size`` are ``torch.vmap``'s. One rule for ``vmap_call`` and
    ``Ensemble``: the default is torch.vmap's ``"error"`` (a random op in a member, such as
    dropout in training mode, is refused); ``"different"`` draws independently for every member,
    as a loop over the models would, ``"same"`` draws once for all.

    The tree is checked before anything runs: every leaf must be the module's tensor with one
    leading member dim, and every input mapped by ``in_dims`` must have as many members; errors
    name the leaf or the input and both counts, and an unstacked tree is recognized as such.

    In-place updates in ``forward`` land in the stacked tensors (BatchNorm's running statistics,
    one per member); a buffer that ``forward`` reassigns is written back into ``stacked``, stacked.
    Tied tensors stay tied (the stacked tree holds one tensor at both paths). The module is left
    exactly as it was: same objects, same ``requires_grad``.

    >>> import torch, modstate as ms
    >>> models = [torch.nn.Linear(3, 2) for _ in range(4)]
    >>> stacked = ms.stack_modules(models)
    >>> ms.vmap_call(models[0], stacked, torch.randn(10, 3)).shape
    torch.Size([4, 10, 2])
    """
    return batched_call(module, stacked, args, kwargs, in_dims, randomness, chunk_size)


def batched_call(
    module: nn.Module,
    stacked: Tree,
    args: tuple[Any, ...],
    kwargs: dict[str, Any],
    in_dims: InDims,
    randomness: str,
    chunk_size: int | None,
) -> Any:
    """[`vmap_call`][modstate.vmap_call] with its arguments gathered."""
    if not isinstance(stacked, dict):
        raise TypeError(
            f"expected a stacked tree (a dict of tensors), got {type(stacked).__name__}"
        )
    flat = flatten(stacked)
    _check_stacked(module, flat)
    structure = Structure(list(flat), list(flat.values()), buffer_paths(module))
    out, reassigned = structure.run(
        module,
        # A stacked tree of DTensors (a sharded module's trees, stacked) goes in as it is: the
        # call gathers each FSDP unit's members when the unit runs.
        structure.distinct(list(flat.values())),
        args,
        kwargs,
        in_dims,
        randomness,
        chunk_size,
    )
    if reassigned:
        write_back(stacked, unflatten({structure.paths[i]: v for i, v in reassigned.items()}))
    return out


_RANDOMNESS_FIX = (
    "modstate: a member drew random numbers (dropout in training mode, say) and randomness is "
    "'error': pass randomness='different' (an independent draw per member, like a loop over the "
    "models) or 'same' (one draw shared by all), as in ms.Ensemble(models, "
    "randomness='different') or ms.vmap_call(module, stacked, x, randomness='different'); or "
    "call .eval() to turn dropout off"
)


class Structure:
    """A stacked tree's structure, compiled once: its distinct tensors (a tensor held at several
    paths, a tie, counts once) and how to nest them into a tree again.

    ``torch.vmap`` wraps every leaf it is given separately, so one tensor at two paths would come
    out as two tensors and the tie would be lost; passing each tensor once and nesting inside the
    vmapped function keeps it. Lists are in optree's leaf order of the tree (sorted keys)."""

    __slots__ = ("buffers", "constants", "paths", "sources", "treespec", "where")

    def __init__(self, paths: list[str], values: list[Any], buffers: set[str]) -> None:
        layout = _layout(tuple(paths))
        self.treespec = layout.treespec
        self.paths = [paths[j] for j in layout.order]
        self.constants = [values[j] for j in layout.order]
        position: dict[int, int] = {}
        self.where: list[int | None] = []
        self.sources: list[int] = []  # flat index of each distinct tensor's first path
        for j, value in zip(layout.order, self.constants):
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

    def distinct(self, values: list[Any]) -> list[Tensor]:
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
        chunk_size: int | None,
        count: int | None = None,
    ) -> tuple[Any, dict[int, Tensor]]:
        """Run every member; return the stacked outputs and the buffers ``forward`` reassigned,
        stacked, keyed by their index in ``paths``. ``count``, the number of members, is needed
        only when neither the tree nor the inputs are batched (a module without state)."""
        where, constants, treespec, buffers = (
            self.where,
            self.constants,
            self.treespec,
            self.buffers,
        )
        arg_dims = _argument_dims(in_dims, len(args))
        self.check_counts(distinct, args, arg_dims, count)
        if not distinct and all(d is None for d in arg_dims):
            if count is None:
                raise ValueError(
                    "the stacked tree holds no tensors and every input is shared: nothing says "
                    "how many members there are"
                )
            distinct = [torch.empty(count, 0)]  # only carries the member count into vmap

        def member(leaves: list[Tensor], *member_args: Any) -> tuple[Any, dict[int, Tensor]]:
            values = [c if i is None else leaves[i] for i, c in zip(where, constants)]
            tree = optree.tree_unflatten(treespec, values)
            out = call(module, tree, *member_args, **kwargs)
            reassigned = {}
            for k, keys in buffers:
                now = _leaf_at(tree, keys)
                if now is not values[k]:
                    reassigned[k] = now
            return out, reassigned

        try:
            return torch.vmap(
                member, in_dims=(0, *arg_dims), randomness=randomness, chunk_size=chunk_size
            )(distinct, *args)
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
                    f"{path!r} has {members} members along dim 0, {against}: every leaf of a "
                    "stacked tree needs the same leading member dim"
                )
        if count is None:
            return
        for position, (arg, dim) in enumerate(zip(args, arg_dims)):
            if not isinstance(dim, int):
                continue
            for leaf in optree.tree_leaves(arg):
                if not isinstance(leaf, Tensor) or not -leaf.dim() <= dim < leaf.dim():
                    continue  # torch.vmap names inputs without that dim itself
                if leaf.shape[dim] != count:
                    source = f"(as {first_path!r} has)" if first_path else "(the ensemble's)"
                    raise ValueError(
                        f"input {position} has {leaf.shape[dim]} members along dim {dim} "
                        f"(in_dims), but there are {count} members {source}: give one slice "
                        "per member, or in_dims=None to share the input"
                    )


def _check_stacked(module: nn.Module, flat: dict[str, Any]) -> None:
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
            f"the tree is not stacked: {path!r} has shape {tuple(leaf.shape)}, the module's own "
            "shape, where vmap_call needs a leading member dim; stack trees with "
            "ms.stack([tree, ...]) or models with ms.stack_modules(models)"
        )
    path, leaf, mine = wrong[0]
    raise ValueError(
        f"{path!r}: shape {tuple(leaf.shape)} in the stacked tree, so each member holds "
        f"{tuple(leaf.shape[1:])}, but the module holds {tuple(mine.shape)} there"
    )


def _leaf_at(tree: Tree, keys: list[str]) -> Any:
    for key in keys:
        tree = tree[key]
    return tree


@functools.lru_cache(maxsize=64)
def _layout(paths: tuple[str, ...]) -> Layout:
    return Layout(list(paths))


def _argument_dims(in_dims: InDims, count: int) -> tuple[Any, ...]:
    if in_dims is None or isinstance(in_dims, int):
        return (in_dims,) * count
    if isinstance(in_dims, (tuple, list)):
        if len(in_dims) != count:
            raise ValueError(
                f"in_dims has {len(in_dims)} entries for {count} positional inputs; give one per "
                "input (None shares it across members)"
            )
        return tuple(in_dims)
    raise TypeError(f"in_dims must be None, an int or a tuple, got {type(in_dims).__name__}")
