"""Split a module's state into what is trained and what is carried."""

from __future__ import annotations

from torch import Tensor, nn

from .extract import detached, extract
from .flat import iter_leaves, unflatten
from .types import Tree


def split(module: nn.Module, *, detach: bool = False) -> tuple[Tree, Tree]:
    """``(params, state)``: the trainable parameters, and every other leaf of ``extract(module)``.

    ``params`` holds the floating-point parameters with ``requires_grad=True``, at their paths;
    ``state`` holds the rest: buffers (BatchNorm's running statistics and its integer
    ``num_batches_tracked``, non-persistent caches) and frozen parameters. The two trees are
    disjoint (no None holes; empty subtrees are left out) and together give every path, so
    ``ms.call(module, (params, state), x)`` and ``ms.apply(module, params, state, x)`` take them
    as they are. Leaves are the module's own objects; ``detach=True`` gives detached ones (ties
    kept), for a functional training loop where only ``params`` go through ``torch.func.grad``.

    >>> import torch, modstate as ms
    >>> model = torch.nn.Sequential(torch.nn.Linear(3, 4), torch.nn.BatchNorm1d(4))
    >>> params, state = ms.split(model, detach=True)
    >>> ms.flatten(params).keys()
    dict_keys(['0.weight', '0.bias', '1.weight', '1.bias'])
    >>> ms.flatten(state).keys()
    dict_keys(['1.running_mean', '1.running_var', '1.num_batches_tracked'])
    """
    tree = extract(module)
    trainable = {path for path, leaf in iter_leaves(tree) if _is_trainable(leaf)}
    if detach:
        tree = detached(tree)
    params, state = {}, {}
    for path, leaf in iter_leaves(tree):
        (params if path in trainable else state)[path] = leaf
    return unflatten(params), unflatten(state)


def _is_trainable(leaf: object) -> bool:
    return (
        isinstance(leaf, Tensor)
        and leaf.requires_grad
        and (leaf.is_floating_point() or leaf.is_complex())
    )
