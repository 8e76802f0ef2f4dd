"""The one recursion behind `modstate.tree`: rebuild any pytree leaf by leaf, naming paths in errors.

What is a node and what is a leaf is ``_core/trees/nodes.py``'s rule (optree's, with
``none_is_leaf=False``, dicts in insertion order), shared with ``modstate.optim``. ``None`` is a
node with no children: it is kept where it stands and never given to a leaf function.

The three dict flavours are one kind of node: where two trees must have the same structure, a
``dict`` matches an ``OrderedDict`` (``model.state_dict()``) or a ``defaultdict`` with the same
keys, in any order; the result follows the first tree's flavour and order.

A tie (one tensor at several places) is computed once, at its first place, and the result stands
at all of them (``_ties``), so every op built on this walk keeps a model's tied weights tied.

Paths cost nothing on the way down: an error raised at a leaf is wrapped once in `AtPath`, and each
container it passes through on the way up adds its key (``_errors``).
"""

from __future__ import annotations

import enum
from collections.abc import Callable, Sequence
from typing import Any

from torch import Tensor

from modstate._core.trees.nodes import DICT_KINDS, children, is_leaf
from modstate._core.trees.ties import keeping_ties
from modstate.tree._errors import AtPath, StructureMismatch, at_key, refuse_non_tensor


class NonTensor(enum.Enum):
    """What a leaf function does with a leaf that is not a tensor."""

    APPLY = enum.auto()  # call it anyway (`map`)
    KEEP = enum.auto()  # leave it as it is (`clone`, `detach`, `to`)
    REFUSE = enum.auto()  # TypeError naming the path (shape and arithmetic ops)


APPLY, KEEP, REFUSE = NonTensor.APPLY, NonTensor.KEEP, NonTensor.REFUSE


def map_leaves(
    fn: Callable[[Any], Any], node: Any, non_tensor: NonTensor = APPLY, *, ties: bool = True
) -> Any:
    """A copy of the tree ``node`` with ``fn(leaf)`` in place of every leaf.

    ``non_tensor`` says what happens to a leaf that is not a tensor: `APPLY`, `KEEP` or `REFUSE`.
    A tensor at several places (a tie) goes to ``fn`` once, at its first place, and the result
    stands at all of them (``ties=False``: at every place, for a caller that keys its own).
    Errors come out wrapped in `AtPath` (except one raised by ``fn`` on a root leaf).
    """
    return _map_leaves(keeping_ties(fn) if ties else fn, node, non_tensor)


def _map_leaves(fn: Callable[[Any], Any], node: Any, non_tensor: NonTensor) -> Any:
    kind = type(node)
    if kind is dict:
        out = {}
        try:
            for key, value in node.items():
                if isinstance(value, Tensor):
                    out[key] = fn(value)
                else:
                    out[key] = _map_leaves(fn, value, non_tensor)
        except Exception as error:
            raise at_key(error, key) from None
        return out
    if isinstance(node, Tensor):
        return fn(node)
    if node is None:
        return None
    if kind is not list and kind is not tuple and is_leaf(node):
        if non_tensor is APPLY:
            return fn(node)
        if non_tensor is KEEP:
            return node
        refuse_non_tensor(node)
    keys, kids, rebuild = children(node)
    new = []
    try:
        for child in kids:
            new.append(_map_leaves(fn, child, non_tensor))
    except Exception as error:
        raise at_key(error, keys[len(new)]) from None
    return rebuild(new)


def describe(node: Any) -> str:
    """``"a tensor of shape (2, 3)"``, ``"a dict node"``: what stands at a place, for errors.
    All dict flavours read as ``dict``: they are one kind of node."""
    if isinstance(node, Tensor):
        return f"a tensor of shape {tuple(node.shape)}"
    if node is None:
        return "None"
    if type(node) in DICT_KINDS:
        return "a dict node"
    if is_leaf(node):
        return f"a leaf of type {type(node).__name__}"
    return f"a {type(node).__name__} node"


def same_kind(node: Any, other: Any) -> bool:
    """Whether two nodes are of one type (all dict flavours counting as one)."""
    kind, other_kind = type(node), type(other)
    return kind is other_kind or (kind in DICT_KINDS and other_kind in DICT_KINDS)


def _check_same_node(node: Any, other: Any, name: str) -> None:
    """Raise `StructureMismatch` unless ``other`` is a node of the same kind and arity as ``node``."""
    if not same_kind(node, other):
        raise StructureMismatch(f"tree has {describe(node)}, {name} has {describe(other)}")
    if isinstance(node, dict):
        if node.keys() != other.keys():
            missing = [key for key in node if key not in other]
            extra = [key for key in other if key not in node]
            # Name the first differing child so that the path points at it.
            key = missing[0] if missing else extra[0]
            what = f"{name} has no key {key!r}" if missing else f"{name} has an extra key {key!r}"
            raise AtPath(StructureMismatch(what + _flat_hint(node, other, name)), key)
    elif node is not None:
        if type(node) in (list, tuple):
            count, other_count = len(node), len(other)
        else:
            count, other_count = len(children(node)[1]), len(children(other)[1])
        if count != other_count:
            raise StructureMismatch(f"tree has {count} children here, {name} has {other_count}")


