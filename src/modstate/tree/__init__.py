"""Operations on pytrees of tensors: map, reshape, split, arithmetic, selection, summary.

Every function takes any pytree (nested ``dict``/``list``/``tuple``/namedtuple, ``None`` as an
empty subtree) whose leaves are tensors, returns a new tree of the same structure, and never
mutates its input. Dicts keep their insertion order. The leading ``batch_ndim`` dims of each leaf
(default 1, the ensemble dim) are its batch dims; the rest of each leaf is untouched.

>>> import torch, modstate as ms
>>> tree = {"layer": {"weight": torch.ones(4, 3, 2), "bias": torch.zeros(4, 3)}}
>>> ms.tree.reshape(tree, (2, 2))["layer"]["weight"].shape
torch.Size([2, 2, 3, 2])
>>> [t["layer"]["bias"].shape for t in ms.tree.unbind(tree)]
[torch.Size([3]), torch.Size([3]), torch.Size([3]), torch.Size([3])]

A tie stays a tie: one tensor at several places (``extract`` lists a tied weight at each of its
paths) gives one result at all of them, computed at its first place, so the result still fits
the model (see ``_ties``).

Errors name the dotted path of the offending leaf (``"layer.bias"``); a refused call returns
nothing and changes nothing. Plain nested dicts of tensors (what ``modstate.extract`` gives) take a
fast path; other pytrees are walked with optree's node definitions, nothing registered globally.
"""

from __future__ import annotations

import numbers
from builtins import map as _builtin_map
from collections.abc import Callable, Sequence
from itertools import repeat
from typing import Any

import torch
from torch import Tensor

from modstate._core.torch_facts import functorch_active
from modstate.tree._flat import flatten_dict, unflatten_dict
from modstate.tree._partition import combine, is_float, is_trainable, partition
from modstate.tree._select import exclude, select
from modstate.tree._summary import TreeSummary, summary
from modstate.tree._ties import keeping_ties, retie, tie_pairs
from modstate.tree._walk import (
    APPLY,
    KEEP,
    REFUSE,
    AtPath,
    StructureMismatch,
    first_tensor,
    leaves_with_paths,
    map_leaves,
    map_leaves_n,
    raise_at,
    split_leaves,
)

__all__ = [
    "TreeSummary",
    "add",
    "clone",
    "combine",
    "detach",
    "exclude",
    "is_float",
    "is_trainable",
    "lerp",
    "map",
    "map_with_path",
    "mul",
    "partition",
    "reshape",
    "select",
    "split",
    "sub",
    "summary",
    "to",
    "unbind",
    "view",
    "zeros_like",
]

_SCALAR_TYPES = (int, float, bool)


# ---------------------------------------------------------------------------------------------
# map


def map(fn: Callable[..., Any], tree: Any, *rest: Any) -> Any:
    """``fn(leaf, *matching_leaves)`` at every leaf; a new tree of the same structure.

    ``rest`` are trees with exactly the structure of ``tree`` (dicts: same keys, any order). Every
    leaf goes to ``fn``, tensor or not; ``None`` is an empty subtree and stays ``None``. A tensor
    at several places (a tied weight) goes to ``fn`` once, at its first place, and the result
    stands at all of them. An exception from ``fn`` propagates unchanged, with the leaf's path
    added as a note.

    >>> ms.tree.map(lambda p, g: p - 0.1 * g, params, grads)    # doctest: +SKIP
    >>> ms.tree.map(torch.square, {"a": torch.tensor([2.0])})
    {'a': tensor([4.])}
    """
    return _map_user_fn("map", fn, tree, rest)


