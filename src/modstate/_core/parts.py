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

from .anatomy import Anatomy
from .readers import TreeReader

_MOST_PLANS = 8  # structures remembered per module; a loop uses one or two


class _Plan:
    """How to read parts of one combination of structures: per part, a reader of its leaves
    (``given``) and one of its None holes (``holes``; None without holes), the plan position of
    each given leaf, and for each position the part and the given leaf that fill it. ``fits`` is False for structures that
    cannot take the compiled route (a path the module lacks, given twice, or left out): the
    general route then says what is wrong, and the plan only spares finding that out again."""

    __slots__ = ("fits", "given", "holes", "positions", "sources")

    def __init__(self, anatomy: Anatomy, parts: Sequence[dict[str, Any]]) -> None:
        position_of = {slot.path: i for i, slot in enumerate(anatomy.ordered)}
        sources: list[tuple[int, int] | None] = [None] * len(position_of)
        self.given: list[TreeReader] = []
        self.holes: list[TreeReader | None] = []
        self.positions: list[list[int]] = []
        fits = True
        for index, part in enumerate(parts):
            paths = TreeReader.leaf_paths(part)
            nodes = dict(zip(paths, TreeReader(part, paths).read(part)[0]))  # type: ignore[index]
            given = [path for path in paths if nodes[path] is not None]
            self.given.append(TreeReader(part, given))
            holes = [path for path in paths if nodes[path] is None]
            self.holes.append(TreeReader(part, holes) if holes else None)
            where = []
            for number, path in enumerate(given):
                position = position_of.get(path)
                if position is None or sources[position] is not None:
                    fits = False
                    continue
                sources[position] = (index, number)
                where.append(position)
            self.positions.append(where)
        self.fits = fits and all(source is not None for source in sources)
        self.sources = sources

    def read(self, parts: Sequence[Any]) -> list[tuple[list[Any], list[Any]]] | None:
        """Each part's given leaves and its nodes, or None if a part is shaped otherwise than
        this plan's (a hole filled included)."""
        found = []
        for part, given, holes in zip(parts, self.given, self.holes):
            read = given.read(part)
            if read is None:
                return None
            if holes is not None:
                hole_read = holes.read(part)
                if hole_read is None or any(hole is not None for hole in hole_read[0]):
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
        if len(plan.given) == len(parts):
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
    for (part_leaves, _), where in zip(found, plan.positions):
        for leaf, position in zip(part_leaves, where):
            leaves[position] = leaf
    sources, readers = plan.sources, plan.given

    def target(position: int) -> tuple[Any, str]:
        part, number = sources[position]  # type: ignore[misc]
        reader = readers[part]
        return found[part][1][reader.leaf_nodes[number]], reader.leaf_keys[number]

    return leaves, target
