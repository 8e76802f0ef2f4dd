"""Differentiable optimizer steps: gradients through an unrolled loop with respect to the
hyperparameters (meta-learning), tensor hyperparameters, and one optimizer per ensemble member
under ``torch.vmap``."""

from __future__ import annotations

import copy

import optree
import pytest
import torch
from torch import nn

import modstate as ms
from modstate import optim

from sample_trees import grads_like, make_params

# -- differentiable steps (meta-learning) -------------------------------------------------------


TARGET = torch.tensor([1.0, -2.0, 0.5], dtype=torch.float64)
CURVATURE = torch.tensor([1.0, 3.0, 0.5], dtype=torch.float64)


def inner_loss(w):
    return (CURVATURE * (w - TARGET) ** 2).sum()


def unrolled(make_opt, hyper, steps: int = 4):
    """Validation loss after `steps` steps of `make_opt(hyper)` on the inner loss (MAML-style)."""
    opt = make_opt(hyper)
    params = {"w": torch.zeros(3, dtype=torch.float64, requires_grad=True)}
    state = opt.init(params)
    for _ in range(steps):
        (grad,) = torch.autograd.grad(inner_loss(params["w"]), params["w"], create_graph=True)
        params, state = opt.step(params, {"w": grad}, state)
    return ((params["w"] - TARGET - 0.1) ** 2).sum()


@pytest.mark.parametrize(
    "make_opt",
    [
        lambda lr: optim.sgd(lr=lr, momentum=0.5, nesterov=True),
        lambda lr: optim.sgd(lr=lr, momentum=0.5, dampening=0.2, weight_decay=0.1),
        lambda lr: optim.adam(lr=lr, amsgrad=True, weight_decay=0.1),
        lambda lr: optim.adamw(lr=lr, betas=(0.8, 0.9)),
    ],
    ids=["sgd-nesterov", "sgd-dampening", "adam", "adamw"],
)
def test_learning_rate_gets_a_gradient_through_an_unrolled_loop(make_opt):
    lr = torch.tensor(0.05, dtype=torch.float64, requires_grad=True)
    (meta_grad,) = torch.autograd.grad(unrolled(make_opt, lr), lr)
    assert meta_grad != 0
    assert torch.autograd.gradcheck(lambda lr: unrolled(make_opt, lr), (lr,))


def test_betas_get_a_gradient_too():
    beta1 = torch.tensor(0.8, dtype=torch.float64, requires_grad=True)
    assert torch.autograd.gradcheck(
        lambda b: unrolled(lambda b: optim.adam(lr=0.1, betas=(b, 0.95)), b), (beta1,)
    )


def test_meta_gradient_with_torch_func():
    def meta_loss(lr):
        opt = optim.sgd(lr=lr, momentum=0.9)
        params = {"w": torch.zeros(3, dtype=torch.float64)}
        state = opt.init(params)
        for _ in range(3):
            grads = torch.func.grad(lambda p: inner_loss(p["w"]))(params)
            params, state = opt.step(params, grads, state)
        return ((params["w"] - TARGET) ** 2).sum()

    lr = torch.tensor(0.05, dtype=torch.float64)
    leaf = lr.clone().requires_grad_()
    (expected,) = torch.autograd.grad(meta_loss(leaf), leaf)
    torch.testing.assert_close(torch.func.grad(meta_loss)(lr), expected)


def step_both(plain, tensors, steps: int = 5) -> tuple[tuple, tuple]:
    """``(params, state)`` after ``steps`` steps of each optimizer on the same gradients."""
    a, b = make_params(), make_params()
    sa, sb = plain.init(a), tensors.init(b)
    generator = torch.Generator().manual_seed(0)
    for _ in range(steps):
        grads = grads_like(a, generator)
        a, sa = plain.step(a, grads, sa)
        b, sb = tensors.step(b, grads, sb)
    return (a, sa), (b, sb)


def test_tensor_hyperparameters_give_the_numbers_of_plain_ones():
    plain = optim.adam(lr=0.05, betas=(0.9, 0.99), eps=1e-6, weight_decay=0.01)
    tensors = optim.adam(
        lr=torch.tensor(0.05),
        betas=(torch.tensor(0.9), torch.tensor(0.99)),
        eps=torch.tensor(1e-6),
        weight_decay=torch.tensor(0.01),
    )
    (a, _), (b, _) = step_both(plain, tensors)
    for x, y in zip(optree.tree_leaves(a), optree.tree_leaves(b), strict=True):
        torch.testing.assert_close(x, y, atol=1e-6, rtol=1e-5)


