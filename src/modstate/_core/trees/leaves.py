"""Reading the trees a caller passes: one tree, or several that together give the module's paths;
and the one check of the leaves that are differentiated or stepped."""

from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import Any

from torch import Tensor

from modstate._core.errors import DuplicatePath, PathTypeError
from modstate._core.torch_facts import DIFFERENTIABLE_DTYPES
from modstate._core.trees.flat import is_subtree, non_string_key
from modstate._core.types import TreeArg

TWICE_IN_ONE_TREE = (
    "given twice in one tree, as a dotted key and nested",
    "a tree may mix state_dict-style dotted keys and nested dicts, but gives each path once",
)


def leaves_of(tree: TreeArg) -> Iterator[tuple[str, Any, Any, str]]:
    """``(path, leaf, node, key)`` for every leaf of a tree or of several trees, ``node[key]``
    being where the leaf sits; refuses anything else, and a path given twice.

    A key with dots is the path it spells (``{"0.weight": w}`` gives ``"0.weight"``, as
    ``state_dict()`` keys do), so one tree could give a path twice, as a dotted key and nested:
    that is an error naming the path, and so is a path given by two trees of a tuple.
    A None leaf is a hole: the path is not given by this tree (the halves that
    ``modstate.tree.partition`` makes hold None where a leaf went to the other half)."""
    components = tree if isinstance(tree, (tuple, list)) else (tree,)
    given_by: dict[str, int] = {}
    for index, component in enumerate(components):
        _check_is_tree(component)
        for item in _leaves_with_parents(component, ""):
            path = item[0]
            if path in given_by:
                if given_by[path] == index:
                    raise DuplicatePath(path, *TWICE_IN_ONE_TREE)
                raise DuplicatePath(path, "given by two of the trees", "give it in one of them")
            given_by[path] = index
            yield item


def _check_is_tree(tree: Any) -> None:
    if not isinstance(tree, Mapping):
        raise PathTypeError(
            "",
            f"expected a tree (a dict of tensors) or a tuple of trees, got {type(tree).__name__}",
        )


def _leaves_with_parents(
    tree: Mapping[str, Any], prefix: str
) -> Iterator[tuple[str, Any, Any, str]]:
    for key, value in tree.items():
        if not isinstance(key, str):
            raise non_string_key(key, prefix)
        if is_subtree(key, value):
            yield from _leaves_with_parents(value, f"{prefix}{key}.")
        elif value is not None:
            yield prefix + key, value, tree, key


def refuse_undifferentiable(
    leaves: Sequence[Any],
    path_of: Callable[[int], str],
    function: str,
    found: str,
    not_tensor: tuple[type[Exception], str],
    not_float: tuple[type[Exception], str],
) -> None:
    """Refuse a leaf that is not a floating-point or complex tensor, naming its path: the one
    check of the leaves that ``ms.grad`` differentiates and that an optimizer steps.

    ``path_of(i)`` is leaf ``i``'s dotted path (looked up only for an error); ``found`` says what
    the leaf is to the caller (``"leaf of argument 0"``). ``not_tensor`` and ``not_float`` are,
    per fault, the exception class the caller raises (each keeps the class its users catch:
    ``grad`` raises torch.func.grad's RuntimeError for an integer leaf, an optimizer TypeError)
    and the message's tail, which says why and what to do instead."""
    for index, leaf in enumerate(leaves):
        if type(leaf) is Tensor and leaf.dtype in DIFFERENTIABLE_DTYPES:
            continue  # the common case, decided without the slower checks below
        if not isinstance(leaf, Tensor):
            error, tail = not_tensor
            raise error(
                f"{function}: '{path_of(index)}': a {type(leaf).__name__} {found}, not a tensor"
                f"{tail}"
            )
        if not (leaf.is_floating_point() or leaf.is_complex()):
            error, tail = not_float
            raise error(f"{function}: '{path_of(index)}': a {leaf.dtype} {found}; {tail}")
