"""A tie stays a tie: one tensor at several places of a tree gives one result at all of them.

``extract`` lists a tied tensor (an embedding tied to an output head) at each of its paths, as
``state_dict`` does, and ``inject`` refuses two different tensors at tied paths. So an op that
computed each place on its own would turn every tied model's tree into one that no longer fits
the model (``ms.tree.clone(ms.extract(gpt2))``). Instead the first place of a tie decides: the op
runs there once (with the other trees' leaves at that place), and the result stands at every
place of the tie. That is also where ``torch.func`` transforms put the gradient of a tie (the
first path serves the whole tie; see ``docs/semantics.md``).

    >>> import torch
    >>> w = torch.ones(2)
    >>> leaves = [w, torch.zeros(2), w]
    >>> out = [leaf + 1 for leaf in leaves]
    >>> retie(out, tie_pairs(leaves))
    >>> out[0] is out[2]
    True
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch import Tensor


def has_ties(leaves: Sequence[Any]) -> bool:
    """Whether some object stands at two places of ``leaves``."""
    if torch.compiler.is_compiling():
        return bool(_traced_pairs(leaves, range(len(leaves))))
    return len(set(map(id, leaves))) != len(leaves)


def tie_pairs(leaves: Sequence[Any], order: Sequence[int] | None = None) -> list[tuple[int, int]]:
    """``(place, first place)`` for every leaf that is an object seen at an earlier place.

    Places are visited in ``order`` (default: as listed); give it when ``leaves`` are not in the
    tree's walk order (optree sorts dict keys; a tie's first path is the first in module order).
    """
    if torch.compiler.is_compiling():
        return _traced_pairs(leaves, order if order is not None else range(len(leaves)))
    if not has_ties(leaves):
        return []
    first: dict[int, int] = {}
    pairs = []
    for index in order if order is not None else range(len(leaves)):
        seen = first.setdefault(id(leaves[index]), index)
        if seen != index:
            pairs.append((index, seen))
    return pairs


def _traced_pairs(leaves: Sequence[Any], order: Sequence[int]) -> list[tuple[int, int]]:
    """`tie_pairs` while ``torch.compile`` traces: Dynamo guards on the ``id()`` of an input, so
    a step whose params are new tensors each time would recompile every step; ``is`` between two
    inputs is decided by the aliasing guards the graph has anyway. Quadratic, at trace time only."""
    pairs: list[tuple[int, int]] = []
    firsts: list[int] = []
    for index in order:
        leaf = leaves[index]
        for seen in firsts:
            if leaves[seen] is leaf:
                pairs.append((index, seen))
                break
        else:
            firsts.append(index)
    return pairs


def retie(out: list[Any], pairs: list[tuple[int, int]]) -> None:
    """Put the result of each tie's first place at its other places (in place)."""
    for index, seen in pairs:
        out[index] = out[seen]


def keeping_ties(fn: Callable[..., Any]) -> Callable[..., Any]:
    """``fn`` for a leaf-by-leaf walk, computed once per distinct tensor (first place decides)."""
    # asked once per walk, not per leaf: a walk is traced whole or not at all
    if torch.compiler.is_compiling():
        traced: list[tuple[Tensor, Any]] = []  # the same, while torch.compile traces (no id())

        def run_traced(leaf: Any, *others: Any) -> Any:
            if not isinstance(leaf, Tensor):
                return fn(leaf, *others)
            for seen, result in traced:
                if seen is leaf:
                    return result
            traced.append((leaf, fn(leaf, *others)))
            return traced[-1][1]

        return run_traced
    done: dict[int, tuple[Tensor, Any]] = {}

    def run(leaf: Any, *others: Any) -> Any:
        if not isinstance(leaf, Tensor):
            return fn(leaf, *others)
        hit = done.get(id(leaf))
        if hit is not None:
            return hit[1]
        result = fn(leaf, *others)
        done[id(leaf)] = (leaf, result)  # the leaf is held so that its id stays its own
        return result

    return run
