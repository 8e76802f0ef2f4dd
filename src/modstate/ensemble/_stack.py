"""Stack N trees along a new leading dim (the ensemble dim), and take them apart again."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
from torch import Tensor, nn
from torch.nn.parameter import is_lazy
from torch.nn.utils import parametrize

from modstate._core.extract import extract
from modstate._core.flat import flatten, unflatten
from modstate._core.types import Tree


def stack(trees: Sequence[Tree]) -> Tree:
    """Stack N trees of the same structure into one tree whose leaves have a leading dim N.

    Stacked leaves are new leaf tensors (no autograd link to the inputs) with the members'
    ``requires_grad``; members that disagree on it at a path are refused (stacking a frozen weight
    with a trainable one would make it trainable), as are uninitialized lazy parameters. Ties are kept: where every tree holds one tensor at
    several paths, the stacked tree holds one stacked tensor at those paths. Non-tensor leaves
    (``_extra_state``) must be equal in every tree and are kept once. Errors name the first path
    where a tree differs from the first one.

    >>> import torch, modstate as ms
    >>> trees = [{"w": torch.zeros(2), "b": torch.ones(())} for _ in range(3)]
    >>> {k: tuple(v.shape) for k, v in ms.stack(trees).items()}
    {'w': (3, 2), 'b': (3,)}
    """
    trees = list(trees)
    if not trees:
        raise ValueError("stack needs at least one tree")
    return _stack(trees, "tree")


def _stack(trees: list[Tree], noun: str) -> Tree:
    flats = [_flat_tree(tree, i) for i, tree in enumerate(trees)]
    first = flats[0]
    ties = [_tie_map(flat) for flat in flats]
    for i, flat in enumerate(flats[1:], 1):
        _check_same_paths(first, flat, i, noun)
        for path in first:
            if ties[i][path] != ties[0][path]:
                raise ValueError(
                    f"{path!r}: {noun} 0 holds the same tensor there as at {ties[0][path]!r}, "
                    f"{noun} {i} holds it at {ties[i][path]!r}: they are tied differently"
                )
    for path, leaf in first.items():
        _check_stackable(path, leaf, [flat[path] for flat in flats], noun)

    out: dict[str, Any] = {}
    for path, leaf in first.items():
        tied_to = ties[0][path]
        if tied_to != path:
            out[path] = out[tied_to]
        elif isinstance(leaf, Tensor):
            members = [flat[path] for flat in flats]
            with torch.no_grad():
                stacked = torch.stack([m.detach() for m in members])
            out[path] = stacked.requires_grad_(leaf.requires_grad)
        else:
            out[path] = leaf
    return unflatten(out)


def unstack(tree: Tree) -> list[Tree]:
    """Split a stacked tree into its N members: ``unstack(stack(trees))`` gives equal trees back.

    Member ``i`` holds ``leaf[i]`` at every tensor leaf: views of the stacked tensors (gradients
    flow back to them; use ``ms.tree.clone`` for independent copies). Ties are kept; non-tensor
    leaves are shared by every member.

    >>> import torch, modstate as ms
    >>> members = ms.unstack({"w": torch.arange(6.0).reshape(3, 2)})
    >>> [m["w"].tolist() for m in members]
    [[0.0, 1.0], [2.0, 3.0], [4.0, 5.0]]
    """
    flat = _flat_tree(tree, None)
    count = None
    for path, leaf in flat.items():
        if not isinstance(leaf, Tensor):
            continue
        if leaf.dim() == 0:
            raise ValueError(
                f"{path!r} is a 0-dim tensor: a stacked tree's leaves have a leading dim"
            )
        if count is None:
            count, first_path = leaf.shape[0], path
        elif leaf.shape[0] != count:
            raise ValueError(
                f"{path!r} has {leaf.shape[0]} members along dim 0, {first_path!r} has {count}"
            )
    if count is None:
        raise ValueError("the tree has no tensor leaves: the number of members is unknown")
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

    The models must agree in every submodule's type and training mode, and in every tensor's
    path, shape, dtype and device (buffers included, non-persistent ones too); otherwise the error
    names the first path where one differs from the first model. ``use_state_dict=True`` stacks
    ``extract(m, use_state_dict=True)`` (what ``state_dict`` shows) instead.

    >>> import torch, modstate as ms
    >>> models = [torch.nn.Linear(3, 2) for _ in range(5)]
    >>> ms.stack_modules(models)["weight"].shape
    torch.Size([5, 2, 3])
    """
    modules = list(modules)
    if not modules:
        raise ValueError("stack_modules needs at least one module")
    for i, module in enumerate(modules):
        if not isinstance(module, nn.Module):
            raise TypeError(f"module {i} is a {type(module).__name__}, not a torch.nn.Module")
    layout = _module_layout(modules[0])
    for i, module in enumerate(modules[1:], 1):
        _check_same_modules(layout, _module_layout(module), i)
    return _stack([extract(m, use_state_dict=use_state_dict) for m in modules], "module")


