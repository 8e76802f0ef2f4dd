"""Module anatomy: where every tensor of a module lives, the one place that knows it.

A tensor of a module lives in a *slot*: an entry ``name`` of the owning module's ``_parameters`` or
``_buffers`` dict. Parametrizations (``torch.nn.utils.parametrize``) keep their originals in such
slots too, under ``parametrizations.<name>.original``. Tied weights are one tensor held by several
slots. Some modules also keep tensors computed from their slots in ``__dict__`` (legacy
``weight_norm`` / ``spectral_norm`` recompute ``module.weight`` in a forward pre-hook) or change
their own class and hooks on the first forward (lazy modules); `ModuleGuard` snapshots and
restores those, so a temporary swap leaves nothing behind.

An `Anatomy` is built once per module and reused while the module's structure and tensors
stay the same; `anatomy_of` checks that in a few C-level passes and rebuilds when it changed.

Building an anatomy makes each slot's dict a `SlotTable` (the same
entries, in a dict subclass that a thread can overlay privately; see ``tables.py``), once per
dict: every table this file hands out is one, so no reference to a replaced dict goes stale. The
fingerprint and the tie groups read the dicts' own entries (what every thread sees); ``holding``
and `Slot.get` read what the calling thread sees (a call's tree, inside that call).
"""

from __future__ import annotations

import operator
import threading
import weakref
from collections import OrderedDict
from collections.abc import Mapping
from typing import Any

import optree
import torch
from torch import nn
from torch.nn.modules.lazy import LazyModuleMixin
from torch.nn.parameter import is_lazy
from torch.nn.utils.spectral_norm import SpectralNorm
from torch.nn.utils.weight_norm import WeightNorm

from modstate._core.module.tables import SlotTable, calls_here
from modstate._core.sharded.sharding import Sharding, sharding_of
from modstate._core.trees.readers import TreeReader

_getitem = operator.getitem
_own = dict.__getitem__  # a slot's own entry, never a thread's layer
_is = operator.is_
_HOOK_DICTS = (
    "_forward_pre_hooks",
    "_forward_pre_hooks_with_kwargs",
    "_forward_hooks",
    "_forward_hooks_with_kwargs",
    "_forward_hooks_always_called",
    "_load_state_dict_pre_hooks",
    "_load_state_dict_post_hooks",
    "_state_dict_pre_hooks",
    "_state_dict_hooks",
)


class Slot:
    """One place a tensor lives: ``table[name]``, ``table`` being ``module._parameters`` or
    ``module._buffers`` (made a `SlotTable` when it is a plain dict)."""

    __slots__ = ("is_buffer", "name", "path", "persistent", "table")

    def __init__(self, path: str, module: nn.Module, name: str, is_buffer: bool) -> None:
        self.path = path
        self.name = name
        self.is_buffer = is_buffer
        self.table: dict[str, Any] = slot_table(module, "_buffers" if is_buffer else "_parameters")
        self.persistent = not is_buffer or name not in module._non_persistent_buffers_set

    def get(self) -> Any:
        """The tensor the calling thread sees here (inside a call: the call's)."""
        return self.table[self.name]

    def __repr__(self) -> str:
        return f"Slot({self.path!r})"


_install_lock = threading.Lock()


def slot_table(module: nn.Module, attribute: str) -> dict[str, Any]:
    """``module._parameters`` or ``module._buffers``, made a `SlotTable` (same entries) when
    it is a plain ``dict`` / ``OrderedDict``; a dict of another type is left as it is (calls on
    its module then swap for every thread, see ``Anatomy.layered``)."""
    table = module.__dict__[attribute]
    if type(table) is SlotTable or type(table) not in (dict, OrderedDict):
        return table
    with _install_lock:  # two threads installing at once would each keep a different table
        table = module.__dict__[attribute]
        if type(table) in (dict, OrderedDict):
            table = module.__dict__[attribute] = SlotTable(table)
    return table


def slot_at(module: nn.Module, path: str) -> Slot:
    """The slot at a dotted path of ``module`` (``"0.weight"``); ``KeyError`` if none is there."""
    prefix, _, name = path.rpartition(".")
    owner = module.get_submodule(prefix)
    if owner._parameters.get(name) is not None:
        return Slot(path, owner, name, is_buffer=False)
    if owner._buffers.get(name) is not None:
        return Slot(path, owner, name, is_buffer=True)
    raise KeyError(f"{path!r}: the module has no parameter or buffer there")


def buffer_paths(module: nn.Module, *, persistent_only: bool = False) -> set[str]:
    """Every path at which ``module`` holds a buffer, shared submodules at each of their paths
    (as ``state_dict`` lists them)."""
    return {
        f"{prefix}.{name}" if prefix else name
        for prefix, owner in module.named_modules(remove_duplicate=False)
        for name, buffer in owner._buffers.items()
        if buffer is not None
        and not (persistent_only and name in owner._non_persistent_buffers_set)
    }


