"""`modstate.apply` under a lone ``torch.vmap``: every member at once, with the batched kernels.

``torch.vmap(ms.grad(loss, has_aux=True))(params, state)`` with ``loss`` calling
``ms.apply(model, p, s, x)`` is the functional ensemble loop. Left to ``torch.vmap``, the model's
forward runs one operation at a time through vmap's batching rules. When that vmap is the only
transform running (``ms.grad`` runs the members' loss under the caller's vmap with plain
autograd: see `modstate._core.grad.members`) and it maps every tensor of ``params`` and
``state``, the call goes to the module's kept `Ensemble` (`_kept`) over those stacked tensors
instead: the same batched kernels and plan as ``Ensemble`` (one batched matmul per ``Linear``,
grouped convolutions, per-member BatchNorm), with vmap's randomness. Anything the route does not
cover runs as the plain call, with the same results as before: a tensor of ``params`` or
``state`` shared by the members, an input that maps members but is not a tensor argument (a
keyword argument, a list), hooks on the model, a model the ensemble cannot be built for,
``torch.compile``.
"""

from __future__ import annotations

from typing import Any

import optree
import torch
from torch import Tensor, nn

from modstate._core.apply import apply as apply_one
from modstate._core.errors import PathError
from modstate._core.torch_facts import functorch_active, is_dtensor
from modstate._core.types import Tree
from modstate._core.vmap_levels import (
    LoneVmap,
    VmapSetAside,
    as_member_view,
    lone_vmap,
    maps_members,
    members_of,
    vmap_tree_map,
)

from ._kept import ensemble_for
from ._vmap import InDims


def apply(
    module: nn.Module, params: Tree, state: Tree, /, *args: Any, **kwargs: Any
) -> tuple[Any, Tree]:
    """``(module(*args, **kwargs), new_state)`` computed with ``params`` and ``state``, purely.

    ``params`` and ``state`` together give every path of the module, as [`modstate.split`][modstate.split]
    returns them (a None leaf is a hole, so the halves of ``modstate.tree.partition`` work too);
    buffers belong in ``state`` (one in ``params`` is refused).
    Nothing passed in is mutated: the buffers in ``state`` are copied before ``forward`` runs, so
    a buffer that ``forward`` updates in place (BatchNorm's running statistics in train mode) or
    reassigns (``self.count = self.count + 1``) comes back as a new tensor in ``new_state``, which
    has the structure of ``state``; every other leaf comes back as the very same object. Which
    buffers changed cannot always be seen (``batch_norm`` writes its statistics without a trace),
    so the buffers of submodules in training mode always come back as their copies, changed or
    not; in eval mode an untouched buffer comes back as the same object. Outputs
    and new statistics equal the stateful ``module(*args, **kwargs)`` bit for bit, and the module
    is left exactly as it was.

    Pure, so it composes: ``torch.func.grad(loss, has_aux=True)`` with ``new_state`` as the aux,
    ``grad_and_value``, ``vjp``, ``torch.vmap`` over stacked ``params`` and ``state`` (each member
    keeps its own BatchNorm statistics: stack the state too) and ``torch.compile(fullgraph=True)``.
    Frozen parameters in ``state`` are not copied (``forward`` must not write into parameters).
    Inside ``torch.compile`` every buffer comes back as a new tensor (a compiled graph cannot
    tell which of its copies ``forward`` wrote to); the values are the same. Threads: as
    [`modstate.call`][modstate.call], several threads may apply one module at once.

    Under ``torch.vmap`` over stacked ``params`` and ``state``, when the vmap is the only
    transform running (inside ``torch.vmap(ms.grad(loss))`` it is: ``ms.grad`` differentiates
    there with plain autograd) and every tensor of ``params`` and ``state`` is stacked, the
    members run at once as an [`Ensemble`][modstate.Ensemble] of ``module`` runs them: its
    batched kernels and plan, vmap's ``randomness``. Results then equal the members run one by one to the last bits,
    as ``Ensemble``'s do, rather than bit for bit. The ensemble is kept for the next calls (per
    member count, inputs' member dims, randomness and the module's settings: ``model.eval()``
    or a changed hyperparameter gets its own), shares the module's tensors and holds none of the
    trees. Other calls under vmap (a shared tensor, inputs mapped in keyword arguments, hooks,
    ``torch.func.grad`` around it) run by vmap's rules, as before.

    Args:
        module: the module to compute with; it is left exactly as it was.
        params: the parameters, as ``ms.split(module, detach=True)[0]`` gives them.
        state: the buffers (and frozen parameters), as ``ms.split(module, detach=True)[1]``.
        *args: positional arguments of ``forward``.
        **kwargs: keyword arguments of ``forward``.

    Returns:
        ``(out, new_state)``: what ``forward`` returns, and a tree shaped like ``state`` whose
        buffers are the values after the call (new tensors where ``forward`` may have changed
        them, the very objects of ``state`` elsewhere).

    Raises:
        TypeError: ``state`` is not a tree, or a leaf's dtype differs from the module's.
        ValueError: a buffer in ``params``, or a leaf whose shape differs from the module's.
        KeyError: a path of the module that neither tree gives, or one the module lacks.

    >>> import torch, modstate as ms
    >>> model = torch.nn.Sequential(torch.nn.Linear(3, 4), torch.nn.BatchNorm1d(4))  # train mode
    >>> params, state = ms.split(model, detach=True)
    >>> x = torch.randn(8, 3)
    >>> def loss(params, state):
    ...     out, new_state = ms.apply(model, params, state, x)
    ...     return out.square().mean(), new_state
    >>> grads, new_state = torch.func.grad(loss, has_aux=True)(params, state)
    >>> int(new_state["1"]["num_batches_tracked"]), int(state["1"]["num_batches_tracked"])
    (1, 0)
    >>> new_state["1"]["running_mean"] is state["1"]["running_mean"]
    False
    """
    if functorch_active() and not torch.compiler.is_compiling():
        vmap = lone_vmap()
        if vmap is not None:
            found = _apply_members(vmap, module, params, state, args, kwargs)
            if found is not None:
                return found
    return apply_one(module, params, state, *args, **kwargs)


