"""The ``state_dict`` bridge: trees as ``state_dict()`` sees them, and as ``load_state_dict`` reads them.

Extraction is ``module.state_dict(keep_vars=True)`` itself, nested: every pre/post hook,
``_save_to_state_dict`` override and ``get_extra_state`` runs exactly as torch runs them.

Reinjection replays ``load_state_dict``'s walk (``torch/nn/modules/module.py``): for each module, at
its real dotted prefix, its load pre-hooks edit the flat dict, its own keys are matched to its slots
and its extra state, its children get the keys under their prefix, and its post-hooks see (and may
edit) the missing and unexpected key lists. Instead of copying, the walk returns a `LoadPlan`
that says which tensor goes into which slot, so the swap engine can put the tree's own tensors in
(``inject`` / ``swap``) or copy them (``load``), after every check has passed.

``_load_from_state_dict`` overrides: the two in ``torch.nn`` (batch and instance norm, which only
adjust keys of old checkpoints) are replayed; any other override cannot be replayed reversibly, so
``inject`` / ``swap`` refuse the module and ``load`` calls the override itself.
"""

from __future__ import annotations

import weakref
from collections import OrderedDict
from collections.abc import Mapping
from typing import Any

import torch
from torch import nn
from torch.nn.modules.batchnorm import _NormBase
from torch.nn.modules.instancenorm import _InstanceNorm
from torch.nn.modules.module import _EXTRA_STATE_KEY_SUFFIX, _IncompatibleKeys
from torch.nn.parameter import is_lazy

from modstate._core.errors import PathError
from modstate._core.module.anatomy import buffer_paths
from modstate._core.trees.flat import Layout, unflatten
from modstate._core.types import Tree

_DEFAULT_LOAD = nn.Module._load_from_state_dict
_DEFAULT_SET_EXTRA_STATE = nn.Module.set_extra_state
_REPLAYED_LOADS = {
    _NormBase._load_from_state_dict,
    _InstanceNorm._load_from_state_dict,
}


def state_dict_tree(module: nn.Module, *, buffers: bool = True) -> Tree:
    """``module.state_dict(keep_vars=True)``, nested; with ``buffers=False`` the persistent buffers'
    keys are left out (keys that hooks renamed are kept)."""
    flat = module.state_dict(keep_vars=True)
    if buffers:
        keys = list(flat)
        layout = _layouts.get(module)
        if layout is None or layout.keys != keys:
            layout = _layouts[module] = Layout(keys)
        return layout.nest(list(flat.values()))
    else:
        buffer_keys = buffer_paths(module, persistent_only=True)
        flat = {key: value for key, value in flat.items() if key not in buffer_keys}
    return unflatten(flat)


# The nesting of each module's last state_dict keys: rebuilt when the keys differ.
_layouts: weakref.WeakKeyDictionary[nn.Module, Layout] = weakref.WeakKeyDictionary()


class Assignment:
    """``value`` goes into ``table[name]``, the slot that ``load_state_dict`` would fill from ``key``."""

    __slots__ = ("current", "is_buffer", "key", "name", "table", "value")

    def __init__(
        self, table: dict[str, Any], name: str, key: str, value: Any, is_buffer: bool
    ) -> None:
        self.table = table
        self.is_buffer = is_buffer
        self.name = name
        self.key = key
        self.value = value
        self.current = table[name]


class LoadPlan:
    """What ``load_state_dict`` would do with a flat dict, without having done any of it."""

    def __init__(self) -> None:
        self.assignments: list[Assignment] = []
        self.extra_states: list[tuple[nn.Module, str, Any]] = []
        self.overridden: list[tuple[nn.Module, dict[str, Any], str]] = []
        self.missing: list[str] = []
        self.unexpected: list[str] = []
        self.errors: list[str] = []


def plan_load(
    module: nn.Module, flat: Mapping[str, Any], *, strict: bool, in_place: bool
) -> LoadPlan:
    """Replay ``module.load_state_dict(flat)`` as a plan; run every load hook on the way.

    ``strict`` decides whether shapes must match (``in_place`` loads always need them to); missing
    and unexpected keys are recorded either way, for the caller to judge.
    """
    plan = LoadPlan()
    _visit(module, OrderedDict(flat), "", plan, strict or in_place, in_place)
    return plan


