"""Arithmetic on trees with torch's rules: `add`, `sub`, `mul`, `lerp`."""

from __future__ import annotations

import numbers
from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch import Tensor

from modstate._core.torch_facts import foreach_allowed
from modstate.tree._errors import naming_paths
from modstate.tree._fast import Decline, DictLeaves, dict_leaves, fast_or_walk, refill_tied
from modstate.tree._predicates import is_float
from modstate.tree._walk import REFUSE, map_leaves, map_leaves_n

_SCALAR_TYPES = (int, float, bool)


def _integers_kept_fix(op: str, arguments: str) -> str:
    """The fix for an integer leaf that ``op`` would float: ``op`` on the floating-point half
    (``arguments`` after ``floats``), combined with the rest."""
    return (
        f"apply {op} to the floating-point leaves only and keep the others: floats, ints = "
        "ms.tree.partition(tree, ms.tree.is_float); "
        f"ms.tree.combine(ms.tree.{op}(floats, {arguments}), ints)"
    )


def _operand(name: str, is_tree: bool) -> str:
    """How the fix passes an operand: a tree loses the places of the tree's integer leaves too."""
    return f"ms.tree.partition({name}, ms.tree.is_float)[0]" if is_tree else name


def _is_fractional(number: Any) -> bool:
    if isinstance(number, Tensor):
        return is_float(number)
    return isinstance(number, numbers.Number) and not isinstance(number, numbers.Integral)


def _floated(leaf: Tensor, by: str, result: str, fix: str) -> TypeError:
    """The one error for an integer leaf that an op would make floating-point."""
    return TypeError(
        f"a {leaf.dtype} leaf, which {by} would make {result}: integer leaves (BatchNorm's "
        f"num_batches_tracked) are never floated; {fix}"
    )


def _integers_kept(
    op: str, leaf_op: Callable[[Tensor, Any], Tensor], operand_is_tree: bool, alpha: Any = None
) -> Callable[[Tensor, Any], Tensor]:
    """``leaf_op``, refusing an integer (or bool) leaf that the op would make floating-point.

    torch promotes ``int64 * 0.5`` to float32, which would silently turn BatchNorm's
    ``num_batches_tracked`` into a float (and a fractional ``alpha`` on an integer tensor is an
    error in torch): every such leaf gets one TypeError, with the fix that keeps it integer.
    """

    def fix() -> str:
        other_argument = _operand("other", operand_is_tree)
        return _integers_kept_fix(
            op, other_argument if alpha is None else f"{other_argument}, alpha=alpha"
        )

    fractional_alpha = _is_fractional(alpha)  # once: an ABC check costs a microsecond a leaf

    def checked(leaf: Tensor, other: Any) -> Tensor:
        if isinstance(leaf, Tensor) and not is_float(leaf):
            if fractional_alpha:
                raise _floated(
                    leaf, f"{op} with a fractional alpha ({alpha})", "floating-point", fix()
                )
            if isinstance(other, Tensor) and other.dtype == leaf.dtype:
                pass  # a counter plus a counter: nothing to promote
            elif isinstance(other, (Tensor, int, float, complex)):
                result = torch.result_type(leaf, other)
                if result.is_floating_point or result.is_complex:
                    raise _floated(leaf, op, str(result), fix())
        return leaf_op(leaf, other)

    return checked


def add(tree: Any, other: Any, *, alpha: float | Tensor = 1) -> Any:
    """``leaf + alpha * other`` at every leaf, with ``torch.add``'s rules (dtype promotion, alpha).

    Args:
        tree: A pytree of tensors.
        other: A Python number, a tensor (broadcast against every leaf), or a tree with the
            structure of ``tree`` whose leaves are added leaf by leaf (dicts: same keys, any
            order; a ``dict`` matches an ``OrderedDict``).
        alpha: The multiplier for ``other``.

    Returns:
        A new tree shaped like ``tree``; the inputs are not changed.

    Raises:
        ValueError: ``other`` is a tree of another structure (naming the first differing place).
        TypeError: A leaf is not a tensor, or an integer or bool leaf would become
            floating-point (a fractional ``other`` or ``alpha``); the message names its path
            and the fix: `partition` the tree with [`is_float`][modstate.tree.is_float], then
            [`combine`][modstate.tree.combine].
        RuntimeError: torch refuses the op at a leaf (naming its path).

    Example:
        >>> ms.tree.add({"w": torch.ones(2)}, 1)
        {'w': tensor([2., 2.])}
        >>> ms.tree.add({"w": torch.ones(2)}, {"w": torch.ones(2)}, alpha=-0.5)
        {'w': tensor([0.5000, 0.5000])}
    """
    if type(alpha) is int and alpha == 1:
        return _binary("add", tree, other, torch.add, torch._foreach_add)
    return _binary("add", tree, other, _with_alpha(torch.add, alpha), alpha=alpha)


