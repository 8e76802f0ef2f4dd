"""The swap objects: slots and the tensors that go into them, applied and undone.

A `Swap` is what `prepare` produces after every check passed: which
slot (``table[name]``) gets which tensor, what it held before, and where in the caller's tree each
value sits (so that a buffer that ``forward`` reassigns is written back there). Every write into
the slots goes through `Swap.put`, in one of two ways:

- *private* (a stateless call): the tensors go into the calling thread's layer of each
  `SlotTable`; no other thread sees them, and undo takes the layer
  away (restoring an enclosing call's layer when calls nest in one thread);
- *shared* (``inject``, ``swap``, and calls on modules that cannot be layered, sharded ones
  included): the tensors go into the dicts themselves, for every thread; undo puts back what each
  slot held. Inside a stateless call in the same thread, the call's layer is updated too, so the
  body sees what it injected.

`UnshardedSwap` is the form for modules sharded with FSDP2 / tensor parallel,
`HookedSwap` the one that replays ``load_state_dict``.
"""

from __future__ import annotations

import operator
import threading
from collections import deque
from collections.abc import Callable
from typing import Any

from torch import nn

from modstate._core.module.anatomy import ModuleGuard
from modstate._core.module.state_dict import LoadPlan
from modstate._core.module.tables import SlotTable, calls_here, enter_call, get_ident, leave_call
from modstate._core.sharded.gathers import gathered
from modstate._core.sharded.sharding import Sharding
from modstate._core.sharded.units import Units
from modstate._core.trees.flat import unflatten
from modstate._core.trees.leaves import leaves_of
from modstate._core.types import Tree, TreeArg

_own = dict.__getitem__
_set_own = dict.__setitem__
_tag = operator.attrgetter("tag")
_MISSING = object()
_EMPTY: dict[Any, Any] = {}  # stands for "none yet"; never written
_NONE: list[Any] = []  # likewise


