"""Slot tables that a thread can overlay privately: how a stateless call stays invisible to others.

A module reads its tensors from two dicts, ``_parameters`` and ``_buffers`` (``Module.__getattr__``
does ``_parameters[name]``). A `SlotTable` is such a dict with one addition: a *layer* per
thread, a small dict of overrides that only that thread sees. A stateless call puts the tree's
tensors into its own thread's layer and takes the layer away afterwards; the dict's own entries,
what every other thread reads, are never touched. So a call is invisible to other threads (other
calls, a plain ``module(x)``), and calls are not serialized.

A table also tells the anatomies built on it when one of its own entries is replaced or deleted
(`SlotTable.watch`), so that they let go of the old tensor at once.

Inside the calling thread the layer looks exactly as if the tensors had been swapped in:
``__getitem__``, ``get``, ``items`` and ``values`` show it (so ``forward``, ``parameters()`` and
``state_dict()`` see the call's tree), and ``__setitem__`` of a name the layer holds writes into
the layer (a buffer that ``forward`` reassigns stays the call's). Everything else is the plain
dict: iteration, ``in``, ``len`` and C-level readers (``dict(table)``, ``{**table}``) see the
module's own entries.

What it must not change (tested): a pickled, ``torch.save``-d or deep-copied table is a plain
``dict`` (``__reduce_ex__``), so unpickling never needs modstate; under ``torch.compile`` the
table is the plain dict (``is_dynamo_compiling`` is constant-folded, so Dynamo never reads a
layer nor guards on one). Without a layer the cost of a read is one Python call (~0.1-0.3 us).

What it cannot do: compiled code reads a dict subclass with ``dict.__getitem__`` (Dynamo will not
run an overridden ``__getitem__``), so it never sees a layer; calls on a module that keeps
compiled code swap for every thread instead (``Anatomy.layered``).
"""

from __future__ import annotations

import threading
import weakref
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from torch.compiler import is_dynamo_compiling

if TYPE_CHECKING:
    from _collections_abc import dict_items, dict_values

_get = dict.__getitem__
_set = dict.__setitem__
_get_or = dict.get
_items = dict.items
_values = dict.values
_MISSING = object()
get_ident = threading.get_ident


class SlotTable(dict):  # type: ignore[type-arg]
    """A module's ``_parameters`` or ``_buffers`` dict, with a private layer per thread.

    ``layers`` maps a thread's ident to that thread's layer: one dict per stateless call, shared
    by every table the call fills, keyed by ``(table.tag, name)``. It is empty unless a call is
    running; only the swap engine writes it (``swaps.py``)."""

    __slots__ = ("layers", "tag", "watchers")

    def __init__(self, entries: Any = ()) -> None:
        super().__init__(entries)
        self.layers: dict[int, dict[tuple[int, str], Any]] = {}
        self.tag = id(self)
        self.watchers: list[weakref.ref[Callable[[], None]]] = []

    def watch(self, watcher: Callable[[], None]) -> None:
        """Call ``watcher()`` (held by weak reference) once one of the table's own entries is
        replaced or deleted: the module let go of a tensor, which an anatomy built on this
        table must not keep alive (``anatomy.py``'s `Stale`). A thread's layer is not watched."""
        watchers = [ref for ref in self.watchers if ref() is not None]
        watchers.append(weakref.ref(watcher))
        self.watchers = watchers

    def _changed(self) -> None:
        watchers, self.watchers = self.watchers, []
        for ref in watchers:
            watcher = ref()
            if watcher is not None:
                watcher()

    def _mine(self) -> dict[str, Any] | None:
        """The calling thread's overrides in this table, or None when it has none."""
        layers = self.layers
        layer = layers.get(get_ident()) if layers else None
        if layer is None:
            return None
        tag = self.tag
        return {name: value for (owner, name), value in layer.items() if owner == tag}

    def __getitem__(self, name: str) -> Any:
        if is_dynamo_compiling():
            return super().__getitem__(name)
        # The thread's layer lookup is written out here and in `get`, not shared by a helper:
        # every read of a parameter in forward (``self.weight``) lands here, and a call more
        # per read shows in the small-model call overhead.
        layers = self.layers
        if layers:
            layer = layers.get(get_ident())
            if layer is not None:
                value = layer.get((self.tag, name), _MISSING)
                if value is not _MISSING:
                    return value
        return _get(self, name)

    def __setitem__(self, name: str, value: Any) -> None:
        if is_dynamo_compiling():
            super().__setitem__(name, value)
            return
        layers = self.layers
        if layers:
            layer = layers.get(get_ident())
            if layer is not None and (self.tag, name) in layer:
                layer[self.tag, name] = value
                return
        if self.watchers and _get_or(self, name, _MISSING) is not value:
            self._changed()
        _set(self, name, value)

    def __delitem__(self, name: str) -> None:
        if not is_dynamo_compiling() and self.watchers:
            self._changed()
        super().__delitem__(name)

    def get(self, name: str, default: Any = None) -> Any:
        if is_dynamo_compiling():
            return super().get(name, default)
        layers = self.layers
        if layers:
            layer = layers.get(get_ident())
            if layer is not None:
                value = layer.get((self.tag, name), _MISSING)
                if value is not _MISSING:
                    return value
        return _get_or(self, name, default)

    def items(self) -> dict_items[str, Any]:
        if is_dynamo_compiling():
            return super().items()
        mine = self._mine()
        return _items(self) if mine is None else {**self, **mine}.items()

    def values(self) -> dict_values[str, Any]:
        if is_dynamo_compiling():
            return super().values()
        mine = self._mine()
        return _values(self) if mine is None else {**self, **mine}.values()

    def __reduce_ex__(self, protocol: Any) -> tuple[type, tuple[dict[str, Any]]]:
        # A plain dict of the module's own entries: pickle, torch.save and copy.deepcopy give a
        # module that knows nothing of modstate (and never another thread's layer).
        return (dict, (dict(self),))


class _Here(threading.local):
    depth = 0  # how many private (per-thread) swaps this thread has applied and not undone


_here = _Here()


def calls_here() -> int:
    """How many stateless calls are running in this thread (nested ones counted)."""
    return _here.depth


def enter_call() -> None:
    _here.depth += 1


def leave_call() -> None:
    _here.depth -= 1
