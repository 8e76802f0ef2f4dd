"""From trees to lists of leaves and back, for the optimizers in `modstate.optim`.

An optimizer step sees three trees of one structure (params, grads, and each per-leaf buffer of
its state) and updates only the leaves whose gradient is not None. `StepLeaves` checks the trees
against each other, naming the dotted path of the first leaf that does not fit, hands the
optimizer real-valued lists of the leaves to update (complex leaves are viewed as real, as
`torch.optim` does), and rebuilds the output trees, in which every other leaf is the very object
that came in.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from numbers import Number
from typing import Any

import optree
import torch
from torch import Tensor

from modstate.optim._lists import Leaves, Scalar


def check_hyperparameter(
    name: str, value: object, *, low: float, high: float | None = None
) -> None:
    """Check a hyperparameter the way torch.optim does; a tensor must be 0-dim (values unchecked)."""
    if isinstance(value, Tensor):
        if value.dim() != 0:
            raise ValueError(
                f"{name} must be a number or a 0-dim tensor, got shape {tuple(value.shape)}"
            )
        if not (value.is_floating_point() or value.is_complex()):
            raise ValueError(f"{name} must be a floating-point tensor, got {value.dtype}")
        return
    if isinstance(value, bool) or not isinstance(value, Number):
        raise TypeError(f"{name} must be a number or a 0-dim tensor, got {type(value).__name__}")
    if value < low or (high is not None and value >= high):
        bounds = f"in [{low}, {high})" if high is not None else f">= {low}"
        raise ValueError(f"invalid {name}: {value} (must be {bounds})")


def scalar_dtype(device: torch.device) -> torch.dtype:
    """The dtype for bias corrections: float64 where the device has it, so they round like torch's."""
    return torch.float32 if device.type == "mps" else torch.float64


def new_step_counter() -> Tensor:
    """A 0-dim step counter, float32 and on the CPU like `torch.optim`'s default ``state["step"]``.

    On the CPU it can be read without a device sync; under `vmap` it is batched like any tensor.
    """
    dtype = torch.float64 if torch.get_default_dtype() == torch.float64 else torch.float32
    return torch.zeros((), dtype=dtype)


def read_count(step: Tensor) -> float | None:
    """The step count as a number when reading it is free (a CPU tensor, no transform, no trace)."""
    if (
        step.device.type != "cpu"
        or torch._C._are_functorch_transforms_active()
        or torch.compiler.is_compiling()
    ):
        return None
    return step.item()


def bias_corrections(
    betas: Sequence[Scalar], step: Tensor, count: float | None, device: torch.device
) -> list[Scalar]:
    """``1 - beta ** step`` for each beta, where `step` counts from 1.

    Python floats (as torch.optim computes them) when `count` and the betas are numbers; else
    0-dim tensors on `device`, in float64 where the device has it.
    """
    if count is not None and not any(isinstance(beta, Tensor) for beta in betas):
        return [1 - beta**count for beta in betas]
    exponent = step.to(device=device, dtype=scalar_dtype(device))
    return [1 - beta**exponent for beta in betas]


def _dotted(path: tuple[Any, ...]) -> str:
    return ".".join(str(key) for key in path) or "<root>"


def _flatten_params(params: Any) -> tuple[list[Any], optree.PyTreeSpec]:
    leaves, treedef = optree.tree_flatten(params, none_is_leaf=True)
    if not all(isinstance(leaf, Tensor) for leaf in leaves):
        for path, leaf in zip(optree.tree_paths(params, none_is_leaf=True), leaves):
            if not isinstance(leaf, Tensor):
                name = type(leaf).__name__
                raise TypeError(f"params leaf {_dotted(path)!r} is {name}, not a tensor")
    return leaves, treedef


def _mismatch(params: Any, tree: Any, what: str) -> str:
    """The first dotted path where `tree` does not have the structure of `params`."""
    param_paths = [_dotted(p) for p in optree.tree_paths(params, none_is_leaf=True)]
    tree_paths = [_dotted(p) for p in optree.tree_paths(tree, none_is_leaf=True)]
    param_set, tree_set = set(param_paths), set(tree_paths)
    missing = [p for p in param_paths if p not in tree_set]
    extra = [p for p in tree_paths if p not in param_set]
    if missing:
        return f"{what} has no leaf at {missing[0]!r}, a path of params"
    if extra:
        return f"{what} has a leaf at {extra[0]!r}, which is not a path of params"
    return f"{what} does not have the structure of params"