def sub(tree: Any, other: Any, *, alpha: float | Tensor = 1) -> Any:
    """``leaf - alpha * other`` at every leaf, with ``torch.sub``'s rules.

    Args:
        tree: A pytree of tensors.
        other: A number, a tensor, or a tree with the structure of ``tree``, as in
            [`add`][modstate.tree.add].
        alpha: The multiplier for ``other``.

    Returns:
        A new tree shaped like ``tree``.

    Raises:
        ValueError: ``other`` is a tree of another structure (naming the first differing place).
        TypeError: A leaf is not a tensor, or an integer or bool leaf would become
            floating-point, as in [`add`][modstate.tree.add] (naming its path and the fix).
        RuntimeError: torch refuses the op at a leaf (naming its path).

    Example:
        >>> ms.tree.sub({"w": torch.ones(2)}, {"w": torch.ones(2)})
        {'w': tensor([0., 0.])}
    """
    if type(alpha) is int and alpha == 1:
        return _binary("sub", tree, other, torch.sub, torch._foreach_sub)
    return _binary("sub", tree, other, _with_alpha(torch.sub, alpha), alpha=alpha)


def mul(tree: Any, other: Any) -> Any:
    """``leaf * other`` at every leaf, with ``torch.mul``'s rules.

    An integer factor keeps integer leaves integer; a fractional one refuses them (torch would
    make BatchNorm's ``num_batches_tracked`` a float), naming the path and the fix.

    Args:
        tree: A pytree of tensors.
        other: A number, a tensor, or a tree with the structure of ``tree``, as in
            [`add`][modstate.tree.add].

    Returns:
        A new tree shaped like ``tree``.

    Raises:
        ValueError: ``other`` is a tree of another structure (naming the first differing place).
        TypeError: A leaf is not a tensor, or an integer or bool leaf would become
            floating-point (naming its path, with the fix: `partition` the tree with
            [`is_float`][modstate.tree.is_float], then [`combine`][modstate.tree.combine]).
        RuntimeError: torch refuses the op at a leaf (naming its path).

    Example:
        >>> ms.tree.mul({"w": torch.ones(2), "n": torch.tensor(3)}, 2)
        {'w': tensor([2., 2.]), 'n': tensor(6)}
    """
    return _binary("mul", tree, other, torch.mul, torch._foreach_mul)


def lerp(tree: Any, end: Any, weight: Any) -> Any:
    """``torch.lerp(leaf, end, weight)`` = ``leaf + weight * (end - leaf)`` at every leaf.

    An exponential moving average of parameters is ``ema = ms.tree.lerp(ema, params, 1 - decay)``.
    Leaves must be floating-point or complex ([`is_float`][modstate.tree.is_float]).

    Args:
        tree: A pytree of floating-point or complex tensors.
        end: A tree with the structure of ``tree`` (a ``dict`` matches an ``OrderedDict`` such
            as ``model.state_dict()``), or one tensor, broadcast against every leaf.
        weight: A number, a tensor, or a tree with the structure of ``tree``.

    Returns:
        A new tree shaped like ``tree``.

    Raises:
        ValueError: ``end`` or ``weight`` is a tree of another structure (naming the place).
        TypeError: A leaf is not a floating-point or complex tensor (naming its path, with the
            fix: `partition` the tree with [`is_float`][modstate.tree.is_float], then
            [`combine`][modstate.tree.combine]).
        RuntimeError: torch refuses the op at a leaf (naming its path).

    Example:
        >>> ms.tree.lerp({"w": torch.zeros(2)}, {"w": torch.ones(2)}, 0.25)
        {'w': tensor([0.2500, 0.2500])}
    """
    end_is_tree = not isinstance(end, Tensor)
    weight_is_tree = not (isinstance(weight, (Tensor, numbers.Number)))
    others: list[Any] = []
    names: list[str] = []
    if end_is_tree:
        others.append(end)
        names.append("end")
    if weight_is_tree:
        others.append(weight)
        names.append("weight")

    fix = _integers_kept_fix(
        "lerp", f"{_operand('end', end_is_tree)}, {_operand('weight', weight_is_tree)}"
    )

    def leaf_lerp(leaf: Tensor, *matching: Any) -> Tensor:
        if not is_float(leaf):
            raise _floated(leaf, "lerp", "floating-point", fix)
        leaf_end = matching[0] if end_is_tree else end
        leaf_weight = matching[-1] if weight_is_tree else weight
        return torch.lerp(leaf, leaf_end, leaf_weight)

    return naming_paths("lerp", lambda: map_leaves_n(leaf_lerp, tree, others, REFUSE, names))


