"""modstate.optim: pure optimizers on trees, and torch.optim state as a tree."""

from __future__ import annotations

import copy

import optree
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch import nn

import modstate as ms
from modstate import optim

STEPS = 20


def make_params(seed: int = 0, dtype: torch.dtype = torch.float32) -> dict:
    generator = torch.Generator().manual_seed(seed)
    return {
        "encoder": {
            "weight": torch.randn(4, 3, generator=generator).to(dtype),
            "bias": torch.randn(4, generator=generator).to(dtype),
        },
        "head": {"weight": torch.randn(2, 4, generator=generator).to(dtype)},
    }


def grads_like(params: dict, generator: torch.Generator) -> dict:
    return optree.tree_map(
        lambda leaf: torch.randn(leaf.shape, generator=generator).to(leaf.dtype), params
    )


def run_both(torch_factory, opt, *, steps: int = STEPS, dtype: torch.dtype = torch.float32):
    """Step `opt` and a torch.optim optimizer on the same gradients; return both final params."""
    params = make_params(dtype=dtype)
    leaves = optree.tree_leaves(params)
    torch_params = [leaf.clone().requires_grad_() for leaf in leaves]
    torch_opt = torch_factory(torch_params)
    state = opt.init(params)
    generator = torch.Generator().manual_seed(1)
    for _ in range(steps):
        grads = grads_like(params, generator)
        for param, grad in zip(torch_params, optree.tree_leaves(grads), strict=True):
            param.grad = grad.clone()
        torch_opt.step()
        params, state = opt.step(params, grads, state)
    return optree.tree_leaves(params), [p.detach() for p in torch_params], state


def assert_matches_torch(torch_factory, opt, **kwargs) -> None:
    ours, theirs, _ = run_both(torch_factory, opt, **kwargs)
    for a, b in zip(ours, theirs, strict=True):
        torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-5)


# -- same numbers as torch.optim ----------------------------------------------------------------


SGD_OPTIONS = [
    {},
    {"momentum": 0.9},
    {"momentum": 0.9, "dampening": 0.3},
    {"momentum": 0.8, "nesterov": True},
    {"weight_decay": 0.1},
    {"momentum": 0.9, "weight_decay": 0.05, "maximize": True},
    {"momentum": 0.5, "nesterov": True, "weight_decay": 0.1, "maximize": True},
]


@pytest.mark.parametrize("options", SGD_OPTIONS, ids=str)
def test_sgd_matches_torch(options):
    assert_matches_torch(
        lambda p: torch.optim.SGD(p, lr=0.05, **options), optim.sgd(lr=0.05, **options)
    )


ADAM_OPTIONS = [
    {},
    {"amsgrad": True},
    {"weight_decay": 0.1},
    {"maximize": True},
    {"betas": (0.5, 0.9), "eps": 1e-3},
    {"amsgrad": True, "weight_decay": 0.05, "maximize": True},
]


@pytest.mark.parametrize("options", ADAM_OPTIONS, ids=str)
def test_adam_matches_torch(options):
    assert_matches_torch(
        lambda p: torch.optim.Adam(p, lr=0.05, **options), optim.adam(lr=0.05, **options)
    )


@pytest.mark.parametrize("options", ADAM_OPTIONS, ids=str)
def test_adamw_matches_torch(options):
    assert_matches_torch(
        lambda p: torch.optim.AdamW(p, lr=0.05, **options), optim.adamw(lr=0.05, **options)
    )


def test_defaults_match_torch():
    assert_matches_torch(lambda p: torch.optim.Adam(p), optim.adam())
    assert_matches_torch(lambda p: torch.optim.AdamW(p), optim.adamw())


def test_float64_leaves_match_torch():
    assert_matches_torch(
        lambda p: torch.optim.Adam(p, lr=0.1, amsgrad=True),
        optim.adam(lr=0.1, amsgrad=True),
        dtype=torch.float64,
    )


