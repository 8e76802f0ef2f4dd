"""From trees to lists of leaves and back, for the optimizers in `modstate.optim`.

An optimizer step sees three trees of one structure (params, grads, and each per-leaf buffer of
its state) and updates only the leaves whose gradient is not None. `StepLeaves` checks the trees
against each other, naming the dotted path of the first leaf that does not fit, hands the
optimizer real-valued lists of the leaves to update (complex leaves are viewed as real, as
`torch.optim` does), and rebuilds the output trees, in which every other leaf is the very object
that came in. None in `params` is an empty subtree (no leaf), as everywhere in modstate.

A tie (one tensor at several paths of `params`, as ``extract`` lists tied weights) is stepped
once, with the gradient and state at its first path (where ``torch.func`` puts the gradient of a
tie), and the new tensor stands at every path of the tie, so the result still fits the model.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping, Sequence
from numbers import Number
from typing import Any

import optree
import torch
from torch import Tensor

from modstate._core.torch_facts import functorch_active
from modstate.optim._lists import Leaves, Scalar
from modstate.tree._ties import has_ties, keeping_ties, retie, tie_pairs
from modstate.tree._walk import leaves_with_paths


def check_hyperparameter(
    name: str,
    value: object,
    *,
    low: float,
    high: float | None = None,
    high_inclusive: bool = False,
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
    above = high is not None and (value > high if high_inclusive else value >= high)
    if value < low or above:
        closing = "]" if high_inclusive else ")"
        bounds = f"in [{low}, {high}{closing}" if high is not None else f">= {low}"
        raise ValueError(f"invalid {name}: {value} (must be {bounds})")


def check_betas(betas: object) -> tuple[Scalar, Scalar]:
    if not isinstance(betas, (tuple, list)) or len(betas) != 2:
        raise ValueError(f"betas must be a pair (beta1, beta2), got {betas!r}")
    check_hyperparameter("beta1", betas[0], low=0.0, high=1.0)
    check_hyperparameter("beta2", betas[1], low=0.0, high=1.0)
    return (betas[0], betas[1])


def scalar_dtype(device: torch.device) -> torch.dtype:
    """The dtype for step-dependent scalars: float64 where the device has it (Python's floats)."""
    return torch.float32 if device.type == "mps" else torch.float64


def new_scalar(value: float = 0.0) -> Tensor:
    """A 0-dim CPU tensor in torch.optim's dtype for ``state["step"]`` (float32, or float64 when
    that is the default dtype). Read without a device sync; batched under `vmap` like any tensor.
    """
    dtype = torch.float64 if torch.get_default_dtype() == torch.float64 else torch.float32
    return torch.full((), value, dtype=dtype)


def read_number(value: Tensor) -> float | None:
    """The value as a number when reading it is free (a CPU tensor, no transform, no trace)."""
    if (
        value.device.type != "cpu"
        or value.requires_grad
        or functorch_active()
        or torch.compiler.is_compiling()
    ):
        return None
    return value.item()


def _dotted(path: tuple[Any, ...]) -> str:
    return ".".join(str(key) for key in path) or "<root>"


def _paths(tree: Any) -> list[str]:
    return [_dotted(p) for p in optree.tree_paths(tree, none_is_leaf=False)]


def _not_float(path: str, leaf: Tensor) -> TypeError:
    return TypeError(
        f"params leaf {path!r} is {leaf.dtype}, and an optimizer steps floating-point or "
        f"complex leaves only: leave it out of the tree, e.g. "
        f"params = ms.tree.exclude(params, {path!r}) (or set it to None), or take the "
        f"trainable leaves of a model with params, state = ms.split(model, detach=True)"
    )


def flatten_params(params: Any) -> tuple[list[Tensor], optree.PyTreeSpec]:
    """The tensor leaves of `params` (None is an empty subtree); path-named errors for others."""
    leaves, treedef = optree.tree_flatten(params, none_is_leaf=False)
    for index, leaf in enumerate(leaves):
        if not isinstance(leaf, Tensor):
            path = _paths(params)[index]
            raise TypeError(f"params leaf {path!r} is {type(leaf).__name__}, not a tensor")
        if not (leaf.is_floating_point() or leaf.is_complex()):
            raise _not_float(_paths(params)[index], leaf)
    return leaves, treedef


def _mismatch(params: Any, tree: Any, what: str) -> str:
    """The first dotted path where `tree` does not have the structure of `params`."""
    param_paths = _paths(params)
    tree_paths = [_dotted(p) for p in optree.tree_paths(tree, none_is_leaf=True)]
    param_set, tree_set = set(param_paths), set(tree_paths)
    missing = [p for p in param_paths if p not in tree_set]
    extra = [p for p in tree_paths if p not in param_set]
    if missing:
        return f"{what} has no leaf at {missing[0]!r}, a path of params"
    if extra:
        return f"{what} has a leaf at {extra[0]!r}, which is not a path of params"
    return f"{what} does not have the structure of params"


def init_buffers(
    params: Any, names: Iterable[str], fill: Callable[[str, Tensor], Tensor] | None = None
) -> dict[str, Any]:
    """Trees shaped like `params`, one per name: zeros, or ``fill(name, leaf)``."""
    leaves, treedef = flatten_params(params)

    def make(name: str, leaf: Tensor) -> Tensor:
        if fill is not None:
            return fill(name, leaf)
        return torch.zeros_like(leaf, memory_format=torch.preserve_format)

    def tree_of(name: str) -> Any:
        make_once = keeping_ties(lambda leaf: make(name, leaf))  # a tie has one buffer
        return treedef.unflatten([make_once(leaf) for leaf in leaves])

    return {name: tree_of(name) for name in names}


def _walk_order(params: Any, leaves: list[Tensor]) -> list[int] | None:
    """The positions of optree's ``leaves`` (sorted dict keys) in the tree's walk order (dict
    insertion order, which is module order for trees from ``extract``); None without ties."""
    if not has_ties(leaves):
        return None
    rank = {path: i for i, (path, _) in enumerate(leaves_with_paths(params))}
    paths = _paths(params)
    return sorted(range(len(leaves)), key=lambda index: rank[paths[index]])


def _misfit(param: Tensor, leaf: Any) -> str | None:
    """Why `leaf` cannot stand beside `param` in a step, or None."""
    if not isinstance(leaf, Tensor):
        return f"is {type(leaf).__name__}, not a tensor"
    if leaf.shape != param.shape:
        return f"has shape {tuple(leaf.shape)}, but the param there has shape {tuple(param.shape)}"
    if leaf.is_complex() != param.is_complex() or not (
        leaf.is_floating_point() or leaf.is_complex()
    ):
        return f"is {leaf.dtype}, but the param there is {param.dtype}"
    return None


class StepLeaves:
    """The leaves of one optimizer step: params, grads and per-leaf state buffers, checked.

    `active` lists the positions whose gradient is not None; `gather` returns those leaves of a
    list (complex ones viewed as real) and `rebuild` puts updated leaves back into a tree.
    """

    __slots__ = (
        "_complex",
        "_params_tree",
        "_ties",
        "_treedef",
        "active",
        "buffers",
        "grads",
        "params",
    )

    def __init__(
        self,
        params: Any,
        grads: Any,
        state: Mapping[str, Any],
        buffer_names: Sequence[str],
        owner: str,
    ) -> None:
        self._params_tree = params
        self.params, self._treedef = flatten_params(params)
        self.grads = self._leaves_like(grads, "grads", allow_none=True)
        self.buffers = {
            name: self._leaves_like(state[name], f"state[{name!r}]", allow_none=False)
            for name in buffer_names
        }
        self._ties = tie_pairs(self.params, _walk_order(params, self.params))
        repeated = {index for index, _ in self._ties}
        self.active = [i for i, g in enumerate(self.grads) if g is not None and i not in repeated]
        self._complex = [leaf.is_complex() for leaf in self.params]

    def _leaves_like(self, tree: Any, what: str, *, allow_none: bool) -> list[Any]:
        try:
            leaves = self._treedef.flatten_up_to(tree)
        except (ValueError, TypeError):
            raise ValueError(_mismatch(self._params_tree, tree, what)) from None
        for index, (param, leaf) in enumerate(zip(self.params, leaves)):
            if leaf is None and allow_none:
                continue
            problem = _misfit(param, leaf)
            if problem is not None:
                path = _paths(self._params_tree)[index]
                raise ValueError(f"{what} at {path!r} {problem}")
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
        retie(leaves, self._ties)
        return self._treedef.unflatten(leaves)

    @property
    def device(self) -> torch.device:
        """Where the leaves to update live (the first one's device)."""
        return self.params[self.active[0]].device if self.active else torch.device("cpu")

    def tensors(self) -> list[Tensor]:
        """Every input tensor of the step (to decide whether autograd is involved)."""
        found = [self.params[i] for i in self.active] + [self.grads[i] for i in self.active]
        for leaves in self.buffers.values():
            found.extend(leaves[i] for i in self.active)
        return found
