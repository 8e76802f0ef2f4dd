"""Random pytrees for the tree tests (hypothesis strategies), and how to compare an op with the
same torch op applied leaf by leaf."""

from __future__ import annotations

import collections

import optree
import torch
from hypothesis import settings
from hypothesis import strategies as st

BATCH = (3, 4)
DTYPES = [torch.float32, torch.float64, torch.float16, torch.int64, torch.int32, torch.bool]
Point = collections.namedtuple("Point", ["x", "y"])


@st.composite
def tensors(draw, batch=BATCH):
    rest = tuple(draw(st.lists(st.integers(1, 3), max_size=2)))
    dtype = draw(st.sampled_from(DTYPES))
    shape = (*batch, *rest)
    numel = 1
    for size in shape:
        numel *= size
    scale = draw(st.sampled_from([-1.5, 0.5, 3.0]))
    values = (torch.arange(numel, dtype=torch.float64) * scale - numel / 2).reshape(shape)
    return (values > 0) if dtype is torch.bool else values.to(dtype)


keys = st.text(alphabet="abcxyz_0123", min_size=1, max_size=3).filter(lambda k: "." not in k)


def trees(leaves=None):
    leaves = tensors() if leaves is None else leaves
    return st.recursive(
        leaves | st.none(),
        lambda kids: (
            st.dictionaries(keys, kids, max_size=3)
            | st.lists(kids, max_size=3)
            | st.lists(kids, max_size=3).map(tuple)
        ),
        max_leaves=8,
    )


def containers(leaves=None):
    """Trees whose root is a dict (the shape of trees from ``extract``), holding any pytree."""
    return st.dictionaries(keys, trees(leaves), min_size=1, max_size=3)


def per_leaf(fn, tree, *rest):
    """The reference: optree's own tree_map, None an empty subtree like in modstate."""
    return optree.tree_map(fn, tree, *rest, none_is_leaf=False)


def assert_same_tree(actual, expected, path="<root>"):
    """Same node types, same dict key order, and leaves equal in dtype, shape and values."""
    assert type(actual) is type(expected), f"{path}: {type(actual)} vs {type(expected)}"
    if isinstance(expected, torch.Tensor):
        assert actual.dtype == expected.dtype, path
        assert actual.shape == expected.shape, path
        assert torch.equal(actual, expected), path
    elif isinstance(expected, dict):
        assert list(actual) == list(expected), path
        for key in expected:
            assert_same_tree(actual[key], expected[key], f"{path}.{key}")
    elif isinstance(expected, (list, tuple)):
        assert len(actual) == len(expected), path
        for index, (a, e) in enumerate(zip(actual, expected, strict=True)):
            assert_same_tree(a, e, f"{path}.{index}")
    else:
        assert actual == expected, path


def outcome(fn):
    """``("ok", result)`` or ``("error", exception class)``: ops must fail where torch fails."""
    try:
        return "ok", fn()
    except (RuntimeError, TypeError, ValueError) as error:
        return "error", type(error)


def assert_matches_reference(ours, reference):
    got, expected = outcome(ours), outcome(reference)
    assert got[0] == expected[0], (got, expected)
    if got[0] == "ok":
        if isinstance(expected[1], list):
            assert len(got[1]) == len(expected[1])
            for a, e in zip(got[1], expected[1], strict=True):
                assert_same_tree(a, e)
        else:
            assert_same_tree(got[1], expected[1])
    else:
        assert got[1] is expected[1]


def snapshot(tree):
    return optree.tree_map(lambda x: x.clone(), tree, none_is_leaf=False)


SETTINGS = settings(max_examples=40, deadline=None)
