"""ms.grad / ms.grad_and_value: torch.func.grad's contract, computed with plain autograd outside
torch.func transforms and by torch.func inside them."""

from __future__ import annotations

from collections import OrderedDict

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import modstate as ms


def bn_model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(4, 8), nn.BatchNorm1d(8), nn.ReLU(), nn.Linear(8, 3)).train()


def loss_and_state(model, x, y):
    def loss(params, state):
        out, new_state = ms.apply(model, params, state, x)
        return F.cross_entropy(out, y), new_state

    return loss


def data():
    generator = torch.Generator().manual_seed(1)
    return torch.randn(16, 4, generator=generator), torch.randint(0, 3, (16,), generator=generator)


def test_gradients_and_statistics_equal_torch_func_on_a_batchnorm_model_in_train_mode():
    model = bn_model()
    params, state = ms.split(model, detach=True)
    loss = loss_and_state(model, *data())
    grads, new_state = ms.grad(loss, has_aux=True)(params, state)
    want_grads, want_state = torch.func.grad(loss, has_aux=True)(params, state)
    for path, want in ms.flatten(want_grads).items():
        torch.testing.assert_close(ms.flatten(grads)[path], want, rtol=1e-6, atol=1e-7)
    for path, want in ms.flatten(want_state).items():
        assert torch.equal(ms.flatten(new_state)[path], want), path
    assert int(new_state["1"]["num_batches_tracked"]) == 1
    assert int(state["1"]["num_batches_tracked"]) == 0  # inputs untouched


def test_outside_a_transform_fn_runs_under_plain_autograd():
    seen = []

    def loss(p):
        seen.append((torch._C._are_functorch_transforms_active(), p["w"].requires_grad))
        return (p["w"] ** 2).sum()

    w = torch.tensor([1.0, -2.0])
    grads = ms.grad(loss)({"w": w})
    assert seen == [(False, True)]
    assert torch.equal(grads["w"], torch.tensor([2.0, -4.0]))
    assert not w.requires_grad and not grads["w"].requires_grad


def test_return_order_argnums_and_has_aux_follow_torch_func():
    x, y = torch.tensor([1.0, 2.0]), torch.tensor([3.0])

    def f(a, b, scale=1.0):
        return scale * (a.sum() * b.sum()), {"a": a * 2}

    for argnums in (0, 1, -1, (0, 1), (1, 0)):
        ours = ms.grad_and_value(f, argnums=argnums, has_aux=True)(x, y, scale=2.0)
        theirs = torch.func.grad_and_value(f, argnums=argnums, has_aux=True)(x, y, scale=2.0)
        assert type(ours[0]) is type(theirs[0])
        for a, b in zip(
            torch.utils._pytree.tree_leaves(ours),
            torch.utils._pytree.tree_leaves(theirs),
            strict=True,
        ):
            assert torch.equal(a, b)
    grads, aux = ms.grad(f, argnums=(0, 1), has_aux=True)(x, y)
    assert isinstance(grads, tuple) and torch.equal(aux["a"], x * 2)
    grads, value = ms.grad_and_value(lambda a: (a**2).sum())(x)
    assert torch.equal(grads, 2 * x) and torch.equal(value, torch.tensor(5.0))


def test_pytrees_none_holes_unused_leaves_and_ties():
    w = torch.tensor([1.0, 2.0])
    tree = {"used": w, "unused": torch.ones(3), "hole": None, "list": [w * 0 + 3.0]}
    grads = ms.grad(lambda t: (t["used"] * t["list"][0]).sum())(tree)
    assert grads["hole"] is None  # None is an empty subtree, as everywhere in modstate
    assert torch.equal(grads["unused"], torch.zeros(3))  # torch.func.grad's zeros
    assert torch.equal(grads["used"], torch.full((2,), 3.0))
    assert torch.equal(grads["list"][0], w)
    # A tie (one tensor at two paths) is one input: its whole gradient stands at both paths.
    tied = {"a": w, "b": w}
    grads = ms.grad(lambda t: (t["a"] * 2).sum() + (t["b"] * 3).sum())(tied)
    assert grads["a"] is grads["b"] and torch.equal(grads["a"], torch.full((2,), 5.0))
    # A function that does not depend on its input at all has zero gradients.
    assert torch.equal(ms.grad(lambda t: torch.tensor(1.0))({"w": w})["w"], torch.zeros(2))


def test_one_gradient_function_over_trees_of_changing_structures():
    # a loop's structure is read by a plan made once; any other tree is still read for what it is
    def loss(tree):
        return sum((leaf * leaf).sum() for leaf in ms.flatten(tree).values() if leaf is not None)

    gradient = ms.grad(loss)
    a, b, c = torch.tensor([1.0, 2.0]), torch.tensor([3.0]), torch.tensor([5.0])
    trees = [
        {"x": {"a": a}, "b": b},
        {"x": {"a": a}, "b": b},  # the structure met before
        {"x": {"a": a, "c": c}, "b": b},  # a key more
        {"x": {"a": a}, "b": None},  # a hole where there was a leaf
        {"x": {"b": a}, "b": b},  # another key
        {"x": OrderedDict(a=a), "b": b},  # another kind of node
    ]
    for tree in trees:
        grads = gradient(tree)
        assert type(grads["x"]) is type(tree["x"])
        assert ms.flatten(grads).keys() == ms.flatten(tree).keys()
        for path, leaf in ms.flatten(tree).items():
            got = ms.flatten(grads)[path]
            assert got is None if leaf is None else torch.equal(got, 2 * leaf), path


