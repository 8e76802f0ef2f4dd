"""What is a node and what is a leaf of any pytree, and its leaves with their dotted paths.

The rule follows optree with ``none_is_leaf=False``: ``dict``, ``list``, ``tuple``, namedtuples,
``OrderedDict``, ``defaultdict`` and ``deque`` are walked into; ``None`` is a node with no children;
everything else, tensors first, is a leaf. The dicts, lists and tuples are handled here (the common
case, without optree's per-node cost); every other node type goes through
``optree.tree_flatten_one_level``, so nothing is registered with optree. Dicts are walked in
insertion order (module order), unlike ``optree.tree_flatten``, which sorts keys.

``modstate.tree``'s walk (``tree/_walk.py``) and ``modstate.optim`` share this one rule.
"""

from __future__ import annotations

import collections
from collections.abc import Callable
from typing import Any

import optree
from torch import Tensor

DICT_KINDS = (dict, collections.OrderedDict, collections.defaultdict)
_WALKED = (*DICT_KINDS, list, tuple)


def is_leaf(node: Any) -> bool:
    """True for a leaf of a modstate tree (a tensor, or any value optree does not walk into)."""
    if isinstance(node, Tensor):
        return True
    if node is None or type(node) in _WALKED:
        return False
    return optree.tree_is_leaf(node, none_is_leaf=False)


def dict_like(node: dict, items: Any) -> dict:
    """A dict of ``node``'s flavour (``dict``, ``OrderedDict``, ``defaultdict`` with its
    factory) holding ``items``."""
    if type(node) is dict:
        return dict(items)
    if isinstance(node, collections.defaultdict):
        return type(node)(node.default_factory, items)
    return type(node)(items)


def children(node: Any) -> tuple[list[Any], list[Any], Callable[[list[Any]], Any]]:
    """``(keys, children, rebuild)`` of a container node, in insertion order.

    ``keys`` are what a dotted path shows (dict keys, list indices, namedtuple field names);
    ``rebuild(new_children)`` makes a node of the same type and metadata.
    """
    kind = type(node)
    if kind in DICT_KINDS:
        keys = list(node)
        return keys, list(node.values()), lambda new: dict_like(node, zip(keys, new, strict=True))
    if kind is list:
        return list(range(len(node))), list(node), list
    if kind is tuple:
        return list(range(len(node))), list(node), tuple
    if node is None:
        return [], [], lambda new: None
    flat = optree.tree_flatten_one_level(node, none_is_leaf=False)
    fields = getattr(node, "_fields", None)
    keys = list(fields) if isinstance(node, tuple) and fields is not None else list(flat.entries)
    metadata, unflatten = flat.metadata, flat.unflatten_func
    return keys, list(flat.children), lambda new: unflatten(metadata, new)


def leaves_with_paths(node: Any, prefix: str = "") -> list[tuple[str, Any]]:
    """``[(dotted_path, leaf), ...]`` in walk order (dict insertion order)."""
    out: list[tuple[str, Any]] = []
    _collect(node, prefix, out)
    return out


def _collect(node: Any, path: str, out: list[tuple[str, Any]]) -> None:
    if is_leaf(node):
        out.append((path, node))
        return
    if node is None:
        return
    keys, kids, _ = children(node)
    for key, child in zip(keys, kids, strict=True):
        _collect(child, f"{path}.{key}" if path else str(key), out)