def test_tensor_sgd_hyperparameters_give_the_numbers_of_plain_ones():
    plain = optim.sgd(lr=0.05, momentum=0.9, dampening=0.2, weight_decay=0.01)
    tensors = optim.sgd(
        lr=torch.tensor(0.05),
        momentum=torch.tensor(0.9),
        dampening=torch.tensor(0.2),
        weight_decay=torch.tensor(0.01),
    )
    ours, theirs = step_both(plain, tensors)
    for x, y in zip(optree.tree_leaves(ours), optree.tree_leaves(theirs), strict=True):
        torch.testing.assert_close(x, y, atol=1e-6, rtol=1e-5)


def test_functional_training_loop_trains_like_torch_optim():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(3, 8), nn.Tanh(), nn.Linear(8, 1))
    reference = copy.deepcopy(model)
    x, y = torch.randn(16, 3), torch.randn(16, 1)

    def loss_fn(params):
        return ((ms.call(model, params, x) - y) ** 2).mean()

    params = ms.extract(model, detach=True)
    opt = optim.adamw(lr=0.01)
    state = opt.init(params)
    torch_opt = torch.optim.AdamW(reference.parameters(), lr=0.01)
    first = loss_fn(params)
    for _ in range(10):
        params, state = opt.step(params, torch.func.grad(loss_fn)(params), state)
        torch_opt.zero_grad()
        ((reference(x) - y) ** 2).mean().backward()
        torch_opt.step()
    assert loss_fn(params) < first
    for path, value in ms.flatten(params).items():
        torch.testing.assert_close(
            value, reference.get_parameter(path).detach(), atol=1e-5, rtol=1e-5
        )


# -- vmap: one optimizer per ensemble member ----------------------------------------------------


MEMBERS = 3


@pytest.mark.parametrize(
    "factory",
    [
        lambda lr: optim.sgd(lr=lr, momentum=0.9, dampening=0.1, weight_decay=0.01),
        lambda lr: optim.adam(lr=lr, amsgrad=True),
        lambda lr: optim.adamw(lr=lr, weight_decay=0.1, maximize=True),
    ],
    ids=["sgd", "adam", "adamw"],
)
def test_vmapped_steps_with_per_member_learning_rates_match_a_loop(factory):
    members = [make_params(seed) for seed in range(MEMBERS)]
    lrs = [0.1, 0.03, 0.01]
    generator = torch.Generator().manual_seed(0)
    grads = [[grads_like(members[0], generator) for _ in range(MEMBERS)] for _ in range(4)]

    stacked = optree.tree_map(lambda *xs: torch.stack(xs), *members)
    lr_tensor = torch.tensor(lrs)
    state = torch.vmap(lambda p: factory(0.1).init(p))(stacked)
    for step_grads in grads:
        stacked_grads = optree.tree_map(lambda *xs: torch.stack(xs), *step_grads)
        stacked, state = torch.vmap(lambda p, g, s, lr: factory(lr).step(p, g, s))(
            stacked, stacked_grads, state, lr_tensor
        )
    assert state["step"].tolist() == [4.0] * MEMBERS

    for i in range(MEMBERS):
        opt = factory(lrs[i])
        params, member_state = members[i], opt.init(members[i])
        for step_grads in grads:
            params, member_state = opt.step(params, step_grads[i], member_state)
        for a, b in zip(optree.tree_leaves(params), optree.tree_leaves(stacked), strict=True):
            torch.testing.assert_close(b[i], a, atol=1e-6, rtol=1e-5)


def test_init_and_all_steps_inside_one_vmap():
    members = optree.tree_map(lambda *xs: torch.stack(xs), *[make_params(s) for s in range(2)])
    grads = optree.tree_map(torch.ones_like, members)

    def train(params, grads, lr):
        opt = optim.adam(lr=lr)
        state = opt.init(params)
        for _ in range(3):
            params, state = opt.step(params, grads, state)
        return params

    out = torch.vmap(train)(members, grads, torch.tensor([0.1, 0.2]))
    # With a constant gradient every Adam step moves each entry by about lr.
    delta = members["head"]["weight"] - out["head"]["weight"]
    torch.testing.assert_close(delta[0], torch.full_like(delta[0], 0.3), atol=1e-4, rtol=0)
    torch.testing.assert_close(delta[1], torch.full_like(delta[1], 0.6), atol=1e-4, rtol=0)
