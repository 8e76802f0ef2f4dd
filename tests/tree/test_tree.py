"""modstate.tree: every op against the per-leaf torch op, on random pytrees and on module trees."""

from __future__ import annotations

import collections

import optree
import pytest
import torch
from hypothesis import given
from torch import nn

import modstate as ms
import modstate.tree

from random_trees import (
    SETTINGS,
    Point,
    assert_same_tree,
    containers,
    per_leaf,
    trees,
)

# ---------------------------------------------------------------------------------------------
# map


@SETTINGS
@given(trees())
def test_map_is_tree_map(tree):
    assert_same_tree(ms.tree.map(lambda x: x * 2, tree), per_leaf(lambda x: x * 2, tree))


@SETTINGS
@given(containers())
def test_map_over_several_trees(tree):
    other = per_leaf(lambda x: x.to(torch.float64) + 1, tree)
    expected = per_leaf(lambda a, b: a + b, tree, other)
    assert_same_tree(ms.tree.map(lambda a, b: a + b, tree, other), expected)


@SETTINGS
@given(trees())
def test_map_with_path_gives_dotted_paths(tree):
    out = ms.tree.map_with_path(lambda path, x: path, tree)
    paths, _, _ = optree.tree_flatten_with_path(tree, none_is_leaf=False)
    assert optree.tree_leaves(out, none_is_leaf=False) == [".".join(map(str, p)) for p in paths]


def test_map_with_path_on_a_module_tree():
    model = nn.Sequential(nn.Linear(2, 3), nn.ReLU(), nn.BatchNorm1d(3))
    paths = ms.flatten(ms.tree.map_with_path(lambda path, x: path, ms.extract(model)))
    assert list(paths.values()) == list(model.state_dict().keys())


def test_map_keeps_none_and_non_tensor_leaves_go_to_fn():
    tree = {"a": None, "b": [1, torch.ones(1)], "c": "text"}
    out = ms.tree.map(lambda x: ("seen", type(x).__name__), tree)
    assert out == {"a": None, "b": [("seen", "int"), ("seen", "Tensor")], "c": ("seen", "str")}


def test_map_keeps_node_types_and_order():
    tree = collections.OrderedDict(
        z=Point(torch.ones(1), [torch.zeros(1)]),
        a=collections.defaultdict(list, {"q": torch.ones(2), "b": (torch.ones(3),)}),
    )
    out = ms.tree.map(lambda x: x + 1, tree)
    assert type(out) is collections.OrderedDict and list(out) == ["z", "a"]
    assert type(out["z"]) is Point and torch.equal(out["z"].y[0], torch.ones(1))
    assert type(out["a"]) is collections.defaultdict and out["a"].default_factory is list
    assert list(out["a"]) == ["q", "b"]
    assert ms.tree.map_with_path(lambda p, x: p, tree)["z"].x == "z.x"


def test_map_error_from_fn_is_the_same_exception_with_the_path_as_a_note():
    class Boom(Exception):
        pass

    def fn(x):
        raise Boom("no")

    with pytest.raises(Boom) as info:
        ms.tree.map(fn, {"enc": {"layers": [torch.ones(1)]}})
    assert info.value.args == ("no",)  # fn's own exception, its message untouched
    assert info.value.__notes__ == [
        "raised by the function given to tree.map, at leaf 'enc.layers.0'"
    ]


def test_map_structure_mismatch_names_the_first_differing_path():
    tree = {"a": {"b": torch.ones(1), "c": torch.ones(1)}, "d": [torch.ones(1)]}
    with pytest.raises(ValueError, match=r"'a\.c'.*no key 'c'"):
        ms.tree.map(torch.add, tree, {"a": {"b": torch.ones(1), "x": torch.ones(1)}, "d": [1]})
    with pytest.raises(ValueError, match=r"'d':.*1 children.*2"):
        ms.tree.map(torch.add, tree, {"a": {"b": 1, "c": 1}, "d": [1, 2]})
    with pytest.raises(ValueError, match=r"'a\.b':.*tensor.*dict"):
        ms.tree.map(torch.add, tree, {"a": {"b": {}, "c": 1}, "d": [1]})


