"""Modules sharded with FSDP2 or tensor parallel: the one place that knows their machinery.

FSDP2 (``fully_shard``) keeps each parameter as a sharded ``DTensor`` and, in a forward pre-hook,
all-gathers its *own* copies into the module's slots (initialising itself lazily on the first
forward); a forward hook puts the shards back. Tensor parallel (``parallelize_module``) keeps
``DTensor`` parameters and converts inputs and outputs in forward hooks. Neither sees a tree put
into the slots: FSDP overwrites it, and its lazy initialisation would adopt it.

So a stateless call on such a module computes what the *unsharded* module computes, at FSDP's
memory: during the call, `Sharding.bypass` puts stand-ins (`units`) at
the keys of FSDP2's forward hooks, which gather the tree's leaves of one FSDP unit at a time, and
takes the tensor-parallel hooks off; ``DTensor`` leaves outside any FSDP unit (tensor parallel)
are gathered whole before the call (`gathered`). Gradients come
back as ``DTensor`` s laid out like the leaves, also under ``torch.func.grad``. FSDP's own state
(lazy init, reshard, all-gather buffers) is never touched. ``swap`` is refused on FSDP-managed
parameters (FSDP would put its own back), and ``load`` copies a full tensor into a sharded one by
taking this rank's piece.

While a call runs, its stand-ins sit in the module's hook dicts (and a method registered with
``register_fsdp_forward_method`` is shadowed on the instance), so another thread that runs the
module meanwhile runs it with the call's tree; concurrent calls on one sharded module are not
supported. Everything is put back when the call returns or raises.

Nothing here imports ``torch.distributed`` unless it was imported already: a module can only be
sharded if it was.
"""

from __future__ import annotations

import sys
from collections.abc import Callable
from typing import Any, Protocol

from torch import Tensor, nn

from modstate._core.sharded.gathers import gathered, holds_dtensor, piece_of
from modstate._core.torch_facts import is_dtensor
from modstate._core.vmap_levels import unwrapped

__all__ = [
    "Sharding",
    "gathered",
    "holds_dtensor",
    "loadable",
    "partial_leaf",
    "piece_of",
    "sharding_of",
]

# Forward hooks defined in these packages are the parallelism's own: FSDP2's pre-forward
# all-gather / post-forward reshard, and the input/output conversions of tensor-parallel styles.
_FSDP_HOOK_PACKAGE = "torch.distributed.fsdp."
_FSDP_SOURCE = "torch/distributed/fsdp/"
_PARALLEL_HOOK_PACKAGES = (_FSDP_HOOK_PACKAGE, "torch.distributed.tensor.")


class StandIns(Protocol):
    """What takes the place of FSDP2's forward machinery during a call (``units.Units``)."""

    def hook(self, module: nn.Module, hook_dict: str) -> Any: ...

    def method(self, module: nn.Module, method: Callable[..., Any]) -> Any: ...


def _is_fsdp_module(module: nn.Module) -> bool:
    fsdp = sys.modules.get("torch.distributed.fsdp")
    return fsdp is not None and isinstance(module, fsdp.FSDPModule)


def _is_parallel_hook(hook: Any) -> bool:
    owner = getattr(hook, "__module__", None) or ""
    return owner.startswith(_PARALLEL_HOOK_PACKAGES)