def map_with_path(fn: Callable[..., Any], tree: Any, *rest: Any) -> Any:
    """``fn(path, leaf, *matching_leaves)`` at every leaf, ``path`` the dotted string of its keys.

    Paths read like ``state_dict`` keys: ``"encoder.layers.0.linear1.weight"`` (list indices and
    namedtuple field names appear as keys too; a root leaf has path ``""``).
    A tensor at several paths (a tied weight) goes to ``fn`` once, with its first path, and the
    result stands at all of them, as in `map`.

    >>> ms.tree.map_with_path(lambda path, x: path, {"0": {"weight": torch.ones(1)}})
    {'0': {'weight': '0.weight'}}
    """
    paths = iter([path for path, _ in leaves_with_paths(tree)])
    # with_path must see every place, to keep the paths in step; the tie is kept here instead,
    # keyed by the leaf, so that it is computed once, with its first path.
    tied = keeping_ties(lambda leaf, path, *others: fn(path, leaf, *others))

    def with_path(leaf: Any, *others: Any) -> Any:
        return tied(leaf, next(paths), *others)

    return _map_user_fn("map_with_path", with_path, tree, rest, ties=False)


def _map_user_fn(
    name: str, fn: Callable[..., Any], tree: Any, rest: tuple[Any, ...], *, ties: bool = True
) -> Any:
    """``fn`` at every leaf of ``tree`` and the matching leaves of ``rest``; errors name ``name``."""
    try:
        if rest:
            return map_leaves_n(fn, tree, rest, APPLY, _rest_names(len(rest)), ties=ties)
        return map_leaves(fn, tree, APPLY, ties=ties)
    except AtPath as error:
        raise_at(name, error, user_fn=True)
    except StructureMismatch as error:
        raise_at(name, AtPath(error))


def _rest_names(count: int) -> tuple[str, ...]:
    return tuple(f"rest[{index}]" for index in range(count))


# ---------------------------------------------------------------------------------------------
# batch shape: reshape, view, unbind, split


def reshape(tree: Any, shape: int | Sequence[int], *, batch_ndim: int = 1) -> Any:
    """Reshape the leading ``batch_ndim`` dims of every leaf to ``shape``; the rest is kept.

    Each leaf becomes ``leaf.reshape(*shape, *leaf.shape[batch_ndim:])``, a view where torch can
    make one and a copy otherwise. ``shape`` may hold one ``-1``, resolved per leaf.

    >>> tree = {"w": torch.zeros(3, 4, 5), "b": torch.zeros(3, 4)}
    >>> {k: v.shape for k, v in ms.tree.reshape(tree, 12, batch_ndim=2).items()}
    {'w': torch.Size([12, 5]), 'b': torch.Size([12])}
    """
    new = _as_shape(shape, "reshape")
    ndim = _as_batch_ndim(batch_ndim, "reshape")
    flat = flatten_dict(tree) if type(tree) is dict else None
    if flat is not None:
        structure, leaves, _ = flat
        try:
            if leaves and min(_builtin_map(Tensor.dim, leaves)) < ndim:
                raise _Slow
            if len(new) == 1 and ndim >= 2:
                # flatten(0, ndim - 1) is reshape(-1, *rest) (same view-or-copy rule) with less
                # argument parsing; a size other than the merged one goes the slow way to fail.
                out = [leaf.flatten(0, ndim - 1) for leaf in leaves]
                if new[0] != -1 and {*_builtin_map(Tensor.size, out, repeat(0))} != {new[0]}:
                    raise _Slow
            else:
                out = [leaf.reshape(*new, *leaf.shape[ndim:]) for leaf in leaves]
            return _rebuild(structure, leaves, out)
        except Exception:
            pass  # the generic walk below raises the error with the leaf's path
    try:
        return map_leaves(lambda leaf: _reshape_leaf(leaf, new, ndim), tree, REFUSE)
    except AtPath as error:
        raise_at("reshape", error)


def view(tree: Any, shape: int | Sequence[int], *, batch_ndim: int = 1) -> Any:
    """Like `reshape`, but every leaf is a ``view`` that shares storage with the input leaf.

    Raises (naming the leaf) where a leaf's memory layout does not allow a view.

    >>> tree = {"w": torch.zeros(3, 4, 5)}
    >>> out = ms.tree.view(tree, (-1,), batch_ndim=2)
    >>> out["w"].shape, out["w"].data_ptr() == tree["w"].data_ptr()
    (torch.Size([12, 5]), True)
    """
    new = _as_shape(shape, "view")
    ndim = _as_batch_ndim(batch_ndim, "view")
    flat = flatten_dict(tree) if type(tree) is dict else None
    if flat is not None:
        structure, leaves, _ = flat
        try:
            if leaves and min(_builtin_map(Tensor.dim, leaves)) < ndim:
                raise _Slow
            out = [leaf.view(*new, *leaf.shape[ndim:]) for leaf in leaves]
            return _rebuild(structure, leaves, out)
        except Exception:
            pass  # the generic walk below raises the error with the leaf's path
    try:
        return map_leaves(lambda leaf: _view_leaf(leaf, new, ndim), tree, REFUSE)
    except AtPath as error:
        raise_at("view", error)