class Swap:
    """Slots and the tensors that go into them, ready to be applied and undone.

    ``targets(i)`` is ``(node, key)``, where the tree holds ``values[i]``: a buffer that the body
    reassigns is written back there, as ``torch.func.functional_call`` does. ``rebuild(olds)``
    nests values listed like ``values`` at the tree's paths (what [`swap`][modstate.swap] returns).
    ``guard()`` snapshots what the module keeps outside its slots (a `ModuleGuard`), taken
    when the swap is applied and restored when it is undone. ``private``: only the calling thread
    sees the swap (see the module docstring); ``lock``: held from apply to undo (calls on modules
    that rewrite tensors kept in ``__dict__`` run one at a time). ``layout``: for a private swap
    of the anatomy's compiled plan, its layer keys and distinct ``layers`` dicts, precomputed.
    """

    __slots__ = (
        "_applied",
        "_attached",
        "_inherited",
        "_layer",
        "_outers",
        "_patched",
        "_restore",
        "_thread",
        "_written",
        "buffers",
        "guard",
        "layout",
        "lock",
        "names",
        "olds",
        "private",
        "rebuild",
        "tables",
        "targets",
        "values",
    )

    def __init__(
        self,
        tables: list[dict[str, Any]],
        names: list[str],
        values: list[Any],
        olds: list[Any],
        buffers: list[int],
        targets: Callable[[int], tuple[Any, str] | None],
        guard: Callable[[], ModuleGuard] | None,
        rebuild: Callable[[list[Any]], Tree],
        *,
        private: bool = False,
        lock: threading.RLock | None = None,
        layout: tuple[list[tuple[int, str]], list[dict[int, Any]]] | None = None,
    ) -> None:
        self.rebuild = rebuild
        self.tables = tables
        self.names = names
        self.values = values
        self.olds = olds
        self.buffers = buffers
        self.targets = targets
        self.guard = guard
        self.private = private
        self.lock = lock
        self.layout = layout
        self._applied = False
        self._restore: Callable[[], None] | None = None
        # private: this call's layer, the tables' ``layers`` dicts it is attached to, and (when
        # nested in a call in this thread) the enclosing calls' layers it replaced there and the
        # entries it took from them; made by apply
        self._thread = 0
        self._layer: dict[tuple[int, str], Any] = _EMPTY
        self._attached: list[dict[int, Any]] = _NONE
        self._outers: list[dict[tuple[int, str], Any] | None] | None = None
        self._inherited: list[tuple[dict[tuple[int, str], Any], tuple[int, str], Any]] = _NONE
        # shared: (tables, names, what they held, the setter) per put, and the layer entries of
        # an enclosing call in this thread that the puts updated; made by the first put
        self._written: list[tuple[list[dict[str, Any]], list[str], list[Any], Any]] = _NONE
        self._patched: list[tuple[dict[tuple[int, str], Any], tuple[int, str], Any]] = _NONE

    def apply(self) -> None:
        """Begin the swap and put every value in (see `begin` to put them in parts)."""
        self.begin()
        try:
            self.put(self.tables, self.names, self.values)
        except BaseException:
            self.undo()
            raise

    def begin(self) -> None:
        """Take the lock and the guard's snapshot and make ready for `put`, writing nothing:
        a subclass that fills the slots in parts (one FSDP unit at a time, say) calls this, then
        ``put`` for each part; `undo` takes back whatever was put."""
        if self.lock is not None:
            self.lock.acquire()
        try:
            self._restore = self.guard().restore if self.guard is not None else None
        except BaseException:
            if self.lock is not None:
                self.lock.release()
            raise
        if self.private:
            self._thread = get_ident()
            self._layer, self._attached = {}, []
            enter_call()
        else:
            self._written, self._patched = [], []
        self._applied = True

    def put(self, tables: list[dict[str, Any]], names: list[str], values: list[Any]) -> None:
        """Put ``values[i]`` into ``tables[i][names[i]]`` for this swap (undone by `undo`):
        for the calling thread only when the swap is private, else for every thread."""
        if not self._applied:
            raise RuntimeError("Swap.put: begin (or apply) the swap first")
        if self.private:
            if tables is self.tables and self.layout is not None:
                keys, layer_dicts = self.layout
            else:
                keys = list(zip(map(_tag, tables), names, strict=True))
                layer_dicts = list({id(t): t.layers for t in tables}.values())  # type: ignore[attr-defined]
            self._layer.update(zip(keys, values, strict=True))
            self._attach(layer_dicts)
            return
        # The dicts' own entries, never a call's layer; a dict of another type keeps its methods.
        slot_tables = set(map(type, tables)) <= {SlotTable}
        get, set_ = (_own, _set_own) if slot_tables else (operator.getitem, operator.setitem)
        self._written.append((tables, names, list(map(get, tables, names)), set_))
        deque(map(set_, tables, names, values), maxlen=0)
        if calls_here():
            self._patch_layers(tables, names, values)

    def _attach(self, layer_dicts: list[dict[int, Any]]) -> None:
        """Make this call's layer the calling thread's layer of each table."""
        thread, layer = self._thread, self._layer
        for layers in layer_dicts:
            if thread in layers:
                self._attach_nested(layer_dicts)
                return
        for layers in layer_dicts:
            layers[thread] = layer
        self._attached += layer_dicts

    def _attach_nested(self, layer_dicts: list[dict[int, Any]]) -> None:
        """Attach inside a call in this thread (or again, for a later put): what the enclosing
        call put in stays visible where this one puts nothing, and its layer comes back at undo."""
        thread, layer = self._thread, self._layer
        if self._outers is None:
            self._outers = [None] * len(self._attached)
            self._inherited = []
        for layers in layer_dicts:
            outer = layers.get(thread)
            if outer is layer:
                continue
            if outer is not None:
                for key, value in outer.items():
                    if key not in layer:
                        layer[key] = value
                        self._inherited.append((outer, key, value))
            layers[thread] = layer
            self._attached.append(layers)
            self._outers.append(outer)

    def _patch_layers(self, tables: list[Any], names: list[str], values: list[Any]) -> None:
        """A shared swap inside a stateless call in this thread: the call's layer shadows the
        dicts, so the body would not see the swap; update the layer where it holds the slot."""
        thread = get_ident()
        for table, name, value in zip(tables, names, values, strict=True):
            layers = getattr(table, "layers", None)
            layer = layers.get(thread) if layers else None
            key = (getattr(table, "tag", 0), name)
            if layer is not None and key in layer:
                self._patched.append((layer, key, layer[key]))
                layer[key] = value

    def replaced(self) -> Tree:
        """What the applied swap took out of the module, at the tree's paths."""
        return self.rebuild(self.olds)

    def undo(self) -> None:
        if not self._applied:
            return
        self._applied = False
        try:
            self._write_back()
            if self.private:
                self._detach()
                leave_call()
            else:
                # Reversed, so that a slot listed twice ends up with what it held first.
                while self._written:
                    tables, names, olds, set_ = self._written.pop()
                    deque(map(set_, reversed(tables), reversed(names), reversed(olds)), maxlen=0)
                while self._patched:
                    layer, key, old = self._patched.pop()
                    layer[key] = old
            restore, self._restore = self._restore, None
            if restore is not None:
                restore()
        finally:
            if self.lock is not None:
                self.lock.release()

    def _detach(self) -> None:
        thread, outers = self._thread, self._outers
        if outers is None:
            for layers in self._attached:
                del layers[thread]
        else:
            for layers, outer in zip(self._attached, outers, strict=True):
                if outer is None:
                    del layers[thread]
                else:
                    layers[thread] = outer
            # What the body assigned to a slot of the enclosing call goes to that call.
            layer = self._layer
            for outer, key, value in self._inherited:
                if layer[key] is not value:
                    outer[key] = layer[key]
        self._attached, self._outers, self._layer, self._inherited = _NONE, None, _EMPTY, _NONE

    def _write_back(self) -> None:
        """A buffer that the body reassigned goes into the caller's tree."""
        tables, names, values = self.tables, self.names, self.values
        for i in self.buffers:
            if self.private:
                now = self._layer.get((_tag(tables[i]), names[i]), _MISSING)
            else:
                now = tables[i][names[i]]  # what this thread sees (a call's layer, if any)
            if now is not _MISSING and now is not values[i]:
                target = self.targets(i)
                if target is not None:
                    target[0][target[1]] = now


