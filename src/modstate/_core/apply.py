"""The pure stateful call: a forward that returns its buffer updates instead of making them."""

from __future__ import annotations

from collections.abc import Mapping
from functools import partial
from typing import Any

import torch
from torch import Tensor, nn

from modstate._core.call import call, run_swapped
from modstate._core.errors import DtypeMismatch, MissingPaths, PathError, ShapeMismatch
from modstate._core.module.anatomy import anatomy_of, buffer_owners
from modstate._core.swap.parts import copy_buffers, read_parts
from modstate._core.swap.prepare import prepare_in_plan_order
from modstate._core.swap.swaps import Swap
from modstate._core.torch_facts import eager_route, version
from modstate._core.trees.flat import is_subtree, iter_leaves
from modstate._core.types import Tree


def apply(
    module: nn.Module, params: Tree, state: Tree, /, *args: Any, **kwargs: Any
) -> tuple[Any, Tree]:
    """`modstate.apply` as the call is written: under ``torch.vmap`` the forward runs by vmap's
    batching rules. The public `modstate.apply` (in `modstate.ensemble._members_apply`) adds the
    route that runs every member at once under a lone ``torch.vmap``, and states the contract.
    """
    if not isinstance(state, Mapping):
        raise TypeError(
            f"apply: state must be a tree (a dict of tensors), got {type(state).__name__}"
        )
    if torch.compiler.is_compiling():
        return _apply(module, params, state, args, kwargs, compiling=True)
    return eager_route(_eager_apply, module, params, state, args, kwargs)


def _eager_apply(
    module: nn.Module, params: Any, state: Tree, args: tuple, kwargs: dict
) -> tuple[Any, Tree]:
    if type(params) is dict and type(state) is dict:
        fast = _apply_in_plan_order(module, params, state, args, kwargs)
        if fast is not None:
            return fast
    return _apply(module, params, state, args, kwargs, compiling=False)


def _apply(
    module: nn.Module, params: Any, state: Tree, args: tuple, kwargs: dict, *, compiling: bool
) -> tuple[Any, Tree]:
    """The general route: any tree shapes, precise errors, and what Dynamo can trace."""
    # Which paths hold buffers (copied) rather than frozen parameters (passed as they are).
    if compiling:
        buffers = {path for path, _ in module.named_buffers(remove_duplicate=False)}
    else:
        buffers = {path for path, slot in anatomy_of(module).by_path.items() if slot.is_buffer}
    _refuse_buffers_in(params, buffers)
    updated_by_kernel = _buffers_of_training_modules(module)
    copies: dict[str, tuple[Tensor, int]] = {}
    work = _copy_buffers(state, "", buffers, copies, compiling)
    out = _call(module, (params, work), args, kwargs)
    new_state = _collect(state, work, "", copies, updated_by_kernel, compiling)
    return out, new_state


_UNBATCHED_STATE_FIX = (
    "modstate.apply under vmap: give every member its own statistics, stacked like the params: "
    "state = ms.stack([ms.split(m, detach=True)[1] for m in members]) and map over it too "
    "(in_dims=0 for state)"
)


_MISSING_FIX = (
    "apply needs every path of the module between params and state: take both from "
    "params, state = ms.split(module, detach=True) (a path may be None in one and given by "
    "the other, as the halves of ms.tree.partition are)"
)
_SHAPES_FIX = (
    "apply takes the module's shapes and dtypes, as ms.split(module, detach=True) gives them"
)
_APPLY_FIXES = {MissingPaths: _MISSING_FIX, ShapeMismatch: _SHAPES_FIX, DtypeMismatch: _SHAPES_FIX}


def _call(module: nn.Module, tree: Any, args: tuple, kwargs: dict, swap: Swap | None = None) -> Any:
    """``call(module, tree, ...)``, or the call with ``swap`` prepared already, as apply's."""
    try:
        if swap is not None:
            return run_swapped(module, swap, args, kwargs)
        return call(module, tree, *args, **kwargs)
    except PathError as error:
        raise error.within("apply", _APPLY_FIXES.get(type(error))) from None
    except RuntimeError as error:
        if "running_mean or running_var" in str(error) and "not batched" in str(error):
            error.add_note(_UNBATCHED_STATE_FIX)
        raise