def init_buffers(params: Any, names: Iterable[str]) -> dict[str, Any]:
    """Zero trees shaped like `params`, one per name."""
    leaves, treedef = _flatten_params(params)
    return {
        name: treedef.unflatten(
            [torch.zeros_like(leaf, memory_format=torch.preserve_format) for leaf in leaves]
        )
        for name in names
    }


class StepLeaves:
    """The leaves of one optimizer step: params, grads and per-leaf state buffers, checked.

    `active` lists the positions whose gradient is not None; `gather` returns those leaves of a
    list (complex ones viewed as real) and `rebuild` puts updated leaves back into a tree.
    """

    __slots__ = ("_complex", "_treedef", "active", "buffers", "grads", "params", "step")

    def __init__(
        self,
        params: Any,
        grads: Any,
        state: Mapping[str, Any],
        buffer_names: Sequence[str],
        owner: str,
    ) -> None:
        if not isinstance(state, Mapping):
            raise TypeError(
                f"state must be the dict returned by {owner}.init, got {type(state).__name__}"
            )
        expected = {"step", *buffer_names}
        if set(state) != expected:
            raise ValueError(
                f"state has keys {sorted(state)}, but {owner} keeps {sorted(expected)}: "
                f"pass the state made by this optimizer's init (or its last step)"
            )
        step = state["step"]
        if not isinstance(step, Tensor) or step.dim() != 0:
            raise ValueError("state['step'] must be a 0-dim tensor")

        self.params, self._treedef = _flatten_params(params)
        self.grads = self._leaves_like(params, grads, "grads", allow_none=True)
        self.buffers = {
            name: self._leaves_like(params, state[name], f"state[{name!r}]", allow_none=False)
            for name in buffer_names
        }
        self.step = step
        self.active = [i for i, g in enumerate(self.grads) if g is not None]
        self._complex = [leaf.is_complex() for leaf in self.params]

    def _leaves_like(self, params: Any, tree: Any, what: str, *, allow_none: bool) -> list[Any]:
        try:
            leaves = self._treedef.flatten_up_to(tree)
        except (ValueError, TypeError):
            raise ValueError(_mismatch(params, tree, what)) from None
        for index, (param, leaf) in enumerate(zip(self.params, leaves)):
            if leaf is None and allow_none:
                continue
            if not isinstance(leaf, Tensor) or leaf.shape != param.shape:
                path = _dotted(optree.tree_paths(params, none_is_leaf=True)[index])
                got = (
                    f"shape {tuple(leaf.shape)}"
                    if isinstance(leaf, Tensor)
                    else type(leaf).__name__
                )
                raise ValueError(
                    f"{what} at {path!r} is {got}, but the param there has shape {tuple(param.shape)}"
                )
        return leaves

    def gather(self, leaves: Sequence[Tensor | None]) -> Leaves:
        return [
            torch.view_as_real(leaves[i]) if self._complex[i] else leaves[i]  # type: ignore[misc]
            for i in self.active
        ]

    def rebuild(self, full: Sequence[Tensor], updated: Sequence[Tensor]) -> Any:
        leaves = list(full)
        for index, value in zip(self.active, updated):
            leaves[index] = torch.view_as_complex(value) if self._complex[index] else value
        return self._treedef.unflatten(leaves)

    @property
    def device(self) -> torch.device:
        """Where the leaves to update live (the first one's device)."""
        return self.params[self.active[0]].device if self.active else torch.device("cpu")

    def unchanged(self) -> tuple[Any, dict[str, Any]]:
        """The step's result when no leaf has a gradient: same leaves, step counted."""
        state = {"step": self.step + 1}
        state.update({name: self.rebuild(leaves, []) for name, leaves in self.buffers.items()})
        return self.rebuild(self.params, []), state

    def tensors(self) -> list[Tensor]:
        """Every input tensor of the step (to decide whether autograd is involved)."""
        found = [self.params[i] for i in self.active] + [self.grads[i] for i in self.active]
        for leaves in self.buffers.values():
            found.extend(leaves[i] for i in self.active)
        return found