def test_complex_leaves_match_torch():
    params = {
        "z": torch.randn(3, dtype=torch.complex64, generator=torch.Generator().manual_seed(0))
    }
    theirs = params["z"].clone().requires_grad_()
    torch_opt = torch.optim.Adam([theirs], lr=0.1)
    opt = optim.adam(lr=0.1)
    state = opt.init(params)
    for step in range(5):
        grad = torch.randn(3, dtype=torch.complex64, generator=torch.Generator().manual_seed(step))
        theirs.grad = grad.clone()
        torch_opt.step()
        params, state = opt.step(params, {"z": grad}, state)
    assert params["z"].dtype == torch.complex64
    torch.testing.assert_close(params["z"], theirs.detach(), atol=1e-5, rtol=1e-5)


@settings(max_examples=15, deadline=None)
@given(
    lr=st.floats(1e-3, 0.5),
    momentum=st.sampled_from([0.0, 0.5, 0.9]),
    dampening=st.sampled_from([0.0, 0.1]),
    nesterov=st.booleans(),
    weight_decay=st.sampled_from([0.0, 0.01, 0.2]),
    maximize=st.booleans(),
)
def test_sgd_matches_torch_for_any_hyperparameters(
    lr, momentum, dampening, nesterov, weight_decay, maximize
):
    nesterov = nesterov and momentum > 0 and dampening == 0
    options = dict(
        lr=lr,
        momentum=momentum,
        dampening=dampening,
        nesterov=nesterov,
        weight_decay=weight_decay,
        maximize=maximize,
    )
    assert_matches_torch(lambda p: torch.optim.SGD(p, **options), optim.sgd(**options), steps=8)


@settings(max_examples=15, deadline=None)
@given(
    lr=st.floats(1e-4, 0.2),
    beta1=st.floats(0.0, 0.95),
    beta2=st.floats(0.5, 0.9999),
    eps=st.sampled_from([1e-8, 1e-6, 1e-3]),
    weight_decay=st.sampled_from([0.0, 0.01, 0.2]),
    amsgrad=st.booleans(),
    maximize=st.booleans(),
    decoupled=st.booleans(),
)
def test_adam_matches_torch_for_any_hyperparameters(
    lr, beta1, beta2, eps, weight_decay, amsgrad, maximize, decoupled
):
    options = dict(
        lr=lr,
        betas=(beta1, beta2),
        eps=eps,
        weight_decay=weight_decay,
        amsgrad=amsgrad,
        maximize=maximize,
    )
    torch_class = torch.optim.AdamW if decoupled else torch.optim.Adam
    factory = optim.adamw if decoupled else optim.adam
    assert_matches_torch(lambda p: torch_class(p, **options), factory(**options), steps=8)


# -- the state ----------------------------------------------------------------------------------


def test_state_is_a_step_counter_and_one_tree_per_buffer():
    params = make_params()
    state = optim.adam(amsgrad=True).init(params)
    assert set(state) == {"step", "exp_avg", "exp_avg_sq", "max_exp_avg_sq"}
    assert state["step"].shape == () and state["step"].item() == 0
    assert ms.flatten(state["exp_avg"]).keys() == ms.flatten(params).keys()
    assert set(optim.sgd(lr=0.1).init(params)) == {"step"}
    assert set(optim.sgd(lr=0.1, momentum=0.9).init(params)) == {"step", "momentum_buffer"}

    _, _, state = run_both(lambda p: torch.optim.Adam(p), optim.adam(), steps=3)
    assert state["step"].item() == 3


# -- purity -------------------------------------------------------------------------------------


def snapshot(*trees):
    leaves = [leaf for tree in trees for leaf in optree.tree_leaves(tree)]
    return leaves, [leaf.clone() for leaf in leaves], [leaf._version for leaf in leaves]


def assert_untouched(snap) -> None:
    leaves, copies, versions = snap
    for leaf, copied, version in zip(leaves, copies, versions, strict=True):
        assert torch.equal(leaf, copied)
        assert leaf._version == version


