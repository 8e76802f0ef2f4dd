"""Reading nested dicts by a program made once per structure: `TreeReader`.

A tree handed to modstate over and over (every training step) has the same structure each time.
Walking it recursively costs more than the swap itself on small models; a `TreeReader` numbers
the dict nodes of one structure once, and then reads a tree of that structure with a few C-level
passes over flat lists, or tells that the tree is shaped otherwise. The module's `Anatomy` keeps
one for trees shaped like ``extract``'s; ``swap/parts.py`` keeps one per part of a tuple of trees.
"""

from __future__ import annotations

import operator
from collections.abc import Mapping
from typing import Any

_getitem = operator.getitem


class TreeReader:
    """How to read the leaves of trees shaped like one nested dict (``template``), without
    recursion: its dict nodes numbered depth first (``node_program``: each one's parent number
    and key; ``node_lens``: each one's length), and where each of ``paths`` sits (its node number
    and key); ``paths`` defaults to every leaf path of ``template``, None leaves included, in its
    order. A tree whose nodes have other lengths, or lack a key, is shaped otherwise.
    `build` makes a new tree of the template's structure from a flat list of leaves."""

    __slots__ = ("entries", "leaf_keys", "leaf_nodes", "node_lens", "node_program", "paths")

    def __init__(self, template: dict[str, Any], paths: list[str] | None = None) -> None:
        parents: list[int] = []
        keys: list[str] = []
        self.node_lens: list[int] = [0]
        leaf_node_of: dict[str, tuple[int, str]] = {}
        self.entries: list[tuple[int, str, int]] = []
        _number_nodes(template, 0, "", parents, keys, self.node_lens, leaf_node_of, self.entries)
        self.node_program = list(zip(parents, keys, strict=True))
        self.paths = list(leaf_node_of) if paths is None else paths
        where = [leaf_node_of[path] for path in self.paths]
        self.leaf_nodes = [node for node, _ in where]
        self.leaf_keys = [key for _, key in where]

    def read(self, tree: Mapping[str, Any]) -> tuple[list[Any], list[Any]] | None:
        """The leaves of ``tree`` at ``paths``, with its nodes, or None if it is shaped
        otherwise."""
        nodes: list[Any] = [tree]
        append = nodes.append
        try:
            for parent, key in self.node_program:
                node = nodes[parent][key]
                if type(node) is not dict and not isinstance(node, Mapping):
                    return None
                append(node)
        except KeyError:
            return None
        if list(map(len, nodes)) != self.node_lens:
            return None
        try:
            leaves = list(map(_getitem, map(nodes.__getitem__, self.leaf_nodes), self.leaf_keys))
        except KeyError:
            return None
        return leaves, nodes

    def build(self, leaves: list[Any]) -> dict[str, Any]:
        """A new nested dict shaped like the template (plain dicts, keys in its order) holding
        ``leaves``, given in the order of the template's own leaf paths (the default ``paths``)."""
        nodes: list[dict[str, Any]] = [{} for _ in self.node_lens]
        for node, key, child in self.entries:
            nodes[node][key] = nodes[child] if child >= 0 else leaves[~child]
        return nodes[0]

    def paths_are_distinct(self) -> bool:
        """False for a template where two entries make one path (a key ``"a.b"`` beside
        ``{"a": {"b": ...}}``): ``paths`` then has fewer leaves than the template."""
        return len(self.paths) == sum(1 for *_, child in self.entries if child < 0)

    def place(self, nodes: list[Any], i: int) -> tuple[Any, str]:
        """``(node, key)``: where leaf ``i`` stands in the tree whose ``nodes`` `read` returned."""
        return nodes[self.leaf_nodes[i]], self.leaf_keys[i]


def _number_nodes(
    node: dict[str, Any],
    index: int,
    prefix: str,
    parents: list[int],
    keys: list[str],
    lens: list[int],
    leaf_node_of: dict[str, tuple[int, str]],
    entries: list[tuple[int, str, int]],
) -> None:
    """Number the dict nodes below ``node`` (number ``index``) depth first: each one's parent
    number and key, each node's length, each leaf path's ``(node number, key)``, and every entry
    in order as ``(node number, key, child)``, ``child`` a node number or ``~leaf number``. A function
    of the module, not a closure: a recursive closure refers to itself, and through its cell to
    the anatomy, which then outlives its module until the cycle collector runs."""
    lens[index] = len(node)
    for key, value in node.items():
        if isinstance(value, dict):
            parents.append(index)
            keys.append(key)
            lens.append(0)
            entries.append((index, key, len(lens) - 1))
            _number_nodes(
                value, len(lens) - 1, f"{prefix}{key}.", parents, keys, lens, leaf_node_of, entries
            )
        else:
            entries.append((index, key, ~len(leaf_node_of)))
            leaf_node_of[prefix + key] = (index, key)
