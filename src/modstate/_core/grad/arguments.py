"""The arguments that `ms.grad` differentiates, read as modstate reads trees, and the checks on
what the differentiated function returns.

Nested dicts of tensors of a structure met before (a training loop's every step) are read by that
structure's `TreeReader`; other nested dicts, lists and tuples are walked here, and any other tree
by optree. None is an empty subtree. Errors name the path of the leaf at fault.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Sequence
from typing import Any, NamedTuple

import optree
import torch
from torch import Tensor

from modstate._core.trees.leaves import refuse_undifferentiable
from modstate._core.trees.paths import dotted
from modstate._core.trees.readers import TreeReader

_NOT_TENSOR_FIX = (
    " (torch.func differentiates tensors); pass it as another argument, or set it to None "
    "(an empty subtree)"
)
_NOT_FLOAT_FIX = (
    "only floating-point and complex tensors can be differentiated (as with torch.func.grad); "
    "differentiate the trainable part only: params, state = ms.split(model, detach=True), with "
    "state as another argument (out, state = ms.apply(model, params, state, x))"
)


class Differentiated:
    """One differentiated argument: its tensor leaves (None is an empty subtree), checked.

    Nested dicts of tensors of a structure met before (``known``, a loop's every step) are read
    by that structure's `TreeReader`; other nested dicts, lists and tuples are walked here, and
    any other tree by optree."""

    __slots__ = ("leaves", "reader", "requires_grad", "tree", "treedef")

    def __init__(self, name: str, position: int, tree: Any, known: list[TreeReader]) -> None:
        self.tree = tree
        self.treedef: Any = None
        self.reader: TreeReader | None = None
        if (known_read := _read_by_known_reader(tree, known)) is not None:
            self.reader, self.leaves = known_read
        elif (leaves := _plain_leaves(tree)) is not None:
            self.leaves = leaves
        else:
            self.leaves, self.treedef = optree.tree_flatten(tree, none_is_leaf=False)
        refuse_undifferentiable(
            self.leaves,
            self.path,
            name,
            f"leaf of argument {position}",
            (ValueError, _NOT_TENSOR_FIX),
            (RuntimeError, _NOT_FLOAT_FIX),
        )
        self.requires_grad = any(leaf.requires_grad for leaf in self.leaves)

    def path(self, index: int) -> str:
        """The dotted path of leaf `index` (for errors)."""
        if self.reader is not None:
            return self.reader.paths[index]
        if self.treedef is None:
            paths: list[str] = []
            _plain_paths(self.tree, "", paths)
            return paths[index]
        return dotted(optree.tree_paths(self.tree, none_is_leaf=False)[index])

    def rebuild(self, leaves: Sequence[Any]) -> Any:
        if self.reader is not None:
            return self.reader.build(list(leaves))
        if self.treedef is None:
            return _plain_rebuild(self.tree, iter(leaves))
        return self.treedef.unflatten(leaves)


_MOST_STRUCTURES = 4  # per argument; a training loop meets one


def _read_by_known_reader(
    tree: Any, known: list[TreeReader]
) -> tuple[TreeReader, list[Any]] | None:
    """The reader of ``tree``'s structure and the leaves it read, when ``tree`` is nested plain
    dicts of plain tensors (no hole, no other node); a new reader is remembered in ``known``.
    None for any other tree."""
    if type(tree) is not dict:
        return None
    for reader in known:
        read = reader.read(tree)
        if read is not None and _only_tensors(read):
            return reader, read[0]
    try:
        reader = TreeReader(tree)
    except TypeError:  # a key that is not a string
        return None
    read = reader.read(tree)
    if read is None or not _only_tensors(read) or not reader.paths_are_distinct():
        return None
    if len(known) >= _MOST_STRUCTURES:
        del known[0]
    known.append(reader)
    return reader, read[0]


def _only_tensors(read: tuple[list[Any], list[Any]]) -> bool:
    leaves, nodes = read
    return set(map(type, leaves)) <= _TENSOR and set(map(type, nodes)) == _DICT


_TENSOR, _DICT = frozenset({Tensor}), frozenset({dict})


def _plain_leaves(tree: Any) -> list[Any] | None:
    """The tensors of a tree made of plain dicts, lists and tuples (None is an empty subtree),
    in the order `_plain_rebuild` takes them back; None for any other tree (namedtuples,
    OrderedDicts, registered nodes, non-tensor leaves), which optree walks instead."""
    found: list[Any] = []

    def walk(node: Any) -> bool:
        kind = type(node)
        if kind is dict:
            return all(walk(item) for item in node.values())
        if kind is list or kind is tuple:
            return all(walk(item) for item in node)
        if node is None:
            return True
        if type(node) is not Tensor:
            return False  # anything else: optree's walk (and its errors) decide
        found.append(node)
        return True

    return found if walk(tree) else None


def _plain_rebuild(node: Any, leaves: Any) -> Any:
    kind = type(node)
    if kind is dict:
        return {key: _plain_rebuild(item, leaves) for key, item in node.items()}
    if kind is list or kind is tuple:
        return kind(_plain_rebuild(item, leaves) for item in node)
    if node is None:
        return None
    return next(leaves)


def _plain_paths(node: Any, prefix: str, paths: list[str]) -> None:
    """The dotted paths of `_plain_leaves`'s leaves, in its order."""
    items = (
        node.items()
        if type(node) is dict
        else enumerate(node)
        if type(node) in (list, tuple)
        else None
    )
    if items is None:
        if node is not None:
            paths.append(prefix[:-1] or "<root>")
        return
    for key, item in items:
        _plain_paths(item, f"{prefix}{key}.", paths)


def split_output(name: str, output: Any, has_aux: bool) -> tuple[Any, Any]:
    if has_aux:
        if not (isinstance(output, tuple) and len(output) == 2):
            raise RuntimeError(
                f"{name}: '<output>': with has_aux=True, fn must return a tuple "
                f"(output, aux); return one, or pass has_aux=False"
            )
        output, aux = output
    else:
        aux = None
    if not isinstance(output, Tensor):
        raise RuntimeError(
            f"{name}: '<output>': fn returned {type(output).__name__}, not a Tensor; return a "
            f"0-dim tensor (the loss)"
        )
    if output.dim() != 0:
        raise RuntimeError(
            f"{name}: '<output>': fn returned a tensor with {output.dim()} dims, not a scalar; "
            f"reduce it (.sum(), .mean()), or use torch.func.vjp / jacrev for non-scalar outputs"
        )
    return output, aux


def grad_enabled() -> Any:
    """Grad mode on for the call (``grad`` ignores an outer ``torch.no_grad()``, as
    ``torch.func.grad`` does); no context switch when it is on already."""
    return contextlib.nullcontext() if torch.is_grad_enabled() else torch.enable_grad()


def detached(value: Any) -> Any:
    """`value` with every tensor that requires grad detached; the very same object when none
    does (the common case: new statistics, metrics), containers copied only where needed."""
    if isinstance(value, Tensor):
        return value.detach() if value.requires_grad else value
    if type(value) is dict:
        copied: dict[Any, Any] | None = None
        for key, item in value.items():
            new = detached(item)
            if new is not item:
                if copied is None:
                    copied = dict(value)
                copied[key] = new
        return value if copied is None else copied
    if type(value) in (list, tuple):
        items = [detached(item) for item in value]
        unchanged = all(new is old for new, old in zip(items, value, strict=True))
        return value if unchanged else type(value)(items)
    if value is None or isinstance(value, (int, float, str, bool)):
        return value
    return optree.tree_map(detached, value, none_is_leaf=True)  # other pytree nodes


class Ties:
    """The distinct tensors among the differentiated leaves (a tensor at several paths, a tie, is
    one input, whose whole gradient stands at each of its paths) and which one each leaf is.

    ``Ties(per_tree)`` takes, for each differentiated tree, the tensors standing for its leaves
    (the leaves themselves, or what a route unwrapped from them); `distinct` lists each once."""

    __slots__ = ("distinct", "slots")

    def __init__(self, per_tree: Sequence[Sequence[Tensor]]) -> None:
        self.distinct: list[Tensor] = []
        self.slots: list[list[int]] = []
        slot_of: dict[int, int] = {}
        for tensors in per_tree:
            tree_slots = []
            for tensor in tensors:
                slot = slot_of.get(id(tensor))
                if slot is None:
                    slot = slot_of[id(tensor)] = len(self.distinct)
                    self.distinct.append(tensor)
                tree_slots.append(slot)
            self.slots.append(tree_slots)

    def per_tree(self, values: Sequence[Any]) -> list[list[Any]]:
        """For each tree, its leaves' entries of `values` (one per distinct tensor)."""
        return [[values[slot] for slot in tree_slots] for tree_slots in self.slots]


class GradCall(NamedTuple):
    """One call of ``ms.grad(fn)``'s wrapper: what each route (plain autograd, torch.func, every
    member at once) computes the gradients of, and the steps they share."""

    name: str  # the public function, for errors: "grad" or "grad_and_value"
    fn: Callable[..., Any]
    positions: tuple[int, ...]  # of the differentiated arguments
    has_aux: bool
    trees: list[Differentiated]  # one per position
    args: tuple[Any, ...]
    kwargs: dict[str, Any]

    def call(self, leaf_lists: Sequence[list[Any]]) -> Any:
        """``fn(*args, **kwargs)`` with the differentiated arguments rebuilt from `leaf_lists`."""
        call_args = list(self.args)
        for position, tree, leaves in zip(self.positions, self.trees, leaf_lists, strict=True):
            call_args[position] = tree.rebuild(leaves)
        return self.fn(*call_args, **self.kwargs)

    def output(self, result: Any) -> tuple[Any, Any]:
        """``(output, aux)`` of what fn returned, checked (see `split_output`)."""
        return split_output(self.name, result, self.has_aux)

    def rebuild(self, leaf_lists: Sequence[list[Any]]) -> list[Any]:
        """Per differentiated argument, a tree of its structure holding its entry of
        `leaf_lists` (its gradients)."""
        return [tree.rebuild(leaves) for tree, leaves in zip(self.trees, leaf_lists, strict=True)]