OPTIMIZERS = [
    optim.sgd(lr=0.1),
    optim.sgd(lr=0.1, momentum=0.9, dampening=0.1, weight_decay=0.1, maximize=True),
    optim.sgd(lr=0.1, momentum=0.9, nesterov=True),
    optim.adam(lr=0.1, weight_decay=0.1, maximize=True, amsgrad=True),
    optim.adamw(lr=0.1),
    optim.adamw(lr=torch.tensor(0.1), betas=(torch.tensor(0.8), 0.99)),
]


@pytest.mark.parametrize("opt", OPTIMIZERS, ids=repr)
@pytest.mark.parametrize("recording", [False, True], ids=["foreach", "per-leaf"])
def test_step_mutates_no_input(opt, recording):
    params = make_params()
    if recording:  # autograd records the step: the per-leaf path
        params = optree.tree_map(lambda leaf: leaf.requires_grad_(), params)
    state = opt.init(params)
    generator = torch.Generator().manual_seed(0)
    params, state = opt.step(params, grads_like(params, generator), state)
    grads = grads_like(params, generator)
    snap = snapshot(params, grads, state)
    new_params, _ = opt.step(params, grads, state)
    assert_untouched(snap)
    inputs = {id(leaf) for leaf in snap[0]}
    assert optree.tree_structure(new_params) == optree.tree_structure(params)
    assert not any(id(leaf) in inputs for leaf in optree.tree_leaves(new_params))


def test_foreach_and_per_leaf_paths_agree():
    for opt in OPTIMIZERS:
        params = make_params()
        recorded = optree.tree_map(lambda leaf: leaf.clone().requires_grad_(), params)
        state = recorded_state = opt.init(params)
        generator = torch.Generator().manual_seed(0)
        for _ in range(5):
            grads = grads_like(params, generator)
            params, state = opt.step(params, grads, state)
            recorded, recorded_state = opt.step(recorded, grads, recorded_state)
        assert recorded["head"]["weight"].grad_fn is not None
        for a, b in zip(
            optree.tree_leaves((params, state)),
            optree.tree_leaves((recorded, recorded_state)),
            strict=True,
        ):
            assert torch.equal(a, b.detach())  # on CPU the _foreach_ kernels loop the same ops


def test_none_gradient_leaves_a_leaf_and_its_state_alone():
    params = make_params()
    opt = optim.adam(lr=0.1)
    state = opt.init(params)
    generator = torch.Generator().manual_seed(0)
    for _ in range(3):
        grads = grads_like(params, generator)
        grads["encoder"]["bias"] = None
        new_params, new_state = opt.step(params, grads, state)
        assert new_params["encoder"]["bias"] is params["encoder"]["bias"]
        assert new_state["exp_avg"]["encoder"]["bias"] is state["exp_avg"]["encoder"]["bias"]
        assert not torch.equal(new_params["head"]["weight"], params["head"]["weight"])
        params, state = new_params, new_state

    no_grads = optree.tree_map(lambda _: None, params)
    new_params, new_state = opt.step(params, no_grads, state)
    assert all(
        a is b
        for a, b in zip(optree.tree_leaves(new_params), optree.tree_leaves(params), strict=True)
    )
    assert new_state["step"].item() == 4


def test_frozen_leaves_match_torch_skipping_them():
    params = make_params()
    leaves, _ = optree.tree_flatten(params)
    torch_params = [leaf.clone().requires_grad_() for leaf in leaves]
    torch_opt = torch.optim.SGD(torch_params, lr=0.1, momentum=0.9)
    opt = optim.sgd(lr=0.1, momentum=0.9)
    state = opt.init(params)
    generator = torch.Generator().manual_seed(0)
    for _ in range(5):
        grads = grads_like(params, generator)
        grads["encoder"]["bias"] = None  # sorted leaf order: encoder.bias is leaf 0
        for i, (param, grad) in enumerate(
            zip(torch_params, optree.tree_leaves(grads, none_is_leaf=True), strict=True)
        ):
            param.grad = None if i == 0 else grad.clone()
        torch_opt.step()
        params, state = opt.step(params, grads, state)
    for a, b in zip(optree.tree_leaves(params), torch_params, strict=True):
        torch.testing.assert_close(a, b.detach())


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


