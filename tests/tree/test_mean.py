"""ms.tree.mean: model soups from a list of trees or a stacked tree; floating leaves averaged in
their own dtype (16-bit floats summed in float32), integer leaves kept where they agree."""

from __future__ import annotations

import pytest
import torch
from torch import nn

import modstate as ms


def bn_trees(n=3):
    trees = []
    for seed in range(n):
        torch.manual_seed(seed)
        trees.append(ms.extract(nn.Sequential(nn.Linear(3, 4), nn.BatchNorm1d(4)), detach=True))
    return trees


def test_a_list_of_trees_averages_each_floating_leaf_and_keeps_agreeing_integers():
    trees = bn_trees()
    soup = ms.tree.mean(trees)
    flat = [ms.flatten(t) for t in trees]
    assert list(ms.flatten(soup)) == list(flat[0])
    for path, leaf in ms.flatten(soup).items():
        if leaf.is_floating_point():
            expected = (flat[0][path] + flat[1][path] + flat[2][path]) / 3
            assert leaf.dtype == torch.float32 and torch.allclose(leaf, expected), path
    counter = soup["1"]["num_batches_tracked"]
    assert counter.dtype == torch.int64 and counter is not trees[0]["1"]["num_batches_tracked"]
    ms.load(nn.Sequential(nn.Linear(3, 4), nn.BatchNorm1d(4)), soup)  # the soup is a model


def test_a_stacked_tree_averages_along_its_member_dim_as_the_list_does():
    trees = bn_trees()
    from_list, from_stacked = ms.tree.mean(trees), ms.tree.mean(ms.stack(trees))
    for path, leaf in ms.flatten(from_list).items():
        got = ms.flatten(from_stacked)[path]
        assert got.shape == leaf.shape and got.dtype == leaf.dtype, path
        assert torch.allclose(got, leaf, rtol=1e-6, atol=1e-7), path


@pytest.mark.parametrize(("dtype", "big"), [(torch.float16, 2048.0), (torch.bfloat16, 256.0)])
def test_16_bit_leaves_are_summed_in_float32_and_keep_their_dtype(dtype, big):
    # Values where summing in the leaf's own dtype loses the small ones (big + 0.75 == big).
    values = [torch.full((4,), big), *[torch.full((4,), 0.75)] * 7]
    trees = [{"w": v.to(dtype)} for v in values]
    expected = (sum(v.to(dtype).float() for v in values) / len(values)).to(dtype)
    in_own_dtype = sum(v.to(dtype) for v in values) / len(values)
    assert not torch.equal(in_own_dtype, expected)  # so the test tells the two apart
    for got in (ms.tree.mean(trees)["w"], ms.tree.mean(ms.stack(trees))["w"]):
        assert got.dtype == dtype and torch.equal(got, expected)


def test_the_inputs_are_left_as_they_were():
    trees = bn_trees(2)
    before = [ms.tree.clone(t) for t in trees]
    ms.tree.mean(trees)
    ms.tree.mean(ms.stack(trees))
    for tree, kept in zip(trees, before, strict=True):
        for path, leaf in ms.flatten(tree).items():
            assert torch.equal(leaf, ms.flatten(kept)[path]), path


def differing_counters():
    trees = bn_trees()
    trees[2]["1"]["num_batches_tracked"] = torch.tensor(5)
    return trees


@pytest.mark.parametrize("stacked", [False, True], ids=["list", "stacked"])
def test_integer_leaves_that_differ_are_refused_naming_the_path_and_the_fix_works(stacked):
    trees = ms.stack(differing_counters()) if stacked else differing_counters()
    member = r"member 2 holds another value than member 0" if stacked else r"trees\[2\] holds"
    with pytest.raises(ValueError, match=rf"^tree\.mean: '1\.num_batches_tracked': {member}") as e:
        ms.tree.mean(trees)
    fix = str(e.value).split("others: ")[1]  # the code the message names, run as pasted
    statement, expression = fix.split("; ")
    namespace = {"ms": ms, "trees": trees}
    exec(f"{statement}\nresult = {expression}", namespace)
    soup = namespace["result"]
    assert int(soup["1"]["num_batches_tracked"]) == 0  # the first member's
    expected = ms.tree.mean(ms.tree.partition(trees, ms.tree.is_float)[0])
    assert torch.equal(soup["0"]["weight"], expected["0"]["weight"])


def test_trees_that_do_not_match_are_refused_naming_the_place():
    a, b = bn_trees(2)
    with pytest.raises(ValueError, match=r"^tree\.mean: '0\.bias': trees\[1\] holds shape \(5,\)"):
        ms.tree.mean([a, {**b, "0": {**b["0"], "bias": torch.zeros(5)}}])
    with pytest.raises(ValueError, match=r"^tree\.mean: '1': structure mismatch"):
        ms.tree.mean([a, {"0": b["0"]}])
    with pytest.raises(ValueError, match=r"^tree\.mean: an empty list of trees"):
        ms.tree.mean([])
    with pytest.raises(ValueError, match=r"^tree\.mean: 'n': a 0-dim leaf has no member dim"):
        ms.tree.mean({"n": torch.tensor(1.0)})
    with pytest.raises(TypeError, match=r"^tree\.mean: 'x':"):
        ms.tree.mean([{"x": "text"}])


def test_a_tie_stays_a_tie():
    shared = torch.ones(2)
    soup = ms.tree.mean([{"a": shared, "b": shared}, {"a": shared * 3, "b": shared * 3}])
    assert soup["a"] is soup["b"] and torch.equal(soup["a"], torch.full((2,), 2.0))
