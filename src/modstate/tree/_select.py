"""`select` / `exclude`: keep or drop the leaves of a tree whose dotted path matches a glob."""

from __future__ import annotations

from typing import Any

from modstate._core.trees.nodes import children, dict_like, is_leaf
from modstate._core.trees.paths import glob_matches
from modstate.tree._errors import message
from modstate.tree._walk import map_leaves


def select(tree: Any, *patterns: str) -> Any:
    """The part of ``tree`` whose dotted leaf paths match any of the glob ``patterns``.

    Patterns are ``fnmatch`` globs (case-sensitive) on dotted paths, and ``*`` crosses dots:
    ``"encoder.*"`` keeps every leaf under ``encoder``, ``"*.bias"`` every bias. A pattern that
    matches a subtree's own path keeps the whole subtree (``"encoder"`` works like
    ``"encoder.*"``).

    What is left out: a dict drops the key; a list or tuple keeps its length and holds ``None``
    there (``None`` is an empty subtree, and indices keep their meaning). Subtrees that held no
    leaf to begin with are kept as they are.

    Args:
        tree: Any pytree.
        *patterns: Glob patterns on dotted leaf paths; no pattern selects nothing.

    Returns:
        A new tree holding the selected leaves (the input's own objects) in new containers.

    Raises:
        TypeError: A pattern is not a string.

    Example:
        >>> tree = {"encoder": {"w": torch.ones(1), "b": torch.ones(1)}, "head": {"w": torch.ones(1)}}
        >>> ms.tree.select(tree, "encoder.*")
        {'encoder': {'w': tensor([1.]), 'b': tensor([1.])}}
        >>> ms.tree.select(tree, "*.w")
        {'encoder': {'w': tensor([1.])}, 'head': {'w': tensor([1.])}}
    """
    return _filter(tree, "", _compile(patterns, "select"), keep_matches=True)[0]


def exclude(tree: Any, *patterns: str) -> Any:
    """``tree`` without the leaves whose dotted paths match any of the glob ``patterns``.

    The complement of [`select`][modstate.tree.select], with the same pattern and pruning rules.

    Args:
        tree: The pytree to drop leaves from.
        *patterns: The paths to drop, read as `select` reads them (``*`` crosses dots); with
            none, nothing is dropped.

    Returns:
        ``tree`` without the matched leaves: its other leaves (the input's own objects), in
        new containers.

    Raises:
        TypeError: A pattern is not a string.

    Example:
        >>> tree = {"encoder": {"w": torch.ones(1), "b": torch.ones(1)}, "head": {"w": torch.ones(1)}}
        >>> ms.tree.exclude(tree, "*.b", "head")
        {'encoder': {'w': tensor([1.])}}
    """
    return _filter(tree, "", _compile(patterns, "exclude"), keep_matches=False)[0]


def _compile(patterns: tuple[Any, ...], op: str) -> tuple[str, ...]:
    for pattern in patterns:
        if not isinstance(pattern, str):
            raise TypeError(message(op, f"patterns must be strings, got {pattern!r}"))
    return patterns


def _copy_containers(node: Any) -> Any:
    return map_leaves(lambda leaf: leaf, node)


def _filter(
    node: Any, path: str, patterns: tuple[str, ...], keep_matches: bool
) -> tuple[Any, bool]:
    """``(filtered node, whether it is now empty although it held leaves)``."""
    matched = glob_matches(patterns, path) if path else False
    if is_leaf(node):
        keep = glob_matches(patterns, path) == keep_matches
        return (node, False) if keep else (None, True)
    if matched:
        # A subtree named by a pattern is kept or dropped whole.
        if keep_matches:
            return _copy_containers(node), False
        return None, _has_leaf(node)
    if node is None:
        return None, False
    keys, kids, rebuild = children(node)
    kept_any = False
    emptied = False
    new_kids = []
    dropped = []
    for key, child in zip(keys, kids, strict=True):
        child_path = f"{path}.{key}" if path else str(key)
        new_child, child_emptied = _filter(child, child_path, patterns, keep_matches)
        new_kids.append(new_child)
        dropped.append(child_emptied)
        if child_emptied:
            emptied = True
        elif _has_leaf(child):
            kept_any = True
    if isinstance(node, dict):
        items = [
            (key, new_child)
            for key, new_child, was_dropped in zip(keys, new_kids, dropped, strict=True)
            if not was_dropped
        ]
        rebuilt: Any = dict_like(node, items)
    else:
        rebuilt = rebuild(new_kids)
    return rebuilt, emptied and not kept_any


def _has_leaf(node: Any) -> bool:
    if is_leaf(node):
        return True
    if node is None:
        return False
    return any(_has_leaf(child) for child in children(node)[1])
