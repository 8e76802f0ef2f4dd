"""`partition` / `combine`: split a tree by a predicate on its leaves into two halves with None
holes, and merge such halves back."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from modstate._core.trees.nodes import children, dict_like, is_leaf
from modstate.tree._errors import StructureMismatch, at_key, message, naming_paths
from modstate.tree._walk import APPLY, describe, map_leaves, same_kind


def partition(tree: Any, predicate: Callable[[Any], bool]) -> tuple[Any, Any]:
    """Split ``tree`` in two by a predicate on its leaves, keeping the structure in both halves.

    As equinox's ``partition``: both halves keep the full structure, with None where the other
    half has the leaf, so they zip back together with [`combine`][modstate.tree.combine], and
    ``modstate.call`` / ``inject`` / ``apply`` take the pair ``(kept, rest)`` as a tuple of trees
    (a None leaf is a hole).

    Args:
        tree: Any pytree.
        predicate: Called on every leaf (tensor or not); a true result puts the leaf in ``kept``.

    Returns:
        The pair ``(kept, rest)`` of trees shaped like ``tree``. ``kept`` holds the leaves for
        which ``predicate(leaf)`` is true and None elsewhere, ``rest`` the others and None
        elsewhere. Leaves are the input's own objects.

    Raises:
        TypeError: ``predicate`` is not callable.
        Exception: Whatever ``predicate`` raises, as the same object, with the leaf's path as a
            note.

    Example:
        >>> tree = {"0": {"weight": torch.ones(2), "num_batches_tracked": torch.tensor(0)}}
        >>> floats, ints = ms.tree.partition(tree, ms.tree.is_float)
        >>> floats
        {'0': {'weight': tensor([1., 1.]), 'num_batches_tracked': None}}
        >>> ints
        {'0': {'weight': None, 'num_batches_tracked': tensor(0)}}
    """
    if not callable(predicate):
        raise TypeError(
            message("partition", f"predicate must be callable, got {type(predicate).__name__}")
        )
    mask = naming_paths(
        "partition",
        lambda: map_leaves(lambda leaf: bool(predicate(leaf)), tree, APPLY),
        user_fn=True,
    )
    return _select_by(tree, mask, True), _select_by(tree, mask, False)


def _select_by(node: Any, mask: Any, side: bool) -> Any:
    if type(node) is dict:
        return {key: _select_by(value, mask[key], side) for key, value in node.items()}
    if is_leaf(node):
        return node if mask is side else None
    if node is None:
        return None
    _, kids, rebuild = children(node)
    mask_kids = children(mask)[1]
    return rebuild([_select_by(kid, m, side) for kid, m in zip(kids, mask_kids, strict=True)])


def combine(*trees: Any) -> Any:
    """One tree from several with None holes: at each place, the first leaf that is not None.

    The inverse of [`partition`][modstate.tree.partition]: ``combine(*partition(tree, p))``
    rebuilds ``tree``, with the very same leaves. Dicts merge by key (keys that only some trees
    have are kept, in first-seen order; a ``dict`` merges with an ``OrderedDict``), so halves made
    by [`select`][modstate.tree.select] and [`exclude`][modstate.tree.exclude] combine too; lists
    and tuples must have the same length. Two trees giving different leaves at one place is not
    an error: the first one wins.

    Args:
        *trees: Trees of one structure, up to None holes and missing dict keys.

    Returns:
        The merged tree, with the node types of the first tree that has a node at each place.

    Raises:
        TypeError: No tree is given.
        ValueError: Two trees have a leaf and a subtree, or nodes of different kinds or lengths,
            at one place (naming its path).

    Example:
        >>> a = {"w": torch.ones(1), "b": None}
        >>> b = {"w": None, "b": torch.zeros(1)}
        >>> ms.tree.combine(a, b)
        {'w': tensor([1.]), 'b': tensor([0.])}
    """
    if not trees:
        raise TypeError(message("combine", "give at least one tree"))
    return naming_paths("combine", lambda: _combine(list(trees)))


def _combine(nodes: list[Any]) -> Any:
    present = [node for node in nodes if node is not None]
    if not present:
        return None
    first = present[0]
    if is_leaf(first):
        for other in present[1:]:
            if not is_leaf(other):
                raise StructureMismatch(
                    f"one tree has {describe(first)} here, another {describe(other)}"
                )
        return first
    for other in present[1:]:
        if is_leaf(other) or not same_kind(first, other):
            raise StructureMismatch(
                f"one tree has {describe(first)} here, another {describe(other)}"
            )
    if isinstance(first, dict):
        keys: dict[Any, None] = {}
        for node in present:
            keys.update(dict.fromkeys(node))
        out = {}
        for key in keys:
            try:
                out[key] = _combine([node.get(key) for node in present])
            except Exception as error:
                raise at_key(error, key) from None
        return out if type(first) is dict else dict_like(first, out.items())
    keys_of_first, kids_of_first, rebuild = children(first)
    columns = [children(node)[1] for node in present]
    if any(len(column) != len(kids_of_first) for column in columns):
        raise StructureMismatch(
            f"{type(first).__name__} nodes of different lengths "
            f"({sorted({len(column) for column in columns})})"
        )
    new = []
    for index, key in enumerate(keys_of_first):
        try:
            new.append(_combine([column[index] for column in columns]))
        except Exception as error:
            raise at_key(error, key) from None
    return rebuild(new)
