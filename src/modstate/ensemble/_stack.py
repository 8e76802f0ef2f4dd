"""Stack N trees along a new leading dim (the ensemble dim), and take them apart again."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
from torch import Tensor, nn
from torch.nn.parameter import is_lazy
from torch.nn.utils import parametrize

from modstate._core.extract import extract
from modstate._core.trees.flat import flatten, unflatten
from modstate._core.types import Tree


def stack(trees: Sequence[Tree]) -> Tree:
    """Stack N trees of the same structure into one tree whose leaves have a leading dim N.

    Stacked leaves are new leaf tensors (no autograd link to the inputs) with the members'
    ``requires_grad``. Ties are kept: where every tree holds one tensor at several paths, the
    stacked tree holds one stacked tensor at those paths. Non-tensor leaves (``_extra_state``)
    must be equal in every tree and are kept once.

    Args:
        trees: the members' trees, each a nested dict of tensors with the same paths.

    Returns:
        A tree with the same paths whose tensors have a leading dim of ``len(trees)``.

    Raises:
        TypeError: a tree is not a dict, or one holds a tensor where another does not.
        ValueError: no trees; or a tree differs from the first in its paths, shapes, dtypes,
            devices, ties, ``requires_grad`` (stacking a frozen weight with a trainable one would
            make it trainable) or non-tensor values, or holds an uninitialized lazy parameter.
            The message names the first path where a tree differs from the first one.

    Example:
        >>> import torch, modstate as ms
        >>> trees = [{"w": torch.zeros(2), "b": torch.ones(())} for _ in range(3)]
        >>> {k: tuple(v.shape) for k, v in ms.stack(trees).items()}
        {'w': (3, 2), 'b': (3,)}
    """
    trees = list(trees)
    if not trees:
        raise ValueError("stack: no trees; give at least one")
    return _stack(trees, "tree", "stack")


def _stack(trees: list[Tree], noun: str, caller: str) -> Tree:
    flats = [flat_tree(tree, i, caller) for i, tree in enumerate(trees)]
    for i, flat in enumerate(flats):
        check_initialized(flat, i, noun, caller)
    first = flats[0]
    ties = tie_map(first)
    for i, flat in enumerate(flats[1:], 1):
        check_same_tree(first, ties, flat, i, noun, caller)
    out: dict[str, Any] = {}
    for path, leaf in first.items():
        tied_to = ties[path]
        if tied_to != path:
            out[path] = out[tied_to]
        elif isinstance(leaf, Tensor):
            with torch.no_grad():
                stacked = torch.stack([flat[path].detach() for flat in flats])
            out[path] = stacked.requires_grad_(leaf.requires_grad)
        else:
            out[path] = leaf
    return unflatten(out)


def unstack(tree: Tree) -> list[Tree]:
    """Split a stacked tree into its N members: ``unstack(stack(trees))`` gives equal trees back.

    Member ``i`` holds ``leaf[i]`` at every tensor leaf: views of the stacked tensors (gradients
    flow back to them; use ``ms.tree.clone`` for independent copies). Ties are kept; non-tensor
    leaves are shared by every member.

    Args:
        tree: a stacked tree (every tensor leaf has the same leading member dim).

    Returns:
        The N member trees, in order.

    Raises:
        TypeError: ``tree`` is not a dict.
        ValueError: a leaf is 0-dim, leaves disagree on the member count (the message names
            both paths), or the tree holds no tensor.

    Example:
        >>> import torch, modstate as ms
        >>> members = ms.unstack({"w": torch.arange(6.0).reshape(3, 2)})
        >>> [m["w"].tolist() for m in members]
        [[0.0, 1.0], [2.0, 3.0], [4.0, 5.0]]
    """
    flat = flat_tree(tree, None, "unstack")
    count = None
    first_path = ""
    for path, leaf in flat.items():
        if not isinstance(leaf, Tensor):
            continue
        if leaf.dim() == 0:
            raise ValueError(
                f"unstack: {path!r}: a 0-dim tensor, where a stacked tree's leaves have a "
                "leading member dim; unstack trees made by ms.stack"
            )
        if count is None:
            count, first_path = leaf.shape[0], path
        elif leaf.shape[0] != count:
            raise ValueError(
                f"unstack: {path!r}: {leaf.shape[0]} members along dim 0, {first_path!r} has "
                f"{count}; every leaf of a stacked tree needs the same leading member dim"
            )
    if count is None:
        raise ValueError(
            "unstack: the tree has no tensor leaves, so the number of members is unknown; "
            "give a stacked tree of tensors"
        )
    pieces: dict[int, tuple[Tensor, ...]] = {}
    for leaf in flat.values():
        if isinstance(leaf, Tensor) and id(leaf) not in pieces:
            pieces[id(leaf)] = leaf.unbind(0)
    return [
        unflatten({p: pieces[id(v)][i] if isinstance(v, Tensor) else v for p, v in flat.items()})
        for i in range(count)
    ]


def stack_modules(modules: Sequence[nn.Module], *, use_state_dict: bool = False) -> Tree:
    """``stack([extract(m) for m in modules])``, for models that are copies of one another.

    Args:
        modules: models of one architecture: every submodule of the same type and training
            mode, every tensor of the same path, shape, dtype and device (buffers included,
            non-persistent ones too).
        use_state_dict: stack ``extract(m, use_state_dict=True)`` (what ``state_dict`` shows)
            instead of the modules' own tensors.

    Returns:
        The stacked tree, shaped like ``ms.extract(modules[0])`` with a leading member dim.

    Raises:
        TypeError: an entry is not an ``nn.Module``, or a submodule's type differs.
        ValueError: no modules, or the models differ (see [`stack`][modstate.stack]); the
            message names the first path where one differs from the first model.

    Example:
        >>> import torch, modstate as ms
        >>> models = [torch.nn.Linear(3, 2) for _ in range(5)]
        >>> ms.stack_modules(models)["weight"].shape
        torch.Size([5, 2, 3])
    """
    modules = list(modules)
    if not modules:
        raise ValueError("stack_modules: no modules; give at least one")
    for i, module in enumerate(modules):
        check_module(module, i, "stack_modules")
    layout = module_layout(modules[0])
    for i, module in enumerate(modules[1:], 1):
        check_same_modules(layout, module_layout(module), i, "stack_modules")
    trees = [extract(m, use_state_dict=use_state_dict) for m in modules]
    return _stack(trees, "module", "stack_modules")


# -- checks, shared with Ensemble.from_factory, which stacks one member at a time ------------------


def check_module(module: Any, index: int, caller: str) -> None:
    if not isinstance(module, nn.Module):
        raise TypeError(
            f"{caller}: model {index} is a {type(module).__name__}; give torch.nn.Module objects"
        )


def flat_tree(tree: Any, index: int | None, caller: str) -> dict[str, Any]:
    if not isinstance(tree, dict):
        which = "the tree" if index is None else f"tree {index}"
        raise TypeError(f"{caller}: {which} is a {type(tree).__name__}; give a dict of tensors")
    return flatten(tree)


def tie_map(flat: dict[str, Any]) -> dict[str, str]:
    """Each path -> the first path holding the same tensor (itself when untied)."""
    first_path: dict[int, str] = {}
    return {
        path: first_path.setdefault(id(leaf), path) if isinstance(leaf, Tensor) else path
        for path, leaf in flat.items()
    }


def check_same_tree(
    first: dict[str, Any],
    first_ties: dict[str, str],
    other: dict[str, Any],
    index: int,
    noun: str,
    caller: str,
) -> None:
    """Refuse ``other`` (tree ``index``) unless it has ``first``'s paths, ties, and leaves of
    the same kind, shape, dtype, device and ``requires_grad`` (equal non-tensor values)."""
    same = f"stack {noun}s of one architecture"
    if list(first) != list(other):
        # The first differing path of the common prefix; a longer tree's extra is named below.
        for a, b in zip(first, other, strict=False):
            if a != b:
                raise ValueError(
                    f"{caller}: {b!r}: {noun} {index} has it where {noun} 0 has {a!r}; {same}"
                )
        longer, which = (first, 0) if len(first) > len(other) else (other, index)
        extra = list(longer)[min(len(first), len(other))]
        raise ValueError(f"{caller}: {extra!r}: only {noun} {which} has it; {same}")
    ties = tie_map(other)
    for path, leaf in first.items():
        if ties[path] != first_ties[path]:
            raise ValueError(
                f"{caller}: {path!r}: {noun} 0 holds the same tensor there as at "
                f"{first_ties[path]!r}, {noun} {index} holds it at {ties[path]!r}; tie the same "
                f"paths in every {noun}"
            )
        _check_leaf(path, leaf, other[path], index, noun, caller)


def _check_leaf(path: str, leaf: Any, other: Any, index: int, noun: str, caller: str) -> None:
    if isinstance(leaf, Tensor) != isinstance(other, Tensor):
        raise TypeError(
            f"{caller}: {path!r}: {noun} 0 holds a {type(leaf).__name__}, {noun} {index} a "
            f"{type(other).__name__}; stack {noun}s of one architecture"
        )
    if not isinstance(leaf, Tensor):
        if not _equal_values(leaf, other):
            raise ValueError(
                f"{caller}: {path!r}: the non-tensor value differs in {noun} {index}; give "
                f"every {noun} the same value"
            )
        return
    if other.requires_grad != leaf.requires_grad:
        raise ValueError(
            f"{caller}: {path!r}: requires_grad is {other.requires_grad} in {noun} {index}, "
            f"{leaf.requires_grad} in {noun} 0; freeze or unfreeze it in every {noun} first "
            "(stacking would make one flag hold for all)"
        )
    for what in ("shape", "dtype", "device"):
        mine, theirs = getattr(leaf, what), getattr(other, what)
        if mine != theirs:
            show = tuple if what == "shape" else str
            raise ValueError(
                f"{caller}: {path!r}: {what} {show(theirs)} in {noun} {index}, {show(mine)} in "
                f"{noun} 0; give every {noun} the same {what}"
            )


def check_initialized(flat: dict[str, Any], index: int, noun: str, caller: str) -> None:
    for path, leaf in flat.items():
        if isinstance(leaf, Tensor) and is_lazy(leaf):
            raise ValueError(
                f"{caller}: {path!r}: not initialized yet in {noun} {index} (a lazy module); "
                f"run each {noun} once on an example input, which gives it its shapes, then stack"
            )


def _equal_values(a: Any, b: Any) -> bool:
    try:
        return bool(a == b)
    except Exception:  # values without a usable ==, e.g. dicts of tensors
        return a is b


ModuleKind = tuple[type, str | None]
"""A submodule's class, and for a ``torch.fx.GraphModule`` the Python code it runs."""

