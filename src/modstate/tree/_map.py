"""`map` and `map_with_path`: a user's function at every leaf of one tree or of several."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from modstate._core.trees.nodes import leaves_with_paths
from modstate._core.trees.ties import keeping_ties
from modstate.tree._errors import naming_paths
from modstate.tree._walk import APPLY, map_leaves, map_leaves_n


def map(fn: Callable[..., Any], tree: Any, *rest: Any) -> Any:
    """``fn(leaf, *matching_leaves)`` at every leaf; a new tree of the same structure.

    Every leaf goes to ``fn``, tensor or not; ``None`` is an empty subtree and stays ``None``. A
    tensor at several places (a tied weight) goes to ``fn`` once, at its first place, and the
    result stands at all of them.

    Args:
        fn: Called as ``fn(leaf, *matching_leaves)``, once per leaf of ``tree``.
        tree: Any pytree (nested ``dict``/``list``/``tuple``/namedtuple).
        *rest: Trees with exactly the structure of ``tree`` (dicts: same keys, any order; a
            ``dict`` matches an ``OrderedDict``), whose leaves at the same place go to ``fn``.

    Returns:
        A tree shaped like ``tree`` (same node types, same dict order) holding what ``fn``
        returned at each leaf.

    Raises:
        ValueError: ``rest`` holds a tree of another structure; the message names the first
            place where it differs.
        Exception: Whatever ``fn`` raises propagates as the same object, with the leaf's path
            added as a note.

    Example:
        >>> ms.tree.map(torch.square, {"a": torch.tensor([2.0])})
        {'a': tensor([4.])}
        >>> params = {"w": torch.ones(2)}
        >>> grads = {"w": torch.full((2,), 10.0)}
        >>> ms.tree.map(lambda p, g: p - 0.1 * g, params, grads)
        {'w': tensor([0., 0.])}
    """
    return _map_user_fn("map", fn, tree, rest)


def map_with_path(fn: Callable[..., Any], tree: Any, *rest: Any) -> Any:
    """``fn(path, leaf, *matching_leaves)`` at every leaf, ``path`` the dotted string of its keys.

    Paths read like ``state_dict`` keys: ``"encoder.layers.0.linear1.weight"`` (list indices and
    namedtuple field names appear as keys too; a root leaf has path ``""``). A tensor at several
    paths (a tied weight) goes to ``fn`` once, with its first path, and the result stands at all
    of them, as in [`map`][modstate.tree.map].

    Args:
        fn: Called as ``fn(path, leaf, *matching_leaves)``, once per leaf of ``tree``.
        tree: Any pytree.
        *rest: Trees with the structure of ``tree``, as in [`map`][modstate.tree.map].

    Returns:
        A tree shaped like ``tree`` holding what ``fn`` returned at each leaf.

    Raises:
        ValueError: ``rest`` holds a tree of another structure (the message names the place).
        Exception: Whatever ``fn`` raises, as the same object, with the leaf's path as a note.

    Example:
        >>> ms.tree.map_with_path(lambda path, x: path, {"0": {"weight": torch.ones(1)}})
        {'0': {'weight': '0.weight'}}
    """
    paths = iter([path for path, _ in leaves_with_paths(tree)])
    # with_path must see every place, to keep the paths in step; the tie is kept here instead,
    # keyed by the leaf, so that it is computed once, with its first path.
    tied = keeping_ties(lambda leaf, path, *others: fn(path, leaf, *others))

    def with_path(leaf: Any, *others: Any) -> Any:
        return tied(leaf, next(paths), *others)

    return _map_user_fn("map_with_path", with_path, tree, rest, ties=False)


def _map_user_fn(
    op: str, fn: Callable[..., Any], tree: Any, rest: tuple[Any, ...], *, ties: bool = True
) -> Any:
    """``fn`` at every leaf of ``tree`` and the matching leaves of ``rest``; errors name ``op``."""
    if rest:
        names = tuple(f"rest[{index}]" for index in range(len(rest)))
        return naming_paths(
            op, lambda: map_leaves_n(fn, tree, rest, APPLY, names, ties=ties), user_fn=True
        )
    return naming_paths(op, lambda: map_leaves(fn, tree, APPLY, ties=ties), user_fn=True)
