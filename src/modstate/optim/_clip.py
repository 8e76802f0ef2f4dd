"""`clip_grad_norm`: `torch.nn.utils.clip_grad_norm_` on a gradient tree, without mutation."""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor

from modstate._core.torch_facts import foreach_allowed
from modstate.tree import map as tree_map
from modstate.tree import map_with_path


def _leaves(grads: Any) -> list[Tensor]:
    """The distinct gradient tensors in module order (dicts in insertion order, as torch's
    parameters; a tie is visited once, as ``model.parameters()`` lists it once); None is an
    empty subtree."""
    found: list[Tensor] = []

    def collect(path: str, leaf: Any) -> Any:
        if not (isinstance(leaf, Tensor) and (leaf.is_floating_point() or leaf.is_complex())):
            got = f"a {leaf.dtype} tensor" if isinstance(leaf, Tensor) else type(leaf).__name__
            raise TypeError(
                f"clip_grad_norm: '{path}': {got}, not a floating-point tensor or None; pass "
                f"a gradient tree (None where a leaf has no gradient)"
            )
        found.append(leaf)
        return leaf

    map_with_path(collect, grads)
    return found


def _norms(tensors: list[Tensor], norm_type: float) -> list[Tensor]:
    """Each tensor's norm, grouped by (device, dtype) in order of first appearance, as torch."""
    groups: dict[tuple[torch.device, torch.dtype], list[Tensor]] = {}
    for tensor in tensors:
        groups.setdefault((tensor.device, tensor.dtype), []).append(tensor)
    eager = foreach_allowed(tensors)
    norms: list[Tensor] = []
    for group in groups.values():
        if eager:
            norms.extend(torch._foreach_norm(group, norm_type))
        else:
            norms.extend(torch.linalg.vector_norm(g, norm_type) for g in group)
    return norms


def clip_grad_norm(grads: Any, max_norm: float, norm_type: float = 2.0) -> tuple[Any, Tensor]:
    """Scale a gradient tree so that its total norm is at most `max_norm`: ``(grads, norm)``.

    The numbers of `torch.nn.utils.clip_grad_norm_` (``norm_type`` 2, 1, ``inf``, any p): the
    total norm is the norm of the leaves' norms (a tensor at several paths, a tie, counts once, as
    ``model.parameters()`` lists it once), and every leaf is multiplied by
    ``min(max_norm / (norm + 1e-6), 1)``. Pure: returns new leaves (None leaves stay None) and
    the total norm as a 0-dim tensor; differentiable and usable under `vmap`.

    Args:
        grads: a gradient tree; None is an empty subtree.
        max_norm: the largest total norm allowed.
        norm_type: the p of the p-norm (``float("inf")`` for the largest magnitude).

    Returns:
        ``(clipped_grads, total_norm)``: a new tree of the same structure and the total norm
        before clipping.

    Raises:
        TypeError: a leaf is neither None nor a floating-point tensor (the message names it).

    Example:
        >>> grads = {"w": torch.tensor([3.0, 4.0]), "b": None}
        >>> clipped, norm = clip_grad_norm(grads, max_norm=1.0)
        >>> norm
        tensor(5.)
        >>> clipped["w"], clipped["b"]
        (tensor([0.6000, 0.8000]), None)
    """
    norm_type = float(norm_type)
    max_norm = float(max_norm)
    present = _leaves(grads)
    if not present:
        return grads, torch.tensor(0.0)
    first_device = present[0].device
    norms = _norms(present, norm_type)
    total = torch.linalg.vector_norm(
        torch.stack([norm.to(first_device) for norm in norms]), norm_type
    )
    coefficient = torch.clamp(max_norm / (total + 1e-6), max=1.0)
    return tree_map(lambda leaf: leaf * coefficient.to(leaf.device), grads), total
