"""ms.tree.partition / combine / is_float / is_trainable, and float-only ops on integer leaves."""

import pytest
import torch
from torch import nn

import modstate as ms


def bn_tree():
    torch.manual_seed(0)
    return ms.extract(nn.Sequential(nn.Linear(3, 4), nn.BatchNorm1d(4)))


def test_partition_keeps_the_structure_with_none_holes():
    tree = bn_tree()
    floats, ints = ms.tree.partition(tree, ms.tree.is_float)
    assert ms.flatten(floats).keys() == ms.flatten(tree).keys() == ms.flatten(ints).keys()
    assert floats["1"]["num_batches_tracked"] is None
    assert ints["1"]["num_batches_tracked"] is tree["1"]["num_batches_tracked"]
    assert floats["0"]["weight"] is tree["0"]["weight"] and ints["0"]["weight"] is None


def test_combine_undoes_partition_with_the_same_objects():
    tree = bn_tree()
    trained, carried = ms.tree.partition(tree, ms.tree.is_trainable)
    combined = ms.tree.combine(trained, carried)
    assert list(ms.flatten(combined)) == list(ms.flatten(tree))
    assert all(
        a is b
        for a, b in zip(ms.flatten(combined).values(), ms.flatten(tree).values(), strict=True)
    )


def test_partition_works_on_lists_and_tuples():
    tree = {"a": [torch.ones(1), torch.tensor(1)], "b": (torch.zeros(1), None)}
    floats, rest = ms.tree.partition(tree, ms.tree.is_float)
    assert floats["a"][1] is None and rest["a"][0] is None
    assert type(floats["b"]) is tuple and floats["b"][1] is None and rest["b"] == (None, None)
    assert ms.tree.combine(floats, rest)["a"][1] is tree["a"][1]


def test_combine_merges_select_and_exclude():
    tree = bn_tree()
    head, rest = ms.tree.select(tree, "1.*"), ms.tree.exclude(tree, "1.*")
    combined = ms.tree.combine(rest, head)
    assert sorted(ms.flatten(combined)) == sorted(ms.flatten(tree))


def test_combine_refuses_a_leaf_against_a_subtree_naming_the_path():
    with pytest.raises(ValueError, match=r"tree\.combine: 'enc\.w':.*structure mismatch"):
        ms.tree.combine({"enc": {"w": torch.ones(1)}}, {"enc": {"w": {"x": torch.ones(1)}}})
    with pytest.raises(ValueError, match=r"'a':.*different lengths"):
        ms.tree.combine({"a": [torch.ones(1)]}, {"a": [None, None]})


def test_predicates():
    parameter = nn.Parameter(torch.zeros(2))
    assert ms.tree.is_trainable(parameter) and ms.tree.is_float(parameter)
    assert not ms.tree.is_trainable(parameter.detach())
    assert not ms.tree.is_float(torch.tensor(3)) and not ms.tree.is_float("text")
    assert not ms.tree.is_trainable(None)


def test_a_failing_predicate_names_the_path():
    def predicate(leaf):
        if leaf.dim() == 0:
            raise RuntimeError("scalar")
        return True

    with pytest.raises(RuntimeError, match="scalar") as info:
        ms.tree.partition(bn_tree(), predicate)
    assert "'1.num_batches_tracked'" in " ".join(info.value.__notes__)


def test_lerp_on_an_integer_leaf_names_the_path_and_the_fix_works():
    tree = ms.tree.detach(bn_tree())
    with pytest.raises(TypeError, match=r"tree\.lerp: '1\.num_batches_tracked':.*partition"):
        ms.tree.lerp(tree, tree, 0.1)
    # The fix the message names: average the floating-point half only.
    floats, _ = ms.tree.partition(tree, ms.tree.is_float)
    ema = ms.tree.lerp(floats, ms.tree.mul(floats, 2), 0.5)
    assert torch.equal(ema["0"]["weight"], tree["0"]["weight"] * 1.5)
    assert ema["1"]["num_batches_tracked"] is None


def test_add_with_a_fractional_alpha_on_an_integer_leaf_names_the_path_and_the_fix_works():
    tree = ms.tree.detach(bn_tree())
    with pytest.raises(RuntimeError, match=r"tree\.add: '1\.num_batches_tracked':.*partition"):
        ms.tree.add(tree, tree, alpha=-0.1)
    with pytest.raises(RuntimeError, match=r"tree\.sub: '1\.num_batches_tracked':"):
        ms.tree.sub(tree, tree, alpha=0.5)
    floats, _ = ms.tree.partition(tree, ms.tree.is_float)
    stepped = ms.tree.add(floats, floats, alpha=-0.1)
    assert torch.allclose(stepped["0"]["bias"], tree["0"]["bias"] * 0.9)