class Sharding:
    """How a module is sharded: its parallelism hooks, and which slots FSDP2 owns.

    ``hooks``: ``(module, hook dict name, key)`` of every FSDP2 / tensor-parallel forward hook.
    ``fsdp_owned``: ``id(module._parameters) -> (module path, FSDP module path)`` for the
    parameters that FSDP2 manages (those of an ``fully_shard``-ed module and its submodules).
    ``unit_of``: ``id(module._parameters) -> the fully_shard-ed module`` whose forward gathers
    them (the innermost one above), for the units whose FSDP2 hooks a call can stand in for.
    ``methods``: ``(module, name)`` of the methods registered with FSDP2's
    ``register_fsdp_forward_method`` (an instance attribute wrapping the class's method).
    ``unit_tables``: the ``_parameters`` dicts that ``unit_of`` maps.
    """

    __slots__ = ("fsdp_owned", "hooks", "methods", "unit_of", "unit_tables")

    def __init__(
        self,
        hooks: list[tuple[nn.Module, str, Any]],
        fsdp_owned: dict[int, tuple[str, str]],
        unit_of: dict[int, nn.Module],
        methods: list[tuple[nn.Module, str]],
        unit_tables: list[dict[str, Any]],
    ) -> None:
        self.hooks = hooks
        self.fsdp_owned = fsdp_owned
        self.unit_of = unit_of
        self.methods = methods
        self.unit_tables = unit_tables

    def units(self, tables: list[dict[str, Any]]) -> list[tuple[nn.Module, list[int]]]:
        """Every FSDP unit, with the positions in ``tables`` of the slots it owns (a unit owning
        none of them too: its forward still applies its mixed-precision policy)."""
        positions: dict[int, tuple[nn.Module, list[int]]] = {
            id(m): (m, []) for m in self.unit_of.values()
        }
        for i, table in enumerate(tables):
            module = self.unit_of.get(id(table))
            if module is not None:
                positions[id(module)][1].append(i)
        return list(positions.values())

    def untouched(self, tables: list[dict[str, Any]], names: list[str]) -> list[tuple[Any, ...]]:
        """``(table, name, parameter)`` of every ``DTensor`` parameter of an FSDP unit that is
        not among ``tables`` / ``names`` (a partial tree leaves it to the module): the unit's
        stand-in gathers it with the rest, as FSDP would."""
        given = {(id(table), name) for table, name in zip(tables, names, strict=True)}
        return [
            (table, name, value)
            for table in self.unit_tables
            for name, value in table.items()
            if (id(table), name) not in given and is_dtensor(value)
        ]

    def bypass(self, stand_ins: StandIns | None = None) -> Callable[[], None]:
        """Take the parallelism's forward hooks off, FSDP2's replaced by
        ``stand_ins.hook(module, hook dict name)`` at their very keys where that gives a hook,
        and the methods registered with ``register_fsdp_forward_method`` by
        ``stand_ins.method(module, method)``; return the function that puts everything back
        where it was (same order, hooks added meanwhile kept)."""
        saved: dict[int, tuple[dict[Any, Any], dict[Any, Any], set[Any]]] = {}
        for module, name, key in self.hooks:
            table = vars(module)[name]
            entry = saved.get(id(table))
            if entry is None:
                entry = saved[id(table)] = (table, dict(table), set())
            if key in table:
                replacement = None
                if stand_ins is not None and _is_fsdp_hook(table[key]):
                    replacement = stand_ins.hook(module, name)
                if replacement is not None:
                    table[key] = replacement
                else:
                    del table[key]
                    entry[2].add(key)
        methods = []
        for module, name in self.methods:
            registered = vars(module).get(name)
            # FSDP's wrapper calls its own pre-forward (which would gather the module's own
            # parameters into the slots); the method it wraps runs between the stand-ins.
            inner = getattr(getattr(registered, "__func__", None), "__wrapped__", None)
            if inner is None:
                continue
            replacement = None if stand_ins is None else stand_ins.method(module, inner)
            vars(module)[name] = replacement or inner
            methods.append((module, name, registered))

        def restore() -> None:
            for table, before, removed in saved.values():
                now = dict(table)
                table.clear()
                table.update(
                    (key, value) for key, value in before.items() if key in now or key in removed
                )
                table.update((key, value) for key, value in now.items() if key not in before)
            for module, name, registered in methods:
                vars(module)[name] = registered

        return restore

    def _fsdp_owner(self, table: dict[str, Any], name: str) -> tuple[str, str] | None:
        """``(path of table[name], path of the FSDP2 module owning it)`` for a parameter that
        FSDP2 owns, else None."""
        owner = self.fsdp_owned.get(id(table))
        if owner is None:
            return None
        return (f"{owner[0]}.{name}" if owner[0] else name), (owner[1] or "the root module")

    def check_swappable(self, tables: list[dict[str, Any]], names: list[str]) -> None:
        """Refuse, naming the path, a permanent swap of a parameter that FSDP2 owns."""
        for table, name in zip(tables, names, strict=True):
            owned = self._fsdp_owner(table, name)
            if owned is not None:
                path, fsdp_path = owned
                raise ValueError(
                    f"{path!r}: {fsdp_path!r} is sharded with FSDP2 (fully_shard), which owns "
                    "this parameter and all-gathers its own copy before every forward, so "
                    "swap cannot replace it; use ms.load to copy values into it (identity "
                    "kept), or ms.inject / ms.call to compute with another tree"
                )

    def check_loadable(self, tables: list[dict[str, Any]], names: list[str]) -> None:
        """Refuse, naming the path, an in-place load into parameters that FSDP2 holds gathered
        (between forward and backward): FSDP reshards from its own shards, so it would be lost."""
        for table, name in zip(tables, names, strict=True):
            owned = self._fsdp_owner(table, name)
            if owned is not None and not is_dtensor(table.get(name)):
                path, fsdp_path = owned
                raise ValueError(
                    f"{path!r}: {fsdp_path!r} (FSDP2) holds its gathered parameters now (after a "
                    "forward whose backward has not run, or with reshard_after_forward=False), "
                    "and reshards from its own shards, so a load into them would be lost; call "
                    "reshard() on that module (or finish the backward) first"
                )

    def refuse_state_dict_route(self, operation: str) -> None:
        """Refuse ``use_state_dict=True`` for a computing swap: that route swaps the tensors in
        as they are, which the parallelism's forward hooks would replace or misread."""
        raise ValueError(
            f"{operation}(..., use_state_dict=True) on a module sharded with FSDP2 or tensor "
            f"parallel is not supported: the module's forward hooks would not compute with the "
            f"tree; use {operation}(...) without use_state_dict (the tree's paths are the "
            "module's own, as extract gives them)"
        )


