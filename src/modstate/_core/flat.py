"""Nested trees <-> ``state_dict``-style flat dicts with dotted keys."""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from typing import Any

import optree

from .types import Tree

EXTRA_STATE = "_extra_state"
"""The key ``state_dict`` uses for ``get_extra_state()``: its value is opaque, never walked into."""


def is_subtree(key: str, value: Any) -> bool:
    """Whether ``value`` stored under ``key`` is a level of the tree rather than a leaf."""
    return isinstance(value, Mapping) and key != EXTRA_STATE


def iter_leaves(tree: Mapping[str, Any], prefix: str = "") -> Iterator[tuple[str, Any]]:
    """Yield ``(dotted_path, leaf)`` for every leaf of ``tree``, in insertion order."""
    for key, value in tree.items():
        if not isinstance(key, str):
            raise TypeError(
                f"tree keys must be strings, got {key!r} under {prefix[:-1] or 'the root'!r}"
            )
        if is_subtree(key, value):
            yield from iter_leaves(value, f"{prefix}{key}.")
        else:
            yield prefix + key, value


def flatten(tree: Mapping[str, Any]) -> dict[str, Any]:
    """Flatten a nested tree into ``state_dict``-style dotted keys, keeping the tree's order.

    ``_extra_state`` values are leaves even when they are dicts, as in ``state_dict``.

    >>> import torch
    >>> flatten({"0": {"weight": torch.ones(1), "bias": torch.zeros(1)}}).keys()
    dict_keys(['0.weight', '0.bias'])
    """
    return dict(iter_leaves(tree))


def unflatten(flat: Mapping[str, Any]) -> Tree:
    """Nest ``state_dict``-style dotted keys into a tree; ``flatten`` undoes it.

    Keys are split on dots; insertion order is kept, so ``flatten(unflatten(sd))`` lists the keys of
    ``sd`` in the same order whenever the keys under each prefix are contiguous, as ``state_dict``
    produces them.

    >>> import torch
    >>> unflatten({"0.weight": torch.ones(1), "0.bias": torch.zeros(1)})["0"].keys()
    dict_keys(['weight', 'bias'])
    """
    root: Tree = {}
    nodes: dict[str, Tree] = {"": root}
    last_prefix = ""
    last_node = root
    for key, value in flat.items():
        prefix, _, name = key.rpartition(".")
        if prefix != last_prefix:
            last_node = nodes.get(prefix) or _make_node(nodes, prefix, key)
            last_prefix = prefix
        if name in last_node:
            raise ValueError(f"path {key!r} appears twice, or both as a leaf and as a prefix")
        last_node[name] = value
    return root


def _make_node(nodes: dict[str, Tree], prefix: str, key: str) -> Tree:
    parent_prefix, _, name = prefix.rpartition(".")
    parent = nodes.get(parent_prefix)
    if parent is None:
        parent = _make_node(nodes, parent_prefix, key)
    node = parent.get(name)
    if node is None:
        node = parent[name] = {}
    elif not is_subtree(name, node):
        raise ValueError(f"path {key!r} lies under {prefix!r}, which is already a leaf")
    nodes[prefix] = node
    return node


class Layout:
    """The nesting of one sequence of dotted keys, compiled: `nest` builds the same tree as
    ``unflatten`` for values listed in that key order, with one C-level pass (optree)."""

    __slots__ = ("keys", "order", "treespec")

    def __init__(self, keys: list[str]) -> None:
        self.keys = keys
        self.order, self.treespec = optree.tree_flatten(
            unflatten(dict(zip(keys, range(len(keys)))))
        )

    def nest(self, values: list[Any]) -> Tree:
        return optree.tree_unflatten(self.treespec, list(map(values.__getitem__, self.order)))
