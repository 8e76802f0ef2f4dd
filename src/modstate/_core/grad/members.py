"""`ms.grad` under a lone ``torch.vmap``: every member's gradient from one plain backward.

``torch.vmap(ms.grad(f))(stacked, ...)`` asks for each member's gradient of its own loss. Under
vmap the members cannot see each other, so the gradient of the *sum* of their losses with
respect to the stacked tensors holds, in each member's slice, that member's own gradient. So
each differentiated stacked tensor is detached and set to require grad, handed to `f` as the
member's view of it, and `f` runs under the caller's vmap, whose batching rules call plain ops
that autograd records; one plain backward of the summed losses then gives every gradient, which
goes back as the member's view. No ``torch.func.grad`` level wraps every tensor of every
operation, and inside, `modstate.apply` sees a lone ``torch.vmap`` over stacked tensors, where it
runs the ensemble's batched kernels.

This holds only when every differentiated leaf is a member's own tensor (batched by the vmap). A
leaf shared by the members (per-sample gradients: the vmap maps the data, not the params) needs
each member's gradient of one shared tensor, which the sum would add up; there, and where a
stacked tensor already requires grad (an outer differentiation), ``torch.func.grad`` runs
instead (`across_members` returns None).
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor

from modstate._core.grad.arguments import (
    GradCall,
    Ties,
    grad_enabled,
)
from modstate._core.torch_facts import scalar_gradients
from modstate._core.vmap_levels import (
    LoneVmap,
    VmapSetAside,
    as_member_view,
    members_of,
    vmap_tree_map,
)


def across_members(vmap: LoneVmap, request: GradCall) -> tuple[list[Any], Any] | None:
    """``(gradients per position, value)`` as `ms.grad_and_value` returns them, computed for
    every member at once; None where this route does not hold (see the module docstring)."""
    level = vmap.level
    stacked: list[list[Tensor]] = []  # per tree, the tensor holding every member of each leaf
    dim_of: dict[int, int] = {}  # the member dim of each stacked tensor, by id
    for tree in request.trees:
        tree_stacked = []
        for leaf in tree.leaves:
            members, dim = members_of(leaf, level)
            if dim is None or members.requires_grad:
                return None
            dim_of.setdefault(id(members), dim)
            tree_stacked.append(members)
        stacked.append(tree_stacked)
    ties = Ties(stacked)
    dims = [dim_of[id(members)] for members in ties.distinct]
    with VmapSetAside():  # torch refuses requires_grad_ under a transform
        inputs = [members.detach().requires_grad_() for members in ties.distinct]
    views = [as_member_view(tensor, dim, level) for tensor, dim in zip(inputs, dims, strict=True)]
    with grad_enabled():
        output, aux = request.output(request.call(ties.per_tree(views)))
        losses, loss_dim = members_of(output, level)
        with VmapSetAside():
            found = (
                scalar_gradients(losses.sum(), inputs)
                if losses.requires_grad
                else [None] * len(inputs)  # fn does not depend on the inputs: zero gradients
            )
    gradients = [
        as_member_view(torch.zeros_like(tensor) if g is None else g, dim, level)
        for tensor, g, dim in zip(inputs, found, dims, strict=True)
    ]
    grads = request.rebuild(ties.per_tree(gradients))
    value = losses.detach()
    value = value if loss_dim is None else as_member_view(value, loss_dim, level)
    return grads, ((value, _detached_members(aux, level)) if request.has_aux else value)


def _detached_members(aux: Any, level: int) -> Any:
    """`aux` with every tensor detached from this differentiation: a member's view is detached
    inside (the view itself does not say whether what it wraps requires grad)."""

    def detach(leaf: Tensor) -> Tensor:
        inner, dim = members_of(leaf, level)
        if not inner.requires_grad:
            return leaf
        return inner.detach() if dim is None else as_member_view(inner.detach(), dim, level)

    return vmap_tree_map(detach, aux)