def test_partition_halves_are_differentiated_with_the_hole_kept():
    model = bn_model()
    params, rest = ms.tree.partition(ms.extract(model), ms.tree.is_trainable)
    params, rest = ms.tree.detach(params), ms.tree.detach(rest)
    grads, rest = ms.grad(loss_and_state(model, *data()), has_aux=True)(params, rest)
    assert grads["1"]["num_batches_tracked"] is None
    assert int(rest["1"]["num_batches_tracked"]) == 1


def test_an_integer_leaf_is_refused_by_path_as_torch_func_refuses_it_and_the_fix_works():
    model = bn_model()
    tree = ms.extract(model, detach=True)
    loss = lambda t: ms.call(model, t, data()[0]).sum()  # noqa: E731
    with pytest.raises(RuntimeError, match="only Tensors of floating point dtype"):
        torch.func.grad(loss)(tree)
    with pytest.raises(
        RuntimeError, match=r"^grad: '1\.num_batches_tracked': a torch\.int64 leaf of argument 0"
    ) as error:
        ms.grad(loss)(tree)
    assert "params, state = ms.split(model, detach=True)" in str(error.value)
    # The fix, as worded: differentiate params, pass state as another argument to apply.
    params, state = ms.split(model, detach=True)
    grads, state = ms.grad(loss_and_state(model, *data()), has_aux=True)(params, state)
    assert set(ms.flatten(grads)) == set(ms.flatten(params))


def test_a_leaf_that_is_not_a_tensor_is_refused_by_path():
    with pytest.raises(ValueError, match=r"^grad: 'n': a int leaf of argument 0, not a tensor"):
        ms.grad(lambda t: t["w"].sum())({"w": torch.ones(2), "n": 3})
    # The fix the message names: None (an empty subtree), or another argument.
    assert ms.grad(lambda t: t["w"].sum())({"w": torch.ones(2), "n": None})["n"] is None
    assert torch.equal(ms.grad(lambda t, n: t["w"].sum() * n)({"w": torch.ones(2)}, 3)["w"],
                       torch.full((2,), 3.0))  # fmt: skip


@pytest.mark.parametrize("route", ["autograd", "torch.func"])
def test_bad_outputs_and_argnums_raise_as_torch_func_does(route):
    x = torch.ones(2)
    if route == "torch.func":
        x = x.requires_grad_()  # a leaf that requires grad takes torch.func's route
    cases = [
        (lambda a: a, {}, "scalar"),
        (lambda a: 1.0, {}, "Tensor"),
        (lambda a: (a.sum(),), {"has_aux": True}, "tuple"),
        (lambda a: a.sum(), {"argnums": 3}, "argnum"),
        (lambda a: a.sum(), {"argnums": (0, 0)}, "unique|repeats"),
        (lambda a: a.sum(), {"argnums": ()}, "empty|non-empty"),
        (lambda a: a.sum(), {"argnums": 1.0}, "int"),
    ]
    for fn, options, words in cases:
        with pytest.raises(RuntimeError, match=words):
            torch.func.grad(fn, **options)(x)
        with pytest.raises(RuntimeError, match=words):
            ms.grad(fn, **options)(x)


def test_under_vmap_it_is_torch_func_and_gives_per_member_gradients():
    members = torch.randn(3, 4, dtype=torch.float64)

    def loss(p):
        return (torch.sin(p["w"]) * p["w"]).sum()

    ours = torch.vmap(ms.grad(loss))({"w": members})
    theirs = torch.vmap(torch.func.grad(loss))({"w": members})
    assert torch.equal(ours["w"], theirs["w"])
    for m in range(3):
        assert torch.allclose(ours["w"][m], ms.grad(loss)({"w": members[m]})["w"])


def test_higher_order_and_outer_autograd_see_through_it():
    w = torch.tensor([0.5, -1.0], dtype=torch.float64)

    def loss(p):
        return (p["w"] ** 3).sum()

    # grad of grad: torch.func outside, ms.grad inside.
    second = torch.func.grad(lambda p: ms.grad(loss)(p)["w"].sum())({"w": w})
    assert torch.allclose(second["w"], 6 * w)
    # A leaf that requires grad (an outer loop, as in MAML): the result is differentiable.
    outer = w.clone().requires_grad_()
    inner = ms.grad(loss)({"w": outer})["w"]  # 3 w^2, a function of outer
    (meta,) = torch.autograd.grad(inner.sum(), outer)
    assert torch.allclose(meta, 6 * w)


def test_value_and_aux_come_back_detached_and_inputs_unchanged():
    w = torch.tensor([1.0, 2.0])
    _, (value, aux) = ms.grad_and_value(lambda t: ((t["w"] ** 2).sum(), t["w"] * 3),
                                            has_aux=True)({"w": w})  # fmt: skip
    assert not value.requires_grad and not aux.requires_grad
    assert torch.equal(aux, w * 3) and not w.requires_grad and w._version == 0


def test_a_training_loop_with_ms_grad_equals_backward_and_torch_optim():
    model = bn_model()
    reference = bn_model()
    x, y = data()
    params, state = ms.split(model, detach=True)
    opt = ms.optim.adam(lr=1e-2)
    opt_state = opt.init(params)
    torch_opt = torch.optim.Adam(reference.parameters(), lr=1e-2)
    step = ms.grad(loss_and_state(model, x, y), has_aux=True)
    for _ in range(5):
        grads, state = step(params, state)
        params, opt_state = opt.step(params, grads, opt_state, donate=True)
        torch_opt.zero_grad()
        F.cross_entropy(reference(x), y).backward()
        torch_opt.step()
    got = ms.flatten(ms.tree.combine(params, state))
    for path, want in ms.flatten(ms.extract(reference, detach=True)).items():
        assert torch.equal(got[path], want), path