def _flat_hint(node: dict, other: dict, name: str) -> str:
    """The fix when one side is a flat ``state_dict`` (dotted keys) and the other is nested."""
    for flat, nested, which in ((other, node, name), (node, other, "tree")):
        dotted = [key for key in flat if isinstance(key, str) and "." in key]
        if dotted and not any(isinstance(key, str) and "." in key for key in nested):
            return (
                f"; {which} has flat state_dict keys ({dotted[0]!r}): "
                f"nest it first with ms.unflatten({which})"
            )
    return ""


def map_leaves_n(
    fn: Callable[..., Any],
    node: Any,
    others: Sequence[Any],
    non_tensor: NonTensor = APPLY,
    names: Sequence[str] = (),
    *,
    ties: bool = True,
) -> Any:
    """Like `map_leaves` with ``fn(leaf, *matching_leaves_of_others)``; a tie is computed at its
    first place in ``node``, with the others' leaves there.

    Every tree in ``others`` must have exactly the structure of ``node`` (dicts of any flavour:
    the same keys, in any order; the result follows ``node``'s order); the first difference
    raises a `StructureMismatch` naming its path. ``names`` name the others in that message.
    """
    return _map_leaves_n(keeping_ties(fn) if ties else fn, node, others, non_tensor, names)


def _map_leaves_n(
    fn: Callable[..., Any],
    node: Any,
    others: Sequence[Any],
    non_tensor: NonTensor,
    names: Sequence[str],
) -> Any:
    if not others:
        return _map_leaves(fn, node, non_tensor)
    if is_leaf(node):
        for index, other in enumerate(others):
            if not is_leaf(other):
                name = names[index] if index < len(names) else f"tree {index + 1}"
                raise StructureMismatch(f"tree has {describe(node)}, {name} has {describe(other)}")
        if non_tensor is APPLY or isinstance(node, Tensor):
            return fn(node, *others)
        if non_tensor is KEEP:
            return node
        refuse_non_tensor(node)
    for index, other in enumerate(others):
        name = names[index] if index < len(names) else f"tree {index + 1}"
        _check_same_node(node, other, name)
    if node is None:
        return None
    keys, kids, rebuild = children(node)
    if isinstance(node, dict):
        other_kids = [[other[key] for key in keys] for other in others]
    else:
        other_kids = [children(other)[1] for other in others]
    new = []
    try:
        for index, child in enumerate(kids):
            matching = [kids_of_other[index] for kids_of_other in other_kids]
            new.append(_map_leaves_n(fn, child, matching, non_tensor, names))
    except Exception as error:
        raise at_key(error, keys[len(new)]) from None
    return rebuild(new)


def split_leaves(fn: Callable[[Tensor], Sequence[Any]], node: Any, count: int) -> list[Any]:
    """``count`` trees shaped like ``node``: tree ``i`` holds ``fn(leaf)[i]`` at each leaf.

    ``fn`` must give exactly ``count`` pieces at every leaf; leaves must be tensors. A tie gives
    the same pieces at all its places.
    """
    return _split_leaves(keeping_ties(fn), node, count)


def _pieces(fn: Callable[[Tensor], Sequence[Any]], leaf: Tensor, count: int) -> Sequence[Any]:
    pieces = fn(leaf)
    if len(pieces) != count:
        raise ValueError(
            f"this leaf gives {len(pieces)} pieces but the first leaf gave {count}; "
            "every leaf must give the same number"
        )
    return pieces


def _split_leaves(fn: Callable[[Tensor], Sequence[Any]], node: Any, count: int) -> list[Any]:
    if type(node) is dict:
        columns: list[Sequence[Any]] = []
        try:
            for value in node.values():
                if isinstance(value, Tensor):
                    columns.append(_pieces(fn, value, count))
                else:
                    columns.append(_split_leaves(fn, value, count))
        except Exception as error:
            raise at_key(error, list(node)[len(columns)]) from None
        return transpose(node, columns, count)
    if isinstance(node, Tensor):
        return list(_pieces(fn, node, count))
    if node is None:
        return [None] * count
    if is_leaf(node):
        refuse_non_tensor(node)
    keys, kids, rebuild = children(node)
    columns = []
    try:
        for child in kids:
            columns.append(_split_leaves(fn, child, count))
    except Exception as error:
        raise at_key(error, keys[len(columns)]) from None
    return [rebuild([column[i] for column in columns]) for i in range(count)]


def transpose(node: dict, columns: list[Sequence[Any]], count: int) -> list[dict]:
    """``count`` dicts with ``node``'s keys: dict ``i`` maps the ``j``-th key to ``columns[j][i]``."""
    if not columns:
        return [{} for _ in range(count)]
    return [dict(zip(node, row, strict=True)) for row in zip(*columns, strict=True)]


def first_tensor(node: Any) -> Tensor | None:
    """The first tensor leaf in walk order, or None when the tree holds no tensor."""
    if isinstance(node, Tensor):
        return node
    if type(node) is dict:
        for value in node.values():
            found = first_tensor(value)
            if found is not None:
                return found
        return None
    if node is None or is_leaf(node):
        return None
    for child in children(node)[1]:
        found = first_tensor(child)
        if found is not None:
            return found
    return None