def buffer_owners(module: nn.Module) -> dict[str, nn.Module]:
    """The module that holds each buffer, by path (a shared module, or buffer, at each path)."""
    return {
        f"{prefix}.{name}" if prefix else name: owner
        for prefix, owner in module.named_modules(remove_duplicate=False)
        for name, _ in owner.named_buffers(recurse=False, remove_duplicate=False)
    }


def check_supported(module: nn.Module) -> None:
    if isinstance(module, torch.jit.ScriptModule):
        raise TypeError(
            f"{type(module).__name__} is a TorchScript module; modstate needs an eager nn.Module "
            "(its parameters cannot be swapped): script the module after swapping instead"
        )
    if not isinstance(module, nn.Module):
        raise TypeError(f"expected a torch.nn.Module, got {type(module).__name__}")


class Anatomy:
    """Every slot of a module, its tie groups, and a compiled plan for trees shaped like ``extract``.

    ``slots`` is in ``state_dict`` order (own parameters, own buffers, then children, depth first),
    one entry per path: tied tensors appear at each path that holds them. A module reachable twice
    is visited once, as ``named_modules`` does. The anatomy holds no reference to the root module
    (it is cached under a weak reference to it), only to its dicts and its tensors; its children
    it knows by id and weak reference. It leaves the cache as soon as the module lets go of a
    tensor or a child (see `Stale`), which is then freed at once, not at the next call.
    """

    def __init__(self, root: nn.Module) -> None:
        check_supported(root)
        self.slots: list[Slot] = []
        modules: list[tuple[str, nn.Module]] = []
        guarded: list[nn.Module] = []
        template = self._walk(root, "", set(), modules, guarded)
        self.template: dict[str, Any] = template or {}
        self.by_path = {slot.path: slot for slot in self.slots}
        self.module_paths = {prefix for prefix, _ in modules}
        own = [_own(slot.table, slot.name) for slot in self.slots]
        self.sharding: Sharding | None = sharding_of(modules, own)
        self._guarded = [weakref.ref(m) for m in guarded]
        # Whether a stateless call can fill a private layer per thread (see tables.py): every
        # slot's table is a SlotTable, and no torch.compile'd code runs inside the module, since
        # compiled code reads the dicts' own entries (Dynamo calls dict.__getitem__ on a subclass).
        self.runs_compiled_code = any(_holds_compiled_code(m) for _, m in modules)
        self.layered = not self.runs_compiled_code and all(
            type(slot.table) is SlotTable for slot in self.slots
        )
        # Whether calls must run one at a time: forward rewrites tensors kept in __dict__.
        self.serialized = any(_rewrites_tensor_attributes(m) for m in guarded)

        holders: dict[int, list[int]] = {}
        for index, tensor in enumerate(own):
            holders.setdefault(id(tensor), []).append(index)
        self.tie_groups = [group for group in holders.values() if len(group) > 1]

        # The compiled plan, every list in optree's leaf order of the template (sorted keys).
        order: list[int]
        order, self.treespec = optree.tree_flatten(self.template)  # type: ignore[arg-type]
        self.ordered: list[Slot] = [self.slots[i] for i in order]
        self.tables = [slot.table for slot in self.ordered]
        self.names = [slot.name for slot in self.ordered]
        self.held = list(map(_own, self.tables, self.names))
        # For a private swap of the whole plan: each slot's key in a call's layer, and the
        # distinct ``layers`` dicts of the tables (see tables.py).
        self.layout: tuple[list[tuple[int, str]], list[dict[int, Any]]] | None = None
        if self.layered:
            distinct = {id(t): t for t in self.tables}.values()
            keys = [(t.tag, n) for t, n in zip(self.tables, self.names, strict=True)]  # type: ignore[attr-defined]
            self.layout = (keys, [t.layers for t in distinct])  # type: ignore[attr-defined]
        self.buffer_positions = [i for i, slot in enumerate(self.ordered) if slot.is_buffer]
        position = {slot_index: pos for pos, slot_index in enumerate(order)}
        self.tie_positions = [[position[i] for i in group] for group in self.tie_groups]
        # Reads trees shaped like ``template`` leaf by leaf in plan order, without recursion.
        self.reader = TreeReader(self.template, [slot.path for slot in self.ordered])

        # Structure fingerprint: every dict that can gain or lose an entry, and every child.
        self.dicts: list[dict[str, Any]] = []
        self.child_tables: list[dict[str, Any]] = []
        self.child_names: list[str] = []
        children: list[Any] = []
        for _, m in modules:
            self.dicts += (m._parameters, m._buffers, m._modules)
            for name, child in m._modules.items():
                self.child_tables.append(m._modules)
                self.child_names.append(name)
                children.append(child)
        self.child_ids = list(map(id, children))
        self.dict_lens = list(map(len, self.dicts))
        # A child that leads back to the root would keep the weakly cached root alive.
        self.cacheable = all(child is not root for child in children)
        # Letting go (see `Stale`): the children are known by id and held by weak reference,
        # and the slot tables say when one of their own entries is replaced or deleted.
        self._stale = Stale(root, self)
        self._refs = [weakref.ref(child, self._stale) for child in children if child is not None]
        for table in self.dicts:  # each module's own, once: the walk visits a module once
            if type(table) is SlotTable:
                table.watch(self._stale)

    @property
    def holding(self) -> list[Any]:
        """What each slot holds, in plan order, as the calling thread sees it: the module's own
        tensors, or inside a stateless call in this thread, that call's. Outside a call this is
        the anatomy's own list (no copy per call): read it, copy it before changing it."""
        if calls_here():
            return list(map(_getitem, self.tables, self.names))
        return self.held

    @property
    def guarded(self) -> list[nn.Module]:
        """Modules whose non-slot state a swap must snapshot (see `ModuleGuard`)."""
        return [m for m in (ref() for ref in self._guarded) if m is not None]

    def _walk(
        self,
        module: nn.Module,
        prefix: str,
        seen: set[int],
        modules: list[tuple[str, nn.Module]],
        guarded: list[nn.Module],
    ) -> dict[str, Any] | None:
        seen.add(id(module))
        check_supported(module)
        modules.append((prefix[:-1], module))
        if isinstance(module, LazyModuleMixin) or _has_tensor_attributes(module):
            guarded.append(module)
        node: dict[str, Any] = {}
        for is_buffer, table in ((False, module._parameters), (True, module._buffers)):
            own: dict[str, Any] = table
            for name, tensor in dict.items(own):  # the module's own, not a call's layer
                if tensor is not None:
                    node[name] = len(self.slots)
                    self.slots.append(Slot(prefix + name, module, name, is_buffer))
        for name, child in module._modules.items():
            if child is None or id(child) in seen:
                continue
            sub = self._walk(child, f"{prefix}{name}.", seen, modules, guarded)
            if sub:
                node[name] = sub
        return node or None

    # -- the fast path ---------------------------------------------------------------------------

    def is_current(self) -> bool:
        """Whether the module still has exactly the structure and tensors this anatomy saw."""
        try:
            return (
                not self._stale.found
                and list(map(len, self.dicts)) == self.dict_lens
                and list(map(id, map(_getitem, self.child_tables, self.child_names)))
                == self.child_ids
                and all(map(_is, map(_own, self.tables, self.names), self.held))
            )
        except KeyError:
            return False

    def read(self, tree: Mapping[str, Any]) -> tuple[list[Any], list[Any]] | None:
        """The leaves of ``tree`` in plan order, with its nodes, or None if it is shaped otherwise."""
        return self.reader.read(tree)

    def new_tree(self, leaves: list[Any]) -> dict[str, Any]:
        """A fresh nested dict shaped like ``template`` holding ``leaves`` (in plan order)."""
        tree: dict[str, Any] = optree.tree_unflatten(self.treespec, leaves)  # type: ignore[assignment]
        return tree


