"""Building an ensemble's members from a factory: who seeds member ``i``, and how each member
goes straight into the stacked tensors.

Seeding: one number is drawn from the global random state per ensemble (so the global seed
decides every member, and two ensembles built in a row differ); member ``i`` is built under a
seed mixed from that number and ``i``, the caller's random state set aside meanwhile. Member
``i`` therefore does not depend on which process builds it: a member-parallel ensemble takes the
number drawn on its mesh's first rank, and every rank builds its own members as the one-process
ensemble would. Seeds given by the caller (``seeds=[...]``) replace the mixed ones and draw
nothing: member ``i`` is what ``torch.manual_seed(seeds[i]); factory()`` builds, and the
caller's random state is as it was.

Memory: the stacked tensors are allocated once the first member is built, and each member is
copied into its row and dropped before the next is built, so the peak stays near the stacked
size (plus one member, and the first member kept as the template).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch import Tensor, nn

from modstate._core.extract import extract
from modstate._core.trees.flat import flatten, unflatten
from modstate._core.types import Tree

from ._stack import (
    check_initialized,
    check_module,
    check_same_modules,
    check_same_tree,
    module_layout,
    tie_map,
)

_MASK = (1 << 63) - 1


def draw_base_seed(group: Any = None) -> int:
    """One draw from the global random state (torch's default generator); with a process
    ``group``, the draw of the group's first rank, on every rank."""
    base = torch.randint(0, _MASK, (1,), dtype=torch.int64)
    if group is not None:
        import torch.distributed as dist

        dist.broadcast(base, group=group, group_src=0)
    return int(base.item())


# The seeds torch.manual_seed takes.
_SEED_RANGE = (-(1 << 63), (1 << 64) - 1)


def checked_seeds(seeds: Any, n: int, caller: str) -> list[int]:
    """``seeds`` as a list of ``n`` ints that ``torch.manual_seed`` takes, or a ValueError /
    TypeError naming the entry at fault."""
    if isinstance(seeds, (str, bytes)) or not isinstance(seeds, Sequence):
        raise TypeError(
            f"{caller}: seeds is a {type(seeds).__name__}; give a list of {n} ints, one per "
            f"member (seeds=list(range({n})))"
        )
    if len(seeds) != n:
        raise ValueError(
            f"{caller}: seeds has {len(seeds)} entries for n={n} members; give one seed per "
            f"member (seeds=list(range({n})))"
        )
    for i, seed in enumerate(seeds):
        if not isinstance(seed, int) or isinstance(seed, bool):
            raise TypeError(
                f"{caller}: 'seeds[{i}]': a {type(seed).__name__} ({seed!r}); a seed is an int, "
                "as torch.manual_seed takes"
            )
        if not _SEED_RANGE[0] <= seed <= _SEED_RANGE[1]:
            raise ValueError(
                f"{caller}: 'seeds[{i}]': {seed} is outside the seeds torch.manual_seed takes "
                f"([{_SEED_RANGE[0]}, {_SEED_RANGE[1]}]); give a seed in that range"
            )
    return list(seeds)


def member_seed(base: int, index: int) -> int:
    """The seed of member ``index``: splitmix64 of ``base`` and ``index``, so that members'
    seeds are far apart."""
    z = (base + (index + 1) * 0x9E3779B97F4A7C15) & ((1 << 64) - 1)
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & ((1 << 64) - 1)
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & ((1 << 64) - 1)
    return (z ^ (z >> 31)) & _MASK


def build_members(
    factory: Callable[[], nn.Module], seeds: Sequence[int], caller: str
) -> tuple[nn.Module, Tree]:
    """Build one member per seed (``factory()`` under ``torch.manual_seed(seed)``), copying each
    into the stacked tensors as it comes; return the first member (the template) and the
    stacked tree."""
    count = len(seeds)
    template: nn.Module | None = None
    first: dict[str, Any] = {}
    ties: dict[str, str] = {}
    layout: Any = None
    stacked: dict[str, Any] = {}
    for index, seed in enumerate(seeds):
        model = _built(factory, seed)
        check_module(model, index, caller)
        flat = flatten(extract(model))
        check_initialized(flat, index, "model", caller)
        if template is None:
            template, first, ties, layout = model, flat, tie_map(flat), module_layout(model)
            stacked = _allocate(first, ties, count)
        else:
            check_same_modules(layout, module_layout(model), index, caller)
            check_same_tree(first, ties, flat, index, "model", caller)
        with torch.no_grad():
            for path, leaf in flat.items():
                if ties[path] == path and isinstance(leaf, Tensor):
                    stacked[path][index].copy_(leaf)
        del model, flat  # the next member is built without this one alive
    assert template is not None
    out = {}
    for path, leaf in first.items():
        value = stacked[ties[path]] if isinstance(leaf, Tensor) else leaf
        if isinstance(leaf, Tensor) and ties[path] == path:
            value.requires_grad_(leaf.requires_grad)
        out[path] = value
    return template, unflatten(out)


def _built(factory: Callable[[], nn.Module], seed: int) -> nn.Module:
    devices = list(range(torch.cuda.device_count())) if torch.cuda.is_initialized() else []
    with torch.random.fork_rng(devices=devices):
        torch.manual_seed(seed)
        return factory()


def _allocate(first: dict[str, Any], ties: dict[str, str], count: int) -> dict[str, Tensor]:
    return {
        path: torch.empty((count, *leaf.shape), dtype=leaf.dtype, device=leaf.device)
        for path, leaf in first.items()
        if ties[path] == path and isinstance(leaf, Tensor)
    }
