"""The swap objects: slots and the tensors that go into them, applied and undone.

A `Swap` is what `prepare` produces after every check passed: which
slot (``table[name]``) gets which tensor, what it held before, and where in the caller's tree each
value sits (so that a buffer that ``forward`` reassigns is written back there). Applying and
undoing it are C-level passes over flat lists. `UnshardedSwap` is the form for modules
sharded with FSDP2 / tensor parallel, `HookedSwap` the one that replays ``load_state_dict``.
"""

from __future__ import annotations

import operator
from collections import deque
from collections.abc import Callable
from typing import Any

from torch import nn

from .anatomy import ModuleGuard
from .flat import unflatten
from .gathers import gathered
from .hooks import LoadPlan
from .leaves import leaves_of
from .sharded import Sharding
from .types import Tree, TreeArg
from .units import Units

_setitem = operator.setitem


class Swap:
    """Slots and the tensors that go into them, ready to be applied and undone.

    ``targets(i)`` is ``(node, key)``, where the tree holds ``values[i]``: a buffer that the body
    reassigns is written back there, as ``torch.func.functional_call`` does. ``rebuild(olds)``
    nests values listed like ``values`` at the tree's paths (what [`swap`][modstate.swap] returns).
    """

    __slots__ = (
        "_applied",
        "buffers",
        "guard",
        "names",
        "olds",
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
        guard: Callable[[], None] | None,
        rebuild: Callable[[list[Any]], Tree],
    ) -> None:
        self.rebuild = rebuild
        self.tables = tables
        self.names = names
        self.values = values
        self.olds = olds
        self.buffers = buffers
        self.targets = targets
        self.guard = guard
        self._applied = False

    def apply(self) -> None:
        deque(map(_setitem, self.tables, self.names, self.values), maxlen=0)
        self._applied = True

    def replaced(self) -> Tree:
        """What the applied swap took out of the module, at the tree's paths."""
        return self.rebuild(self.olds)

    def undo(self) -> None:
        if not self._applied:
            return
        self._applied = False
        tables, names, values = self.tables, self.names, self.values
        for i in self.buffers:
            now = tables[i][names[i]]
            if now is not values[i]:
                target = self.targets(i)
                if target is not None:
                    target[0][target[1]] = now
        # Reversed, so that a slot listed twice ends up with what it held first.
        deque(map(_setitem, reversed(tables), reversed(names), reversed(self.olds)), maxlen=0)
        if self.guard is not None:
            self.guard()


class UnshardedSwap(Swap):
    """A swap on a sharded module that computes unsharded, one FSDP unit at a time.

    The tree's ``DTensor`` leaves that an FSDP unit owns stay in their slots as they are; while
    the swap is applied, stand-ins for FSDP2's forward hooks (:class:`~.units.Units`) gather
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
        for i, value in zip(others, gathered([values[i] for i in others])):
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
        for i, value in zip(positions, values):
            tables[i][names[i]] = value

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

        super().__init__(
            [a.table for a in assignments],
            [a.name for a in assignments],
            [a.value for a in assignments],
            [a.current for a in assignments],
            [i for i, a in enumerate(assignments) if a.is_buffer],
            target,
            None if guard is None else guard.restore,
            lambda olds: unflatten({a.key: old for a, old in zip(assignments, olds)}),
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
