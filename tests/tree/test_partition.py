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


# Each call that would float BatchNorm's integer counter, with its arguments by the names the
# fix in the message uses, and what the call gives on one floating-point leaf.
FLOATING_CALLS = {
    "mul": (lambda tree, other: ms.tree.mul(tree, other), {"other": 0.5}, lambda w: w * 0.5),
    "mul-tensor": (
        lambda tree, other: ms.tree.mul(tree, other),
        {"other": torch.tensor(0.5)},
        lambda w: w * 0.5,
    ),
    "add-alpha": (
        lambda tree, other, alpha: ms.tree.add(tree, other, alpha=alpha),
        {"other": "tree", "alpha": -0.1},
        lambda w: w - 0.1 * w,
    ),
    "sub-alpha": (
        lambda tree, other, alpha: ms.tree.sub(tree, other, alpha=alpha),
        {"other": "tree", "alpha": 0.5},
        lambda w: w - 0.5 * w,
    ),
    "sub-float": (
        lambda tree, other: ms.tree.sub(tree, other),
        {"other": 0.25},
        lambda w: w - 0.25,
    ),
    "lerp": (
        lambda tree, end, weight: ms.tree.lerp(tree, end, weight),
        {"end": "tree", "weight": 0.1},
        lambda w: torch.lerp(w, w, 0.1),
    ),
}


@pytest.mark.parametrize("name", list(FLOATING_CALLS))
def test_an_op_that_would_float_an_integer_leaf_names_the_path_and_the_fix_works(name):
    call, arguments, on_a_float = FLOATING_CALLS[name]
    tree = ms.tree.detach(bn_tree())
    arguments = {k: tree if v == "tree" else v for k, v in arguments.items()}
    op = name.partition("-")[0]
    with pytest.raises(TypeError, match=rf"^tree\.{op}: '1\.num_batches_tracked': ") as error:
        call(tree, **arguments)
    assert "integer leaves (BatchNorm's num_batches_tracked) are never floated" in str(error.value)

    fix = str(error.value).split("keep the others: ")[1]  # the code the message names, as pasted
    namespace = {"ms": ms, "tree": tree, **arguments}
    statement, expression = fix.split("; ")  # "floats, ints = ...", "ms.tree.combine(...)"
    exec(f"{statement}\nresult = {expression}", namespace)
    result = namespace["result"]
    assert result["1"]["num_batches_tracked"] is tree["1"]["num_batches_tracked"]  # an int still
    assert torch.allclose(result["0"]["weight"], on_a_float(tree["0"]["weight"]))
    assert ms.flatten(result).keys() == ms.flatten(tree).keys()


def test_an_integer_factor_keeps_integer_leaves_integer():
    tree = ms.tree.detach(bn_tree())
    counted = ms.tree.add(tree, tree, alpha=2)  # 3 * every leaf
    assert counted["1"]["num_batches_tracked"].dtype == torch.int64
    doubled = ms.tree.mul(counted, 2)
    assert doubled["1"]["num_batches_tracked"].dtype == torch.int64
    assert torch.equal(doubled["0"]["weight"], tree["0"]["weight"] * 6)
    assert ms.tree.sub(tree, 1)["1"]["num_batches_tracked"].dtype == torch.int64