def unbind(tree: Any, dim: int = 0) -> list[Any]:
    """Split every leaf along ``dim`` into its slices: a list of trees, one per index of ``dim``.

    Tree ``i`` holds ``leaf.unbind(dim)[i]`` at each leaf (like ``TensorDict.unbind``), so
    ``unbind(stack(trees))`` gives the trees back. Every leaf must have the same size along
    ``dim``; a tree without tensor leaves cannot be unbound (the count would be unknown).

    >>> stacked = {"w": torch.arange(6.0).reshape(3, 2)}
    >>> ms.tree.unbind(stacked)
    [{'w': tensor([0., 1.])}, {'w': tensor([2., 3.])}, {'w': tensor([4., 5.])}]
    """
    if type(dim) is not int:
        _check_dim(dim, "unbind")
    flat = flatten_dict(tree) if type(tree) is dict else None
    if flat is not None and flat[1]:
        structure, leaves, _ = flat
        try:
            pieces = [leaf.unbind(dim) for leaf in leaves]
        except Exception:
            pieces = None  # the generic walk below raises the error with the leaf's path
        if pieces is not None and len(set(_builtin_map(len, pieces))) == 1:
            retie(pieces, tie_pairs(leaves))
            return [unflatten_dict(structure, iter(column)) for column in zip(*pieces)]
    return _split_slow("unbind", tree, lambda leaf: leaf.unbind(dim), lambda first: first.size(dim))


def split(tree: Any, split_size_or_sections: int | Sequence[int], dim: int = 0) -> list[Any]:
    """Split every leaf along ``dim`` like ``torch.split``: a list of trees, one per chunk.

    ``split_size_or_sections`` is a chunk size (the last chunk may be smaller) or a list of chunk
    sizes. Every leaf must give the same number of chunks.

    >>> tree = {"w": torch.arange(3.0)}
    >>> ms.tree.split(tree, [1, 2])
    [{'w': tensor([0.])}, {'w': tensor([1., 2.])}]
    """
    if type(dim) is not int:
        _check_dim(dim, "split")
    sections = None
    if isinstance(split_size_or_sections, int) and not isinstance(split_size_or_sections, bool):
        size = split_size_or_sections

        def chunks(leaf: Tensor) -> tuple[Tensor, ...]:
            return leaf.split(size, dim)

    else:
        sections = _as_sections(split_size_or_sections)

        def chunks(leaf: Tensor) -> tuple[Tensor, ...]:
            return leaf.split_with_sizes(sections, dim)

    flat = flatten_dict(tree) if type(tree) is dict else None
    if flat is not None and flat[1]:
        structure, leaves, _ = flat
        try:
            if sections is None:
                pieces = [leaf.split(size, dim) for leaf in leaves]
            else:
                # split_with_sizes skips Tensor.split's Python-level look at the argument's type
                pieces = [leaf.split_with_sizes(sections, dim) for leaf in leaves]
        except Exception:
            pieces = None  # the generic walk below raises the error with the leaf's path
        if pieces is not None and len(set(_builtin_map(len, pieces))) == 1:
            retie(pieces, tie_pairs(leaves))
            return [unflatten_dict(structure, iter(column)) for column in zip(*pieces)]
    if sections is not None:
        try:
            return split_leaves(chunks, tree, len(sections))
        except AtPath as error:
            raise_at("split", error)
    return _split_slow("split", tree, chunks, lambda first: len(chunks(first)))


