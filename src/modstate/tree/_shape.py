"""The batch dims of a tree: `reshape`, `view`, `unbind`, `split`."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
from torch import Tensor

from modstate._core.trees.ties import retie, tie_pairs
from modstate.tree._errors import message
from modstate.tree._fast import Decline, DictLeaves, fast_or_walk, refill, refill_tied
from modstate.tree._walk import REFUSE, first_tensor, map_leaves, split_leaves


def reshape(tree: Any, shape: int | Sequence[int], *, batch_ndim: int = 1) -> Any:
    """Reshape the leading ``batch_ndim`` dims of every leaf to ``shape``; the rest is kept.

    Each leaf becomes ``leaf.reshape(*shape, *leaf.shape[batch_ndim:])``, a view where torch can
    make one and a copy otherwise.

    Args:
        tree: A pytree of tensors, each with at least ``batch_ndim`` dims.
        shape: The new batch shape (an int or a sequence of ints); it may hold one ``-1``,
            resolved per leaf.
        batch_ndim: How many leading dims of each leaf are its batch dims.

    Returns:
        A tree shaped like ``tree`` holding the reshaped leaves.

    Raises:
        ValueError: ``shape`` or ``batch_ndim`` is invalid, or a leaf has fewer than
            ``batch_ndim`` dims (naming its path).
        TypeError: A leaf is not a tensor (naming its path).
        RuntimeError: torch cannot reshape a leaf to ``shape`` (naming its path).

    Example:
        >>> tree = {"w": torch.zeros(3, 4, 5), "b": torch.zeros(3, 4)}
        >>> {k: v.shape for k, v in ms.tree.reshape(tree, 12, batch_ndim=2).items()}
        {'w': torch.Size([12, 5]), 'b': torch.Size([12])}
    """
    return _new_batch_shape("reshape", tree, shape, batch_ndim)


def view(tree: Any, shape: int | Sequence[int], *, batch_ndim: int = 1) -> Any:
    """Like [`reshape`][modstate.tree.reshape], but every leaf is a ``view`` that shares storage
    with the input leaf.

    Args:
        tree: A pytree of tensors, each with at least ``batch_ndim`` dims.
        shape: The new batch shape (an int or a sequence of ints, one of which may be ``-1``).
        batch_ndim: How many leading dims of each leaf are its batch dims.

    Returns:
        A tree shaped like ``tree`` holding views of its leaves.

    Raises:
        ValueError: ``shape`` or ``batch_ndim`` is invalid, or a leaf has fewer than
            ``batch_ndim`` dims (naming its path).
        TypeError: A leaf is not a tensor (naming its path).
        RuntimeError: A leaf's memory layout allows no such view (naming its path); use
            [`reshape`][modstate.tree.reshape], which copies where it must.

    Example:
        >>> tree = {"w": torch.zeros(3, 4, 5)}
        >>> out = ms.tree.view(tree, (-1,), batch_ndim=2)
        >>> out["w"].shape, out["w"].data_ptr() == tree["w"].data_ptr()
        (torch.Size([12, 5]), True)
    """
    return _new_batch_shape("view", tree, shape, batch_ndim)


def _new_batch_shape(op: str, tree: Any, shape: int | Sequence[int], batch_ndim: int) -> Any:
    """``leaf.<op>(*shape, *leaf.shape[batch_ndim:])`` at every leaf (`reshape`, `view`)."""
    new = _as_shape(shape, op)
    ndim = _as_batch_ndim(batch_ndim, op)
    return fast_or_walk(op, tree, _new_batch_shape_fast, _new_batch_shape_walk, op, new, ndim)


def _new_batch_shape_fast(flat: DictLeaves, op: str, new: tuple[int, ...], ndim: int) -> dict:
    leaves = flat.leaves
    if leaves and min(map(Tensor.dim, leaves)) < ndim:
        raise Decline
    # bound methods in the loops: Tensor.view(leaf, ...) costs more than leaf.view(...)
    if op == "view":
        out = [leaf.view(*new, *leaf.shape[ndim:]) for leaf in leaves]
    elif len(new) == 1 and ndim >= 2:
        # flatten(0, ndim - 1) is reshape(-1, *rest) (same view-or-copy rule) with less
        # argument parsing; a size other than the merged one goes to the walk to fail.
        out = [leaf.flatten(0, ndim - 1) for leaf in leaves]
        if new[0] != -1 and {leaf.size(0) for leaf in out} != {new[0]}:
            raise Decline
    else:
        out = [leaf.reshape(*new, *leaf.shape[ndim:]) for leaf in leaves]
    return refill_tied(flat, out)


def _new_batch_shape_walk(tree: Any, op: str, new: tuple[int, ...], ndim: int) -> Any:
    def at_leaf(leaf: Tensor) -> Tensor:
        if leaf.dim() < ndim:
            raise ValueError(
                f"a leaf of shape {tuple(leaf.shape)} has fewer than batch_ndim={ndim} dims"
            )
        rest = leaf.shape[ndim:]
        return leaf.view(*new, *rest) if op == "view" else leaf.reshape(*new, *rest)

    return map_leaves(at_leaf, tree, REFUSE)


def unbind(tree: Any, dim: int = 0) -> list[Any]:
    """Split every leaf along ``dim`` into its slices: a list of trees, one per index of ``dim``.

    Tree ``i`` holds ``leaf.unbind(dim)[i]`` at each leaf (like ``TensorDict.unbind``), so
    unbinding a stacked tree gives the trees back.

    Args:
        tree: A pytree of tensors, all of the same size along ``dim``.
        dim: The dim to unbind.

    Returns:
        A list of trees shaped like ``tree``, one per index of ``dim``.

    Raises:
        ValueError: The tree holds no tensor (the count would be unknown), or two leaves have
            different sizes along ``dim`` (naming the path of the second).
        TypeError: ``dim`` is not an int, or a leaf is not a tensor (naming its path).
        IndexError: A leaf has no dim ``dim`` (naming its path).

    Example:
        >>> stacked = {"w": torch.arange(6.0).reshape(3, 2)}
        >>> ms.tree.unbind(stacked)
        [{'w': tensor([0., 1.])}, {'w': tensor([2., 3.])}, {'w': tensor([4., 5.])}]
    """
    if type(dim) is not int:
        _check_dim(dim, "unbind")
    return _pieces("unbind", tree, None, dim)


def split(tree: Any, split_size_or_sections: int | Sequence[int], dim: int = 0) -> list[Any]:
    """Split every leaf along ``dim`` like ``torch.split``: a list of trees, one per chunk.

    Args:
        tree: A pytree of tensors.
        split_size_or_sections: A chunk size (the last chunk may be smaller) or a list of chunk
            sizes.
        dim: The dim to split along.

    Returns:
        A list of trees shaped like ``tree``, one per chunk.

    Raises:
        ValueError: Two leaves give different numbers of chunks (naming the path of the
            second), or a chunk size leaves the number unknown (no tensor in the tree).
        TypeError: An argument has the wrong type, or a leaf is not a tensor (naming its path).
        RuntimeError: torch cannot split a leaf so (naming its path).

    Example:
        >>> tree = {"w": torch.arange(3.0)}
        >>> ms.tree.split(tree, [1, 2])
        [{'w': tensor([0.])}, {'w': tensor([1., 2.])}]
    """
    if type(dim) is not int:
        _check_dim(dim, "split")
    if isinstance(split_size_or_sections, int) and not isinstance(split_size_or_sections, bool):
        return _pieces("split", tree, split_size_or_sections, dim)
    return _pieces("split", tree, _as_sections(split_size_or_sections), dim)


def _pieces(op: str, tree: Any, size: int | list[int] | None, dim: int) -> list[Any]:
    """A list of trees, tree ``i`` holding piece ``i`` of each leaf along ``dim``: its slices
    (``size`` None, `unbind`), chunks of ``size`` or of the sizes listed in ``size`` (`split`)."""
    return fast_or_walk(op, tree, _pieces_fast, _pieces_walk, op, size, dim)


def _pieces_fast(flat: DictLeaves, op: str, size: int | list[int] | None, dim: int) -> list[Any]:
    leaves = flat.leaves
    if not leaves:
        raise Decline  # the walk knows the count, or says that it is unknown
    if size is None:
        pieces = [leaf.unbind(dim) for leaf in leaves]
    elif isinstance(size, int):
        pieces = [leaf.split(size, dim) for leaf in leaves]
    else:
        # split_with_sizes skips Tensor.split's Python-level look at the argument's type
        pieces = [leaf.split_with_sizes(size, dim) for leaf in leaves]
    if len(set(map(len, pieces))) != 1:
        raise Decline
    retie(pieces, tie_pairs(leaves))
    return [refill(flat.skeleton, iter(column)) for column in zip(*pieces, strict=True)]


def _pieces_walk(tree: Any, op: str, size: int | list[int] | None, dim: int) -> list[Any]:
    if isinstance(size, list):
        sections = size
        return split_leaves(lambda leaf: leaf.split_with_sizes(sections, dim), tree, len(size))

    def pieces_of(leaf: Tensor) -> Sequence[Tensor]:
        return leaf.unbind(dim) if size is None else leaf.split(size, dim)

    first = first_tensor(tree)
    if first is None:
        raise ValueError(
            message(op, "the tree has no tensor leaf, so the number of pieces is unknown")
        )
    try:
        count = len(pieces_of(first))
    except (RuntimeError, IndexError):
        count = -1  # the walk raises this again at that leaf, naming its path
    return split_leaves(pieces_of, tree, count)


def _as_shape(shape: Any, op: str) -> tuple[int, ...]:
    if isinstance(shape, int) and not isinstance(shape, bool):
        return (shape,)
    if isinstance(shape, (tuple, list, torch.Size)) and all(
        isinstance(size, int) and not isinstance(size, bool) for size in shape
    ):
        if sum(size == -1 for size in shape) > 1 or any(size < -1 for size in shape):
            raise ValueError(message(op, f"invalid shape {tuple(shape)}"))
        return tuple(shape)
    raise TypeError(message(op, f"shape must be an int or a sequence of ints, got {shape!r}"))


def _as_batch_ndim(batch_ndim: Any, op: str) -> int:
    if not isinstance(batch_ndim, int) or isinstance(batch_ndim, bool) or batch_ndim < 0:
        raise ValueError(message(op, f"batch_ndim must be an int >= 0, got {batch_ndim!r}"))
    return batch_ndim


def _as_sections(sections: Any) -> list[int]:
    if isinstance(sections, (list, tuple, torch.Size)) and all(
        isinstance(size, int) and not isinstance(size, bool) for size in sections
    ):
        return list(sections)
    raise TypeError(
        message(
            "split", f"split_size_or_sections must be an int or a list of ints, got {sections!r}"
        )
    )


def _check_dim(dim: Any, op: str) -> None:
    if not isinstance(dim, int) or isinstance(dim, bool):
        raise TypeError(message(op, f"dim must be an int, got {dim!r}"))
