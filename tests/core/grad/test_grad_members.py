"""``torch.vmap(ms.grad(f))`` over stacked trees: every member's gradient from one plain backward,
equal to ``torch.vmap(torch.func.grad(f))``; shared leaves and outer differentiation keep
torch.func's route."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import modstate as ms

from together import run_together

MEMBERS = 4


def stacked_mlps(dtype=torch.float64):
    torch.manual_seed(0)
    models = [nn.Sequential(nn.Linear(3, 5), nn.Tanh(), nn.Linear(5, 2)) for _ in range(MEMBERS)]
    model = models[0].to(dtype)
    stacked = ms.stack([ms.extract(m.to(dtype), detach=True) for m in models])
    return model, stacked


def mse(model, x, y):
    def loss(params):
        return (ms.call(model, params, x) - y).square().mean()

    return loss


def assert_same(ours, theirs, exact=False):
    for path, want in ms.flatten(theirs).items():
        got = ms.flatten(ours)[path]
        if exact:
            assert torch.equal(got, want), path
        else:
            torch.testing.assert_close(got, want, rtol=1e-12, atol=1e-12, msg=path)


def test_every_member_gets_its_own_gradient_as_with_torch_func():
    model, stacked = stacked_mlps()
    x, y = torch.randn(6, 3, dtype=torch.float64), torch.randn(6, 2, dtype=torch.float64)
    loss = mse(model, x, y)
    ours = torch.vmap(ms.grad(loss))(stacked)
    theirs = torch.vmap(torch.func.grad(loss))(stacked)
    assert_same(ours, theirs)
    for m in range(MEMBERS):  # and each is the member's own gradient, computed alone
        alone = ms.grad(loss)(ms.unstack(stacked)[m])
        assert_same({k: v[m] for k, v in ms.flatten(ours).items()}, ms.flatten(alone))


def test_grad_and_value_argnums_and_aux_come_back_per_member():
    model, stacked = stacked_mlps()
    xs = torch.randn(MEMBERS, 6, 3, dtype=torch.float64)  # a batch per member, mapped too
    targets = torch.randn(MEMBERS, 6, 2, dtype=torch.float64)

    def loss(params, x, y):
        out = ms.call(model, params, x)
        return (out - y).square().mean(), {"first": out[0], "scale": y.abs().sum()}

    for transform in (ms.grad_and_value, torch.func.grad_and_value):
        run = torch.vmap(transform(loss, argnums=(0, 1), has_aux=True))
        (grads, grad_x), (value, aux) = run(stacked, xs, targets)
        if transform is ms.grad_and_value:
            ours = grads, grad_x, value, aux
        else:
            theirs = grads, grad_x, value, aux
    assert_same(ours[0], theirs[0])
    torch.testing.assert_close(ours[1], theirs[1], rtol=1e-12, atol=1e-12)
    assert ours[2].shape == (MEMBERS,)
    torch.testing.assert_close(ours[2], theirs[2], rtol=1e-12, atol=1e-12)
    assert_same(ours[3], theirs[3])
    assert not ours[2].requires_grad and not ours[3]["first"].requires_grad


def test_member_dim_other_than_the_first():
    model, stacked = stacked_mlps()
    moved = {k: {n: t.movedim(0, -1) for n, t in v.items()} for k, v in stacked.items()}
    x = torch.randn(6, 3, dtype=torch.float64)
    loss = mse(model, x, torch.zeros(6, 2, dtype=torch.float64))
    ours = torch.vmap(ms.grad(loss), in_dims=-1, out_dims=-1)(moved)
    theirs = torch.vmap(torch.func.grad(loss), in_dims=-1, out_dims=-1)(moved)
    assert_same(ours, theirs)


def test_a_tie_is_one_input_and_an_unused_leaf_gets_zeros():
    weights = torch.randn(MEMBERS, 3, dtype=torch.float64)
    unused = torch.randn(MEMBERS, 2, dtype=torch.float64)

    def loss(tree):
        return (tree["a"] * tree["b"]).sum()  # a and b are one tensor: d(w*w)/dw = 2w

    grads = torch.vmap(ms.grad(loss))({"a": weights, "b": weights, "c": unused})
    assert torch.equal(grads["a"], 2 * weights) and torch.equal(grads["b"], 2 * weights)
    assert torch.equal(grads["c"], torch.zeros_like(unused))


def test_shared_params_give_per_sample_gradients_by_torch_func():
    model, stacked = stacked_mlps()
    params = ms.unstack(stacked)[0]
    xs, ys = torch.randn(5, 1, 3, dtype=torch.float64), torch.randn(5, 1, 2, dtype=torch.float64)

    def loss(p, x, y):
        return (ms.call(model, p, x) - y).square().mean()

    ours = torch.vmap(ms.grad(loss), in_dims=(None, 0, 0))(params, xs, ys)
    theirs = torch.vmap(torch.func.grad(loss), in_dims=(None, 0, 0))(params, xs, ys)
    assert_same(ours, theirs, exact=True)  # the very same route: torch.func.grad
    assert ours["0"]["weight"].shape == (5, 5, 3)


def test_outer_autograd_flows_through_the_member_gradients():
    model, stacked = stacked_mlps()
    x = torch.randn(6, 3, dtype=torch.float64)
    loss = mse(model, x, torch.zeros(6, 2, dtype=torch.float64))
    meta = ms.tree.map(lambda t: t.clone().requires_grad_(), stacked)

    def second_order(transform):
        grads = torch.vmap(transform(loss))(meta)
        total = sum(g.square().sum() for g in ms.flatten(grads).values())
        return torch.autograd.grad(total, list(ms.flatten(meta).values()))

    for ours, theirs in zip(second_order(ms.grad), second_order(torch.func.grad), strict=True):
        torch.testing.assert_close(ours, theirs, rtol=1e-12, atol=1e-12)


def test_a_loss_that_is_not_a_scalar_per_member_is_refused_as_torch_func_refuses_it():
    _, stacked = stacked_mlps()
    with pytest.raises(RuntimeError, match="1 dims, not a scalar"):
        torch.vmap(ms.grad(lambda p: p["0"]["bias"] * 2))(stacked)
    with pytest.raises(RuntimeError, match="scalar"):
        torch.vmap(torch.func.grad(lambda p: p["0"]["bias"] * 2))(stacked)


def test_randomness_follows_the_vmap():
    torch.manual_seed(0)
    weights = torch.randn(MEMBERS, 8)

    def loss(w):
        return F.dropout(w, 0.5, training=True).sum()

    grads = torch.vmap(ms.grad(loss), randomness="different")(weights)
    assert set(grads.unique().tolist()) <= {0.0, 2.0}
    assert len({tuple(g.tolist()) for g in grads}) > 1  # members drew their own masks
    same = torch.vmap(ms.grad(loss), randomness="same")(weights)
    assert all(torch.equal(same[0], g) for g in same)
    with pytest.raises(RuntimeError, match="randomness"):
        torch.vmap(ms.grad(loss))(weights)


def test_threads_each_get_their_own_members_gradients():
    model, stacked = stacked_mlps(torch.float32)
    x = torch.randn(6, 3)
    inputs = [ms.tree.map(lambda t, k=k: t * (1 + k), stacked) for k in range(4)]
    loss = mse(model, x, torch.zeros(6, 2))
    run = torch.vmap(ms.grad(loss))
    expected = [run(tree) for tree in inputs]

    def work(i: int) -> int:
        wrong = 0
        for _ in range(100):
            got = run(inputs[i])
            wrong += any(
                not torch.equal(got_leaf, want)
                for got_leaf, want in zip(
                    ms.flatten(got).values(), ms.flatten(expected[i]).values(), strict=True
                )
            )
        return wrong

    assert run_together(work) == [0, 0, 0, 0]


@pytest.mark.slow
def test_under_torch_compile_it_is_torch_funcs_and_traces_whole():
    model, stacked = stacked_mlps(torch.float32)
    loss = mse(model, torch.randn(6, 3), torch.zeros(6, 2))

    def step(tree):
        return torch.vmap(ms.grad(loss))(tree)

    compiled = torch.compile(step, fullgraph=True)  # the member route is not traced
    got, want = ms.flatten(compiled(stacked)), ms.flatten(step(stacked))
    for path, value in want.items():
        torch.testing.assert_close(got[path], value, rtol=1e-5, atol=1e-6, msg=path)