def sharding_of(modules: list[tuple[str, nn.Module]], tensors: list[Any]) -> Sharding | None:
    """The `Sharding` of a module tree (``(path, module)`` pairs as ``named_modules``
    gives them, and every tensor its slots hold), or None if nothing in it is sharded."""
    if "torch.distributed.tensor" not in sys.modules:
        return None
    if modules and getattr(modules[0][1], "_modstate_computes_with_dtensors", False):
        return None  # a module whose forward takes its DTensors as they are (an Ensemble on a mesh)
    # Only the hooks themselves: the *_with_kwargs / always_called flags of a hook that is not
    # there are never read.
    hooks = [
        (module, name, key)
        for _, module in modules
        for name in ("_forward_pre_hooks", "_forward_hooks")
        for key, hook in vars(module)[name].items()
        if _is_parallel_hook(hook)
    ]
    fsdp_owned: dict[int, tuple[str, str]] = {}
    unit_of: dict[int, nn.Module] = {}
    unit_tables: list[dict[str, Any]] = []
    fsdp_roots: list[tuple[str, nn.Module]] = []
    for path, module in modules:
        if _is_fsdp_module(module):
            fsdp_roots.append((path, module))
        root = next((r for r in reversed(fsdp_roots) if _is_under(path, r[0])), None)
        if root is not None:
            fsdp_owned[id(module._parameters)] = (path, root[0])
            if _has_fsdp_hooks(root[1], hooks):
                unit_of[id(module._parameters)] = root[1]
                unit_tables.append(module._parameters)
    if not hooks and not fsdp_owned and not any(map(is_dtensor, tensors)):
        return None
    methods = [
        (module, name)
        for _, module in fsdp_roots
        for name, value in vars(module).items()
        if _is_fsdp_forward_method(value)
    ]
    return Sharding(hooks, fsdp_owned, unit_of, methods, unit_tables)


def _is_fsdp_forward_method(value: Any) -> bool:
    """Whether ``value`` is the wrapper ``register_fsdp_forward_method`` puts on an instance
    (``functools.wraps`` gives it the user's names; its code is FSDP's)."""
    code = getattr(getattr(value, "__func__", None), "__code__", None)
    return code is not None and _FSDP_SOURCE in code.co_filename.replace("\\", "/")


def _is_fsdp_hook(hook: Any) -> bool:
    owner = getattr(hook, "__module__", None) or ""
    return owner.startswith(_FSDP_HOOK_PACKAGE)


def _has_fsdp_hooks(module: nn.Module, hooks: list[tuple[nn.Module, str, Any]]) -> bool:
    """Whether FSDP2 gathers ``module``'s parameters in its own forward pre-hook and forward hook
    (the pair a call stands in for); a unit without them is gathered whole before the call."""
    names = {
        name
        for owner, name, key in hooks
        if owner is module and _is_fsdp_hook(vars(owner)[name].get(key))
    }
    return names == {"_forward_pre_hooks", "_forward_hooks"}


def _is_under(path: str, prefix: str) -> bool:
    return prefix == "" or path == prefix or path.startswith(prefix + ".")


def partial_leaf(values: list[Any]) -> int | None:
    """The index of the first value that is a ``DTensor`` with a ``Partial`` placement (a pending
    sum, which has no piece of a gradient to give back), or None."""
    for index, value in enumerate(values):
        if holds_dtensor(value):
            inner: Any = unwrapped(value)
            if any(p.is_partial() for p in inner.placements):
                return index
    return None


def loadable(currents: list[Any], values: list[Any]) -> list[Any]:
    """``values`` made copyable into ``currents``: a full tensor going into a ``DTensor`` becomes
    this rank's piece of it (every rank holds the same full tensor), a ``DTensor`` going into
    a plain tensor its full tensor."""
    out = []
    for current, value in zip(currents, values, strict=True):
        if is_dtensor(current) and isinstance(value, Tensor) and not is_dtensor(value):
            value = piece_of(value.detach(), current.device_mesh, current.placements)
        elif is_dtensor(value) and not is_dtensor(current):
            value = value.full_tensor()
        out.append(value)
    return out