class Stale:
    """How an anatomy lets go of what its module let go, so that it outlives nothing until the
    next call: called when a slot table of the module replaces or deletes one of its own
    entries (``load_state_dict(..., assign=True)``, a parameter or buffer assigned anew,
    ``fully_shard``; see `SlotTable.watch`), and as the callback of the weak references to
    the module's children, when one is freed (a submodule assigned anew). It marks the anatomy
    stale (a freed child's id may be taken by another, so equal ids mean the same children
    only while this is unset) and drops it from the cache, with the tensors and dicts it holds.
    A call under way keeps what it uses."""

    __slots__ = ("__weakref__", "_anatomy", "_root", "found")

    def __init__(self, root: nn.Module, anatomy: Anatomy) -> None:
        self.found = False
        self._root = weakref.ref(root)
        self._anatomy = weakref.ref(anatomy)

    def __call__(self, _: object = None) -> None:
        self.found = True
        root, anatomy = self._root(), self._anatomy()
        if root is not None and anatomy is not None and _anatomies.get(root) is anatomy:
            _anatomies.pop(root, None)


def _has_tensor_attributes(module: nn.Module) -> bool:
    return any(_holds_tensors(value) for value in vars(module).values())


def _holds_tensors(value: Any) -> bool:
    """A tensor, or a list / tuple of tensors or weak references (an RNN's ``_flat_weights`` and
    ``_flat_weight_refs``, which must come back together)."""
    if isinstance(value, torch.Tensor):
        return True
    return (
        type(value) in (list, tuple)
        and any(v is not None for v in value)
        and all(v is None or isinstance(v, (torch.Tensor, weakref.ref)) for v in value)
    )


