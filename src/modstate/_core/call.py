"""Call a module on a tree of tensors, without changing the module."""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from .flat import flatten, unflatten
from .inject import TreeArg, prepare


def call(module: nn.Module, tree: TreeArg, /, *args: Any, **kwargs: Any) -> Any:
    """``module(*args, **kwargs)`` computed with the tree's tensors: a stateless call.

    ``tree`` may also be a tuple of trees that together give every path, such as
    ``(params, buffers)`` when only the parameters go through ``torch.func.grad``.

    The same as ``with ms.inject(module, tree): return module(*args, **kwargs)`` (strict), made
    fast for repeated calls, and safe under ``torch.func.vmap``, ``grad``, ``jacrev`` and
    ``torch.compile(fullgraph=True)``. Afterwards, also if the call raised, the module holds
    exactly the tensors it held before (same objects, same ``requires_grad``, values untouched
    unless ``forward`` writes to the tree's tensors in place), and so do tensors it keeps as plain
    attributes and lazy modules' class and hooks; a buffer that ``forward`` reassigns is written
    back into ``tree``. Not restored, as with ``torch.func.functional_call``: other plain
    attributes that ``forward`` assigns (counters, ints, lists, such as the
    ``max_seq_len_cached`` of a Llama with dynamic RoPE); snapshotting every module's
    ``__dict__`` on every call would cost more than the call itself on small models. Call a copy
    (``copy.deepcopy(module)``) when its forward keeps such state.

    >>> import torch, modstate as ms
    >>> lin = torch.nn.Linear(3, 1)
    >>> tree = ms.extract(lin, detach=True)
    >>> x = torch.randn(5, 3)
    >>> grads = torch.func.grad(lambda t: ms.call(lin, t, x).sum())(tree)
    >>> grads["weight"].shape
    torch.Size([1, 3])
    """
    if torch.compiler.is_compiling():
        return _call_while_compiling(module, tree, args, kwargs)
    swap = prepare(module, tree, True)
    swap.apply()
    try:
        return module(*args, **kwargs)
    finally:
        swap.undo()


def _call_while_compiling(module: nn.Module, tree: TreeArg, args: tuple, kwargs: dict) -> Any:
    # Dynamo traces torch.func.functional_call natively; the swap engine's C-level list passes
    # are opaque to it. functional_call (strict) refuses unknown and missing keys.
    components = list(tree) if isinstance(tree, (tuple, list)) else [tree]
    flats = [flatten(component) for component in components]
    given = [dict(flat) for flat in flats]
    out = torch.func.functional_call(
        module, tuple(flats), args, kwargs, tie_weights=True, strict=True
    )
    for component, flat, before in zip(components, flats, given):
        changed = {key: value for key, value in flat.items() if value is not before[key]}
        if changed:
            _write_back(component, unflatten(changed))
    return out


def _write_back(tree: dict[str, Any], changed: dict[str, Any]) -> None:
    for key, value in changed.items():
        if isinstance(value, dict) and isinstance(tree.get(key), dict):
            _write_back(tree[key], value)
        else:
            tree[key] = value
