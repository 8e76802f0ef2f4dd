"""`masked`: an optimizer that steps only the leaves whose dotted path matches a glob."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, cast

from torch import Tensor

from modstate._core.trees.paths import glob_selects
from modstate._core.trees.ties import tie_pairs
from modstate._core.types import Tree
from modstate.optim._protocol import Optimizer, OptimizerState
from modstate.optim._tree import flatten_tree, leaf_paths, mismatch


def _check_patterns(patterns: tuple[str, ...]) -> None:
    for pattern in patterns:
        if not isinstance(pattern, str):
            raise TypeError(
                f"masked: '{pattern!r}': a {type(pattern).__name__}, not a pattern; pass "
                f"strings such as 'encoder.*'"
            )
    if not patterns:
        raise ValueError("masked: '<patterns>': none given; pass at least one, such as 'head.*'")


@dataclass(frozen=True)
class Masked:
    """An optimizer restricted to the leaves whose path matches; build it with `masked`.

    It satisfies the `Optimizer` protocol: `init` and `step` as the inner optimizer's, on the
    matching leaves only.

    Attributes:
        optimizer: the inner optimizer, which steps the matching leaves.
        patterns: the globs on dotted leaf paths that select them.
    """

    optimizer: Optimizer
    patterns: tuple[str, ...]

    def __post_init__(self) -> None:
        _check_patterns(self.patterns)

    def _split(self, params: Any) -> tuple[list[Any], list[bool], Any]:
        # optree's flatten eagerly, TracedSpec's while torch.compile traces (Dynamo's optree
        # support fails to unflatten the None leaves the inner trees hold): the same step.
        leaves, treedef = flatten_tree(params)
        keep = [glob_selects(self.patterns, path) for path in leaf_paths(params)]
        # A tie (one tensor at several paths) is one parameter: matched at one path, it is
        # stepped, and at all its paths, so that it stays one tensor.
        pairs = [(i, first) for i, first in tie_pairs(leaves) if isinstance(leaves[i], Tensor)]
        for index, first in pairs:  # a match anywhere in the tie reaches its first place ...
            keep[first] = keep[first] or keep[index]
        for index, first in pairs:  # ... and from there every place of the tie
            keep[index] = keep[first]
        return leaves, keep, treedef

    def init(self, params: Tree) -> OptimizerState:
        """The inner optimizer's state for the matching leaves (None at the others).

        Args:
            params: the whole tree; only the matching leaves get state.

        Returns:
            The inner optimizer's state, with None at the leaves that do not match.

        Raises:
            ValueError: no leaf path matches the patterns (the message lists some paths).
        """
        leaves, keep, treedef = self._split(params)
        if leaves and not any(keep):
            paths = leaf_paths(params)
            raise ValueError(
                f"masked.init: {', '.join(map(repr, self.patterns))}: matches no leaf path; pass "
                f"patterns that match some of the paths {paths[:5]}"
                + (" ..." if len(paths) > 5 else "")
            )
        inner: Any = treedef.unflatten(
            [leaf if k else None for leaf, k in zip(leaves, keep, strict=True)]
        )
        return self.optimizer.init(inner)

    def step(
        self, params: Tree, grads: Tree, state: Mapping[str, Any], *, donate: bool = False
    ) -> tuple[Tree, OptimizerState]:
        """Step the matching leaves; the others come back as the very objects that came in.

        Args:
            params: the whole tree.
            grads: a tree of the same structure (the gradients of leaves that do not match
                are ignored).
            state: what `init` or the last step returned.
            donate: as the inner optimizer's ``donate``, for the matching leaves.

        Returns:
            ``(new_params, new_state)``.

        Raises:
            ValueError: `grads` does not have the structure of `params` (the message names
                the path), or what the inner optimizer's step raises.
        """
        leaves, keep, treedef = self._split(params)
        try:
            grad_leaves: list[Any] = treedef.flatten_up_to(cast(Any, grads))
        except (ValueError, TypeError):
            raise ValueError(mismatch("masked.step", params, grads, "grads")) from None
        inner_params: Any = treedef.unflatten(
            [p if k else None for p, k in zip(leaves, keep, strict=True)]
        )
        inner_grads: Any = treedef.unflatten(
            [g if k else None for g, k in zip(grad_leaves, keep, strict=True)]
        )
        new_inner, new_state = self.optimizer.step(inner_params, inner_grads, state, donate=donate)
        new_leaves: list[Any] = treedef.flatten_up_to(cast(Any, new_inner))
        merged = [new if k else old for old, new, k in zip(leaves, new_leaves, keep, strict=True)]
        new_params: Any = treedef.unflatten(merged)
        return new_params, new_state


def masked(optimizer: Optimizer, *patterns: str) -> Masked:
    """`optimizer`, stepping only the leaves whose dotted path matches one of the `patterns`.

    Patterns are `fnmatch` globs as in `modstate.tree.select` (``*`` crosses dots; a pattern
    naming a subtree takes all of it). The other leaves keep their value (the same objects) and
    have no optimizer state (None in the state's trees); they may be of any dtype, so an
    integer buffer can stay in the tree. A tied weight (one tensor at several paths) is stepped
    when one of its paths matches, and stays one tensor.

    Args:
        optimizer: any `Optimizer` (`adam(...)`, another `masked(...)`).
        *patterns: one or more globs on dotted leaf paths.

    Returns:
        A `Masked` optimizer (it satisfies `Optimizer`).

    Raises:
        TypeError: a pattern is not a string.
        ValueError: no pattern is given.

    Example:
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
