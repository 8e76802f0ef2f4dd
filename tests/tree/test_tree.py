"""modstate.tree: every op against the per-leaf torch op, on random pytrees and on module trees."""

from __future__ import annotations

import collections
import re

import optree
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch import nn

import modstate as ms
import modstate.tree

BATCH = (3, 4)
DTYPES = [torch.float32, torch.float64, torch.float16, torch.int64, torch.int32, torch.bool]
Point = collections.namedtuple("Point", ["x", "y"])

# ---------------------------------------------------------------------------------------------
# random trees


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
# reshape, view, unbind, split

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


# ---------------------------------------------------------------------------------------------
# arithmetic

OPERANDS = st.sampled_from([1, 2.5, True, -3, "tensor", "tree"])


def _operand(kind, tree):
    if kind == "tensor":
        return torch.tensor([0.5], dtype=torch.float64)
    if kind == "tree":
        return per_leaf(lambda x: (x.to(torch.float32) * 0.25 - 1).to(x.dtype), tree)
    return kind


@SETTINGS
@given(containers(), OPERANDS, st.sampled_from([1, 2, 0.5]))
def test_add_and_sub_are_per_leaf_with_alpha(tree, kind, alpha):
    other = _operand(kind, tree)
    for ours, torch_op in ((ms.tree.add, torch.add), (ms.tree.sub, torch.sub)):

        def reference(op=torch_op):
            if kind == "tree":
                return per_leaf(lambda x, y: op(x, y, alpha=alpha), tree, other)
            return per_leaf(lambda x: op(x, other, alpha=alpha), tree)

        assert_matches_reference(lambda ours=ours: ours(tree, other, alpha=alpha), reference)


@SETTINGS
@given(containers(), OPERANDS)
def test_mul_is_per_leaf(tree, kind):
    other = _operand(kind, tree)

    def reference():
        if kind == "tree":
            return per_leaf(torch.mul, tree, other)
        return per_leaf(lambda x: torch.mul(x, other), tree)

    assert_matches_reference(lambda: ms.tree.mul(tree, other), reference)


@SETTINGS
@given(
    containers(tensors().map(lambda x: x.to(torch.float32))),
    st.sampled_from([0.25, "tensor", "tree"]),
)
def test_lerp_is_per_leaf(tree, weight_kind):
    end = per_leaf(lambda x: x + 10, tree)
    if weight_kind == "tree":
        weight = per_leaf(lambda x: torch.full_like(x, 0.75), tree)
    else:
        weight = torch.tensor(0.5) if weight_kind == "tensor" else weight_kind

    def reference():
        if weight_kind == "tree":
            return per_leaf(torch.lerp, tree, end, weight)
        return per_leaf(lambda x, e: torch.lerp(x, e, weight), tree, end)

    assert_matches_reference(lambda: ms.tree.lerp(tree, end, weight), reference)


def test_lerp_with_one_end_tensor_broadcasts():
    out = ms.tree.lerp({"a": torch.zeros(2, 3)}, torch.ones(3), 0.5)
    assert torch.equal(out["a"], torch.full((2, 3), 0.5))


def test_arithmetic_structure_mismatch_names_the_first_differing_path():
    tree = {"enc": {"w": torch.ones(2), "b": torch.ones(2)}, "head": torch.ones(2)}
    with pytest.raises(ValueError, match=r"tree\.add: 'enc\.b': structure mismatch"):
        ms.tree.add(tree, {"enc": {"w": torch.ones(2)}, "head": torch.ones(2)})
    with pytest.raises(ValueError, match=r"'head': structure mismatch"):
        ms.tree.mul(tree, {"enc": {"w": 1, "b": 1}, "head": {"x": 1}})
    with pytest.raises(ValueError, match=r"'enc\.extra': structure mismatch.*extra key"):
        ms.tree.sub(tree, {"enc": {"w": 1, "b": 1, "extra": 1}, "head": 1})
    with pytest.raises(ValueError, match=r"tree\.lerp: 'head': structure mismatch"):
        ms.tree.lerp(tree, {"enc": {"w": torch.ones(2), "b": torch.ones(2)}}, 0.5)


def test_arithmetic_errors_name_the_leaf_and_non_tensor_leaves_are_refused():
    tree = {"ok": torch.ones(2), "flags": {"mask": torch.ones(2, dtype=torch.bool)}}
    with pytest.raises(RuntimeError, match=r"tree\.sub: 'flags\.mask':"):
        ms.tree.sub(tree, 1)
    with pytest.raises(TypeError, match=r"'n':.*got int"):
        ms.tree.add({"w": torch.ones(1), "n": 3}, 1)


def test_add_keeps_the_autograd_graph_and_works_under_vmap_and_grad():
    w = torch.randn(3, 2, requires_grad=True)
    out = ms.tree.add({"layer": {"w": w}}, 1)
    out["layer"]["w"].sum().backward()
    assert torch.equal(w.grad, torch.ones(3, 2))

    def shifted_sum(x):
        return ms.tree.add({"x": x}, 2)["x"].sum()

    assert torch.equal(torch.vmap(shifted_sum)(torch.zeros(4, 3)), torch.full((4,), 6.0))
    assert torch.equal(torch.func.grad(shifted_sum)(torch.zeros(3)), torch.ones(3))


