"""Reading a tuple of trees that together give every path of a module, in the anatomy's plan order.

``call(module, (params, state), x)`` is how ``split``'s halves go in (and the halves of
``tree.partition``, whose holes are None). The compiled route of `prepare` reads one tree shaped
like ``extract``'s; this module lets a tuple of such parts take it too, instead of the general
path-by-path route. For each combination of the parts' structures met so far (a loop meets one),
a `TreeReader` per part reads its leaves and holes, and the plan says which slot each leaf fills.
"""

from __future__ import annotations

import weakref
from collections.abc import Callable, Sequence
from typing import Any

from modstate._core.module.anatomy import Anatomy
from modstate._core.trees.readers import TreeReader

_MOST_PLANS = 8  # structures remembered per module; a loop uses one or two


class _Plan:
    """How to read parts of one combination of structures: per part, a reader of all its leaves
    (``readers``), which of them are None holes (``holes``), and each other leaf's index with its
    plan position (``positions``); for each plan position, the part and the leaf that fill it
    (``sources``). ``fits`` is False for structures that cannot take the compiled route (a
    path the module lacks, given twice, also as a dotted key beside its nested form, or left
    out): the general route then says what is wrong,
    and the plan only spares finding that out again."""

    __slots__ = ("fits", "holes", "positions", "readers", "sources")

    def __init__(self, anatomy: Anatomy, parts: Sequence[dict[str, Any]]) -> None:
        position_of = {slot.path: i for i, slot in enumerate(anatomy.ordered)}
        sources: list[tuple[int, int] | None] = [None] * len(position_of)
        self.readers: list[TreeReader] = []
        self.holes: list[list[int]] = []
        self.positions: list[list[tuple[int, int]]] = []
        fits = True
        for index, part in enumerate(parts):
            reader = TreeReader(part)
            leaves = reader.read(part)[0]  # type: ignore[index]
            self.readers.append(reader)
            self.holes.append([i for i, leaf in enumerate(leaves) if leaf is None])
            where = []
            for i, leaf in enumerate(leaves):
                if leaf is None:
                    continue
                position = position_of.get(reader.paths[i])
                if position is None or sources[position] is not None:
                    fits = False
                    continue
                sources[position] = (index, i)
                where.append((i, position))
            self.positions.append(where)
        self.fits = (
            fits
            and all(source is not None for source in sources)
            and all(reader.paths_are_distinct() for reader in self.readers)
        )
        self.sources = sources

    def read(self, parts: Sequence[Any]) -> list[tuple[list[Any], list[Any]]] | None:
        """Each part's leaves and nodes, or None if a part is shaped otherwise than this plan's
        (a hole filled included)."""
        found = []
        for part, reader, holes in zip(parts, self.readers, self.holes, strict=True):
            read = reader.read(part)
            if read is None or any(read[0][i] is not None for i in holes):
                return None
            found.append(read)
        return found


_plans: weakref.WeakKeyDictionary[Anatomy, list[_Plan]] = weakref.WeakKeyDictionary()


def read_parts(
    anatomy: Anatomy, parts: Sequence[Any]
) -> tuple[list[Any], Callable[[int], tuple[Any, str]]] | None:
    """The leaves of ``parts`` in plan order and, for position ``i``, the ``(node, key)`` of the
    part that holds it; None when the parts are not dicts that give every path exactly once."""
    if not all(isinstance(part, dict) for part in parts):
        return None
    known = _plans.get(anatomy)
    if known is None:
        known = _plans.setdefault(anatomy, [])
    for plan in known:
        if len(plan.readers) == len(parts):
            found = plan.read(parts)
            if found is not None:
                break
    else:
        plan = _Plan(anatomy, parts)
        found = plan.read(parts)
        if len(known) >= _MOST_PLANS:
            del known[0]
        known.append(plan)
    if not plan.fits or found is None:
        return None
    leaves: list[Any] = [None] * len(plan.sources)
    for (part_leaves, _), where in zip(found, plan.positions, strict=True):
        for i, position in where:
            leaves[position] = part_leaves[i]
    sources, readers = plan.sources, plan.readers

    def target(position: int) -> tuple[Any, str]:
        part, i = sources[position]  # type: ignore[misc]
        return readers[part].place(found[part][1], i)

    return leaves, target