def _as_shape(shape: Any, op: str) -> tuple[int, ...]:
    if isinstance(shape, int) and not isinstance(shape, bool):
        return (shape,)
    if isinstance(shape, (tuple, list, torch.Size)) and all(
        isinstance(size, int) and not isinstance(size, bool) for size in shape
    ):
        if sum(size == -1 for size in shape) > 1 or any(size < -1 for size in shape):
            raise ValueError(f"modstate.tree.{op}: invalid shape {tuple(shape)}")
        return tuple(shape)
    raise TypeError(
        f"modstate.tree.{op}: shape must be an int or a sequence of ints, got {shape!r}"
    )


def _as_batch_ndim(batch_ndim: Any, op: str) -> int:
    if not isinstance(batch_ndim, int) or isinstance(batch_ndim, bool) or batch_ndim < 0:
        raise ValueError(f"modstate.tree.{op}: batch_ndim must be an int >= 0, got {batch_ndim!r}")
    return batch_ndim


def _as_sections(sections: Any) -> list[int]:
    if isinstance(sections, (list, tuple, torch.Size)) and all(
        isinstance(size, int) and not isinstance(size, bool) for size in sections
    ):
        return list(sections)
    raise TypeError(
        f"modstate.tree.split: split_size_or_sections must be an int or a list of ints, "
        f"got {sections!r}"
    )


def _check_dim(dim: Any, op: str) -> None:
    if not isinstance(dim, int) or isinstance(dim, bool):
        raise TypeError(f"modstate.tree.{op}: dim must be an int, got {dim!r}")


def _split_slow(
    op: str,
    tree: Any,
    pieces_of: Callable[[Tensor], Sequence[Tensor]],
    count_of: Callable[[Tensor], int],
) -> list[Any]:
    """`split_leaves` with the piece count taken from the first tensor leaf, errors with paths."""
    first = first_tensor(tree)
    if first is None:
        raise ValueError(
            f"modstate.tree.{op}: the tree has no tensor leaf, so the number of pieces is unknown"
        )
    try:
        count = count_of(first)
    except (RuntimeError, IndexError):
        count = -1  # the walk raises this again at that leaf, naming its path
    try:
        return split_leaves(pieces_of, tree, count)
    except AtPath as error:
        raise_at(op, error)


def _rebuild(structure: Any, leaves: list[Tensor], out: list[Any]) -> dict:
    """The result tree of a fast-path op: ``out[i]`` computed from ``leaves[i]``, ties kept."""
    retie(out, tie_pairs(leaves))
    return unflatten_dict(structure, iter(out))


class _Slow(Exception):
    """Leave the fast path: the generic walk gives the result or the error with its path."""


def _batch_error(leaf: Tensor, ndim: int) -> ValueError:
    return ValueError(f"a leaf of shape {tuple(leaf.shape)} has fewer than batch_ndim={ndim} dims")


def _reshape_leaf(leaf: Tensor, new: tuple[int, ...], ndim: int) -> Tensor:
    if leaf.dim() < ndim:
        raise _batch_error(leaf, ndim)
    return leaf.reshape(*new, *leaf.shape[ndim:])


def _view_leaf(leaf: Tensor, new: tuple[int, ...], ndim: int) -> Tensor:
    if leaf.dim() < ndim:
        raise _batch_error(leaf, ndim)
    return leaf.view(*new, *leaf.shape[ndim:])


# ---------------------------------------------------------------------------------------------
# arithmetic


def add(tree: Any, other: Any, *, alpha: float | Tensor = 1) -> Any:
    """``leaf + alpha * other`` at every leaf, with ``torch.add``'s rules (dtype promotion, alpha).

    ``other`` is a Python number, a tensor (broadcast against every leaf), or a tree with the
    same structure as ``tree`` whose leaves are added leaf by leaf.

    >>> ms.tree.add({"w": torch.ones(2)}, 1)
    {'w': tensor([2., 2.])}
    >>> ms.tree.add({"w": torch.ones(2)}, {"w": torch.ones(2)}, alpha=-0.5)
    {'w': tensor([0.5000, 0.5000])}
    """
    if type(alpha) is int and alpha == 1:
        return _binary("add", tree, other, torch.add, torch._foreach_add)
    return _binary("add", tree, other, _with_alpha(torch.add, alpha))


