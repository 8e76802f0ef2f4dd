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
from .hooks import LoadPlan
from .leaves import leaves_of
from .sharded import Sharding, gathered
from .types import Tree, TreeArg

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
    """A swap on a sharded module that computes unsharded: the tree's ``DTensor`` leaves go in
    gathered (differentiably) and the parallelism's forward hooks are off while it is applied."""

    __slots__ = ("_restore_hooks", "_sharding")

    def __init__(self, prepared: Swap, sharding: Sharding) -> None:
        super().__init__(
            prepared.tables,
            prepared.names,
            gathered(prepared.values),
            prepared.olds,
            prepared.buffers,
            prepared.targets,
            prepared.guard,
            prepared.rebuild,
        )
        self._sharding = sharding
        self._restore_hooks: Callable[[], None] | None = None

    def apply(self) -> None:
        self._restore_hooks = self._sharding.bypass()
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