def test_tensor_hyperparameters_give_the_numbers_of_plain_ones():
    plain = optim.adam(lr=0.05, betas=(0.9, 0.99), eps=1e-6, weight_decay=0.01)
    tensors = optim.adam(
        lr=torch.tensor(0.05),
        betas=(torch.tensor(0.9), torch.tensor(0.99)),
        eps=torch.tensor(1e-6),
        weight_decay=torch.tensor(0.01),
    )
    a, b = make_params(), make_params()
    sa, sb = plain.init(a), tensors.init(b)
    generator = torch.Generator().manual_seed(0)
    for _ in range(5):
        grads = grads_like(a, generator)
        a, sa = plain.step(a, grads, sa)
        b, sb = tensors.step(b, grads, sb)
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
    a, b = make_params(), make_params()
    sa, sb = plain.init(a), tensors.init(b)
    generator = torch.Generator().manual_seed(0)
    for _ in range(5):
        grads = grads_like(a, generator)
        a, sa = plain.step(a, grads, sa)
        b, sb = tensors.step(b, grads, sb)
    for x, y in zip(optree.tree_leaves((a, sa)), optree.tree_leaves((b, sb)), strict=True):
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


# -- refused calls -------------------------------------------------------------------------------


def test_bad_hyperparameters_are_refused():
    with pytest.raises(ValueError, match=r"^sgd: 'lr': invalid value -1\.0 .*; pass a lr >= 0"):
        optim.sgd(lr=-1.0)
    with pytest.raises(ValueError, match="Nesterov"):
        optim.sgd(lr=0.1, nesterov=True)
    with pytest.raises(ValueError, match="beta2"):
        optim.adam(betas=(0.9, 1.0))
    with pytest.raises(ValueError, match="0-dim"):
        optim.adam(lr=torch.tensor([0.1, 0.2]))
    with pytest.raises(TypeError, match="eps"):
        optim.adam(eps="small")


def test_trees_that_do_not_fit_name_the_path():
    opt = optim.adam()
    params = make_params()
    state = opt.init(params)
    grads = optree.tree_map(torch.ones_like, params)

    missing = copy.copy(grads)
    missing["encoder"] = {"weight": grads["encoder"]["weight"]}
    with pytest.raises(ValueError, match=r"^adam\.step: 'encoder\.bias': a path of params"):
        opt.step(params, missing, state)

    wrong_shape = {**grads, "head": {"weight": torch.ones(4, 2)}}
    with pytest.raises(ValueError, match=r"^adam\.step: 'head\.weight': grads has shape \(4, 2\)"):
        opt.step(params, wrong_shape, state)

    with pytest.raises(ValueError, match=r"^adam\.step: 'state': .* keeps"):
        opt.step(params, grads, optim.sgd(lr=0.1).init(params))

    with pytest.raises(TypeError, match=r"^adam\.init: 'head\.weight': a str leaf, not a tensor"):
        opt.init({"head": {"weight": "w"}})
    # The fix the message names: None is an empty subtree.
    assert opt.init({"head": {"weight": None}})["exp_avg"] == {"head": {"weight": None}}


# -- torch.optim state as a tree ----------------------------------------------------------------


def make_model(seed: int = 0) -> nn.Module:
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(3, 4), nn.Tanh(), nn.Linear(4, 4), nn.Linear(4, 2))


def backward(model: nn.Module, seed: int) -> None:
    generator = torch.Generator().manual_seed(seed)
    x = torch.randn(5, 3, generator=generator)
    model.zero_grad()
    model(x).pow(2).sum().backward()


def grouped_optimizer(kind: str, model: nn.Module) -> torch.optim.Optimizer:
    groups = [
        {"params": [model[0].weight, model[0].bias, model[3].weight]},
        {"params": [model[2].weight, model[2].bias, model[3].bias], "lr": 0.01},
    ]
    if kind == "sgd":
        return torch.optim.SGD(groups, lr=0.1, momentum=0.9, nesterov=True)
    if kind == "adam":
        return torch.optim.Adam(groups, lr=0.05, amsgrad=True)
    return torch.optim.AdamW(groups, lr=0.05, weight_decay=0.1)