# ---------------------------------------------------------------------------------------------
# one op per leaf


@SETTINGS
@given(trees())
def test_zeros_like_clone_detach_to(tree):
    assert_same_tree(ms.tree.zeros_like(tree), per_leaf(torch.zeros_like, tree))
    cloned = ms.tree.clone(tree)
    assert_same_tree(cloned, tree)
    for leaf, copy in zip(optree.tree_leaves(tree), optree.tree_leaves(cloned), strict=True):
        assert copy.numel() == 0 or copy.data_ptr() != leaf.data_ptr()
    assert_same_tree(ms.tree.detach(tree), tree)
    assert_same_tree(ms.tree.to(tree, torch.float64), per_leaf(lambda x: x.to(torch.float64), tree))


def test_clone_detach_to_keep_non_tensor_leaves_and_zeros_like_refuses_them():
    extra = {"version": 3}
    tree = {"w": torch.ones(2, requires_grad=True), "_extra_state": ["text", 1]}
    for op in (ms.tree.clone, ms.tree.detach, lambda t: ms.tree.to(t, dtype=torch.float64)):
        out = op(tree)
        assert out["_extra_state"] == ["text", 1]
    assert ms.tree.detach(tree)["w"].requires_grad is False
    assert ms.tree.clone(tree)["w"].requires_grad is True
    assert ms.tree.to({"e": extra}, torch.float16)["e"]["version"] == 3
    with pytest.raises(TypeError, match=r"'_extra_state\.0':"):
        ms.tree.zeros_like(tree)


# ---------------------------------------------------------------------------------------------
# docs


@pytest.mark.parametrize("name", modstate.tree.__all__)
def test_every_public_function_has_a_docstring_with_an_example(name):
    doc = getattr(modstate.tree, name).__doc__
    assert doc and ">>>" in doc


# ---------------------------------------------------------------------------------------------
# dict flavours: a dict, an OrderedDict (state_dict()) and a defaultdict are one kind of node


def _module_state():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(3, 4), nn.BatchNorm1d(4))
    return model, {k: v.detach().clone() for k, v in model.state_dict().items()}


def test_a_plain_dict_and_a_state_dict_match_in_every_op_taking_two_trees():
    model, plain = _module_state()
    floats = {k: v for k, v in plain.items() if v.is_floating_point()}
    state = collections.OrderedDict(
        (k, v * 3) for k, v in model.state_dict().items() if k in floats
    )
    reversed_state = collections.OrderedDict(reversed(state.items()))
    for other in (state, reversed_state):
        mid = ms.tree.lerp(floats, other, 0.5)
        assert type(mid) is dict and list(mid) == list(floats)  # the first tree's flavour, order
        assert all(torch.allclose(mid[k], floats[k] * 2) for k in floats)
        assert all(torch.equal(ms.tree.add(floats, other)[k], floats[k] * 4) for k in floats)
        assert all(torch.allclose(ms.tree.sub(floats, other)[k], -2 * floats[k]) for k in floats)
        assert all(
            torch.allclose(ms.tree.mul(floats, other)[k], 3 * floats[k] ** 2) for k in floats
        )
        assert ms.tree.map(lambda a, b: a is not b, floats, other) == dict.fromkeys(floats, True)
    assert type(ms.tree.lerp(state, floats, 0.5)) is collections.OrderedDict


def test_nested_dict_flavours_match_and_combine_keeps_each_flavour():
    nested = {"enc": {"w": torch.ones(2)}, "head": {"b": torch.zeros(1)}}
    ordered = collections.OrderedDict(
        head=collections.defaultdict(list, b=torch.ones(1)),
        enc=collections.OrderedDict(w=torch.ones(2)),
    )
    assert torch.equal(ms.tree.add(nested, ordered)["head"]["b"], torch.ones(1))
    halves = ms.tree.partition(ordered, lambda leaf: leaf.numel() == 2)
    merged = ms.tree.combine(*halves)
    assert type(merged["head"]) is collections.defaultdict
    assert merged["head"].default_factory is list and merged["head"]["b"] is ordered["head"]["b"]
    assert ms.tree.combine(nested, ordered)["head"]["b"] is nested["head"]["b"]