def _visit(
    module: nn.Module,
    local: dict[str, Any],
    prefix: str,
    plan: LoadPlan,
    check_shapes: bool,
    in_place: bool,
) -> None:
    metadata: dict[str, Any] = {}
    load = type(module)._load_from_state_dict
    if load is _DEFAULT_LOAD or load in _REPLAYED_LOADS:
        if isinstance(module, _NormBase):
            _replay_norm_versions(module, local, prefix, plan)
        _run_pre_hooks(module, local, prefix, metadata, plan)
        _match_own_keys(module, local, prefix, plan, check_shapes)
    elif in_place:
        plan.overridden.append((module, local, prefix))
    else:
        raise Unreplayable(
            prefix[:-1],
            f"{type(module).__name__} overrides _load_from_state_dict, which cannot be replayed "
            "reversibly",
            "use modstate.load (which calls it), or use_state_dict=False",
        )
    for name, child in module._modules.items():
        if child is not None:
            child_prefix = f"{prefix}{name}."
            child_local = {k: v for k, v in local.items() if k.startswith(child_prefix)}
            _visit(child, child_local, child_prefix, plan, check_shapes, in_place)
    incompatible = _IncompatibleKeys(plan.missing, plan.unexpected)
    for hook in module._load_state_dict_post_hooks.values():
        if hook(module, incompatible) is not None:
            raise HookReturned(
                prefix[:-1],
                "a load_state_dict post-hook returned a value",
                "post-hooks edit incompatible_keys in place and return None",
            )


def _run_pre_hooks(
    module: nn.Module, local: dict[str, Any], prefix: str, metadata: dict, plan: LoadPlan
) -> None:
    for hook in module._load_state_dict_pre_hooks.values():
        hook(local, prefix, metadata, True, plan.missing, plan.unexpected, plan.errors)


def _match_own_keys(
    module: nn.Module, local: dict[str, Any], prefix: str, plan: LoadPlan, check_shapes: bool
) -> None:
    own: list[tuple[dict[str, Any], str, bool]] = [
        (module._parameters, name, False) for name, p in module._parameters.items() if p is not None
    ]
    own += [
        (module._buffers, name, True)
        for name, b in module._buffers.items()
        if b is not None and name not in module._non_persistent_buffers_set
    ]
    for table, name, is_buffer in own:
        key = prefix + name
        if key not in local:
            plan.missing.append(key)
            continue
        value = local[key]
        current = table[name]
        if not torch.overrides.is_tensor_like(value):
            plan.errors.append(
                f"{key!r}: expected a tensor, got {type(value).__name__}; give a tensor there"
            )
            continue
        if not is_lazy(current) and not is_lazy(value):
            if current.dim() == 0 and value.shape == (1,):
                value = value[0]  # load_state_dict's allowance for checkpoints of torch 0.3
            if check_shapes and value.shape != current.shape:
                plan.errors.append(
                    f"{key!r}: shape {tuple(value.shape)} in the tree, "
                    f"{tuple(current.shape)} in the module; strict=False accepts other shapes, "
                    "except in load, which copies into the module's tensors"
                )
                continue
        plan.assignments.append(Assignment(table, name, key, value, is_buffer))

    extra_key = prefix + _EXTRA_STATE_KEY_SUFFIX
    if type(module).set_extra_state is not _DEFAULT_SET_EXTRA_STATE:
        if extra_key in local:
            plan.extra_states.append((module, extra_key, local[extra_key]))
        else:
            plan.missing.append(extra_key)
    elif extra_key in local:
        plan.unexpected.append(extra_key)

    own_names = {name for _, name, _ in own}
    for key in local:
        if key.startswith(prefix) and key != extra_key:
            head, dot, _ = key[len(prefix) :].partition(".")
            if (head not in module._modules) if dot else (head not in own_names):
                plan.unexpected.append(key)


def _replay_norm_versions(
    module: _NormBase, local: dict[str, Any], prefix: str, plan: LoadPlan
) -> None:
    """What batch and instance norm do for trees without version metadata (all trees)."""
    if isinstance(module, _InstanceNorm) and not module.track_running_stats:
        stale = [prefix + n for n in ("running_mean", "running_var") if prefix + n in local]
        if stale:
            plan.errors.append(
                f"{stale[0]!r}: running statistics given for {type(module).__name__} with "
                "track_running_stats=False; leave them out of the tree"
            )
            for key in stale:
                local.pop(key)
    elif module.track_running_stats:
        key = prefix + "num_batches_tracked"
        if key not in local:
            tracked = module.num_batches_tracked
            local[key] = (
                tracked
                if tracked is not None and tracked.device.type != "meta"
                else torch.tensor(0, dtype=torch.long)
            )


def run_overridden_loads(plan: LoadPlan, *, assign: bool = False) -> None:
    """Let modules with their own ``_load_from_state_dict`` load themselves (copying, or
    assigning as ``load_state_dict(assign=True)`` tells them through their metadata)."""
    metadata = {"assign_to_params_buffers": True} if assign else {}
    for module, local, prefix in plan.overridden:
        module._load_from_state_dict(
            local, prefix, dict(metadata), True, plan.missing, plan.unexpected, plan.errors
        )


class Unreplayable(PathError, NotImplementedError):
    """A module whose ``_load_from_state_dict`` override cannot be replayed reversibly."""


class HookReturned(PathError, AssertionError):
    """A ``load_state_dict`` post-hook returned a value (torch raises the same)."""
