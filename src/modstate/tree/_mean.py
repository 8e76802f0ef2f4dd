"""`mean`: the leafwise average of several trees (model soups, weight averaging)."""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor

from modstate.tree._errors import message, naming_paths
from modstate.tree._predicates import is_float
from modstate.tree._walk import REFUSE, map_leaves, map_leaves_n

_LIST_FIX = (
    "average the floating-point leaves and keep trees[0]'s others: floats = "
    "[ms.tree.partition(t, ms.tree.is_float)[0] for t in trees]; "
    "ms.tree.combine(ms.tree.mean(floats), ms.tree.partition(trees[0], ms.tree.is_float)[1])"
)
_STACKED_FIX = (
    "average the floating-point leaves and keep member 0's others: floats, ints = "
    "ms.tree.partition(trees, ms.tree.is_float); "
    "ms.tree.combine(ms.tree.mean(floats), ms.tree.map(lambda leaf: leaf[0], ints))"
)


def mean(trees: list[Any] | Any) -> Any:
    """The leafwise mean of a list of trees, or of a stacked tree along its member dim (dim 0).

    A uniform model soup is ``ms.tree.mean([tree_a, tree_b, tree_c])``; the average of an
    ensemble's members is ``ms.tree.mean(ms.split(ensemble)[0])``. Floating-point and complex
    leaves are averaged; 16-bit (and 8-bit) floats are summed in float32 and the mean is cast
    back, so every leaf keeps its dtype. Integer and bool leaves (BatchNorm's
    ``num_batches_tracked``) cannot be averaged: where every member holds the same value it is
    kept, and where they differ the call is refused, naming the path.

    Only a ``list`` is read as a list of trees; anything else (a dict, a tuple) is one stacked
    tree. The result is new tensors; the inputs are not changed, and a tie stays a tie.

    Args:
        trees: A non-empty list of trees of one structure (the same paths, shapes and dtypes),
            or one tree whose leaves stack the members along dim 0.

    Returns:
        One tree shaped like a member (like ``trees[0]``, or like a stacked leaf without its
        first dim).

    Raises:
        ValueError: An empty list; trees of other structures, shapes or dtypes; a 0-dim leaf of
            a stacked tree; integer leaves that differ between the members (the message names
            the path, and the fix that keeps one member's).
        TypeError: A leaf is not a tensor (naming its path).

    Example:
        >>> soup = ms.tree.mean([{"w": torch.zeros(2), "n": torch.tensor(3)},
        ...                      {"w": torch.ones(2), "n": torch.tensor(3)}])
        >>> soup
        {'w': tensor([0.5000, 0.5000]), 'n': tensor(3)}
        >>> ms.tree.mean({"w": torch.arange(6.0).reshape(3, 2)})  # 3 members stacked
        {'w': tensor([2., 3.])}
    """
    if type(trees) is not list:
        return naming_paths("mean", lambda: map_leaves(_mean_along_dim_0, trees, REFUSE))
    if not trees:
        raise ValueError(message("mean", "an empty list of trees; give at least one tree"))
    names = [f"trees[{i}]" for i in range(1, len(trees))]
    return naming_paths(
        "mean", lambda: map_leaves_n(_mean_of_members, trees[0], trees[1:], REFUSE, names)
    )


def _accumulator(dtype: torch.dtype) -> torch.dtype:
    """Where a mean of ``dtype`` values is summed: float32 for 16- and 8-bit floats."""
    if dtype == torch.complex32:
        return torch.complex64
    return torch.float32 if dtype.is_floating_point and dtype.itemsize < 4 else dtype


def _mean_of_members(first: Tensor, *others: Any) -> Tensor:
    for i, other in enumerate(others, 1):
        if not isinstance(other, Tensor):
            raise TypeError(f"trees[{i}] holds a {type(other).__name__} here, not a tensor")
        if other.shape != first.shape or other.dtype != first.dtype:
            raise ValueError(
                f"trees[{i}] holds shape {tuple(other.shape)} {other.dtype}, trees[0] "
                f"{tuple(first.shape)} {first.dtype}; average trees of one model"
            )
    if not is_float(first):
        for i, other in enumerate(others, 1):
            if not torch.equal(other, first):
                raise ValueError(_differ(first.dtype, f"trees[{i}]", "trees[0]", _LIST_FIX))
        return first.clone()
    # A running sum (one leaf of memory, not the members stacked), in a copy: never in place
    # into the caller's tensor.
    total = first.to(_accumulator(first.dtype), copy=True)
    for other in others:
        total.add_(other)
    return total.div_(len(others) + 1).to(first.dtype)


def _mean_along_dim_0(leaf: Tensor) -> Tensor:
    if leaf.dim() == 0:
        raise ValueError(
            "a 0-dim leaf has no member dim; give a list of trees, or a tree whose leaves stack "
            "the members along dim 0 (ms.stack(trees))"
        )
    if not is_float(leaf):
        same = (leaf == leaf[:1]).reshape(leaf.shape[0], -1).all(dim=1)
        if not bool(same.all()):
            member = int((~same).nonzero()[0, 0])
            raise ValueError(_differ(leaf.dtype, f"member {member}", "member 0", _STACKED_FIX))
        return leaf[0].clone()
    return leaf.mean(dim=0, dtype=_accumulator(leaf.dtype)).to(leaf.dtype)


def _differ(dtype: torch.dtype, where: str, first: str, fix: str) -> str:
    return (
        f"{where} holds another value than {first} in this {dtype} leaf, and integer leaves "
        f"cannot be averaged; {fix}"
    )
