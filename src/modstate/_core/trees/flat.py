"""Nested trees <-> ``state_dict``-style flat dicts with dotted keys."""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from typing import Any, cast

import optree

from modstate._core.errors import DuplicatePath, PathError, PathTypeError, PathValueError
from modstate._core.types import Tree

EXTRA_STATE = "_extra_state"
"""The key ``state_dict`` uses for ``get_extra_state()``: its value is opaque, never walked into."""


def is_subtree(key: str, value: Any) -> bool:
    """Whether ``value`` stored under ``key`` is a level of the tree rather than a leaf."""
    return isinstance(value, Mapping) and key != EXTRA_STATE


def non_string_key(key: object, prefix: str) -> PathTypeError:
    """The error for a tree key that is not a string, ``prefix`` being the dotted path above it."""
    return PathTypeError(
        f"{prefix}{key}",
        f"the key {key!r} is of type {type(key).__name__}",
        "tree keys are strings (attribute names, or state_dict's dotted keys)",
    )


def iter_leaves(tree: Mapping[str, Any], prefix: str = "") -> Iterator[tuple[str, Any]]:
    """Yield ``(dotted_path, leaf)`` for every leaf of ``tree``, in insertion order."""
    for key, value in tree.items():
        if not isinstance(key, str):
            raise non_string_key(key, prefix)
        if is_subtree(key, value):
            yield from iter_leaves(value, f"{prefix}{key}.")
        else:
            yield prefix + key, value


def flatten(tree: Mapping[str, Any]) -> dict[str, Any]:
    """Flatten a nested tree into ``state_dict``-style dotted keys, keeping the tree's order.

    ``_extra_state`` values are leaves even when they are dicts, as in ``state_dict``. A key that
    already holds dots is kept as it is, so a flat dict flattens to itself and a tree may mix
    both forms, as long as it gives each path once.

    Args:
        tree: A nested dict (or any mapping) whose keys are strings.

    Returns:
        A new flat ``dict`` from dotted path (``"encoder.0.weight"``) to leaf, in the tree's
        order; the leaves are the tree's own objects.

    Raises:
        TypeError: A key is not a string.
        ValueError: A path is given twice (as a dotted key and nested).

    Example:
        >>> import torch, modstate as ms
        >>> ms.flatten({"0": {"weight": torch.ones(1), "bias": torch.zeros(1)}}).keys()
        dict_keys(['0.weight', '0.bias'])
    """
    flat: dict[str, Any] = {}
    try:
        for path, leaf in iter_leaves(tree):
            if path in flat:
                raise DuplicatePath(
                    path,
                    "given twice, as a dotted key and nested",
                    "a tree may mix dotted keys and nested dicts, but gives each path once",
                )
            flat[path] = leaf
    except PathError as error:
        raise error.within("flatten") from None
    return flat


def unflatten(flat: Mapping[str, Any]) -> Tree:
    """Nest ``state_dict``-style dotted keys into a tree; ``flatten`` undoes it.

    Keys are split on dots; insertion order is kept, so ``flatten(unflatten(sd))`` lists the keys
    of ``sd`` in the same order whenever the keys under each prefix are contiguous, as
    ``state_dict`` produces them.

    Args:
        flat: A mapping from dotted path to leaf, such as ``model.state_dict()``.

    Returns:
        A new nested ``dict`` holding the same leaf objects.

    Raises:
        ValueError: A path appears twice, or is both a leaf and the prefix of another path
            (``"a"`` and ``"a.b"``).

    Example:
        >>> import torch, modstate as ms
        >>> ms.unflatten({"0.weight": torch.ones(1), "0.bias": torch.zeros(1)})["0"].keys()
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
            raise PathValueError(
                key,
                "appears twice, or both as a leaf and as the prefix of other paths",
                "give each path once, and no leaf where other paths continue",
                "unflatten",
            )
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
        raise PathValueError(
            key,
            f"lies under {prefix!r}, which is already a leaf",
            "give each path once, and no leaf where other paths continue",
            "unflatten",
        )
    nodes[prefix] = node
    return node


class Layout:
    """The nesting of one sequence of dotted keys, compiled: `nest` builds the same tree as
    ``unflatten`` for values listed in that key order, with one C-level pass (optree)."""

    __slots__ = ("keys", "order", "treespec")

    def __init__(self, keys: list[str]) -> None:
        self.keys = keys
        positions: Any = unflatten(dict(zip(keys, range(len(keys)), strict=True)))
        order, self.treespec = optree.tree_flatten(positions)
        self.order: list[int] = list(order)

    def nest(self, values: list[Any]) -> Tree:
        nested = optree.tree_unflatten(self.treespec, list(map(values.__getitem__, self.order)))
        return cast(Tree, nested)