def sub(tree: Any, other: Any, *, alpha: float | Tensor = 1) -> Any:
    """``leaf - alpha * other`` at every leaf, with ``torch.sub``'s rules; ``other`` as in `add`.

    >>> ms.tree.sub({"w": torch.ones(2)}, {"w": torch.ones(2)})
    {'w': tensor([0., 0.])}
    """
    if type(alpha) is int and alpha == 1:
        return _binary("sub", tree, other, torch.sub, torch._foreach_sub)
    return _binary("sub", tree, other, _with_alpha(torch.sub, alpha))


_FLOAT_ONLY_HINT = (
    "keep integer leaves (BatchNorm's num_batches_tracked) out: "
    "floats, ints = ms.tree.partition(tree, ms.tree.is_float)"
)


def _with_alpha(op: Callable[..., Tensor], alpha: Any) -> Callable[[Tensor, Any], Tensor]:
    """``op(a, b, alpha=alpha)``; torch's refusal of a fractional alpha on integer leaves gets a
    hint (same error class, so the ops still fail exactly where torch's do)."""

    def leaf_op(leaf: Tensor, other: Any) -> Tensor:
        try:
            return op(leaf, other, alpha=alpha)
        except RuntimeError as error:
            if "alpha" in str(error) and not (leaf.is_floating_point() or leaf.is_complex()):
                raise RuntimeError(f"{error} ({leaf.dtype} leaf); {_FLOAT_ONLY_HINT}") from None
            raise

    return leaf_op


def mul(tree: Any, other: Any) -> Any:
    """``leaf * other`` at every leaf, with ``torch.mul``'s rules; ``other`` as in `add`.

    >>> ms.tree.mul({"w": torch.ones(2)}, 3)
    {'w': tensor([3., 3.])}
    """
    return _binary("mul", tree, other, torch.mul, torch._foreach_mul)


def lerp(tree: Any, end: Any, weight: Any) -> Any:
    """``torch.lerp(leaf, end, weight)`` = ``leaf + weight * (end - leaf)`` at every leaf.

    ``end`` is a tree with the structure of ``tree`` (or one tensor, broadcast); ``weight`` is a
    number, a tensor, or such a tree. An exponential moving average of parameters is
    ``ema = ms.tree.lerp(ema, params, 1 - decay)``.

    >>> ms.tree.lerp({"w": torch.zeros(2)}, {"w": torch.ones(2)}, 0.25)
    {'w': tensor([0.2500, 0.2500])}
    """
    end_is_tree = not isinstance(end, Tensor)
    weight_is_tree = not (isinstance(weight, Tensor) or _is_scalar(weight))
    others: list[Any] = []
    names: list[str] = []
    if end_is_tree:
        others.append(end)
        names.append("end")
    if weight_is_tree:
        others.append(weight)
        names.append("weight")

    def leaf_lerp(leaf: Tensor, *matching: Any) -> Tensor:
        if not (leaf.is_floating_point() or leaf.is_complex()):
            raise TypeError(
                f"lerp needs floating-point leaves, this one is {leaf.dtype}; " + _FLOAT_ONLY_HINT
            )
        leaf_end = matching[0] if end_is_tree else end
        leaf_weight = matching[-1] if weight_is_tree else weight
        return torch.lerp(leaf, leaf_end, leaf_weight)

    try:
        return map_leaves_n(leaf_lerp, tree, others, REFUSE, names)
    except AtPath as error:
        raise_at("lerp", error)
    except StructureMismatch as error:
        raise_at("lerp", AtPath(error))


def _is_scalar(value: Any) -> bool:
    return isinstance(value, numbers.Number)


