"""Ensembles kept for a module, to run stacked trees given at call time with the batched kernels.

`modstate.apply` under a lone ``torch.vmap`` and `modstate.vmap_call` both receive a module and
trees of stacked tensors at each call. Rather than leaving the module's forward to
``torch.vmap``'s per-operation rules, they run an `Ensemble` of the module with the caller's
stacked tensors swapped in: the same batched kernels and plan as ``Ensemble``.

The ensemble is built on first use and kept, per member count, inputs' member dims, randomness,
and the *settings* of the module (`_settings`): which modules it holds and each one's plain
attributes (``training``, ``momentum``, ``p``, ...) and tensors' names, so that
``model.eval()``, a changed hyperparameter or a replaced layer gets an ensemble of its own (at
most `_KEPT_PER_MODEL` per module, the oldest dropped first). It is built on a copy of the
module, whose tensors and stacked tensors are placeholders that hold no memory (every call swaps
the caller's in): it holds neither the module's tensors nor the caller's trees, and it is dropped
with the module (a weak key). A module with forward hooks, or one the ensemble cannot be built
for, gets None: the caller keeps vmap's rules.

Threads: the kept ensembles are shared; building one is serialized, and each call runs as
``Ensemble``'s calls do, each thread on a runner of its own.
"""

from __future__ import annotations

import threading
import weakref
from typing import Any

import optree
import torch
from torch import Tensor, nn
from torch.nn.modules import module as module_globals
from torch.nn.parameter import is_lazy

from modstate._core.extract import extract
from modstate._core.module.anatomy import slot_at
from modstate._core.trees.flat import flatten

from ._ensemble import Ensemble
from ._options import checked_options
from ._stacked_state import sharing_copy
from ._vmap import InDims

_KEPT_PER_MODEL = 4  # settings a module is met with (train, eval, ...); the oldest goes first
_kept: weakref.WeakKeyDictionary[nn.Module, dict[tuple[Any, ...], Ensemble | None]] = (
    weakref.WeakKeyDictionary()
)
_building = threading.Lock()
_MISSING = object()


def ensemble_for(
    module: nn.Module, count: int, randomness: str, in_dims: InDims
) -> Ensemble | None:
    """The kept ensemble of ``module`` for ``count`` members, vmap's ``randomness``, ``in_dims``
    (hashable: an int, a tuple or None) and the module's settings now, built on first use; None
    where the module has forward hooks or no ensemble can be built for it."""
    settings = _settings(module)
    if settings is None:
        return None
    key = (count, in_dims, randomness, settings)
    kept = _kept.get(module)
    if kept is not None:
        found = kept.get(key, _MISSING)  # one lookup: another thread may drop the entry
        if found is not _MISSING:
            return found  # type: ignore[return-value]
    with _building:
        kept = _kept.setdefault(module, {})
        if key not in kept:
            if len(kept) >= _KEPT_PER_MODEL:
                del kept[next(iter(kept))]
            kept[key] = _build(module, count, randomness, in_dims)
        return kept[key]


def _build(module: nn.Module, count: int, randomness: str, in_dims: InDims) -> Ensemble | None:
    template = sharing_copy(module)
    _hollow(template)
    placeholders: Any = optree.tree_map(
        lambda tensor: tensor.detach().expand(count, *tensor.shape),
        extract(template),  # type: ignore[arg-type]
        none_is_leaf=False,
    )
    options = checked_options("modstate", False, in_dims, randomness, True, "batched")
    try:
        return Ensemble._assembled(template, placeholders, count, options)
    except (TypeError, ValueError, RuntimeError, NotImplementedError):
        return None  # a model the ensemble does not take: vmap's rules run it, as before


def _hollow(template: nn.Module) -> None:
    """Replace the template's tensors by placeholders of the same shape, dtype, device and
    ``requires_grad`` that hold no memory (a tie stays one placeholder): every call swaps the
    caller's tensors in, and the kept ensemble must not keep the module's own alive."""
    made: dict[int, Tensor] = {}
    for path, tensor in flatten(extract(template)).items():
        if is_lazy(tensor):
            continue
        hollow = made.get(id(tensor))
        if hollow is None:
            empty = torch.empty((), dtype=tensor.dtype, device=tensor.device)
            hollow = empty.expand(tensor.shape)
            if isinstance(tensor, nn.Parameter):
                hollow = nn.Parameter(hollow, requires_grad=tensor.requires_grad)
            made[id(tensor)] = hollow
        slot = slot_at(template, path)
        slot.table[slot.name] = hollow


_PLAIN = frozenset({bool, int, float, str, type(None)})


def _settings(module: nn.Module) -> tuple[Any, ...] | None:
    """What the kept ensemble was built from: each module (by identity and class), its plain attributes
    (``training``, hyperparameters) and its tensors' names; None where a forward hook or
    pre-hook would run. Walked directly (not ``modules()``): it runs on every call."""
    if module_globals._global_forward_hooks or module_globals._global_forward_pre_hooks:
        return None
    found: list[Any] = []
    append = found.append
    seen: set[int] = set()
    pending = [module]
    plain = _PLAIN
    while pending:
        owner = pending.pop()
        key = id(owner)
        if key in seen:
            continue
        seen.add(key)
        attributes = owner.__dict__
        if attributes["_forward_hooks"] or attributes["_forward_pre_hooks"]:
            return None
        append(key)
        append(type(owner))
        found.extend(attributes["_parameters"])
        append(None)
        found.extend(attributes["_buffers"])
        append(None)
        for item in attributes.items():
            if type(item[1]) in plain:
                append(item)
        children = attributes["_modules"]
        if children:
            pending.extend([child for child in children.values() if child is not None])
    return tuple(found)