def _apply_members(
    vmap: LoneVmap,
    module: nn.Module,
    params: Tree,
    state: Tree,
    args: tuple[Any, ...],
    kwargs: dict[str, Any],
) -> tuple[Any, Tree] | None:
    """``apply`` for every member at once on the stacked trees, or None where the route does not
    cover the call (see the module docstring)."""
    level = vmap.level
    trees: Any = {"params": params, "state": state}
    leaves, spec = optree.tree_flatten(trees, none_is_leaf=False)
    stacked = []
    for leaf in leaves:
        tensor, dim = members_of(leaf, level)
        if dim is None or not isinstance(tensor, Tensor) or is_dtensor(tensor):
            return None
        stacked.append(tensor if dim == 0 else tensor.movedim(dim, 0))
    inputs: list[Any] = []
    dims: list[int | None] = []
    for arg in args:
        value, dim = members_of(arg, level)
        if dim is None and not isinstance(arg, Tensor) and maps_members(arg, level):
            return None
        inputs.append(value if dim in (None, 0) else value.movedim(dim, 0))
        dims.append(None if dim is None else 0)
    if kwargs and maps_members(kwargs, level):
        return None
    in_dims: InDims = (
        None if all(d is None for d in dims) else 0 if all(d == 0 for d in dims) else tuple(dims)
    )
    ensemble = ensemble_for(module, vmap.size, vmap.randomness, in_dims)
    if ensemble is None:
        return None
    members = optree.tree_unflatten(spec, stacked)
    with VmapSetAside():
        try:
            out, new_state = apply_one(
                ensemble,
                {"stacked": members["params"]},
                {"stacked": members["state"]},
                *inputs,
                **kwargs,
            )
        except PathError:
            return None  # the trees do not fit the model: the plain call names the path
    given = {id(tensor): leaf for tensor, leaf in zip(stacked, leaves, strict=True)}

    def member_view(value: Tensor) -> Tensor:
        same = given.get(id(value))
        return as_member_view(value, 0, level) if same is None else same

    return vmap_tree_map(member_view, out), vmap_tree_map(member_view, new_state["stacked"])