# -- checks ----------------------------------------------------------------------------------------


def _flat_tree(tree: Any, index: int | None) -> dict[str, Any]:
    if not isinstance(tree, dict):
        which = "the tree" if index is None else f"tree {index}"
        raise TypeError(f"{which} is a {type(tree).__name__}, expected a dict of tensors")
    return flatten(tree)


def _tie_map(flat: dict[str, Any]) -> dict[str, str]:
    """Each path -> the first path holding the same tensor (itself when untied)."""
    first_path: dict[int, str] = {}
    return {
        path: first_path.setdefault(id(leaf), path) if isinstance(leaf, Tensor) else path
        for path, leaf in flat.items()
    }


def _check_same_paths(first: dict[str, Any], other: dict[str, Any], index: int, noun: str) -> None:
    if list(first) == list(other):
        return
    for a, b in zip(first, other):
        if a != b:
            raise ValueError(f"{noun} {index} has {b!r} where {noun} 0 has {a!r}")
    longer, which = (first, 0) if len(first) > len(other) else (other, index)
    extra = list(longer)[min(len(first), len(other))]
    raise ValueError(f"only {noun} {which} has {extra!r}")


def _check_stackable(path: str, leaf: Any, members: list[Any], noun: str) -> None:
    for i, member in enumerate(members):
        if isinstance(member, Tensor) and is_lazy(member):
            raise ValueError(
                f"{path!r} is not initialized yet in {noun} {i} (a lazy module): run each "
                f"{noun} once on an example input, which gives it its shapes, then stack"
            )
    for i, other in enumerate(members[1:], 1):
        if isinstance(leaf, Tensor) != isinstance(other, Tensor):
            raise TypeError(
                f"{path!r}: {noun} 0 holds a {type(leaf).__name__}, {noun} {i} a "
                f"{type(other).__name__}"
            )
        if not isinstance(leaf, Tensor):
            if not _equal_values(leaf, other):
                raise ValueError(f"{path!r}: the non-tensor value differs in {noun} {i}")
            continue
        if other.requires_grad != leaf.requires_grad:
            raise ValueError(
                f"{path!r}: requires_grad is {other.requires_grad} in {noun} {i}, "
                f"{leaf.requires_grad} in {noun} 0; freeze or unfreeze it in every {noun} first "
                "(stacking would make one flag hold for all)"
            )
        for what in ("shape", "dtype", "device"):
            mine, theirs = getattr(leaf, what), getattr(other, what)
            if mine != theirs:
                show = tuple if what == "shape" else str
                raise ValueError(
                    f"{path!r}: {what} {show(theirs)} in {noun} {i}, {show(mine)} in {noun} 0"
                )


def _equal_values(a: Any, b: Any) -> bool:
    try:
        return bool(a == b)
    except Exception:  # values without a usable ==, e.g. dicts of tensors
        return a is b


Kind = tuple[type, str | None]
"""A submodule's class, and for a ``torch.fx.GraphModule`` the Python code it runs."""


def _module_layout(module: nn.Module) -> list[tuple[str, Kind, bool]]:
    return [(path, _kind(m), m.training) for path, m in module.named_modules()]


def _kind(module: nn.Module) -> Kind:
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


def _check_same_modules(
    first: list[tuple[str, Kind, bool]], other: list[tuple[str, Kind, bool]], index: int
) -> None:
    for (path, kind, training), (other_path, other_kind, other_training) in zip(first, other):
        name = repr(path) if path else "the root"
        if path != other_path:
            raise ValueError(
                f"module {index} has a submodule at {other_path!r} where module 0 has {path!r}"
            )
        if kind[0] is not other_kind[0]:
            mine, theirs = _class_names(kind[0], other_kind[0])
            raise TypeError(f"{name}: module {index} is a {theirs} there, module 0 a {mine}")
        if kind[1] != other_kind[1]:
            raise TypeError(
                f"{name}: module {index} and module 0 are torch.fx GraphModules whose generated "
                "code differs (compare their .code): they compute different things"
            )
        if training != other_training:
            raise ValueError(
                f"{name}: module {index} is in {'training' if other_training else 'eval'} mode "
                f"there, module 0 in {'training' if training else 'eval'} mode"
            )
    if len(first) != len(other):
        longer, which = (first, 0) if len(first) > len(other) else (other, index)
        raise ValueError(
            f"only module {which} has a submodule at {longer[min(len(first), len(other))][0]!r}"
        )
