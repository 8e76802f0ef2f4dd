"""tree.reshape, view, unbind and split against the per-leaf torch ops, on random pytrees
and module trees."""

from __future__ import annotations

import optree
import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st
from torch import nn

import modstate as ms
import modstate.tree

from random_trees import (
    BATCH,
    SETTINGS,
    assert_matches_reference,
    assert_same_tree,
    containers,
    per_leaf,
    trees,
)

NEW_SHAPES = [(12,), (-1,), (2, 6), (6, -1), (2, 3, 2), 12]


@SETTINGS
@given(trees(), st.sampled_from(NEW_SHAPES))
def test_reshape_is_per_leaf_reshape_of_the_batch_dims(tree, shape):
    new = (shape,) if isinstance(shape, int) else shape
    assert_matches_reference(
        lambda: ms.tree.reshape(tree, shape, batch_ndim=2),
        lambda: per_leaf(lambda x: x.reshape(*new, *x.shape[2:]), tree),
    )


@SETTINGS
@given(containers(), st.sampled_from([(3, 1), (-1,), (1, 3)]))
def test_reshape_batch_ndim_1(tree, shape):
    assert_matches_reference(
        lambda: ms.tree.reshape(tree, shape),
        lambda: per_leaf(lambda x: x.reshape(*shape, *x.shape[1:]), tree),
    )


@SETTINGS
@given(containers(), st.sampled_from(NEW_SHAPES))
def test_view_is_per_leaf_view_and_shares_storage(tree, shape):
    new = (shape,) if isinstance(shape, int) else shape
    out = ms.tree.view(tree, shape, batch_ndim=2)
    assert_same_tree(out, per_leaf(lambda x: x.view(*new, *x.shape[2:]), tree))
    for leaf, viewed in zip(optree.tree_leaves(tree), optree.tree_leaves(out), strict=True):
        assert viewed.untyped_storage().data_ptr() == leaf.untyped_storage().data_ptr()
        assert viewed.data_ptr() == leaf.data_ptr()


def test_view_refuses_a_leaf_that_cannot_be_viewed_and_names_it():
    tree = {"ok": torch.zeros(3, 4), "enc": {"w": torch.zeros(4, 3, 2).transpose(0, 1)}}
    with pytest.raises(RuntimeError, match=r"tree\.view: 'enc\.w':"):
        ms.tree.view(tree, 12, batch_ndim=2)
    assert ms.tree.reshape(tree, 12, batch_ndim=2)["enc"]["w"].shape == (12, 2)


def test_reshape_merging_batch_dims_is_a_view_where_possible_and_checks_the_size():
    tree = {"a": {"b": torch.randn(3, 4, 1)}, "c": torch.rand(3, 4, 5, 6)}
    out = ms.tree.reshape(tree, 12, batch_ndim=2)
    assert out["c"].shape == (12, 5, 6) and out["c"].data_ptr() == tree["c"].data_ptr()
    with pytest.raises(RuntimeError, match=r"'a\.b':"):
        ms.tree.reshape(tree, 10, batch_ndim=2)
    # a zero-size leaf follows torch.reshape, which accepts any batch of zero elements
    empty = ms.tree.reshape({"e": torch.zeros(3, 4, 0)}, 5, batch_ndim=2)
    assert empty["e"].shape == (5, 0)


def test_reshape_errors_name_the_leaf():
    with pytest.raises(ValueError, match=r"'x\.1':.*fewer than batch_ndim=2"):
        ms.tree.reshape({"x": [torch.zeros(3, 4), torch.zeros(12)]}, 12, batch_ndim=2)
    with pytest.raises(TypeError, match=r"'x\.n':.*tensor leaf, got int"):
        ms.tree.reshape({"x": {"w": torch.zeros(3), "n": 3}}, 3)
    with pytest.raises(ValueError, match="invalid shape"):
        ms.tree.reshape({"w": torch.zeros(3)}, (-1, -1))
    with pytest.raises(ValueError, match="batch_ndim"):
        ms.tree.reshape({"w": torch.zeros(3)}, 3, batch_ndim=-1)


@SETTINGS
@given(containers(), st.sampled_from([0, 1, -1]))
def test_unbind_is_a_list_of_trees_of_per_leaf_slices(tree, dim):
    # every leaf has the batch dims, so dims 0 and 1 agree; -1 needs equal trailing sizes
    def reference():
        sizes = {x.shape[dim] for x in optree.tree_leaves(tree)}
        if len(sizes) != 1:
            raise ValueError("sizes differ")
        (count,) = sizes
        return [per_leaf(lambda x, i=i: x.unbind(dim)[i], tree) for i in range(count)]

    if not optree.tree_leaves(tree):
        with pytest.raises(ValueError, match="no tensor leaf"):
            ms.tree.unbind(tree, dim)
        return
    assert_matches_reference(lambda: ms.tree.unbind(tree, dim), reference)


def test_unbind_size_mismatch_names_the_leaf():
    tree = {"a": torch.zeros(3, 2), "b": {"c": [torch.zeros(2, 2)]}}
    with pytest.raises(ValueError, match=r"'b\.c\.0':.*2 pieces.*first leaf gave 3"):
        ms.tree.unbind(tree)
    with pytest.raises(ValueError, match=r"'b\.c':.*2 pieces.*first leaf gave 3"):
        ms.tree.unbind({"a": torch.zeros(3, 2), "b": {"c": torch.zeros(2, 2)}})


@SETTINGS
@given(containers(), st.sampled_from([([1, 2], 0), (2, 1), ([2, 2], 1), (1, 0), ([3], 0)]))
def test_split_is_a_list_of_trees_of_per_leaf_chunks(tree, args):
    sections, dim = args

    def reference():
        count = len(sections) if isinstance(sections, list) else -(-BATCH[dim] // sections)
        return [per_leaf(lambda x, i=i: x.split(sections, dim)[i], tree) for i in range(count)]

    if isinstance(sections, int) and not optree.tree_leaves(tree):
        with pytest.raises(ValueError, match="no tensor leaf"):
            ms.tree.split(tree, sections, dim)
        return
    assert_matches_reference(lambda: ms.tree.split(tree, sections, dim), reference)


def test_split_errors_name_the_leaf():
    tree = {"a": torch.zeros(4, 2), "b": [torch.zeros(5, 2)]}
    with pytest.raises(ValueError, match=r"'b\.0':.*3 pieces.*first leaf gave 2"):
        ms.tree.split(tree, 2)
    with pytest.raises(RuntimeError, match=r"'b\.0':"):
        ms.tree.split(tree, [2, 2])
    with pytest.raises(TypeError, match="list of ints"):
        ms.tree.split(tree, "2")


def test_unbind_then_stack_round_trips_a_module_tree():
    members = [ms.extract(nn.Linear(3, 2), detach=True) for _ in range(3)]
    stacked = ms.tree.map(lambda *xs: torch.stack(xs), *members)
    for member, unbound in zip(members, ms.tree.unbind(stacked), strict=True):
        assert_same_tree(unbound, member)
