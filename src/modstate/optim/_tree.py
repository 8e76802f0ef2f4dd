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
from typing import Any

import optree
import torch
from torch import Tensor

from modstate._core.torch_facts import functorch_active
from modstate._core.trees.leaves import refuse_undifferentiable
from modstate._core.trees.nodes import leaves_with_paths
from modstate._core.trees.paths import dotted
from modstate._core.trees.ties import has_ties, keeping_ties, retie, tie_pairs
from modstate.optim._lists import Leaves


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
        value.dim() != 0
        or not value.is_cpu
        or value.requires_grad
        or functorch_active()
        or torch.compiler.is_compiling()
    ):
        return None
    return value.item()


def leaf_paths(tree: Any) -> list[str]:
    """The dotted paths of the leaves of `tree` (None an empty subtree), in `flatten_tree`'s order."""
    if torch.compiler.is_compiling():
        return TracedSpec(tree).paths
    return [dotted(p) for p in optree.tree_paths(tree, none_is_leaf=False)]


_LEAF = "leaf"


class TracedSpec:
    """optree's ``PyTreeSpec`` (None an empty subtree) for the trees a step sees while
    ``torch.compile`` traces it: Dynamo's optree support fails on None subtrees, which a step's
    trees have (a frozen leaf, a masked optimizer's holes). Plain dicts, lists and tuples, walked
    in their own order (dict insertion order, where optree sorts keys): the leaves then come in
    module order, so a tie's first place is the first leaf seen."""

    __slots__ = ("_node", "paths")

    def __init__(self, tree: Any) -> None:
        self.paths: list[str] = []
        self._node = self._spec(tree, ())

    def _spec(self, node: Any, keys: tuple[Any, ...]) -> Any:
        if node is None:
            return None
        if isinstance(node, dict):
            return (dict, tuple(node), [self._spec(v, (*keys, k)) for k, v in node.items()])
        if type(node) in (list, tuple):
            return (type(node), len(node), [self._spec(v, (*keys, i)) for i, v in enumerate(node)])
        self.paths.append(dotted(keys))
        return _LEAF

    def flatten_up_to(self, tree: Any) -> list[Any]:
        """The nodes of `tree` at this structure's leaves; ValueError where `tree` differs."""
        found: list[Any] = []
        self._up_to(self._node, tree, found)
        return found

    def _up_to(self, spec: Any, node: Any, found: list[Any]) -> None:
        if spec is _LEAF:
            found.append(node)
        elif spec is None:
            if node is not None:
                raise ValueError("a leaf where the params hold none")
        else:
            kind, keys, children = spec
            if kind is dict:
                if not isinstance(node, dict) or tuple(node) != keys:
                    raise ValueError("another structure")
                for key, child in zip(keys, children, strict=True):
                    self._up_to(child, node[key], found)
            else:
                if type(node) is not kind or len(node) != keys:
                    raise ValueError("another structure")
                for child, value in zip(children, node, strict=True):
                    self._up_to(child, value, found)

    def unflatten(self, leaves: Sequence[Any]) -> Any:
        """The tree of this structure holding `leaves` (in walk order)."""
        return self._build(self._node, iter(leaves))

    def _build(self, spec: Any, leaves: Any) -> Any:
        if spec is _LEAF:
            return next(leaves)
        if spec is None:
            return None
        kind, keys, children = spec
        if kind is dict:
            return {key: self._build(c, leaves) for key, c in zip(keys, children, strict=True)}
        return kind(self._build(child, leaves) for child in children)


def flatten_tree(tree: Any) -> tuple[list[Any], Any]:
    """optree's flatten (None an empty subtree), or `TracedSpec`'s while compiling."""
    if torch.compiler.is_compiling():
        spec = TracedSpec(tree)
        return spec.flatten_up_to(tree), spec
    return optree.tree_flatten(tree, none_is_leaf=False)


