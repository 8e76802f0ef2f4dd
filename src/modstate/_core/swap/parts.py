"""Reading a tuple of trees that together give every path of a module, by a program made once per
combination of their structures: `PartsReader`, and the one cache of them per module.

``call(module, (params, state), x)`` is how ``split``'s halves go in (and the halves of
``tree.partition``, whose holes are None), and ``apply(module, params, state, x)`` hands the same
pair at every step of a training loop. Walking such trees path by path, and rebuilding ``apply``'s
``new_state`` by another walk, cost more than the swap itself on small models. A `PartsReader`
reads each part with a `TreeReader` (a few C-level passes), knows which leaf fills which position
of the anatomy's plan and which leaves are buffers (``apply`` copies those before the call), and
where each leaf stands in its part, for a buffer that forward reassigns.

Both verbs share one cache: a ``(params, state)`` pair that ``call`` met is read by the same
reader when ``apply`` meets it. The readers keep no module: the modules that own the buffers are
held by weak references, since the readers live as long as the module's anatomy, which lives as
long as the module.
"""

from __future__ import annotations

import operator
import weakref
from collections.abc import Sequence
from itertools import repeat
from typing import Any

from torch import Tensor, nn

from modstate._core.module.anatomy import Anatomy, buffer_owners
from modstate._core.torch_facts import version
from modstate._core.trees.readers import TreeReader

_MOST_READERS = 8  # structures remembered per module; a loop uses one or two
_is = operator.is_

# What `TreeReader.read` returns for one part: its leaves and its dict nodes.
Read = tuple[list[Any], list[Any]]


class PartsReader:
    """How to read parts of one combination of structures (see the module docstring).

    Per part, ``readers`` reads all its leaves and ``nones`` says which of them are None holes.
    The parts' leaves are numbered one after the other (the first part's, then the second's...):
    ``order[position]`` is the number of the leaf that fills that plan position, and
    ``sources[position]`` its ``(part, index in the part)``. ``buffers`` lists each buffer leaf
    as ``(number, position, owner)``, ``owner`` a weak reference to the module holding it (None:
    the root); ``buffers_in_last`` says whether they all are in the last part (``apply``'s
    ``state``). ``fits`` is False for structures that cannot take the compiled route (a path the
    module lacks, given twice, also as a dotted key beside its nested form, or left out): the
    general route then says what is wrong, and the reader only spares finding that out again."""

    __slots__ = ("buffers", "buffers_in_last", "fits", "nones", "order", "readers", "sources")

    def __init__(
        self, anatomy: Anatomy, module: nn.Module, parts: Sequence[dict[str, Any]]
    ) -> None:
        position_of = {slot.path: i for i, slot in enumerate(anatomy.ordered)}
        buffer_paths = {slot.path for slot in anatomy.slots if slot.is_buffer}
        owners: dict[str, nn.Module] | None = None  # looked up at the first buffer met
        order: list[int | None] = [None] * len(position_of)
        sources: list[tuple[int, int] | None] = [None] * len(position_of)
        self.readers: list[TreeReader] = []
        self.buffers: list[tuple[int, int, weakref.ref[nn.Module] | None]] = []
        nones: list[tuple[bool, ...]] = []
        fits = True
        self.buffers_in_last = True
        number = 0  # of the part's first leaf
        for part_index, part in enumerate(parts):
            reader = TreeReader(part)
            leaves = reader.read(part)[0]  # type: ignore[index]
            self.readers.append(reader)
            nones.append(tuple(map(_is, leaves, repeat(None))))
            for i, (path, leaf) in enumerate(zip(reader.paths, leaves, strict=True)):
                if leaf is None:
                    continue
                position = position_of.get(path)
                if position is None or order[position] is not None:
                    fits = False
                    continue
                if path in buffer_paths:
                    if owners is None:
                        owners = buffer_owners(module)
                    owner = owners[path]
                    ref = None if owner is module else weakref.ref(owner)
                    self.buffers.append((number + i, position, ref))
                    self.buffers_in_last = self.buffers_in_last and part_index == len(parts) - 1
                order[position] = number + i
                sources[position] = (part_index, i)
            number += len(leaves)
        self.fits = (
            fits
            and all(index is not None for index in order)
            and all(reader.paths_are_distinct() for reader in self.readers)
        )
        self.order: list[int] = order  # type: ignore[assignment]
        self.sources: list[tuple[int, int]] = sources  # type: ignore[assignment]
        self.nones = nones

    def read(self, parts: Sequence[Any]) -> list[Read] | None:
        """Each part's leaves and nodes, or None if a part is shaped otherwise than this reader's
        (a hole filled, or a leaf left out, included)."""
        found = []
        for part, reader, nones in zip(parts, self.readers, self.nones, strict=True):
            read = reader.read(part)
            # One C-level pass per part: the None holes must stay where they were, since
            # `order` skips them and `sources` knows no leaf there.
            if read is None or tuple(map(_is, read[0], repeat(None))) != nones:
                return None
            found.append(read)
        return found

    def in_plan_order(self, leaves: list[Any]) -> list[Any]:
        """The parts' ``leaves``, numbered one after the other, in the anatomy's plan order."""
        return list(map(leaves.__getitem__, self.order))

    def place(self, found: list[Read], position: int) -> tuple[Any, str]:
        """``(node, key)``: where the leaf at plan ``position`` stands in the parts that `read`
        gave ``found`` for (where a buffer that forward reassigns is written back)."""
        part, i = self.sources[position]
        return self.readers[part].place(found[part][1], i)


_readers: weakref.WeakKeyDictionary[Anatomy, list[PartsReader]] = weakref.WeakKeyDictionary()


def read_parts(
    anatomy: Anatomy, module: nn.Module, parts: Sequence[Any]
) -> tuple[PartsReader, list[Read]] | None:
    """The reader for the structures of ``parts`` (made the first time they are met) and what it
    read of them; None when the parts are not dicts that give every path exactly once."""
    if not all(isinstance(part, dict) for part in parts):
        return None
    known = _readers.get(anatomy)
    if known is None:
        known = _readers.setdefault(anatomy, [])
    for reader in known:
        if len(reader.readers) == len(parts):
            found = reader.read(parts)
            if found is not None:
                break
    else:
        try:
            reader = PartsReader(anatomy, module, parts)
        except TypeError:  # a key that is not a string: the general route says what is wrong
            return None
        found = reader.read(parts)
        if len(known) >= _MOST_READERS:
            del known[0]
        known.append(reader)
    if not reader.fits or found is None:
        return None
    return reader, found


def copy_buffers(
    reader: PartsReader, leaves: list[Any], module: nn.Module
) -> list[tuple[int, int, Tensor, int, bool]]:
    """Replace each buffer leaf (of the parts' ``leaves``, numbered one after the other) by a
    clone, in place; per clone ``(number, position, clone, its version, whether its owner is in
    training mode)``. The version is read only in eval mode (0 in training mode): a training
    owner's copies come back whatever it did to them."""
    copies = []
    for number, position, owner in reader.buffers:
        leaf = leaves[number]
        if isinstance(leaf, Tensor):
            copy = leaf.clone()
            leaves[number] = copy
            holder = module if owner is None else owner()
            training = holder is None or holder.training  # a holder gone: assume it wrote
            copies.append((number, position, copy, 0 if training else version(copy), training))
    return copies