def _with_alpha(op: Callable[..., Tensor], alpha: Any) -> Callable[[Tensor, Any], Tensor]:
    """``op(a, b, alpha=alpha)`` (a fractional alpha on an integer leaf is refused before)."""
    return lambda leaf, other: op(leaf, other, alpha=alpha)


def _binary(
    op: str,
    tree: Any,
    other: Any,
    leaf_op: Callable[[Tensor, Any], Tensor],
    foreach_kernel: Callable[..., Sequence[Tensor]] | None = None,
    *,
    alpha: Any = None,
) -> Any:
    """``leaf_op(leaf, other)`` (other a number or tensor) or ``leaf_op(leaf, other_leaf)``;
    ``alpha`` is the one ``leaf_op`` applies (None: ``leaf_op`` takes none)."""
    operand_is_tree = not (
        type(other) in _SCALAR_TYPES or isinstance(other, (Tensor, numbers.Number))
    )
    checked = _integers_kept(op, leaf_op, operand_is_tree, alpha)
    return fast_or_walk(
        op, tree, _binary_fast, _binary_walk, other, operand_is_tree, leaf_op, checked,
        foreach_kernel,
    )  # fmt: skip


def _binary_fast(
    flat: DictLeaves,
    other: Any,
    operand_is_tree: bool,
    leaf_op: Callable[[Tensor, Any], Tensor],
    checked: Callable[[Tensor, Any], Tensor],
    foreach_kernel: Callable[..., Sequence[Tensor]] | None,
) -> dict:
    # Floating-point leaves need no check (all of a tree of parameters, all but BatchNorm's
    # counters of a model's tree): the plain op there, the check at the other leaves only.
    floats = all(leaf.is_floating_point() for leaf in flat.leaves)
    if operand_is_tree:
        other_flat = dict_leaves(other) if type(other) is dict else None
        if other_flat is None or other_flat.skeleton != flat.skeleton:
            raise Decline  # the walk matches keys in any order and names a mismatch
        pairs = zip(flat.leaves, other_flat.leaves, strict=True)
        if floats:
            out = [leaf_op(leaf, match) for leaf, match in pairs]
        else:
            out = [
                leaf_op(leaf, match) if leaf.is_floating_point() else checked(leaf, match)
                for leaf, match in pairs
            ]
    elif foreach_kernel is not None and _one_foreach_call(flat, other, floats):
        out = list(foreach_kernel(flat.leaves, other))  # a tuple: retie writes into it
    elif floats:
        out = [leaf_op(leaf, other) for leaf in flat.leaves]
    else:
        out = [
            leaf_op(leaf, other) if leaf.is_floating_point() else checked(leaf, other)
            for leaf in flat.leaves
        ]
    return refill_tied(flat, out)


def _binary_walk(
    tree: Any,
    other: Any,
    operand_is_tree: bool,
    leaf_op: Callable[[Tensor, Any], Tensor],
    checked: Callable[[Tensor, Any], Tensor],
    foreach_kernel: Callable[..., Sequence[Tensor]] | None,
) -> Any:
    if operand_is_tree:
        return map_leaves_n(checked, tree, (other,), REFUSE, ("other",))
    return map_leaves(lambda leaf: checked(leaf, other), tree, REFUSE)


def _one_foreach_call(flat: DictLeaves, scalar: Any, floats: bool) -> bool:
    """Whether one foreach call is exactly the per-leaf op, and saves its Python dispatch.

    Only for plain tensors (no subclass with its own dispatch), a Python number (foreach kernels
    promote a 0-dim tensor or a numpy scalar differently from the per-tensor ops), and where
    `foreach_allowed` says so (no ``torch.func`` transform, nothing recorded by autograd). A
    float number over leaves that are not all ``floats`` (floating-point) goes leaf by leaf,
    where an integer leaf is refused.
    """
    return (
        flat.exact
        and type(scalar) in _SCALAR_TYPES
        and bool(flat.leaves)
        and (floats or type(scalar) is not float)
        and foreach_allowed(flat.leaves)
    )