_NOT_TENSOR_FIX = "; leave it out of params (or set it to None, an empty subtree)"
_NOT_FLOAT_FIX = (
    "an optimizer steps floating-point (or complex) leaves only, and integer state such as "
    "BatchNorm's num_batches_tracked is carried, not trained; take the trainable part of the "
    "model with params, state = ms.split(model, detach=True), step params, and run the model "
    "with out, state = ms.apply(model, params, state, x) (see ms.grad for the gradients)"
)


def flatten_params(params: Any, function: str) -> tuple[list[Tensor], optree.PyTreeSpec]:
    """The tensor leaves of `params` (None is an empty subtree); path-named errors for others."""
    leaves, treedef = flatten_tree(params)
    refuse_undifferentiable(
        leaves,
        lambda index: leaf_paths(params)[index],  # paths are walked only for the error
        function,
        "leaf",
        (TypeError, _NOT_TENSOR_FIX),
        (TypeError, _NOT_FLOAT_FIX),
    )
    return leaves, treedef


def mismatch(function: str, params: Any, tree: Any, what: str) -> str:
    """The error for `tree` (named `what`) not having the structure of `params`: the first
    dotted path where they differ."""
    param_paths = leaf_paths(params)
    tree_paths = [dotted(p) for p in optree.tree_paths(tree, none_is_leaf=True)]
    param_set, tree_set = set(param_paths), set(tree_paths)
    missing = [p for p in param_paths if p not in tree_set]
    extra = [p for p in tree_paths if p not in param_set]
    fix = f"pass {what} with the structure of params (None where a leaf has no gradient)"
    if missing:
        return f"{function}: '{missing[0]}': a path of params that {what} lacks; {fix}"
    if extra:
        return f"{function}: '{extra[0]}': {what} has a leaf here, which params has not; {fix}"
    return f"{function}: '<root>': {what} does not have the structure of params; {fix}"


def init_buffers(
    params: Any, names: Iterable[str], fill: Callable[[str, Tensor], Tensor], owner: str
) -> dict[str, Any]:
    """Trees shaped like `params`, one per name, each leaf ``fill(name, leaf)``."""
    leaves, treedef = flatten_params(params, f"{owner}.init")

    def tree_of(name: str) -> Any:
        make_once = keeping_ties(lambda leaf: fill(name, leaf))  # a tie has one buffer
        return treedef.unflatten([make_once(leaf) for leaf in leaves])

    return {name: tree_of(name) for name in names}


def _walk_order(params: Any, leaves: list[Tensor]) -> list[int]:
    """The positions of optree's ``leaves`` (sorted dict keys) in the tree's walk order (dict
    insertion order, which is module order for trees from ``extract``)."""
    if torch.compiler.is_compiling():
        return list(range(len(leaves)))  # TracedSpec walks in this order already
    rank = {path: i for i, (path, _) in enumerate(leaves_with_paths(params))}
    paths = leaf_paths(params)
    return sorted(range(len(leaves)), key=lambda index: rank[paths[index]])


def _misfit(param: Tensor, leaf: Any, what: str) -> tuple[str, str] | None:
    """Why `leaf` (of `what`: grads or a state buffer) cannot stand beside `param` in a step, and
    the fix; None where it can."""
    fix = f"pass {what} of the params' shapes and dtypes"
    if not isinstance(leaf, Tensor):
        return f"is {type(leaf).__name__}, not a tensor", fix
    if leaf.shape != param.shape:
        return (
            f"has shape {tuple(leaf.shape)}, but the param there has shape {tuple(param.shape)}",
            fix,
        )
    if leaf.dtype != param.dtype:
        # torch.optim's kernels take one dtype per param and its grad and state: a float64 grad
        # beside a float32 param fails inside a kernel (lerp's 'end'), or is cast without a word.
        if what == "grads":
            fix = (
                f"cast the gradients to the params' dtype first: grads = ms.tree.to(grads, "
                f"{param.dtype}) (or compute them from params of that dtype)"
            )
        else:
            fix = "make the state from these params: state = opt.init(params)"
        return f"is {leaf.dtype}, but the param there is {param.dtype}", fix
    return None


