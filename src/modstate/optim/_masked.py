"""`masked`: an optimizer that steps only the leaves whose dotted path matches a glob."""

from __future__ import annotations

import fnmatch
import re
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import optree
from torch import Tensor

from modstate.optim._base import Optimizer
from modstate.optim._tree import _dotted, _mismatch


def _matcher(patterns: tuple[str, ...]) -> re.Pattern[str]:
    for pattern in patterns:
        if not isinstance(pattern, str):
            raise TypeError(f"masked: patterns must be strings, got {pattern!r}")
    if not patterns:
        raise ValueError("masked: give at least one pattern, such as 'encoder.*'")
    return re.compile("|".join(fnmatch.translate(pattern) for pattern in patterns))


def _matches(pattern: re.Pattern[str], path: str) -> bool:
    """Whether the leaf path or one of its enclosing subtrees' paths matches (as tree.select)."""
    parts = path.split(".")
    return any(pattern.match(".".join(parts[:end])) for end in range(1, len(parts) + 1))


@dataclass(frozen=True)
class Masked:
    """An optimizer restricted to the leaves whose path matches; build it with `masked`."""

    optimizer: Optimizer
    patterns: tuple[str, ...]

    def __post_init__(self) -> None:
        _matcher(self.patterns)

    def _split(self, params: Any) -> tuple[list[Any], list[bool], optree.PyTreeSpec]:
        leaves, treedef = optree.tree_flatten(params, none_is_leaf=False)
        pattern = _matcher(self.patterns)
        paths = [_dotted(p) for p in optree.tree_paths(params, none_is_leaf=False)]
        keep = [_matches(pattern, path) for path in paths]
        # A tie (one tensor at several paths) is one parameter: matched at one path, it is
        # stepped, and at all its paths, so that it stays one tensor.
        matched_ties = {id(leaf) for leaf, k in zip(leaves, keep) if k and isinstance(leaf, Tensor)}
        keep = [
            k or (isinstance(leaf, Tensor) and id(leaf) in matched_ties)
            for leaf, k in zip(leaves, keep)
        ]
        return leaves, keep, treedef

    def init(self, params: Any) -> dict[str, Any]:
        """The inner optimizer's state for the matching leaves (None at the others)."""
        leaves, keep, treedef = self._split(params)
        if leaves and not any(keep):
            paths = [_dotted(p) for p in optree.tree_paths(params, none_is_leaf=False)]
            raise ValueError(
                f"masked: no leaf path matches {list(self.patterns)}; paths are {paths[:5]}"
                + (" ..." if len(paths) > 5 else "")
            )
        return self.optimizer.init(
            treedef.unflatten([leaf if k else None for leaf, k in zip(leaves, keep)])
        )

    def step(
        self, params: Any, grads: Any, state: Mapping[str, Any], *, donate: bool = False
    ) -> tuple[Any, dict[str, Any]]:
        """Step the matching leaves; the others come back as the very objects that came in."""
        leaves, keep, treedef = self._split(params)
        try:
            grad_leaves = treedef.flatten_up_to(grads)
        except (ValueError, TypeError):
            raise ValueError(_mismatch(params, grads, "grads")) from None
        inner_params = treedef.unflatten([leaf if k else None for leaf, k in zip(leaves, keep)])
        inner_grads = treedef.unflatten([g if k else None for g, k in zip(grad_leaves, keep)])
        new_inner, new_state = self.optimizer.step(inner_params, inner_grads, state, donate=donate)
        new_leaves = treedef.flatten_up_to(new_inner)
        merged = [new if k else old for old, new, k in zip(leaves, new_leaves, keep)]
        return treedef.unflatten(merged), new_state


def masked(optimizer: Optimizer, *patterns: str) -> Masked:
    """`optimizer`, stepping only the leaves whose dotted path matches one of the `patterns`.

    Patterns are `fnmatch` globs as in `modstate.tree.select` (``*`` crosses dots; a pattern
    naming a subtree takes all of it). The other leaves keep their value (the same objects) and
    have no optimizer state (None in the state's trees); they may be of any dtype, so an
    integer buffer can stay in the tree. A tied weight (one tensor at several paths) is stepped
    when one of its paths matches, and stays one tensor.

    >>> params = {"body": {"w": torch.ones(2)}, "head": {"w": torch.ones(2)}}
    >>> opt = masked(modstate.optim.sgd(lr=0.5, momentum=0.9), "head.*")
    >>> state = opt.init(params)
    >>> state["momentum_buffer"]
    {'body': {'w': None}, 'head': {'w': tensor([0., 0.])}}
    >>> grads = {"body": {"w": torch.ones(2)}, "head": {"w": torch.ones(2)}}
    >>> new, state = opt.step(params, grads, state)
    >>> new["body"]["w"] is params["body"]["w"], new["head"]["w"]
    (True, tensor([0.5000, 0.5000]))
    """
    return Masked(optimizer, tuple(patterns))
