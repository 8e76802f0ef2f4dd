"""Call a module on a tree of tensors, without changing the module."""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from modstate._core.errors import DtypeMismatch, MissingPaths, PathError, ShapeMismatch
from modstate._core.swap.prepare import prepare
from modstate._core.swap.swaps import Swap
from modstate._core.swap.traced import BUILTIN, Problem, engine_error, problem_while_tracing
from modstate._core.torch_facts import eager_route, write_back
from modstate._core.trees.flat import flatten, unflatten
from modstate._core.types import TreeArg

_CALL_FIX = (
    "call needs every path: give the rest too, e.g. the tuple ms.split(module) returns, "
    "ms.call(module, (params, state), ...), or use ms.call_partial(module, tree, ...) to keep "
    "the module's own tensors where the tree has none"
)
_OTHER_SHAPES_FIX = (
    "call takes the module's shapes and dtypes; ms.call_partial(module, tree, ...) or "
    "ms.inject(module, tree, strict=False) accept others"
)
_CALL_FIXES = {
    MissingPaths: _CALL_FIX,
    ShapeMismatch: _OTHER_SHAPES_FIX,
    DtypeMismatch: _OTHER_SHAPES_FIX,
}


_MUTATED_BUFFER_FIX = (
    "modstate: forward updates a buffer in place (BatchNorm in train mode, say) that the "
    "torch.func transform did not give it; use the pure form, which copies the buffers and "
    "returns their updates: out, new_state = ms.apply(module, params, state, ...), with "
    "params, state = ms.split(module, detach=True)"
)


def call(module: nn.Module, tree: TreeArg, /, *args: Any, **kwargs: Any) -> Any:
    """``module(*args, **kwargs)`` computed with the tree's tensors: a stateless call.

    ``tree`` gives every path of the module (strict). It may be a tuple of trees that together
    give every path, such as ``(params, state)`` from [`modstate.split`][modstate.split] when only the
    parameters go through ``torch.func.grad``; a None leaf in one of them is a hole (the halves of
    ``modstate.tree.partition`` go in as they are). For a partial tree (the
    ``torch.func.functional_call(model, dict(model.named_parameters()), x)`` habit), use
    [`call_partial`][modstate.call_partial]; every other argument goes to ``forward``.

    The same as ``with ms.inject(module, tree): return module(*args, **kwargs)`` (strict), made
    fast for repeated calls, and safe under ``torch.func.vmap``, ``grad``, ``jacrev`` and
    ``torch.compile(fullgraph=True)``. Afterwards, also if the call raised, the module holds
    exactly the tensors it held before (same objects, same ``requires_grad``, values untouched
    unless ``forward`` writes to the tree's tensors in place), and so do tensors it keeps as plain
    attributes and lazy modules' class and hooks; a buffer that ``forward`` reassigns is written
    back into ``tree``. In-place buffer updates (BatchNorm in train mode) land in the tree's
    tensors: [`modstate.apply`][modstate.apply] is the pure form. Not restored, as with
    ``torch.func.functional_call``: other plain attributes that ``forward`` assigns (counters,
    ints, lists, such as the ``max_seq_len_cached`` of a Llama with dynamic RoPE); snapshotting
    every module's ``__dict__`` on every call would cost more than the call itself on small
    models. Call a copy (``copy.deepcopy(module)``) when its forward keeps such state.

    Threads: calls on one module from several threads run at once, each with its own tree, and
    no other thread sees them (another call, a plain ``module(x)``, ``state_dict()``); only the
    plain attributes above are shared, a data race under threads. Calls on modules that rewrite
    tensors kept in ``__dict__`` (RNNs, legacy ``weight_norm``, lazy modules before their first
    forward) or keep ``torch.compile``d code run one at a time. See "Threads" in
    ``docs/semantics.md``.

    Args:
        module: the module to call; it is left holding its own tensors.
        tree: a tree (or a tuple of trees) that gives every path of ``module`` exactly once.
        *args: positional arguments of ``forward``.
        **kwargs: keyword arguments of ``forward``.

    Returns:
        What ``module(*args, **kwargs)`` returns.

    Raises:
        KeyError: a path of the module that the tree does not give, or a path the module lacks
            (the message names it and the fix).
        ValueError: a leaf whose shape differs from the module's tensor at that path.
        TypeError: a leaf whose dtype differs from the module's tensor at that path.

    >>> import torch, modstate as ms
    >>> lin = torch.nn.Linear(3, 1)
    >>> tree = ms.extract(lin, detach=True)
    >>> x = torch.randn(5, 3)
    >>> grads = torch.func.grad(lambda t: ms.call(lin, t, x).sum())(tree)
    >>> grads["weight"].shape
    torch.Size([1, 3])
    """
    return _stateless("call", module, tree, args, kwargs, strict=True)