def test_optimizer_state_is_keyed_by_parameter_path():
    model = make_model()
    opt = grouped_optimizer("adam", model)
    backward(model, 0)
    opt.step()
    tree = optim.optimizer_state(opt, model)
    flat = ms.flatten(tree["state"])
    assert flat["2.weight.exp_avg"] is opt.state[model[2].weight]["exp_avg"]
    assert set(flat) == {
        f"{path}.{key}"
        for path in ("0.weight", "0.bias", "2.weight", "2.bias", "3.weight", "3.bias")
        for key in ("step", "exp_avg", "exp_avg_sq", "max_exp_avg_sq")
    }
    assert tree["param_groups"][0]["params"] == ["0.weight", "0.bias", "3.weight"]
    assert tree["param_groups"][1]["params"] == ["2.weight", "2.bias", "3.bias"]
    assert tree["param_groups"][1]["lr"] == 0.01
    assert tree["param_groups"][0]["amsgrad"] is True
    assert {p for g in tree["param_groups"] for p in g["params"]} == set(
        ms.flatten(ms.extract(model))
    )


def test_frozen_and_tied_parameters():
    model = nn.Sequential(nn.Linear(3, 4), nn.Linear(4, 4), nn.Linear(4, 4), nn.Linear(4, 2))
    model[0].requires_grad_(False)
    model[2].weight = model[1].weight  # tied: the first path, "1.weight", names it
    opt = torch.optim.SGD([p for p in model.parameters() if p.requires_grad], lr=0.1, momentum=0.9)
    model(torch.randn(2, 3)).sum().backward()
    opt.step()
    tree = optim.optimizer_state(opt, model)
    assert "0" not in tree["state"]
    assert list(tree["state"]["2"]) == ["bias"]
    assert ms.flatten(tree["state"])["1.weight.momentum_buffer"].shape == (4, 4)
    assert tree["param_groups"][0]["params"] == [
        "1.weight",
        "1.bias",
        "2.bias",
        "3.weight",
        "3.bias",
    ]

    fresh_opt = torch.optim.SGD(
        [p for p in model.parameters() if p.requires_grad], lr=0.1, momentum=0.9
    )
    optim.load_optimizer_state(fresh_opt, model, tree)
    assert torch.equal(
        fresh_opt.state[model[2].weight]["momentum_buffer"],
        opt.state[model[1].weight]["momentum_buffer"],
    )


@pytest.mark.parametrize("kind", ["sgd", "adam", "adamw"])
def test_loaded_state_makes_the_next_step_identical(kind):
    model = make_model()
    opt = grouped_optimizer(kind, model)
    torch.optim.lr_scheduler.StepLR(opt, step_size=10)  # adds "initial_lr" to the groups
    for seed in range(3):
        backward(model, seed)
        opt.step()
    tree = copy.deepcopy(optim.optimizer_state(opt, model))  # a checkpoint

    fresh = make_model(seed=1)
    fresh.load_state_dict(model.state_dict())
    fresh_opt = grouped_optimizer(kind, fresh)
    fresh_opt.param_groups[1]["lr"] = 0.5  # the tree's hyperparameters win
    optim.load_optimizer_state(fresh_opt, fresh, tree)
    assert fresh_opt.param_groups[1]["lr"] == 0.01

    for m, o in ((model, opt), (fresh, fresh_opt)):
        backward(m, 10)
        o.step()
    for (name, a), b in zip(model.named_parameters(), fresh.parameters(), strict=True):
        assert torch.equal(a, b), name
    assert (
        ms.flatten(optim.optimizer_state(opt, model)["state"]).keys()
        == ms.flatten(optim.optimizer_state(fresh_opt, fresh)["state"]).keys()
    )


def test_loaded_tree_is_copied_not_shared():
    model = make_model()
    opt = grouped_optimizer("adam", model)
    backward(model, 0)
    opt.step()
    tree = copy.deepcopy(optim.optimizer_state(opt, model))
    before = copy.deepcopy(tree)
    fresh_opt = grouped_optimizer("adam", model)
    optim.load_optimizer_state(fresh_opt, model, tree)
    backward(model, 1)
    fresh_opt.step()
    for key, value in ms.flatten(tree["state"]).items():
        assert torch.equal(value, ms.flatten(before["state"])[key]), key


