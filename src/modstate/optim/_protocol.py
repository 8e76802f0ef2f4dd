"""`Optimizer`: what a pure optimizer of `modstate.optim` is, as a type."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, Protocol, TypeAlias, runtime_checkable

from modstate._core.types import Tree

OptimizerState: TypeAlias = dict[str, Any]
"""An optimizer's state: ``{"step": 0-dim tensor, <buffer name>: tree like params, ...}``."""


@runtime_checkable
class Optimizer(Protocol):
    """A pure optimizer: `init` makes its state, `step` returns new params and a new state.

    Every optimizer of `modstate.optim` (`sgd`, `adam`, ...) and every `masked` optimizer
    satisfies it, so code can be written against the protocol (``isinstance(opt, Optimizer)``
    works too). Neither method writes to its inputs, unless `step` is given ``donate=True``.

    Example:
        >>> def train(opt: modstate.optim.Optimizer, params, grads):
        ...     state = opt.init(params)
        ...     return opt.step(params, grads, state)[0]
        >>> train(modstate.optim.sgd(lr=0.5), {"w": torch.ones(2)}, {"w": torch.ones(2)})
        {'w': tensor([0.5000, 0.5000])}
        >>> isinstance(modstate.optim.masked(modstate.optim.adam(), "w"), modstate.optim.Optimizer)
        True
    """

    def init(self, params: Tree) -> OptimizerState:
        """The state before the first step.

        Args:
            params: the tree of tensors to optimize.

        Returns:
            The optimizer's state: a step counter and one tree per buffer.
        """
        ...

    def step(
        self, params: Tree, grads: Tree, state: Mapping[str, Any], *, donate: bool = False
    ) -> tuple[Tree, OptimizerState]:
        """One step.

        Args:
            params: the tree of tensors being optimized.
            grads: a tree of the same structure; a None leaf freezes its leaf.
            state: what `init` or the last step returned.
            donate: whether the buffers of `params` and `state` may hold the results.

        Returns:
            ``(new_params, new_state)``.
        """
        ...