def _stateless(
    name: str, module: nn.Module, tree: TreeArg, args: tuple, kwargs: dict, *, strict: bool
) -> Any:
    """`call` (strict) and `call_partial` (lenient): check and plan the swap for the calling
    thread, then run the module with it."""
    if torch.compiler.is_compiling():
        return call_while_compiling(module, tree, args, kwargs, strict=strict)
    return eager_route(_eager_stateless, name, module, tree, args, kwargs, strict)


def _eager_stateless(
    name: str, module: nn.Module, tree: TreeArg, args: tuple, kwargs: dict, strict: bool
) -> Any:
    try:
        swap = prepare(module, tree, strict, compute=True, private=True)
    except PathError as error:
        raise error.within(name, _CALL_FIXES.get(type(error)) if strict else None) from None
    return run_swapped(module, swap, args, kwargs)


def run_swapped(module: nn.Module, swap: Swap, args: tuple, kwargs: dict[str, Any]) -> Any:
    """``module(*args, **kwargs)`` with ``swap`` applied, undone afterwards whatever happens."""
    swap.apply()
    try:
        return module(*args, **kwargs)
    except RuntimeError as error:
        if "mutate a captured Tensor" in str(error):
            error.add_note(_MUTATED_BUFFER_FIX)
        raise
    finally:
        swap.undo()


def call_partial(module: nn.Module, tree: TreeArg, /, *args: Any, **kwargs: Any) -> Any:
    """Like [`call`][modstate.call], but paths the tree leaves out keep the module's own tensors.

    The lenient form, as ``torch.func.functional_call`` behaves: ``tree`` may be partial (say
    ``dict(model.named_parameters())`` flattened, or only the parameters of one layer), and its
    shapes and dtypes may differ from the module's (``ms.inject(module, tree, strict=False)``).
    Unknown paths are still an error. Every argument after ``tree`` goes to ``forward``, so no
    option of modstate can collide with ``forward``'s keyword arguments. Threads: as
    [`call`][modstate.call]; the paths the tree leaves out show what the module holds for every thread
    (another thread's open ``inject``, say).

    Args:
        module: the module to call; it is left holding its own tensors.
        tree: a tree (or a tuple of trees) that gives any of the module's paths.
        *args: positional arguments of ``forward``.
        **kwargs: keyword arguments of ``forward``.

    Returns:
        What ``module(*args, **kwargs)`` returns.

    Raises:
        KeyError: a path the module does not have (the message names it).

    >>> import torch, modstate as ms
    >>> model = torch.nn.Sequential(torch.nn.Linear(3, 4), torch.nn.BatchNorm1d(4)).eval()
    >>> params = ms.unflatten(dict(model.named_parameters()))      # no BatchNorm statistics
    >>> out = ms.call_partial(model, params, torch.randn(2, 3))
    >>> out.shape
    torch.Size([2, 4])
    """
    return _stateless("call_partial", module, tree, args, kwargs, strict=False)


def call_while_compiling(
    module: nn.Module, tree: TreeArg, args: tuple, kwargs: dict, *, strict: bool
) -> Any:
    """``call`` as Dynamo can trace it (``torch.func.functional_call``), holes dropped."""
    # Dynamo traces torch.func.functional_call natively; the swap engine's C-level list passes
    # are opaque to it. The tree is checked first, at trace time, with the engine's messages.
    components = list(tree) if isinstance(tree, (tuple, list)) else [tree]
    flats = [
        {path: leaf for path, leaf in flatten(component).items() if leaf is not None}
        for component in components
    ]
    merged = {path: leaf for flat in flats for path, leaf in flat.items()}
    problem = problem_while_tracing(module, merged, strict)
    if problem is not None:
        raise BUILTIN[problem[0]](_error_text("call" if strict else "call_partial", problem))
    given = [dict(flat) for flat in flats]
    out = torch.func.functional_call(
        module, tuple(flats), args, kwargs, tie_weights=True, strict=strict
    )
    for component, flat, before in zip(components, flats, given, strict=True):
        changed = {key: value for key, value in flat.items() if value is not before[key]}
        if changed and isinstance(component, dict):
            write_back(component, unflatten(changed))
    return out


# Run outside the trace on its constant arguments (modstate's errors cannot be built inside one);
# the message is a constant of the trace.
@torch.compiler.assume_constant_result
def _error_text(name: str, problem: Problem) -> str:
    """The message `call` (or `call_partial`) gives for ``problem`` in eager."""
    error = engine_error(problem)
    return str(error.within(name, _CALL_FIXES.get(type(error)) if name == "call" else None))