class UnshardedSwap(Swap):
    """A swap on a sharded module that computes unsharded, one FSDP unit at a time.

    The tree's ``DTensor`` leaves that an FSDP unit owns stay in their slots as they are; while
    the swap is applied, stand-ins for FSDP2's forward hooks (`Units`) gather
    them just before their unit runs and put them back just after. Other ``DTensor`` leaves
    (tensor parallel) go in gathered whole, and the tensor-parallel hooks are off.
    """

    __slots__ = ("_restore_hooks", "_sharding", "_units")

    def __init__(self, prepared: Swap, sharding: Sharding) -> None:
        tables, names = list(prepared.tables), list(prepared.names)
        values, olds = list(prepared.values), list(prepared.olds)
        # A unit's parameters that the tree leaves out (call_partial) are gathered with the
        # rest when the unit runs: the swap lists them, holding what they hold.
        for table, name, parameter in sharding.untouched(tables, names):
            tables.append(table)
            names.append(name)
            values.append(parameter)
            olds.append(parameter)
        units = sharding.units(tables)
        owned = {i for _, positions in units for i in positions}
        others = [i for i in range(len(values)) if i not in owned]
        for i, value in zip(others, gathered([values[i] for i in others]), strict=True):
            values[i] = value
        super().__init__(
            tables,
            names,
            values,
            olds,
            prepared.buffers,
            prepared.targets,
            prepared.guard,
            prepared.rebuild,
        )
        self._sharding = sharding
        self._units = units
        self._restore_hooks: Callable[[], None] | None = None

    def _put(self, positions: list[int], values: list[Any]) -> None:
        """Put ``values`` into the slots at ``positions`` (a unit's gathered parameters before
        its forward, the tree's ``DTensor`` s after it)."""
        tables, names = self.tables, self.names
        for i, value in zip(positions, values, strict=True):
            table = tables[i]
            # A sharded module's swap is shared (for every thread): the dict's own entries.
            (_set_own if type(table) is SlotTable else operator.setitem)(table, names[i], value)

    def apply(self) -> None:
        # The stand-ins hold the swap (to put values into its slots), not the other way round:
        # no reference cycle keeps a call's gathered tensors alive after it.
        units = Units(self._put, self._units, self.values)
        self._restore_hooks = self._sharding.bypass(units)
        super().apply()

    def undo(self) -> None:
        try:
            super().undo()
        finally:
            restore, self._restore_hooks = self._restore_hooks, None
            if restore is not None:
                restore()


class HookedSwap(Swap):
    """A swap prepared by replaying ``load_state_dict``; it swaps extra state too."""

    __slots__ = ("extra_states", "previous_extra")

    def __init__(self, plan: LoadPlan, tree: TreeArg, guard: ModuleGuard | None) -> None:
        assignments = plan.assignments
        flat_nodes = {path: (node, key) for path, _, node, key in leaves_of(tree)}

        def target(i: int) -> tuple[Any, str] | None:
            return flat_nodes.get(assignments[i].key)

        def taken() -> ModuleGuard:
            assert guard is not None
            return guard  # taken before the load pre-hooks ran (see prepare_hooked)

        super().__init__(
            [a.table for a in assignments],
            [a.name for a in assignments],
            [a.value for a in assignments],
            [a.current for a in assignments],
            [i for i, a in enumerate(assignments) if a.is_buffer],
            target,
            None if guard is None else taken,
            lambda olds: unflatten({a.key: old for a, old in zip(assignments, olds, strict=True)}),
        )
        self.extra_states = plan.extra_states
        self.previous_extra: list[tuple[nn.Module, str, Any]] = []

    def apply(self) -> None:
        try:
            for module, key, value in self.extra_states:
                self.previous_extra.append((module, key, module.get_extra_state()))
                module.set_extra_state(value)
        except BaseException:
            self._restore_extra()
            raise
        super().apply()

    def undo(self) -> None:
        if self._applied:
            super().undo()
            self._restore_extra()

    def replaced(self) -> Tree:
        tree = super().replaced()
        for _, key, state in self.previous_extra:
            owner, _, name = key.rpartition(".")
            node = tree
            for part in owner.split(".") if owner else ():
                node = node.setdefault(part, {})
            node[name] = state
        return tree

    def _restore_extra(self) -> None:
        while self.previous_extra:
            module, _, state = self.previous_extra.pop()
            module.set_extra_state(state)