def _binary(
    op: str,
    tree: Any,
    other: Any,
    leaf_op: Callable[[Tensor, Any], Tensor],
    foreach_kernel: Callable[[list[Tensor], Any], list[Tensor]] | None = None,
) -> Any:
    """``leaf_op(leaf, other)`` (other a number or tensor) or ``leaf_op(leaf, other_leaf)``."""
    operand_is_tree = not (
        type(other) in _SCALAR_TYPES or isinstance(other, Tensor) or _is_scalar(other)
    )
    flat = flatten_dict(tree) if type(tree) is dict else None
    if flat is not None:
        structure, leaves, plain = flat
        try:
            if operand_is_tree:
                other_flat = flatten_dict(other) if type(other) is dict else None
                if other_flat is None or other_flat[0] != structure:
                    raise _Slow
                out = [leaf_op(leaf, match) for leaf, match in zip(leaves, other_flat[1])]
            elif plain and foreach_kernel is not None and _foreach_applies(leaves, other):
                out = foreach_kernel(leaves, other)
            else:
                out = [leaf_op(leaf, other) for leaf in leaves]
            return _rebuild(structure, leaves, out)
        except Exception:
            pass  # the generic walk below raises the error with the leaf's path
    try:
        if operand_is_tree:
            return map_leaves_n(leaf_op, tree, (other,), REFUSE, ("other",))
        return map_leaves(lambda leaf: leaf_op(leaf, other), tree, REFUSE)
    except AtPath as error:
        raise_at(op, error)
    except StructureMismatch as error:
        raise_at(op, AtPath(error))


def _foreach_applies(leaves: list[Tensor], scalar: Any) -> bool:
    """Whether one foreach call is exactly the per-leaf op, and saves its Python dispatch.

    Only for plain tensors (no subclass with its own dispatch; the caller checks), a Python
    number (foreach kernels promote a 0-dim tensor or a numpy scalar differently from the
    per-tensor ops), and outside functorch transforms (foreach ops have no vmap rule).
    """
    return type(scalar) in _SCALAR_TYPES and bool(leaves) and not functorch_active()


def _each(op: str, tree: Any, leaf_fn: Callable[[Tensor], Any], non_tensor: str) -> Any:
    """``leaf_fn`` at every tensor leaf; other leaves as ``non_tensor`` says."""
    flat = flatten_dict(tree) if type(tree) is dict else None
    if flat is not None:
        structure, leaves, _ = flat
        try:
            return _rebuild(structure, leaves, [leaf_fn(leaf) for leaf in leaves])
        except Exception:
            pass  # the generic walk below raises the error with the leaf's path
    try:
        return map_leaves(leaf_fn, tree, non_tensor)
    except AtPath as error:
        raise_at(op, error)


# ---------------------------------------------------------------------------------------------
# one tensor op per leaf


def zeros_like(tree: Any) -> Any:
    """A tree of zeros shaped, typed and placed like ``tree``'s leaves (``torch.zeros_like``).

    >>> ms.tree.zeros_like({"w": torch.ones(2, dtype=torch.int64)})
    {'w': tensor([0, 0])}
    """
    return _each("zeros_like", tree, torch.zeros_like, REFUSE)


def clone(tree: Any) -> Any:
    """A copy of every tensor leaf (``Tensor.clone``: new memory, still in the autograd graph).

    Non-tensor leaves are kept as they are (the same objects).

    >>> tree = {"w": torch.zeros(2)}
    >>> copy = ms.tree.clone(tree)
    >>> _ = copy["w"].add_(1)
    >>> tree["w"]
    tensor([0., 0.])
    """
    return _each("clone", tree, Tensor.clone, KEEP)


def detach(tree: Any) -> Any:
    """Every tensor leaf detached from the autograd graph (``Tensor.detach``: storage shared).

    Non-tensor leaves are kept as they are.

    >>> w = torch.ones(2, requires_grad=True)
    >>> ms.tree.detach({"w": w * 2})["w"].requires_grad
    False
    """
    return _each("detach", tree, Tensor.detach, KEEP)


def to(tree: Any, *args: Any, **kwargs: Any) -> Any:
    """``leaf.to(*args, **kwargs)`` at every tensor leaf: device and/or dtype, as ``Tensor.to``.

    Non-tensor leaves are kept as they are, as ``nn.Module.to`` leaves non-tensor state alone.

    >>> ms.tree.to({"w": torch.ones(2)}, torch.float64)["w"].dtype
    torch.float64
    """
    return _each("to", tree, lambda leaf: leaf.to(*args, **kwargs), KEEP)