def _apply_in_plan_order(
    module: nn.Module, params: dict, state: dict, args: tuple, kwargs: dict
) -> tuple[Any, Tree] | None:
    """apply through the anatomy's compiled plan: the leaves of ``params`` and of the copied
    ``state`` go into the module's slots straight from the plan (read by `swap/parts.py`). None
    (nothing done) when the trees are not exactly two disjoint halves of the module's paths with
    every buffer in ``state``: the general route then runs, or names the error."""
    anatomy = anatomy_of(module)
    found = read_parts(anatomy, module, (params, state))
    if found is None or not found[0].buffers_in_last:
        return None
    reader, ((params_leaves, _), (originals, _)) = found
    offset = len(params_leaves)
    leaves = params_leaves + originals
    copies = copy_buffers(reader, leaves, module)
    in_plan_order = reader.in_plan_order(leaves)
    reassigned: dict[Any, Any] = {}  # plan position -> what forward assigned to that buffer
    swap = prepare_in_plan_order(module, anatomy, in_plan_order, partial(_at, reassigned))
    if swap is None:  # other shapes, a sharded module: call reads a tree and says what is wrong
        merged = anatomy.new_tree(in_plan_order)
        out = _call(module, merged, args, kwargs)
        now = anatomy.read(merged)[0]  # type: ignore[index]  # same shape: written in place
        reassigned = {position: now[position] for _, position, *_ in copies}
    else:
        out = _call(module, None, args, kwargs, swap)
    new_leaves = list(originals)
    for index, position, copy, copied_at, training in copies:
        current = reassigned.get(position, copy)
        if current is not copy or training or version(current) != copied_at:
            new_leaves[index - offset] = current
    return out, reader.readers[1].build(new_leaves)


def _at(node: dict[Any, Any], key: Any) -> tuple[dict[Any, Any], Any]:
    return node, key


def _refuse_buffers_in(params: Any, buffers: set[str]) -> None:
    components = params if isinstance(params, (tuple, list)) else (params,)
    for component in components:
        if not isinstance(component, Mapping):
            continue  # call names what is wrong with it
        for path, leaf in iter_leaves(component):
            if leaf is not None and path in buffers:
                raise ValueError(
                    f"apply: {path!r} is a buffer, given in params: forward may update it, so "
                    "it belongs in state, which apply copies and returns updated; split with "
                    "ms.split(module) or ms.tree.partition(ms.extract(module), ms.tree.is_trainable)"
                )


def _copy_buffers(
    node: Mapping[str, Any],
    prefix: str,
    buffers: set[str],
    copies: dict[str, tuple[Tensor, int]],
    compiling: bool,
) -> dict[str, Any]:
    """A new nested dict like ``node`` with a clone of every buffer leaf (recorded in ``copies``
    with its version counter, which in-place ops with a mutating schema bump)."""
    out: dict[str, Any] = {}
    for key, value in node.items():
        if is_subtree(key, value):
            out[key] = _copy_buffers(value, f"{prefix}{key}.", buffers, copies, compiling)
        elif isinstance(value, Tensor) and prefix + key in buffers:
            copy = value.clone()
            copies[prefix + key] = (copy, 0 if compiling else version(copy))
            out[key] = copy
        else:
            out[key] = value
    return out


def _collect(
    state: Mapping[str, Any],
    work: dict[str, Any],
    prefix: str,
    copies: dict[str, tuple[Tensor, int]],
    updated_by_kernel: set[str],
    compiling: bool,
) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for key, original in state.items():
        now = work[key]
        path = prefix + key
        if is_subtree(key, original):
            out[key] = _collect(original, now, f"{path}.", copies, updated_by_kernel, compiling)
        elif path not in copies:
            out[key] = now
        else:
            copy, copied_at = copies[path]
            if now is not copy:  # forward reassigned the buffer; call wrote it back into work
                out[key] = now
            elif compiling or path in updated_by_kernel or version(copy) != copied_at:
                out[key] = copy
            else:
                out[key] = original
    return out


def _buffers_of_training_modules(module: nn.Module) -> set[str]:
    """Paths of the buffers whose owner is in training mode: each comes back as its copy.

    Kernels may write into a buffer without a trace: ``batch_norm`` updates the running statistics
    in place without bumping their version counter (the schema of ``native_batch_norm`` does not
    mark them mutable), and so does any layer built on it (an Ensemble's batched BatchNorm). So in
    training mode a buffer's copy is returned whether or not it changed; in eval mode a buffer
    comes back as the same object unless ``forward`` reassigned it or wrote to it with an in-place
    op that bumps the version counter.
    """
    return {path for path, owner in buffer_owners(module).items() if owner.training}
