"""`partition` / `combine`: split a tree by a predicate on its leaves into two halves with None
holes, and merge such halves back; `is_float` / `is_trainable`, the predicates a training loop
needs."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from torch import Tensor

from modstate.tree._walk import APPLY, AtPath, children, is_leaf, map_leaves, raise_at


def is_float(leaf: Any) -> bool:
    """Whether ``leaf`` is a floating-point tensor (what ``torch.func.grad`` can differentiate
    and ``lerp`` can average; BatchNorm's integer ``num_batches_tracked`` is not).

    >>> ms.tree.is_float(torch.zeros(2)), ms.tree.is_float(torch.tensor(3))
    (True, False)
    """
    return isinstance(leaf, Tensor) and leaf.is_floating_point()


def is_trainable(leaf: Any) -> bool:
    """Whether ``leaf`` is a floating-point tensor that requires grad (a trainable parameter).

    >>> ms.tree.is_trainable(torch.nn.Parameter(torch.zeros(2))), ms.tree.is_trainable(torch.zeros(2))
    (True, False)
    """
    return isinstance(leaf, Tensor) and leaf.is_floating_point() and leaf.requires_grad


def partition(tree: Any, predicate: Callable[[Any], bool]) -> tuple[Any, Any]:
    """``(kept, rest)``: two trees shaped like ``tree``; ``kept`` holds the leaves for which
    ``predicate(leaf)`` is true and None elsewhere, ``rest`` the others and None elsewhere.

    As equinox's ``partition``: both halves keep the full structure, so they zip back together with
    `combine`, and ``modstate.call`` / ``inject`` / ``apply`` take the pair ``(kept, rest)`` as a
    tuple of trees (a None leaf is a hole). Leaves are the input's own objects.

    >>> tree = {"0": {"weight": torch.ones(2), "num_batches_tracked": torch.tensor(0)}}
    >>> floats, ints = ms.tree.partition(tree, ms.tree.is_float)
    >>> floats
    {'0': {'weight': tensor([1., 1.]), 'num_batches_tracked': None}}
    >>> ints
    {'0': {'weight': None, 'num_batches_tracked': tensor(0)}}
    """
    if not callable(predicate):
        raise TypeError(
            f"modstate.tree.partition: predicate must be callable, got {type(predicate).__name__}"
        )
    try:
        mask = map_leaves(lambda leaf: bool(predicate(leaf)), tree, APPLY)
        kept = _select_by(tree, mask, True)
        rest = _select_by(tree, mask, False)
    except AtPath as error:
        raise_at("partition", error, user_fn=True)
    return kept, rest


def _select_by(node: Any, mask: Any, side: bool) -> Any:
    if type(node) is dict:
        return {key: _select_by(value, mask[key], side) for key, value in node.items()}
    if is_leaf(node):
        return node if mask is side else None
    if node is None:
        return None
    _, kids, rebuild = children(node)
    mask_kids = children(mask)[1]
    return rebuild([_select_by(kid, m, side) for kid, m in zip(kids, mask_kids)])


def combine(*trees: Any) -> Any:
    """One tree from several with None holes: at each position, the first leaf that is not None.

    The inverse of `partition` (``combine(*partition(tree, p))`` rebuilds ``tree``, the very same
    leaves). Dicts merge by key (keys that only some trees have are kept, in first-seen order), so
    halves made by `select` and `exclude` combine too; lists and tuples must have the same length.
    Two trees giving different leaves at one position is not an error: the first one wins.

    >>> a = {"w": torch.ones(1), "b": None}
    >>> b = {"w": None, "b": torch.zeros(1)}
    >>> ms.tree.combine(a, b)
    {'w': tensor([1.]), 'b': tensor([0.])}
    """
    if not trees:
        raise TypeError("modstate.tree.combine: give at least one tree")
    try:
        return _combine(list(trees))
    except AtPath as error:
        raise_at("combine", error)


def _combine(nodes: list[Any]) -> Any:
    present = [node for node in nodes if node is not None]
    if not present:
        return None
    first = present[0]
    if is_leaf(first):
        for other in present[1:]:
            if not is_leaf(other):
                raise ValueError(
                    f"structure mismatch: one tree has {_what(first)} here, another {_what(other)}"
                )
        return first
    for other in present[1:]:
        if is_leaf(other) or type(other) is not type(first):
            raise ValueError(
                f"structure mismatch: one tree has {_what(first)} here, another {_what(other)}"
            )
    if isinstance(first, dict):
        keys: dict[Any, None] = {}
        for node in present:
            keys.update(dict.fromkeys(node))
        out = {}
        for key in keys:
            try:
                out[key] = _combine([node.get(key) for node in present])
            except AtPath as error:
                error.keys.append(key)
                raise
            except ValueError as error:
                raise AtPath(error, key) from None
        return out if type(first) is dict else type(first)(out)
    keys_of_first, kids_of_first, rebuild = children(first)
    columns = [children(node)[1] for node in present]
    if any(len(column) != len(kids_of_first) for column in columns):
        raise ValueError(
            f"structure mismatch: {type(first).__name__} nodes of different lengths "
            f"({sorted({len(column) for column in columns})})"
        )
    new = []
    for index, key in enumerate(keys_of_first):
        try:
            new.append(_combine([column[index] for column in columns]))
        except AtPath as error:
            error.keys.append(key)
            raise
        except ValueError as error:
            raise AtPath(error, key) from None
    return rebuild(new)


def _what(node: Any) -> str:
    if isinstance(node, Tensor):
        return f"a tensor of shape {tuple(node.shape)}"
    return f"a {type(node).__name__} node" if not is_leaf(node) else f"a {type(node).__name__}"