def broken_trees(tree):
    """(expected message, broken copy) for each way an Adam tree can fail to fit."""
    cases = []

    def case(match, edit):
        broken = copy.deepcopy(tree)
        edit(broken)
        cases.append((match, broken))

    def make_sgd_group(t):
        del t["param_groups"][0]["betas"]
        t["param_groups"][0]["momentum"] = 0.9

    case(
        r"^load_optimizer_state: '9\.weight': .*not a parameter",
        lambda t: t["param_groups"][0]["params"].append("9.weight"),
    )
    case(
        r"^load_optimizer_state: '0\.bias': .* does not list it",
        lambda t: t["param_groups"][0]["params"].remove("0.bias"),
    )
    case(
        r"^load_optimizer_state: '2\.bias': .*holds it in group 1",
        lambda t: t["param_groups"][0]["params"].append("2.bias"),
    )
    case(
        r"^load_optimizer_state: 'param_groups': the tree has 1 param groups, the optimizer has 2",
        lambda t: t["param_groups"].pop(),
    )
    case(
        r"^load_optimizer_state: 'param_groups\.0': has hyperparameters \['momentum'\] and "
        r"lacks \['betas'\]",
        make_sgd_group,
    )
    case(
        r"^load_optimizer_state: '2\.weight\.exp_avg': state of shape \(3, 3\)",
        lambda t: t["state"]["2"]["weight"].update(exp_avg=torch.zeros(3, 3)),
    )
    case(
        r"^load_optimizer_state: '7\.weight\.exp_avg'",
        lambda t: t["state"].update({"7": {"weight": {"exp_avg": torch.zeros(1)}}}),
    )
    case(
        r"^load_optimizer_state: '0\.bias': the state there is a Tensor; it must be a dict",
        lambda t: t["state"]["0"].update(bias=torch.zeros(4)),
    )
    return cases


def test_trees_that_do_not_fit_are_refused_and_change_nothing():
    model = make_model()
    opt = grouped_optimizer("adam", model)
    backward(model, 0)
    opt.step()
    tree = copy.deepcopy(optim.optimizer_state(opt, model))
    target = grouped_optimizer("adam", model)
    backward(model, 1)
    target.step()
    before = copy.deepcopy(target.state_dict())
    for match, broken in broken_trees(tree):
        with pytest.raises(ValueError, match=match):
            optim.load_optimizer_state(target, model, broken)
        after = target.state_dict()
        assert after["param_groups"] == before["param_groups"]
        for key, entries in before["state"].items():
            for name, value in entries.items():
                assert torch.equal(after["state"][key][name], value)


def test_state_for_a_parameter_the_optimizer_does_not_hold_is_refused():
    model = make_model()
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    backward(model, 0)
    opt.step()
    tree = optim.optimizer_state(opt, model)
    model[0].requires_grad_(False)
    partial = torch.optim.SGD(
        [p for p in model.parameters() if p.requires_grad], lr=0.1, momentum=0.9
    )
    with pytest.raises(ValueError, match=r"'0\.weight'"):
        optim.load_optimizer_state(partial, model, tree)


def test_an_optimizer_of_another_module_is_refused():
    model, other = make_model(), make_model()
    opt = torch.optim.SGD(other.parameters(), lr=0.1)
    with pytest.raises(
        ValueError, match=r"^optimizer_state: 'param_groups\.0\.params\.0': parameter 0 of"
    ):
        optim.optimizer_state(opt, model)


