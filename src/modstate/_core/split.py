"""Split a module's state into what is trained and what is carried."""

from __future__ import annotations

from typing import Any

from torch import nn

from modstate._core.extract import detached, extract
from modstate._core.torch_facts import is_trainable
from modstate._core.trees.flat import iter_leaves, unflatten
from modstate._core.types import Tree


def split(module: nn.Module, *, detach: bool = False) -> tuple[Tree, Tree]:
    """``(params, state)``: the trainable parameters, and every other leaf of ``extract(module)``.

    ``params`` holds the trainable leaves: tensors that require grad and are floating point,
    complex included (``torch.func.grad`` differentiates complex tensors; the rule of
    ``ms.tree.is_trainable``). ``state`` holds the rest: buffers (BatchNorm's running statistics
    and its integer ``num_batches_tracked``, non-persistent caches) and frozen parameters. The two
    trees are disjoint (no None holes; empty subtrees are left out) and together give every path,
    so ``ms.call(module, (params, state), x)`` and ``ms.apply(module, params, state, x)`` take
    them as they are.

    Args:
        module: Any ``nn.Module``.
        detach: Detached leaves (ties kept), for a functional training loop where only
            ``params`` go through ``torch.func.grad``. They share storage with the module, as
            ``extract(module, detach=True)``'s do: copy them (``ms.tree.clone``) to keep a
            snapshot.

    Returns:
        ``(params, state)``, two new nested dicts holding the module's own objects (or their
        detached views).

    Raises:
        TypeError: ``module`` is not an ``nn.Module``, or is a TorchScript module.

    Example:
        >>> import torch, modstate as ms
        >>> model = torch.nn.Sequential(torch.nn.Linear(3, 4), torch.nn.BatchNorm1d(4))
        >>> params, state = ms.split(model, detach=True)
        >>> ms.flatten(params).keys()
        dict_keys(['0.weight', '0.bias', '1.weight', '1.bias'])
        >>> ms.flatten(state).keys()
        dict_keys(['1.running_mean', '1.running_var', '1.num_batches_tracked'])
    """
    tree = extract(module)
    trainable = {path for path, leaf in iter_leaves(tree) if is_trainable(leaf)}
    if detach:
        tree = detached(tree)
    params: dict[str, Any] = {}
    state: dict[str, Any] = {}
    for path, leaf in iter_leaves(tree):
        (params if path in trainable else state)[path] = leaf
    return unflatten(params), unflatten(state)
