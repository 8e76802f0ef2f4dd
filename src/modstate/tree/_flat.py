"""The fast path of `modstate.tree`: a plain nested dict of tensors as a list of leaves and back.

Trees from ``modstate.extract`` are plain nested dicts. For them an op runs as: one walk that
lists the leaves and records the dict structure (`flatten_dict`), the per-leaf torch op over that
list in a single comprehension, and one walk that builds the result dicts (`unflatten_dict`);
``unbind``/``split`` build one result per piece from the same structure. Profiling showed that the
per-leaf work of a walk (type checks, stores, error bookkeeping) costs about as much as the torch
op itself on small leaves; this keeps it to two tight loops. Leaves keep dict insertion order.

Anything else (lists, tuples, non-tensor leaves, dict subclasses) makes `flatten_dict` return
None, and the caller takes the generic walk of ``_walk``, which also names paths in errors.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

from torch import Tensor
from torch.nn import Parameter

# Structure of one dict: a list of ``(key, sub)`` with sub `LEAF`, `NONE`, or a nested structure.
LEAF = "<tensor>"
NONE = "<None>"

Structure = list[tuple[Any, Any]]


class _NotPlain(Exception):
    pass


def flatten_dict(tree: dict) -> tuple[Structure, list[Tensor], bool] | None:
    """``(structure, leaves, plain)`` of a nested dict of tensors (or None values), else None.

    ``plain`` is True when every leaf is exactly a ``Tensor`` or ``Parameter`` (no subclass with
    dispatch of its own), which is when torch's foreach kernels may replace the per-leaf ops.
    """
    leaves: list[Tensor] = []
    subclassed: list[Tensor] = []
    try:
        structure = _flatten(tree, leaves, subclassed)
    except _NotPlain:
        return None
    return structure, leaves, not subclassed


def _flatten(node: dict, leaves: list[Tensor], subclassed: list[Tensor]) -> Structure:
    structure = []
    for key, value in node.items():
        kind = type(value)
        if kind is Tensor or kind is Parameter:
            leaves.append(value)
            structure.append((key, LEAF))
        elif kind is dict:
            structure.append((key, _flatten(value, leaves, subclassed)))
        elif value is None:
            structure.append((key, NONE))
        elif isinstance(value, Tensor):
            leaves.append(value)
            subclassed.append(value)
            structure.append((key, LEAF))
        else:
            raise _NotPlain
    return structure


def unflatten_dict(structure: Structure, leaves: Iterator[Any]) -> dict:
    """The nested dict of ``structure`` holding ``leaves`` (an iterator) in flatten order."""
    out = {}
    for key, sub in structure:
        if sub is LEAF:
            out[key] = next(leaves)
        elif sub is NONE:
            out[key] = None
        else:
            out[key] = unflatten_dict(sub, leaves)
    return out
