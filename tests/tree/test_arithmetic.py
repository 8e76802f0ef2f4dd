"""tree arithmetic (add, sub, mul, lerp, ...) against the per-leaf torch ops, on random
pytrees and module trees."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st
from torch import nn

import modstate as ms
import modstate.tree

from random_trees import (
    SETTINGS,
    assert_matches_reference,
    assert_same_tree,
    containers,
    per_leaf,
    snapshot,
    tensors,
)

OPERANDS = st.sampled_from([1, 2.5, True, -3, "tensor", "tree"])


def integers_kept(op, alpha=None):
    """The reference rule: torch's op, except that an integer or bool leaf the op would make
    floating-point (a float operand, or a fractional alpha) is a TypeError."""

    def reference(x, y):
        if not (x.is_floating_point() or x.is_complex()):
            result = torch.result_type(x, y)
            if isinstance(alpha, float) or result.is_floating_point or result.is_complex:
                raise TypeError("floated")
        return op(x, y) if alpha is None else op(x, y, alpha=alpha)

    return reference


def in_walk_order(fn, tree, *rest):
    """``per_leaf``, but calling ``fn`` in modstate's walk order (dicts in insertion order; optree
    sorts their keys), so that of two leaves that fail differently the reference fails first
    where modstate does."""

    def visit(node, *others):
        if isinstance(node, torch.Tensor):
            fn(node, *others)
        elif isinstance(node, dict):
            for key in node:
                visit(node[key], *(other[key] for other in others))
        elif isinstance(node, (list, tuple)):
            for i, child in enumerate(node):
                visit(child, *(other[i] for other in others))

    visit(tree, *rest)
    return per_leaf(fn, tree, *rest)


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

        def reference(torch_op=torch_op):
            op = integers_kept(torch_op, alpha)
            if kind == "tree":
                return in_walk_order(op, tree, other)
            return in_walk_order(lambda x: op(x, other), tree)

        assert_matches_reference(lambda ours=ours: ours(tree, other, alpha=alpha), reference)


@SETTINGS
@given(containers(), OPERANDS)
def test_mul_is_per_leaf(tree, kind):
    other = _operand(kind, tree)

    def reference():
        op = integers_kept(torch.mul)
        if kind == "tree":
            return in_walk_order(op, tree, other)
        return in_walk_order(lambda x: op(x, other), tree)

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
        ms.tree.sub(tree, 1)  # torch's own refusal (no bool subtraction)
    with pytest.raises(TypeError, match=r"tree\.mul: 'flags\.mask': a torch\.bool leaf, which"):
        ms.tree.mul(tree, 0.5)  # a mask is not silently floated either
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