ModuleLayout = list[tuple[str, ModuleKind, bool]]
"""Every submodule's path, kind and training flag, in module order."""


def module_layout(module: nn.Module) -> ModuleLayout:
    return [(path, _kind(m), m.training) for path, m in module.named_modules()]


def _kind(module: nn.Module) -> ModuleKind:
    # torch.nn.utils.parametrize gives every parametrized module a class of its own, made on the
    # fly from the original class: compare that one (the parametrizations are submodules).
    if parametrize.is_parametrized(module):
        return type(module).__bases__[0], None
    # torch.fx makes a new GraphModule class per instance and per copy: what makes two graph
    # modules the same computation is the code generated from their graphs.
    if isinstance(module, torch.fx.GraphModule):
        return torch.fx.GraphModule, module.code
    return type(module), None


def _class_names(kind: type, other: type) -> tuple[str, str]:
    if kind.__name__ != other.__name__:
        return kind.__name__, other.__name__
    return f"{kind.__module__}.{kind.__qualname__}", f"{other.__module__}.{other.__qualname__}"


def check_same_modules(first: ModuleLayout, other: ModuleLayout, index: int, caller: str) -> None:
    """Refuse model ``index`` unless its submodules have ``first``'s paths, types and modes."""
    same = "stack copies of one architecture"
    # The common prefix first, so that a differing submodule is named rather than the count;
    # a longer layout's extra submodule is named after the loop.
    for (path, kind, training), (other_path, other_kind, other_training) in zip(
        first, other, strict=False
    ):
        name = repr(path) if path else "the root"
        if path != other_path:
            raise ValueError(
                f"{caller}: {other_path!r}: module {index} has a submodule there where module 0 "
                f"has {path!r}; {same}"
            )
        if kind[0] is not other_kind[0]:
            mine, theirs = _class_names(kind[0], other_kind[0])
            raise TypeError(
                f"{caller}: {name}: module {index} is a {theirs} there, module 0 a {mine}; {same}"
            )
        if kind[1] != other_kind[1]:
            raise TypeError(
                f"{caller}: {name}: module {index} and module 0 are torch.fx GraphModules whose "
                "generated code differs (compare their .code): they compute different things; "
                f"{same}"
            )
        if training != other_training:
            raise ValueError(
                f"{caller}: {name}: module {index} is in "
                f"{'training' if other_training else 'eval'} mode there, module 0 in "
                f"{'training' if training else 'eval'} mode; call .train() or .eval() on every "
                "model first"
            )
    if len(first) != len(other):
        longer, which = (first, 0) if len(first) > len(other) else (other, index)
        path = longer[min(len(first), len(other))][0]
        raise ValueError(f"{caller}: {path!r}: only module {which} has a submodule there; {same}")
