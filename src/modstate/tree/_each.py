"""One tensor op at each leaf: `zeros_like`, `clone`, `detach`, `to`."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch import Tensor

from modstate.tree._fast import DictLeaves, fast_or_walk, refill_tied
from modstate.tree._walk import KEEP, REFUSE, NonTensor, map_leaves


def zeros_like(tree: Any) -> Any:
    """A tree of zeros shaped, typed and placed like ``tree``'s leaves (``torch.zeros_like``).

    Args:
        tree: A pytree of tensors.

    Returns:
        A new tree shaped like ``tree`` with a zero tensor at each leaf.

    Raises:
        TypeError: A leaf is not a tensor (naming its path).

    Example:
        >>> ms.tree.zeros_like({"w": torch.ones(2, dtype=torch.int64)})
        {'w': tensor([0, 0])}
    """
    return _at_each_leaf("zeros_like", tree, torch.zeros_like, REFUSE)


def clone(tree: Any) -> Any:
    """A copy of every tensor leaf (``Tensor.clone``: new memory, still in the autograd graph).

    The way to keep a snapshot of a model's state (a target network, the start of an EMA): a tree
    from ``extract`` shares storage with the model, and follows it as the model trains.

    Args:
        tree: A pytree; its non-tensor leaves are kept as they are (the same objects).

    Returns:
        A new tree shaped like ``tree``; a tie (one tensor at several places) stays one copy.

    Example:
        >>> tree = {"w": torch.zeros(2)}
        >>> copy = ms.tree.clone(tree)
        >>> _ = copy["w"].add_(1)
        >>> tree["w"]
        tensor([0., 0.])
    """
    return _at_each_leaf("clone", tree, Tensor.clone, KEEP)


def detach(tree: Any) -> Any:
    """Every tensor leaf detached from the autograd graph (``Tensor.detach``: storage shared).

    Args:
        tree: A pytree; its non-tensor leaves are kept as they are.

    Returns:
        A new tree shaped like ``tree`` whose tensors share storage with the input's.

    Example:
        >>> w = torch.ones(2, requires_grad=True)
        >>> ms.tree.detach({"w": w * 2})["w"].requires_grad
        False
    """
    return _at_each_leaf("detach", tree, Tensor.detach, KEEP)


def to(tree: Any, *args: Any, **kwargs: Any) -> Any:
    """``leaf.to(*args, **kwargs)`` at every tensor leaf: device and/or dtype, as ``Tensor.to``.

    Non-tensor leaves are kept as they are, as ``nn.Module.to`` leaves non-tensor state alone.

    Args:
        tree: A pytree.
        *args: Passed to ``Tensor.to`` (a device, a dtype, or a tensor to match).
        **kwargs: Passed to ``Tensor.to`` (``device=``, ``dtype=``, ``non_blocking=``, ...).

    Returns:
        A new tree shaped like ``tree``.

    Raises:
        TypeError: ``Tensor.to`` refuses the arguments (naming the leaf's path).
        RuntimeError: The move or cast fails at a leaf (naming its path).

    Example:
        >>> ms.tree.to({"w": torch.ones(2)}, torch.float64)["w"].dtype
        torch.float64
    """
    return _at_each_leaf("to", tree, lambda leaf: leaf.to(*args, **kwargs), KEEP)


def _at_each_leaf(
    op: str, tree: Any, leaf_fn: Callable[[Tensor], Any], non_tensor: NonTensor
) -> Any:
    """``leaf_fn`` at every tensor leaf; other leaves as ``non_tensor`` says."""
    return fast_or_walk(op, tree, _each_fast, _each_walk, leaf_fn, non_tensor)


def _each_fast(flat: DictLeaves, leaf_fn: Callable[[Tensor], Any], non_tensor: NonTensor) -> dict:
    return refill_tied(flat, [leaf_fn(leaf) for leaf in flat.leaves])


def _each_walk(tree: Any, leaf_fn: Callable[[Tensor], Any], non_tensor: NonTensor) -> Any:
    return map_leaves(leaf_fn, tree, non_tensor)