def test_a_dict_flavour_mismatch_reads_as_dict_in_the_error():
    with pytest.raises(
        ValueError,
        match=r"tree\.add: 'a': structure mismatch: tree has a dict "
        r"node, other has a list node",
    ):
        ms.tree.add({"a": collections.OrderedDict(x=torch.ones(1))}, {"a": [torch.ones(1)]})


def test_a_flat_state_dict_against_a_nested_tree_names_the_fix_and_the_fix_works():
    model = nn.Sequential(nn.Linear(3, 4), nn.LayerNorm(4))
    ema = ms.tree.clone(ms.extract(model, detach=True))
    with pytest.raises(
        ValueError,
        match=r"tree\.lerp: '0': structure mismatch: end has no key '0'; end has flat "
        r"state_dict keys \('0\.weight'\): nest it first with ms\.unflatten\(end\)",
    ):
        ms.tree.lerp(ema, model.state_dict(), 0.5)
    ema = ms.tree.lerp(ema, ms.unflatten(model.state_dict()), 0.5)
    assert torch.equal(ema["1"]["weight"], model[1].weight.detach())


# ---------------------------------------------------------------------------------------------
# the error format: "tree.<function>: '<path>': <what>; <fix>"


def test_errors_follow_the_one_format():
    tree = {"enc": {"w": torch.zeros(3, 2).t()}}
    with pytest.raises(RuntimeError) as info:
        ms.tree.view(tree, 6, batch_ndim=2)
    assert str(info.value).startswith("tree.view: 'enc.w': view size is not compatible")
    with pytest.raises(TypeError) as info:
        ms.tree.lerp({"n": torch.tensor(1)}, {"n": torch.tensor(2)}, 0.5)
    assert str(info.value) == (
        "tree.lerp: 'n': a torch.int64 leaf, which lerp would make floating-point: integer "
        "leaves (BatchNorm's num_batches_tracked) are never floated; apply lerp to the "
        "floating-point leaves only and keep the others: floats, ints = "
        "ms.tree.partition(tree, ms.tree.is_float); ms.tree.combine(ms.tree.lerp(floats, "
        "ms.tree.partition(end, ms.tree.is_float)[0], weight), ints)"
    )
    # no single place: the path is left out
    with pytest.raises(ValueError, match=r"^tree\.reshape: invalid shape \(-1, -1\)$"):
        ms.tree.reshape(tree, (-1, -1))
    with pytest.raises(ValueError, match=r"^tree\.unbind: the tree has no tensor leaf"):
        ms.tree.unbind({"a": None})
    with pytest.raises(
        ValueError,
        match=r"^tree\.add: structure mismatch at the root: tree has "
        r"a dict node, other has a list node$",
    ):
        ms.tree.add({"a": torch.ones(1)}, [torch.ones(1)])
    with pytest.raises(TypeError, match=r"^tree\.select: patterns must be strings"):
        ms.tree.select(tree, 3)


# ---------------------------------------------------------------------------------------------
# complex leaves: floating-point and complex tensors follow one rule


def test_complex_leaves_are_float_and_trainable_as_split_counts_them():
    z = nn.Parameter(torch.randn(2, dtype=torch.cfloat))
    assert ms.tree.is_float(z) and ms.tree.is_trainable(z)
    assert ms.tree.is_float(z.detach()) and not ms.tree.is_trainable(z.detach())
    model = nn.Module()
    model.z = z
    model.register_buffer("count", torch.tensor(0))
    trained, carried = ms.split(model)
    kept, rest = ms.tree.partition(ms.extract(model), ms.tree.is_trainable)
    assert ms.flatten(trained).keys() == {k for k, v in ms.flatten(kept).items() if v is not None}
    assert ms.flatten(carried).keys() == {k for k, v in ms.flatten(rest).items() if v is not None}


def test_lerp_averages_complex_leaves_as_is_float_promises():
    a = {"z": torch.zeros(2, dtype=torch.cfloat)}
    b = {"z": torch.full((2,), 2 + 4j, dtype=torch.cfloat)}
    assert ms.tree.is_float(a["z"])
    assert torch.equal(ms.tree.lerp(a, b, 0.5)["z"], torch.full((2,), 1 + 2j))