def test_a_modstate_optimizer_is_refused_with_the_reason_and_the_fix_works(tmp_path):
    model = make_model()
    opt = optim.adam()
    with pytest.raises(TypeError, match=r"expected a torch\.optim\.Optimizer.*holds no state"):
        optim.optimizer_state(opt, model)
    with pytest.raises(TypeError, match=r"expected a torch\.optim\.Optimizer"):
        optim.load_optimizer_state(opt, model, {"state": {}, "param_groups": []})
    # The fix the message names: the state is already a tree keyed by path; save it directly.
    params = ms.extract(model, detach=True)
    state = opt.step(params, ms.tree.map(torch.ones_like, params), opt.init(params))[1]
    ms.checkpoint.save(state, tmp_path / "adam.safetensors")
    loaded = ms.checkpoint.load(tmp_path / "adam.safetensors")
    assert ms.flatten(loaded).keys() == ms.flatten(state).keys()
    assert all(torch.equal(ms.flatten(loaded)[k], v) for k, v in ms.flatten(state).items())


# -- tied weights -------------------------------------------------------------------------------
# extract and split list a tie (an embedding tied to the output head) at each of its paths. The
# step takes the tie once, with the gradient at its first path (where torch.func puts it), and
# gives one new tensor for all its paths, so the new params still fit the model.


class _SortsHeadFirst(nn.Module):
    """Tied as GPT-2 is: the embedding comes first in module order, the head first in sorted
    order (optree sorts dict keys), so the two orders disagree about the tie's first path."""

    def __init__(self) -> None:
        super().__init__()
        self.token_embedding = nn.Embedding(10, 4)
        self.lm_head = nn.Linear(4, 10, bias=False)
        self.lm_head.weight = self.token_embedding.weight

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        return self.lm_head(torch.tanh(self.token_embedding(tokens)))


def _tied_lm(kind: str = "TiedLM") -> nn.Module:
    from zoo import TiedLM

    torch.manual_seed(0)
    return TiedLM() if kind == "TiedLM" else _SortsHeadFirst()


TOKENS = torch.tensor([[1, 2, 3], [4, 5, 6]])


@pytest.mark.parametrize("kind", ["TiedLM", "sorts head first"])
@pytest.mark.parametrize("donate", [False, True])
def test_a_tied_model_trains_functionally_as_with_torch_optim(donate, kind):
    lm = _tied_lm(kind)
    reference = copy.deepcopy(lm)  # deepcopy keeps the tie
    params, state = ms.split(lm, detach=True)
    opt = optim.adam(lr=0.1)
    opt_state = opt.init(params)
    first, second = [
        path for path in ms.flatten(params) if path.endswith("weight") and "body" not in path
    ]
    assert ms.flatten(opt_state["exp_avg"])[first] is ms.flatten(opt_state["exp_avg"])[second]
    torch_opt = torch.optim.Adam(reference.parameters(), lr=0.1)

    def loss(p: dict) -> torch.Tensor:
        return ms.call(lm, (p, state), TOKENS).square().mean()

    for _ in range(3):
        grads = torch.func.grad(loss)(params)
        params, opt_state = opt.step(params, grads, opt_state, donate=donate)
        torch_opt.zero_grad()
        reference(TOKENS).square().mean().backward()
        torch_opt.step()
    assert ms.flatten(params)[first] is ms.flatten(params)[second]
    for path, want in ms.flatten(ms.extract(reference, detach=True)).items():
        torch.testing.assert_close(ms.flatten(params)[path], want, msg=path)


def test_a_tie_with_one_gradient_object_at_both_paths_is_stepped_once():
    # torch.autograd.grad gives the whole gradient at each path of a tie (one tensor twice).
    lm = _tied_lm()
    params = ms.tree.map(torch.Tensor.requires_grad_, ms.split(lm, detach=True)[0])
    leaves = list(ms.flatten(params).values())
    gradients = torch.autograd.grad(ms.call(lm, params, TOKENS).sum(), leaves)
    grads = ms.unflatten(dict(zip(ms.flatten(params), gradients, strict=True)))
    with torch.no_grad():
        new, _ = optim.sgd(lr=0.5).step(params, grads, optim.sgd(lr=0.5).init(params))
    expected = params["embed"]["weight"] - 0.5 * grads["embed"]["weight"]
    assert new["head"]["weight"] is new["embed"]["weight"]
    assert torch.equal(new["embed"]["weight"], expected)
