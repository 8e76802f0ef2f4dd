"""`vmap_call`: a module run with every member of a stacked tree.

The checks come first (`check_stacked`: every leaf is the module's tensor with one leading
member dim). Then the module's kept `Ensemble` (`_kept`) runs the call with the stacked tensors
swapped in: the batched kernels and plan of ``Ensemble``. In-place updates in ``forward`` land in
the stacked tensors and a reassigned buffer is written back into ``stacked``, as the stateless
call does for any tree. Under a ``torch.func`` transform, ``torch.compile``, with ``chunk_size``,
DTensor leaves, or for a module without a kept ensemble (forward hooks), the module's forward runs
under ``torch.vmap`` instead (`StackedCall`), with the same results to rounding.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from modstate._core.call import call
from modstate._core.errors import PathError
from modstate._core.module.anatomy import buffer_paths
from modstate._core.torch_facts import functorch_active, is_dtensor, write_back
from modstate._core.trees.flat import flatten, unflatten
from modstate._core.types import Tree

from ._kept import ensemble_for
from ._vmap import RANDOMNESS, InDims, StackedCall, argument_dims, check_stacked


def vmap_call(
    module: nn.Module,
    stacked: Tree,
    /,
    *args: Any,
    in_dims: InDims = None,
    randomness: str = "error",
    chunk_size: int | None = None,
    **kwargs: Any,
) -> Any:
    """Run ``module`` once per member of ``stacked`` and return the stacked outputs (dim 0).

    In essence ``torch.vmap(lambda tree, *a: ms.call(module, tree, *a, **kwargs), in_dims=(0,
    *in_dims))(stacked, *args)``. The tree is checked before anything runs. In-place updates in
    ``forward`` land in the stacked tensors (BatchNorm's running statistics, one per member); a
    buffer that ``forward`` reassigns is written back into ``stacked``, stacked. Tied tensors
    stay tied (the stacked tree holds one tensor at both paths). The module is left exactly as it
    was: same objects, same ``requires_grad``.

    The members run as an [`Ensemble`][modstate.Ensemble] of ``module`` runs them, with the
    stacked tensors swapped in: its batched kernels and plan (kept for the module, per member
    count, ``in_dims``, randomness and the module's settings, sharing its tensors; see
    `modstate.apply` for what is kept). Results equal the members run one by one to the last
    bits. Under a ``torch.func`` transform or ``torch.compile``, with ``chunk_size``, DTensor
    leaves, or forward hooks on the module, the forward runs under ``torch.vmap`` by its rules
    instead.

    Args:
        module: the model whose ``forward`` runs; its own tensors are not used.
        stacked: a tree shaped like ``ms.extract(module)`` whose leaves have one leading member
            dim, as [`stack`][modstate.stack] and [`stack_modules`][modstate.stack_modules]
            make.
        *args: positional inputs of ``forward``.
        in_dims: how positional inputs map to members. None (default): every member sees the
            same inputs; 0: each input holds one slice per member along dim 0; a tuple: one entry
            per positional input, as in ``torch.vmap`` (None shares that input).
        randomness: ``torch.vmap``'s. ``"error"`` (default, as ``torch.vmap``) refuses random
            ops (dropout in training mode); ``"different"`` draws independently for every member,
            as a loop over the models would; ``"same"`` draws once for all.
        chunk_size: ``torch.vmap``'s: run this many members at a time (less memory).
        **kwargs: keyword inputs of ``forward``, shared by every member.

    Returns:
        What ``forward`` returns, with a leading member dim on every tensor.

    Raises:
        TypeError: ``stacked`` is not a dict.
        ValueError: a leaf is not the module's tensor with one leading member dim (an unstacked
            tree is named as such), leaves or inputs disagree on the member count, or
            ``in_dims`` has the wrong length; the message names the leaf or input.
        RuntimeError: a member drew random numbers with ``randomness="error"``.

    Example:
        >>> import torch, modstate as ms
        >>> models = [torch.nn.Linear(3, 2) for _ in range(4)]
        >>> stacked = ms.stack_modules(models)
        >>> ms.vmap_call(models[0], stacked, torch.randn(10, 3)).shape
        torch.Size([4, 10, 2])
    """
    if not isinstance(stacked, dict):
        raise TypeError(
            f"vmap_call: the stacked tree is a {type(stacked).__name__}; give a dict of "
            "tensors with a leading member dim, such as ms.stack_modules(models)"
        )
    if randomness not in RANDOMNESS:
        raise ValueError(
            f"vmap_call: randomness={randomness!r}; use one of {', '.join(map(repr, RANDOMNESS))}"
        )
    if torch.compiler.is_compiling():
        return _traced(module, stacked, args, kwargs, in_dims, randomness, chunk_size)
    flat = flatten(stacked)
    check_stacked(module, flat)
    plan = StackedCall(list(flat), list(flat.values()), buffer_paths(module), "vmap_call")
    # A stacked tree of DTensors (a sharded module's trees, stacked) goes in as it is: the
    # call gathers each FSDP unit's members when the unit runs.
    distinct = plan.distinct(list(flat.values()))
    if distinct and chunk_size is None:
        # The inputs are checked as vmap's route checks them, so that errors are vmap_call's.
        plan.check_counts(distinct, args, argument_dims(in_dims, len(args), "vmap_call"), None)
        out = _with_kept_ensemble(module, stacked, distinct, args, kwargs, in_dims, randomness)
        if out is not _NOT_TAKEN:
            return out
    out, reassigned = plan.run(
        module,
        distinct,
        args,
        kwargs,
        in_dims,
        randomness,
        chunk_size=chunk_size,
    )
    if reassigned:
        write_back(stacked, unflatten({plan.paths[i]: v for i, v in reassigned.items()}))
    return out


_NOT_TAKEN = object()


def _traced(
    module: nn.Module,
    stacked: Tree,
    args: tuple[Any, ...],
    kwargs: dict[str, Any],
    in_dims: InDims,
    randomness: str,
    chunk_size: int | None,
) -> Any:
    """`vmap_call` while torch.compile traces it: ``torch.vmap`` over `call`, which Dynamo
    traces into one graph (the eager route's checks and kept ensemble read the module's
    anatomy, which a trace cannot build). `call` checks the paths while tracing."""
    dims = argument_dims(in_dims, len(args), "vmap_call")
    return torch.vmap(
        lambda tree, *inputs: call(module, tree, *inputs, **kwargs),
        in_dims=(0, *dims),
        randomness=randomness,
        chunk_size=chunk_size,
    )(stacked, *args)


def _with_kept_ensemble(
    module: nn.Module,
    stacked: Tree,
    leaves: list[Any],
    args: tuple[Any, ...],
    kwargs: dict[str, Any],
    in_dims: InDims,
    randomness: str,
) -> Any:
    """The call run by the module's kept `Ensemble` (`_kept`) with ``stacked`` swapped in, or
    `_NOT_TAKEN` where it does not apply: under a ``torch.func`` transform or
    ``torch.compile`` (vmap's rules compose with them as they are), for DTensor leaves, or where
    no ensemble is kept for the module (hooks, a model it cannot be built for)."""
    if functorch_active() or torch.compiler.is_compiling():
        return _NOT_TAKEN
    if any(is_dtensor(leaf) for leaf in leaves):
        return _NOT_TAKEN
    dims = tuple(in_dims) if isinstance(in_dims, list) else in_dims
    ensemble = ensemble_for(module, leaves[0].shape[0], randomness, dims)
    if ensemble is None:
        return _NOT_TAKEN
    try:
        return call(ensemble, {"stacked": stacked}, *args, **kwargs)
    except PathError:
        return _NOT_TAKEN  # checked above already; vmap's route says what does not fit