def test_ops_on_a_module_tree_of_parameters_keep_autograd():
    model = nn.Sequential(nn.Linear(3, 4), nn.LayerNorm(4))
    params = ms.extract(model)
    shifted = ms.tree.add(params, 1)  # per leaf: foreach_allowed refuses what autograd records
    scaled = ms.tree.mul(params, shifted)
    assert list(ms.flatten(scaled)) == list(model.state_dict())
    assert all(leaf.grad_fn is not None for leaf in ms.flatten(scaled).values())
    sum(leaf.sum() for leaf in ms.flatten(scaled).values()).backward()
    expected = 2 * model[0].weight.detach() + 1  # d/dw of w * (w + 1)
    assert torch.allclose(model[0].weight.grad, expected)


def test_arithmetic_does_not_mutate_its_inputs():
    tree = {"a": {"b": torch.ones(2)}, "c": [torch.zeros(1)]}
    before = snapshot(tree)
    ms.tree.add(tree, 1)
    ms.tree.add(tree, tree, alpha=2)
    ms.tree.mul(tree, 3)
    ms.tree.lerp(tree, tree, 0.5)
    assert_same_tree(tree, before)


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
# select / exclude


def _model_tree():
    model = nn.Transformer(
        d_model=8, nhead=2, num_encoder_layers=1, num_decoder_layers=1, dim_feedforward=8
    )
    return ms.extract(model, detach=True)


def test_select_star_crosses_dots_and_keeps_the_input_leaves():
    tree = _model_tree()
    encoder = ms.tree.select(tree, "encoder.*")
    assert list(encoder) == ["encoder"]
    assert (
        ms.flatten(encoder).keys()
        == {k: v for k, v in ms.flatten(tree).items() if k.startswith("encoder.")}.keys()
    )
    assert encoder["encoder"]["norm"]["weight"] is tree["encoder"]["norm"]["weight"]
    biases = ms.flatten(ms.tree.select(tree, "*.bias", "*bias_*"))
    assert biases and all(k.endswith("bias") or "bias_" in k for k in biases)


def test_select_a_subtree_by_its_own_path_and_exclude_is_the_complement():
    tree = _model_tree()
    assert (
        ms.flatten(ms.tree.select(tree, "decoder")).keys()
        == ms.flatten(ms.tree.select(tree, "decoder.*")).keys()
    )
    kept = ms.flatten(ms.tree.exclude(tree, "*.norm?.*", "decoder"))
    assert kept and not any(re.search(r"\.norm\d\.", k) or k.startswith("decoder") for k in kept)
    everything = set(ms.flatten(tree))
    chosen = set(ms.flatten(ms.tree.select(tree, "*weight")))
    assert set(ms.flatten(ms.tree.exclude(tree, "*weight"))) == everything - chosen


def test_select_pruning_on_lists_tuples_and_none():
    tree = {"a": [torch.ones(1), {"w": torch.ones(1)}], "b": (torch.ones(1),), "n": None, "e": {}}
    assert ms.tree.select(tree, "a.1.*") == {
        "a": [None, {"w": tree["a"][1]["w"]}],
        "n": None,
        "e": {},
    }
    out = ms.tree.exclude(tree, "a.0", "b.*")
    assert list(out) == ["a", "n", "e"] and out["a"][0] is None
    assert ms.tree.select(tree) == {"n": None, "e": {}}
    assert ms.tree.exclude(tree) == tree and ms.tree.exclude(tree) is not tree
    with pytest.raises(TypeError, match="strings"):
        ms.tree.select(tree, 1)


# ---------------------------------------------------------------------------------------------
# summary


def test_summary_lists_every_leaf_with_an_aligned_total():
    tree = {
        "0": {"weight": torch.zeros(256, 4), "bias": torch.zeros(256, dtype=torch.float64)},
        "extra": [None, "opaque"],
    }
    tree["tied"] = tree["0"]["weight"]
    report = ms.tree.summary(tree)
    assert [row.path for row in report.rows] == ["0.weight", "0.bias", "extra.1", "tied"]
    assert report.rows[0].shape == (256, 4) and report.rows[1].dtype == "float64"
    assert report.rows[2].nbytes is None and report.rows[2].dtype == "str"
    assert report.tensor_count == 2 and report.total_numel == 1280
    assert report.total_bytes == 256 * 4 * 4 + 256 * 8
    text = str(report)
    lines = text.splitlines()
    assert lines[0].split() == ["path", "shape", "dtype", "device", "size"]
    assert (
        "4 KiB" in text
        and "2 KiB" in text
        and lines[-1] == ("total: 2 tensors, 1,280 elements, 6 KiB")
    )
    columns = {line.index("(256") for line in lines if "(256" in line}
    assert len(columns) == 1  # shapes start in one column
    assert repr(report) == text
    html = report._repr_html_()
    assert html.startswith("<table>") and "0.weight" in html and "total: 2 tensors" in html


def test_summary_of_a_module_tree_follows_state_dict_order():
    model = nn.Sequential(nn.Linear(3, 4), nn.BatchNorm1d(4))
    report = ms.tree.summary(ms.extract(model))
    assert [row.path for row in report.rows] == list(model.state_dict())
    assert report.rows[-1].dtype == "int64"  # num_batches_tracked


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
        "tree.lerp: 'n': lerp needs floating-point or complex leaves, this one is torch.int64; "
        "keep integer leaves (BatchNorm's num_batches_tracked) out: "
        "floats, ints = ms.tree.partition(tree, ms.tree.is_float)"
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
