"""stack / unstack trees, and stack_modules (``ensemble/_stack.py``)."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch import nn

import modstate as ms

from zoo import WithExtraState


def seeded(factory, n, seed=0):
    torch.manual_seed(seed)
    return [factory() for _ in range(n)]


def test_stacked_leaves_are_new_leaves_and_keep_requires_grad():
    models = seeded(lambda: nn.Sequential(nn.Linear(3, 4), nn.BatchNorm1d(4)), 3)
    for m in models:
        m[0].bias.requires_grad_(False)
    stacked = ms.stack_modules(models)
    weight = stacked["0"]["weight"]
    assert weight.shape == (3, 4, 3) and weight.is_leaf and weight.requires_grad
    assert not isinstance(weight, nn.Parameter)
    assert not stacked["0"]["bias"].requires_grad
    assert not stacked["1"]["running_mean"].requires_grad
    assert stacked["1"]["num_batches_tracked"].shape == (3,)
    for i, m in enumerate(models):
        assert torch.equal(weight[i], m[0].weight)
    weight.sum().backward()  # no graph back to the models
    assert models[0][0].weight.grad is None


def test_stack_keeps_ties_and_unstack_gives_the_trees_back():
    shared = [torch.randn(2, 3) for _ in range(4)]
    trees = [
        {"a": {"w": w}, "b": {"w": w, "b": torch.full((2,), float(i))}}
        for i, w in enumerate(shared)
    ]
    stacked = ms.stack(trees)
    assert stacked["a"]["w"] is stacked["b"]["w"]
    members = ms.unstack(stacked)
    assert len(members) == 4
    for tree, member in zip(trees, members, strict=True):
        assert member["a"]["w"] is member["b"]["w"]
        assert torch.equal(member["a"]["w"], tree["a"]["w"])
        assert torch.equal(member["b"]["b"], tree["b"]["b"])


@settings(max_examples=25, deadline=None)
@given(
    count=st.integers(1, 4),
    shapes=st.dictionaries(
        st.sampled_from(["w", "b", "layer.w", "layer.v", "deep.er.x"]),
        st.lists(st.integers(0, 3), max_size=3),
        min_size=1,
    ),
)
def test_unstack_inverts_stack(count, shapes):
    flats = [
        {path: torch.randn(tuple(shape)) for path, shape in shapes.items()} for _ in range(count)
    ]
    trees = [ms.unflatten(flat) for flat in flats]
    stacked = ms.stack(trees)
    assert all(leaf.shape[0] == count for leaf in ms.flatten(stacked).values())
    back = ms.unstack(stacked)
    assert [ms.flatten(t).keys() for t in back] == [f.keys() for f in flats]
    for flat, member in zip(flats, back, strict=True):
        for path, leaf in ms.flatten(member).items():
            assert torch.equal(leaf, flat[path])


@pytest.mark.parametrize(
    ("second", "message"),
    [
        (
            {"a": {"w": torch.zeros(2)}, "c": torch.zeros(1)},
            "stack: 'c': tree 1 has it where tree 0 has 'b'; ",
        ),
        (
            {"a": {"w": torch.zeros(3)}, "b": torch.zeros(1)},
            "stack: 'a.w': shape (3,) in tree 1, (2,) in tree 0; ",
        ),
        (
            {"a": {"w": torch.zeros(2, dtype=torch.float64)}, "b": torch.zeros(1)},
            "stack: 'a.w': dtype torch.float64",
        ),
        ({"a": {"w": torch.zeros(2)}}, "stack: 'b': only tree 0 has it; "),
    ],
)
def test_stack_names_the_first_path_that_differs(second, message):
    first = {"a": {"w": torch.zeros(2)}, "b": torch.zeros(1)}
    with pytest.raises((ValueError, TypeError)) as refused:
        ms.stack([first, second])
    assert str(refused.value).startswith(message)


def test_stack_refuses_trees_tied_differently():
    w = torch.zeros(2)
    with pytest.raises(
        ValueError, match="stack: 'b': tree 0 holds the same tensor there as at 'a'"
    ):
        ms.stack([{"a": w, "b": w}, {"a": torch.zeros(2), "b": torch.zeros(2)}])


def test_unstack_refuses_leaves_with_different_member_counts():
    with pytest.raises(ValueError, match="unstack: 'b': 2 members along dim 0, 'a' has 3"):
        ms.unstack({"a": torch.zeros(3, 1), "b": torch.zeros(2)})


def test_stack_and_unstack_refuse_what_is_not_a_tree():
    with pytest.raises(ValueError, match="stack: no trees"):
        ms.stack([])
    with pytest.raises(TypeError, match="stack: tree 1 is a list; give a dict"):
        ms.stack([{}, []])
    with pytest.raises(ValueError, match="unstack: the tree has no tensor leaves"):
        ms.unstack({"a": {}})


class Mismatch(nn.Module):
    def __init__(self, width=4, kind=nn.ReLU, dtype=torch.float32, extra=False):
        super().__init__()
        self.body = nn.Sequential(nn.Linear(3, width, dtype=dtype), kind())
        self.register_buffer("scale", torch.ones(1), persistent=False)
        if extra:
            self.register_buffer("extra", torch.zeros(1))


@pytest.mark.parametrize(
    ("other", "message"),
    [
        (lambda: Mismatch(kind=nn.Tanh), "'body.1': module 1 is a Tanh there, module 0 a ReLU"),
        (lambda: Mismatch(width=5), r"'body.0.weight': shape \(5, 3\) in module 1"),
        (lambda: Mismatch(dtype=torch.float64), "'body.0.weight': dtype torch.float64 in module 1"),
        (
            lambda: Mismatch(extra=True),
            "'extra': module 1 has it where module 0 has 'body.0.weight'",
        ),
        (lambda: Mismatch().train(False), "the root: module 1 is in eval mode there"),
        (lambda: nn.Linear(3, 4), "the root: module 1 is a Linear there, module 0 a Mismatch"),
    ],
)
def test_stack_modules_refuses_models_that_differ(other, message):
    with pytest.raises((ValueError, TypeError), match=f"stack_modules: {message}"):
        ms.stack_modules([Mismatch(), other()])
    with pytest.raises((ValueError, TypeError), match=f"stack_modules: {message}"):
        ms.Ensemble([Mismatch(), other()], route="batched")


def test_stack_modules_through_state_dict_keeps_equal_extra_state_once():
    models = [WithExtraState() for _ in range(2)]
    stacked = ms.flatten(ms.stack_modules(models, use_state_dict=True))
    assert stacked["_extra_state"] == {"calls": 0, "note": "opaque"}
    assert stacked["linear.weight"].shape == (2, 3, 3)
    assert "scratch" not in stacked  # non-persistent: state_dict does not show it
    models[1].calls = 5
    with pytest.raises(
        ValueError, match="'_extra_state': the non-tensor value differs in module 1"
    ):
        ms.stack_modules(models, use_state_dict=True)


def test_stack_modules_keeps_non_persistent_buffers():
    stacked = ms.stack_modules([Mismatch(), Mismatch()])
    assert stacked["scale"].shape == (2, 1)


def test_stack_modules_refuses_what_is_not_a_module():
    with pytest.raises(ValueError, match="stack_modules: no modules"):
        ms.stack_modules([])
    with pytest.raises(TypeError, match="stack_modules: model 1 is a dict; give torch.nn.Module"):
        ms.stack_modules([nn.Linear(2, 2), {}])