class StepLeaves:
    """The leaves of one optimizer step: params, grads and per-leaf state buffers, checked.

    `active` lists the positions whose gradient is not None; `gather` returns those leaves of a
    list (complex ones viewed as real) and `rebuild` puts updated leaves back into a tree.
    """

    __slots__ = (
        "_all_real",
        "_complex",
        "_function",
        "_params_tree",
        "_signature",
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
        self._function = f"{owner}.step"
        self.params, self._treedef = flatten_params(params, self._function)
        self._signature = [(leaf.shape, leaf.dtype) for leaf in self.params]
        self.grads = self._leaves_like(grads, "grads", allow_none=True)
        self.buffers = {
            name: self._leaves_like(state[name], f"state[{name!r}]", allow_none=False)
            for name in buffer_names
        }
        tied = has_ties(self.params)
        self._ties = tie_pairs(self.params, _walk_order(params, self.params)) if tied else []
        repeated = {index for index, _ in self._ties}
        self.active = [i for i, g in enumerate(self.grads) if g is not None and i not in repeated]
        self._complex = [leaf.is_complex() for leaf in self.params]
        # Every leaf stepped, none complex: gather is a copy of the list.
        self._all_real = len(self.active) == len(self.params) and not any(self._complex)

    def _leaves_like(self, tree: Any, what: str, *, allow_none: bool) -> list[Any]:
        try:
            leaves = self._treedef.flatten_up_to(tree)
        except (ValueError, TypeError):
            raise ValueError(mismatch(self._function, self._params_tree, tree, what)) from None
        try:  # the common case: every leaf a tensor of its param's shape and dtype
            if [(leaf.shape, leaf.dtype) for leaf in leaves] == self._signature:
                return leaves
        except AttributeError:  # a None (or other) leaf: the checks below say which
            pass
        misfits = {}
        for index, (param, leaf) in enumerate(zip(self.params, leaves, strict=True)):
            if leaf is None and allow_none:
                continue
            if type(leaf) is Tensor and leaf.dtype is param.dtype and leaf.shape == param.shape:
                continue
            misfit = _misfit(param, leaf, what)
            if misfit is not None:
                misfits[index] = misfit
        if misfits:  # name the first in module order, as while compiling (optree sorts keys)
            index = next(i for i in _walk_order(self._params_tree, self.params) if i in misfits)
            path, (problem, fix) = leaf_paths(self._params_tree)[index], misfits[index]
            raise ValueError(f"{self._function}: '{path}': {what} {problem}; {fix}")
        return leaves

    def gather(self, leaves: Sequence[Tensor | None]) -> Leaves:
        if self._all_real:
            return list(leaves)  # type: ignore[arg-type]  # every leaf is active: no None
        gathered = []
        for i in self.active:
            leaf = leaves[i]
            assert leaf is not None  # active leaves have a gradient and state
            gathered.append(torch.view_as_real(leaf) if self._complex[i] else leaf)
        return gathered

    def rebuild(self, full: Sequence[Tensor], updated: Sequence[Tensor]) -> Any:
        leaves = list(full)
        for index, value in zip(self.active, updated, strict=True):
            leaves[index] = torch.view_as_complex(value) if self._complex[index] else value
        if self._ties:
            retie(leaves, self._ties)
        return self._treedef.unflatten(leaves)

    @property
    def treedef(self) -> optree.PyTreeSpec:
        """The structure of params (optree's, None an empty subtree)."""
        return self._treedef

    @property
    def simple(self) -> bool:
        """Every leaf has a gradient, none is complex, no tensor stands at two paths."""
        return self._all_real and not self._ties

    def active_params(self) -> list[Tensor]:
        """The params that this step updates, as they are (complex ones not viewed as real)."""
        return [self.params[i] for i in self.active]

    def active_path(self, position: int) -> str:
        """The dotted path of the `position`-th updated param."""
        return leaf_paths(self._params_tree)[self.active[position]]

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
