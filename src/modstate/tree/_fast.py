"""The fast path of `modstate.tree`: a plain nested dict of tensors as a list of leaves and back.

Trees from ``modstate.extract`` are plain nested dicts. For them an op runs as: one walk that
lists the leaves and records the dicts' skeleton (`dict_leaves`), the per-leaf torch op over that
list in a single comprehension, and one walk that builds the result dicts (`refill`);
``unbind``/``split`` build one result per piece from the same skeleton. Profiling showed that the
per-leaf work of a walk (type checks, stores, error bookkeeping) costs about as much as the torch
op itself on small leaves; this keeps it to two tight loops. Leaves keep dict insertion order.

Anything else (lists, tuples, non-tensor leaves, dict subclasses) makes `dict_leaves` return
None, and `fast_or_walk` takes the generic walk of ``_walk`` instead, which also names the path
of an error: a fast path that fails for any reason gives way to the walk, which then raises the
error at its leaf (or gives the result, when the fast path only declined).
"""

from __future__ import annotations

import enum
from collections.abc import Callable, Iterator
from typing import Any, NamedTuple, TypeAlias

from torch import Tensor
from torch.nn import Parameter

from modstate._core.trees.ties import retie, tie_pairs
from modstate.tree._errors import Result, naming_paths


class Place(enum.Enum):
    """What stands at a key of a skeleton, other than a nested dict."""

    TENSOR = enum.auto()
    NONE = enum.auto()


# module-level names: reading an enum member off its class costs more than the rest of the loop
TENSOR, NONE = Place.TENSOR, Place.NONE

Skeleton: TypeAlias = list[tuple[Any, "Place | Skeleton"]]
"""The dicts of a tree without their leaves: ``[(key, Place or nested skeleton), ...]``."""


class DictLeaves(NamedTuple):
    """A plain nested dict of tensors taken apart by `dict_leaves`."""

    skeleton: Skeleton
    leaves: list[Tensor]
    exact: bool
    """Every leaf is exactly a ``Tensor`` or ``Parameter`` (no subclass with dispatch of its
    own): then torch's foreach kernels may replace the per-leaf ops."""


_new_tuple = tuple.__new__  # half the cost of DictLeaves(...), on every call of every op


class _NotPlain(Exception):
    pass


class Decline(Exception):
    """Raised by a fast path to leave the result, or the error with its path, to the walk."""


def dict_leaves(tree: dict) -> DictLeaves | None:
    """The skeleton and leaves of a nested dict of tensors (or None values), else None."""
    leaves: list[Tensor] = []
    subclassed: list[Tensor] = []
    try:
        skeleton = _take_apart(tree, leaves, subclassed)
    except _NotPlain:
        return None
    return _new_tuple(DictLeaves, (skeleton, leaves, not subclassed))


def _take_apart(node: dict, leaves: list[Tensor], subclassed: list[Tensor]) -> Skeleton:
    skeleton: Skeleton = []
    for key, value in node.items():
        kind = type(value)
        if kind is Tensor or kind is Parameter:
            leaves.append(value)
            skeleton.append((key, TENSOR))
        elif kind is dict:
            skeleton.append((key, _take_apart(value, leaves, subclassed)))
        elif value is None:
            skeleton.append((key, NONE))
        elif isinstance(value, Tensor):
            leaves.append(value)
            subclassed.append(value)
            skeleton.append((key, TENSOR))
        else:
            raise _NotPlain
    return skeleton


def refill(skeleton: Skeleton, leaves: Iterator[Any]) -> dict:
    """The nested dict of ``skeleton`` holding ``leaves`` (an iterator) in `dict_leaves` order."""
    out = {}
    for key, sub in skeleton:
        if sub is TENSOR:
            out[key] = next(leaves)
        elif type(sub) is list:
            out[key] = refill(sub, leaves)
        else:
            out[key] = None
    return out


def refill_tied(flat: DictLeaves, out: list[Any]) -> dict:
    """The result tree of a fast-path op: ``out[i]`` computed from ``flat.leaves[i]``, with each
    tie's first result standing at all its places."""
    retie(out, tie_pairs(flat.leaves))
    return refill(flat.skeleton, iter(out))


def fast_or_walk(
    op: str,
    tree: Any,
    fast: Callable[..., Result],
    walk: Callable[..., Result],
    *args: Any,
    user_fn: bool = False,
) -> Result:
    """``fast(dict_leaves(tree), *args)`` for a plain nested dict of tensors, else
    ``walk(tree, *args)``.

    A fast path that raises (`Decline`, or the op's own error) gives way to the walk, which
    gives the result or raises the error with its path, as ``tree.<op>``'s error. (``fast`` and
    ``walk`` take their arguments rather than closing over them: on small trees, making two
    closures per call costs more than the op's own bookkeeping.)
    """
    if type(tree) is dict:
        flat = dict_leaves(tree)
        if flat is not None:
            try:
                return fast(flat, *args)
            except Exception:
                pass  # the walk gives the result or the error with the leaf's path
    return naming_paths(op, walk, tree, *args, user_fn=user_fn)
