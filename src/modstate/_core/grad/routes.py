"""`grad` and `grad_and_value`: `torch.func.grad`'s contract at the cost of ``loss.backward()``.

``torch.func.grad`` wraps every tensor of every operation in a functorch level, and on a small
model that per-operation dispatch costs about as much as the model itself. Outside any
``torch.func`` transform there is nothing to compose with, so plain autograd computes the same
gradients: each differentiated leaf is detached and set to require grad, ``fn`` runs once, and
the autograd engine takes the gradients as ``torch.autograd.grad`` would (entered directly for
plain tensors, `torch_facts.scalar_gradients`), which costs what ``loss.backward()`` costs, or a
little less (no per-call argument handling). Under a lone ``torch.vmap`` over stacked trees
(``vmap(ms.grad(f))``, an ensemble's loop) one plain backward gives every member's gradient
(`grad_members.py`). Inside any other transform, or when a differentiated leaf already requires
grad (an outer autograd computation, as in MAML, whose gradient must flow through this one), or
a differentiated leaf is shared by the members of a vmap (per-sample gradients), they are
``torch.func.grad`` / ``grad_and_value`` themselves.

Both routes read trees the modstate way: optree pytrees in which None is an empty subtree (a hole
left by ``ms.tree.partition``), and a tensor at several paths (a tie) is one input.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch import Tensor

from modstate._core.grad.arguments import (
    Differentiated,
    GradCall,
    Ties,
    detached,
    grad_enabled,
)
from modstate._core.grad.members import across_members
from modstate._core.torch_facts import functorch_active, scalar_gradients
from modstate._core.trees.readers import TreeReader
from modstate._core.vmap_levels import lone_vmap

Argnums = int | tuple[int, ...]


def grad(fn: Callable[..., Any], argnums: Argnums = 0, has_aux: bool = False) -> Callable[..., Any]:
    """The gradient of `fn` with respect to the arguments at `argnums`: `torch.func.grad`'s
    contract, at the cost of ``loss.backward()``.

    Outside a ``torch.func`` transform the gradients come from plain autograd (the leaves are
    detached, set to require grad, and ``torch.autograd.grad`` runs once): no per-operation
    functorch dispatch, so a functional training step costs what ``backward()`` costs. Under
    a lone ``torch.vmap`` whose members each own every differentiated leaf (an ensemble's
    ``torch.vmap(ms.grad(loss))(stacked)``), one plain backward of the members' summed losses
    gives each member its own gradient, and `modstate.apply` inside runs the members together
    with the ensemble's kernels. Inside other transforms (``torch.func.grad(ms.grad(f))``), for
    a leaf the members share (per-sample gradients), or when a differentiated leaf already
    requires grad (meta-learning through an outer loop), this is ``torch.func.grad``, so
    higher-order gradients work as with it. While ``torch.compile`` traces it, this is
    ``torch.func.grad`` too (Dynamo traces it into the graph, where autograd's engine call
    would end the graph), with the results detached as plain autograd's are.

    Trees are read as everywhere in modstate: None is an empty subtree (its gradient is None),
    a tensor at several paths (a tied weight) is one input whose whole gradient stands at each
    of its paths, and a leaf that `fn` does not use gets a zero gradient (as with
    ``torch.func.grad``). Outside a transform, tensors that `fn` closes over are constants and
    the value and aux come back detached from this differentiation.

    Args:
        fn: a function returning a 0-dim tensor (or ``(tensor, aux)`` with `has_aux`).
        argnums: the position (or a tuple of positions) of the arguments to differentiate.
        has_aux: `fn` returns ``(output, aux)``; aux is returned beside the gradients.

    Returns:
        A function taking `fn`'s arguments and returning the gradients (a tree like the
        argument, or a tuple of them for a tuple `argnums`), or ``(gradients, aux)`` with
        `has_aux`.

    Raises:
        RuntimeError: as ``torch.func.grad``: `fn` does not return a 0-dim tensor (or a pair
            with `has_aux`), `argnums` is invalid, or a differentiated leaf is an integer
            tensor (the message names its path and the fix).
        ValueError: a differentiated leaf is not a tensor (the message names its path).

    Example:
        >>> model = torch.nn.Linear(3, 1)
        >>> params = ms.extract(model, detach=True)
        >>> x = torch.ones(4, 3)
        >>> grads = ms.grad(lambda p: ms.call(model, p, x).sum())(params)
        >>> grads["weight"]
        tensor([[4., 4., 4.]])
    """
    run = _grad_and_value(fn, argnums, has_aux, "grad")

    @functools.wraps(fn)
    def gradient(*args: Any, **kwargs: Any) -> Any:
        grads, value = run(*args, **kwargs)
        return (grads, value[1]) if has_aux else grads

    return gradient


def grad_and_value(
    fn: Callable[..., Any], argnums: Argnums = 0, has_aux: bool = False
) -> Callable[..., Any]:
    """The gradient and the value of `fn`: `torch.func.grad_and_value`'s contract, at the cost
    of ``loss.backward()`` (see `grad` for when plain autograd runs and when torch.func does).

    Args:
        fn: a function returning a 0-dim tensor (or ``(tensor, aux)`` with `has_aux`).
        argnums: the position (or a tuple of positions) of the arguments to differentiate.
        has_aux: `fn` returns ``(output, aux)``.

    Returns:
        A function taking `fn`'s arguments and returning ``(gradients, value)``, or
        ``(gradients, (value, aux))`` with `has_aux`, as ``torch.func.grad_and_value``.

    Raises:
        RuntimeError: as ``torch.func.grad_and_value`` (see `grad`).
        ValueError: a differentiated leaf is not a tensor (the message names its path).

    Example:
        >>> w = {"w": torch.tensor([1.0, 2.0])}
        >>> ms.grad_and_value(lambda p: (p["w"] ** 2).sum())(w)
        ({'w': tensor([2., 4.])}, tensor(5.))
    """
    return _grad_and_value(fn, argnums, has_aux, "grad_and_value")


def _grad_and_value(
    fn: Callable[..., Any], argnums: Argnums, has_aux: bool, name: str
) -> Callable[..., tuple[Any, Any]]:
    readers: dict[int, list[TreeReader]] = {}  # per position, the structures met so far

    @functools.wraps(fn)
    def gradient_and_value(*args: Any, **kwargs: Any) -> tuple[Any, Any]:
        positions = _positions(name, argnums, len(args))
        trees = [
            Differentiated(name, position, args[position], readers.setdefault(position, []))
            for position in positions
        ]
        request = GradCall(name, fn, positions, has_aux, trees, args, kwargs)
        transformed = functorch_active()
        found = None
        if transformed and not torch.compiler.is_compiling():
            vmap = lone_vmap()
            if vmap is not None:
                found = across_members(vmap, request)
        if found is not None:
            grads, value = found
        elif transformed or any(tree.requires_grad for tree in trees):
            grads, value = _with_torch_func(request)
        elif torch.compiler.is_compiling():
            # torch.func's grad, which Dynamo traces into the graph (it skips autograd.grad's
            # engine call by design, which would end the graph); detached, as plain autograd's
            # results are: tensors that fn closes over (a module's own Parameters) are constants.
            grads, value = _with_torch_func(request)
            grads, value = [detached(g) for g in grads], detached(value)
        else:
            grads, value = _with_autograd(request)
        return (tuple(grads) if isinstance(argnums, tuple) else grads[0]), value

    return gradient_and_value


def _positions(name: str, argnums: object, count: int) -> tuple[int, ...]:
    """`argnums` as non-negative positions, checked as torch.func checks them."""
    if isinstance(argnums, int) and not isinstance(argnums, bool):
        wanted: tuple[object, ...] = (argnums,)
    elif isinstance(argnums, tuple):
        if not argnums:
            raise RuntimeError(f"{name}: 'argnums': empty; pass a position such as 0")
        wanted = argnums
    else:
        raise RuntimeError(
            f"{name}: 'argnums': got {type(argnums).__name__}; pass an int or a tuple of ints"
        )
    positions = []
    for argnum in wanted:
        if not isinstance(argnum, int) or isinstance(argnum, bool):
            raise RuntimeError(f"{name}: 'argnums': got {argnum!r}; pass an int or a tuple of ints")
        if not -count <= argnum < count:
            raise RuntimeError(
                f"{name}: 'argnums': got argnum={argnum}, but only {count} positional inputs; "
                f"pass a position below {count}"
            )
        positions.append(argnum % count)
    if len(set(positions)) != len(positions):
        raise RuntimeError(f"{name}: 'argnums': {argnums} repeats a position; name each once")
    return tuple(positions)


def _with_autograd(request: GradCall) -> tuple[list[Any], Any]:
    """Plain autograd: one leaf that requires grad per distinct tensor (a tie stays one)."""
    ties = Ties([tree.leaves for tree in request.trees])
    inputs = [leaf.detach().requires_grad_() for leaf in ties.distinct]
    with grad_enabled():
        output, aux = request.output(request.call(ties.per_tree(inputs)))
        found: Sequence[Tensor | None] = (
            scalar_gradients(output, inputs)
            if output.requires_grad
            else [None] * len(inputs)  # fn does not depend on the inputs: zero gradients
        )
    gradients = [
        torch.zeros_like(leaf) if g is None else g for leaf, g in zip(inputs, found, strict=True)
    ]
    grads = request.rebuild(ties.per_tree(gradients))
    value = output.detach()
    return grads, ((value, detached(aux)) if request.has_aux else value)


def _with_torch_func(request: GradCall) -> tuple[list[Any], Any]:
    """``torch.func.grad_and_value`` over the differentiated leaves as flat lists, so that None
    holes stay holes (torch's pytrees would hand None to the transform)."""

    def on_leaves(*leaf_lists: list[Tensor]) -> Any:
        return request.call(leaf_lists)

    leaf_lists = [list(tree.leaves) for tree in request.trees]
    flat_grads, value = torch.func.grad_and_value(
        on_leaves, argnums=tuple(range(len(leaf_lists))), has_aux=request.has_aux
    )(*leaf_lists)
    return request.rebuild([list(g) for g in flat_grads]), value