def _holds_compiled_code(module: nn.Module) -> bool:
    """Whether the module keeps a ``torch.compile``d callable: ``torch.compile(module)`` (an
    ``OptimizedModule``'s ``forward``), ``module.compile()``, an ``Ensemble(compile=True)``, a
    compiled function kept as an attribute."""
    return any(
        callable(value) and getattr(value, "_torchdynamo_orig_callable", None) is not None
        for value in vars(module).values()
    )


def _rewrites_tensor_attributes(module: nn.Module) -> bool:
    """Whether ``forward`` rewrites tensors this module keeps in ``__dict__`` from its slots, where
    every thread sees them: an RNN (``_flat_weights``), legacy ``weight_norm`` / ``spectral_norm``
    (a forward pre-hook recomputes ``module.weight``), a lazy module before its first forward.
    Stateless calls on such a module run one at a time (see ``tables.py``)."""
    if isinstance(module, nn.RNNBase):
        return True
    if isinstance(module, LazyModuleMixin) and module.has_uninitialized_params():
        return True
    return any(
        isinstance(hook, (WeightNorm, SpectralNorm)) for hook in module._forward_pre_hooks.values()
    )


_serial_locks: weakref.WeakKeyDictionary[nn.Module, threading.RLock] = weakref.WeakKeyDictionary()


def serial_lock(module: nn.Module) -> threading.RLock:
    """The lock that makes stateless calls on ``module`` run one at a time (reentrant: a call
    nested in a call on the same module, in the same thread, goes on)."""
    lock = _serial_locks.get(module)
    if lock is None:
        with _install_lock:
            lock = _serial_locks.get(module)
            if lock is None:
                lock = _serial_locks[module] = threading.RLock()
    return lock


_anatomies: weakref.WeakKeyDictionary[nn.Module, Anatomy] = weakref.WeakKeyDictionary()


def anatomy_of(module: nn.Module) -> Anatomy:
    """The module's anatomy, rebuilt whenever its structure or its tensors changed."""
    anatomy = _anatomies.get(module)
    if anatomy is None or not anatomy.is_current():
        anatomy = Anatomy(module)
        if anatomy.cacheable:
            _anatomies[module] = anatomy
    return anatomy


def forget(module: nn.Module) -> None:
    """Drop the cached anatomy, so that it holds no tensor the module no longer holds."""
    _anatomies.pop(module, None)


class ModuleGuard:
    """Snapshot of what a forward or a load hook may change besides the slots, for the modules that
    do that: tensors (and lists of tensors) kept in ``__dict__`` (legacy ``weight_norm`` /
    ``spectral_norm`` recompute ``module.weight``, an RNN its ``_flat_weights``), and everything a
    lazy module changes on its first call or load (its class, its hooks, the attributes holding
    their handles, its uninitialized parameters).
    `restore` puts all of it back; other attributes (counters and the like) are left alone."""

    __slots__ = ("_lazy_tensors", "_saved")

    def __init__(self, modules: list[nn.Module]) -> None:
        self._saved = []
        for m in modules:
            lazy = isinstance(m, LazyModuleMixin)
            attributes = {
                name: value for name, value in vars(m).items() if lazy or _holds_tensors(value)
            }
            hooks = {name: dict(vars(m)[name]) for name in _HOOK_DICTS if lazy and name in vars(m)}
            self._saved.append((m, type(m), lazy, attributes, hooks))
        tables: list[dict[str, Any]] = [t for m in modules for t in (m._parameters, m._buffers)]
        self._lazy_tensors = [
            (tensor, type(tensor), tensor.data)
            for table in tables
            for tensor in dict.values(table)  # the module's own, not a call's layer
            if tensor is not None and is_lazy(tensor)
        ]

    def restore(self) -> None:
        for tensor, tensor_cls, data in self._lazy_tensors:
            if type(tensor) is not tensor_cls:
                with torch.no_grad():
                    tensor.data = data
                tensor.__class__ = tensor_cls
        for module, cls, lazy, attributes, hooks in self._saved:
            if type(module) is not cls:
                module.__class__ = cls
            current = vars(module)
            for name in [
                name
                for name, value in current.items()
                if name not in attributes and (lazy or _holds_tensors(value))
            ]:
                del current[name]
            for name, value in attributes.items():
                if current.get(name, _MISSING) is not value:
                    current[name] = value
            for name, entries in hooks.items():
                table = current[name]
                if table != entries:
                    table.clear()
                    table.update(entries)


_MISSING = object()
