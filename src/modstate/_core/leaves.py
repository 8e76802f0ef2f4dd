"""Reading the trees a caller passes: one tree, or several that together give the module's paths."""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from typing import Any

from .flat import is_subtree
from .types import TreeArg


def leaves_of(tree: TreeArg) -> Iterator[tuple[str, Any, Any, str]]:
    """``(path, leaf, node, key)`` for every leaf of a tree or of several trees, ``node[key]``
    being where the leaf sits; refuses anything else, and a path given by two trees.

    A None leaf is a hole: the path is not given by this tree (the halves that
    ``modstate.tree.partition`` makes hold None where a leaf went to the other half)."""
    if isinstance(tree, (tuple, list)):
        seen: set[str] = set()
        for component in tree:
            _check_is_tree(component)
            for item in _leaves_with_parents(component, ""):
                if item[0] in seen:
                    raise ValueError(f"{item[0]!r} is given by two of the trees")
                seen.add(item[0])
                yield item
    else:
        _check_is_tree(tree)
        yield from _leaves_with_parents(tree, "")


def _check_is_tree(tree: Any) -> None:
    if not isinstance(tree, Mapping):
        raise TypeError(
            f"expected a tree (a dict of tensors) or a tuple of trees, got {type(tree).__name__}"
        )


def _leaves_with_parents(
    tree: Mapping[str, Any], prefix: str
) -> Iterator[tuple[str, Any, Any, str]]:
    for key, value in tree.items():
        if not isinstance(key, str):
            raise TypeError(
                f"tree keys must be strings, got {key!r} under {prefix[:-1] or 'the root'!r}"
            )
        if is_subtree(key, value):
            yield from _leaves_with_parents(value, f"{prefix}{key}.")
        elif value is not None:
            yield prefix + key, value, tree, key
