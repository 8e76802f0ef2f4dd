"""Every optimizer of modstate.optim: torch.optim's numbers bit for bit, pure, donatable,
differentiable with finite meta-gradients, vmappable with per-member hyperparameters, and
path-named errors."""

from __future__ import annotations

import pytest
import torch
from torch import nn

import modstate as ms
from modstate import optim

STEPS = 100

# (name, modstate factory, torch.optim class, options): every option of every optimizer.
CASES = [
    ("sgd", optim.sgd, torch.optim.SGD, {}),
    ("sgd", optim.sgd, torch.optim.SGD, {"lr": 0.01, "momentum": 0.9}),
    ("sgd", optim.sgd, torch.optim.SGD, {"momentum": 0.9, "dampening": 0.3}),
    ("sgd", optim.sgd, torch.optim.SGD, {"momentum": 0.8, "nesterov": True, "weight_decay": 0.1}),
    ("sgd", optim.sgd, torch.optim.SGD, {"weight_decay": 0.1, "maximize": True}),
    ("adam", optim.adam, torch.optim.Adam, {}),
    ("adam", optim.adam, torch.optim.Adam, {"amsgrad": True, "betas": (0.8, 0.99)}),
    ("adam", optim.adam, torch.optim.Adam, {"weight_decay": 0.1, "maximize": True, "eps": 1e-6}),
    (
        "adam",
        optim.adam,
        torch.optim.Adam,
        {"decoupled_weight_decay": True, "weight_decay": 0.1, "amsgrad": True},
    ),
    ("adamw", optim.adamw, torch.optim.AdamW, {}),
    ("adamw", optim.adamw, torch.optim.AdamW, {"amsgrad": True, "maximize": True, "lr": 0.01}),
    ("rmsprop", optim.rmsprop, torch.optim.RMSprop, {}),
    ("rmsprop", optim.rmsprop, torch.optim.RMSprop, {"centered": True, "alpha": 0.9}),
    ("rmsprop", optim.rmsprop, torch.optim.RMSprop, {"momentum": 0.9, "weight_decay": 0.1}),
    (
        "rmsprop",
        optim.rmsprop,
        torch.optim.RMSprop,
        {"centered": True, "momentum": 0.5, "maximize": True, "eps": 1e-6},
    ),
    ("adagrad", optim.adagrad, torch.optim.Adagrad, {}),
    (
        "adagrad",
        optim.adagrad,
        torch.optim.Adagrad,
        {"lr_decay": 0.01, "weight_decay": 0.1, "initial_accumulator_value": 0.1, "maximize": True},
    ),
    ("adamax", optim.adamax, torch.optim.Adamax, {}),
    ("adamax", optim.adamax, torch.optim.Adamax, {"weight_decay": 0.1, "maximize": True}),
    ("nadam", optim.nadam, torch.optim.NAdam, {}),
    ("nadam", optim.nadam, torch.optim.NAdam, {"weight_decay": 0.1, "momentum_decay": 0.01}),
    (
        "nadam",
        optim.nadam,
        torch.optim.NAdam,
        {"decoupled_weight_decay": True, "weight_decay": 0.1, "maximize": True},
    ),
    ("radam", optim.radam, torch.optim.RAdam, {}),
    ("radam", optim.radam, torch.optim.RAdam, {"weight_decay": 0.1, "betas": (0.9, 0.9)}),
    (
        "radam",
        optim.radam,
        torch.optim.RAdam,
        {"decoupled_weight_decay": True, "weight_decay": 0.1, "maximize": True},
    ),
    ("adadelta", optim.adadelta, torch.optim.Adadelta, {}),
    ("adadelta", optim.adadelta, torch.optim.Adadelta, {"weight_decay": 0.1, "maximize": True}),
]
IDS = [f"{name}-{options}" for name, _, _, options in CASES]
FACTORIES = {name: factory for name, factory, _, _ in CASES}


def make_params(dtype: torch.dtype = torch.float32, seed: int = 0) -> dict:
    generator = torch.Generator().manual_seed(seed)
    return {
        "encoder": {
            "weight": torch.randn(6, 5, generator=generator, dtype=dtype),
            "bias": torch.randn(6, generator=generator, dtype=dtype),
        },
        "head": {"weight": torch.randn(3, 6, generator=generator, dtype=dtype)},
    }


def gradients(params: dict, generator: torch.Generator, step: int) -> dict:
    grads = ms.tree.map(lambda p: torch.randn(p.shape, generator=generator, dtype=p.dtype), params)
    if step % 5 == 0:
        # Exact zeros are where sqrt-based optimizers are most delicate.
        grads["encoder"]["weight"][0] = 0
    return grads


def leaves(tree: dict) -> list[torch.Tensor]:
    return list(ms.flatten(tree).values())


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("donate", [False, True], ids=["", "donate"])
@pytest.mark.parametrize(("name", "factory", "torch_class", "options"), CASES, ids=IDS)
def test_equal_to_torch_optim_after_every_step(name, factory, torch_class, options, donate, dtype):
    params = make_params(dtype)
    torch_params = [p.clone().requires_grad_() for p in leaves(params)]
    torch_opt = torch_class(torch_params, **options)  # defaults: the single-tensor path on CPU
    opt = factory(**options)
    state = opt.init(params)
    generator = torch.Generator().manual_seed(1)
    for step in range(STEPS):
        grads = gradients(params, generator, step)
        for param, grad in zip(torch_params, leaves(grads), strict=True):
            param.grad = grad.clone()
        torch_opt.step()
        params, state = opt.step(params, grads, state, donate=donate)
        for ours, theirs in zip(leaves(params), torch_params, strict=True):
            assert torch.equal(ours, theirs.detach()), f"{name} differs at step {step + 1}"


@pytest.mark.parametrize(("name", "factory", "torch_class", "options"), CASES, ids=IDS)
def test_autograd_path_gives_the_same_numbers(name, factory, torch_class, options):
    """Params that require grad take the out-of-place, differentiable path: same numbers."""
    eager = functional = make_params(torch.float64)
    opt = factory(**options)
    eager_state = functional_state = opt.init(eager)
    generator = torch.Generator().manual_seed(1)
    for step in range(20):
        grads = gradients(eager, generator, step)
        eager, eager_state = opt.step(eager, grads, eager_state)
        functional = ms.tree.map(lambda p: p.detach().requires_grad_(), functional)
        functional, functional_state = opt.step(functional, grads, functional_state)
    for a, b in zip(leaves(eager), leaves(functional), strict=True):
        assert torch.equal(a, b.detach())


@pytest.mark.parametrize(("name", "factory", "torch_class", "options"), CASES, ids=IDS)
def test_step_changes_no_input(name, factory, torch_class, options):
    opt = factory(**options)
    params = make_params()
    state = opt.step(
        params, gradients(params, torch.Generator().manual_seed(0), 1), opt.init(params)
    )[1]
    grads = gradients(params, torch.Generator().manual_seed(2), 1)
    before = [t.clone() for t in leaves(params) + leaves(grads) + leaves(state)]
    new_params, _ = opt.step(params, grads, state)
    after = leaves(params) + leaves(grads) + leaves(state)
    assert all(torch.equal(a, b) for a, b in zip(before, after, strict=True))
    assert not any(n is p for n, p in zip(leaves(new_params), leaves(params), strict=True))


@pytest.mark.parametrize("name", sorted(FACTORIES))
def test_donate_reuses_the_buffers_of_params_and_state(name):
    opt = FACTORIES[name]()
    params = make_params()
    state = opt.init(params)
    grads = gradients(params, torch.Generator().manual_seed(0), 1)
    storages = {t.data_ptr() for t in leaves(params) + leaves(state)}
    new_params, new_state = opt.step(params, grads, state, donate=True)
    outputs = leaves(new_params) + leaves(new_state)
    assert len(outputs) == len(leaves(params)) + len(leaves(state))
    assert all(t.data_ptr() in storages for t in outputs)


def test_none_in_params_is_an_empty_subtree_and_a_none_gradient_freezes_its_leaf():
    params = {"encoder": None, "head": {"weight": torch.ones(2), "bias": torch.ones(2)}}
    opt = optim.adam(lr=0.1)
    state = opt.init(params)
    assert state["exp_avg"]["encoder"] is None
    grads = {"encoder": None, "head": {"weight": torch.ones(2), "bias": None}}
    new, new_state = opt.step(params, grads, state)
    assert new["encoder"] is None
    assert new["head"]["bias"] is params["head"]["bias"]
    assert new_state["exp_avg"]["head"]["bias"] is state["exp_avg"]["head"]["bias"]
    torch.testing.assert_close(new["head"]["weight"], torch.full((2,), 0.9))


def test_an_integer_leaf_is_refused_by_path_and_the_suggested_fix_works():
    """Issue 22: the message leads with the fix that works for a model, and the whole chain it
    names (split, step params, apply for the forward) trains a BatchNorm model in train mode."""
    model = nn.Sequential(nn.Linear(3, 4), nn.BatchNorm1d(4))
    params = ms.extract(model, detach=True)
    opt = optim.sgd(lr=0.1, momentum=0.9)
    with pytest.raises(
        TypeError, match=r"^sgd\.init: '1\.num_batches_tracked': a torch\.int64"
    ) as error:
        opt.init(params)
    message = str(error.value)
    assert "params, state = ms.split(model, detach=True)" in message
    assert "out, state = ms.apply(model, params, state, x)" in message
    assert "exclude" not in message  # a fix that leads into further errors is not offered

    # Apply the fix exactly as the message words it, in train mode, under both gradients.
    x = torch.randn(8, 3)
    params, state = ms.split(model, detach=True)
    opt_state = opt.init(params)

    def loss(params, state):
        out, state = ms.apply(model, params, state, x)
        return out.square().mean(), state

    for grad in (torch.func.grad, ms.grad):
        grads, state = grad(loss, has_aux=True)(params, state)
        params, opt_state = opt.step(params, grads, opt_state)
    assert int(state["1"]["num_batches_tracked"]) == 2
    assert int(model[1].num_batches_tracked) == 0  # the model itself is untouched


def test_an_integer_gradient_or_state_leaf_is_refused_by_path():
    params = make_params()
    opt = optim.sgd(lr=0.1, momentum=0.9)
    state = opt.init(params)
    grads = ms.tree.map(torch.ones_like, params)
    grads["head"]["weight"] = torch.ones(3, 6, dtype=torch.int64)
    with pytest.raises(ValueError, match=r"^sgd\.step: 'head\.weight': grads is torch\.int64"):
        opt.step(params, grads, state)
    grads["head"]["weight"] = torch.ones(6, 3)
    with pytest.raises(ValueError, match=r"^sgd\.step: 'head\.weight': grads has shape \(6, 3\)"):
        opt.step(params, grads, state)
    # The fix the messages name: a gradient of the param's shape and dtype.
    grads["head"]["weight"] = torch.ones(3, 6)
    opt.step(params, grads, state)


def test_wrong_structure_names_the_path():
    params = make_params()
    opt = optim.rmsprop(momentum=0.9)
    state = opt.init(params)
    grads = ms.tree.map(torch.ones_like, params)
    del grads["encoder"]["bias"]
    with pytest.raises(ValueError, match=r"^rmsprop\.step: 'encoder\.bias': a path of params"):
        opt.step(params, grads, state)
    with pytest.raises(ValueError, match=r"^rmsprop\.step: 'state': has keys .* but rmsprop keeps"):
        opt.step(params, ms.tree.map(torch.ones_like, params), {"step": state["step"]})


@pytest.mark.parametrize("name", sorted(FACTORIES))
def test_meta_gradients_are_finite_where_a_gradient_element_is_zero(name):
    w = torch.tensor([1.0, 2.0, -1.5], dtype=torch.float64, requires_grad=True)
    opt = FACTORIES[name](lr=0.1)

    def unrolled(w):
        params, state = {"w": w}, opt.init({"w": w})
        for _ in range(3):
            grads = {"w": torch.tensor([0.0, 1.0, 0.5], dtype=torch.float64) * params["w"]}
            params, state = opt.step(params, grads, state)
        return params["w"]

    (meta,) = torch.autograd.grad(unrolled(w).sum(), w)
    assert torch.isfinite(meta).all()
    assert torch.autograd.gradcheck(unrolled, (w,))


def test_issue_repro_adam_meta_gradient_at_a_zero_gradient_is_finite():
    w = torch.tensor([1.0, 2.0], dtype=torch.float64, requires_grad=True)
    opt = optim.adam(lr=0.1)
    grads = {"w": torch.tensor([0.0, 1.0], dtype=torch.float64) * w}
    new, _ = opt.step({"w": w}, grads, opt.init({"w": w}))
    (meta,) = torch.autograd.grad(new["w"][0], w)
    # The zero-gradient element does not move, whatever w is: d new_w0 / dw = (1, 0).
    assert torch.equal(meta, torch.tensor([1.0, 0.0], dtype=torch.float64))


@pytest.mark.parametrize("name", sorted(FACTORIES))
def test_a_learning_rate_tensor_gets_a_gradient(name):
    lr = torch.tensor(0.05, dtype=torch.float64, requires_grad=True)
    opt = FACTORIES[name](lr=lr)
    params = {"w": torch.tensor([1.0, -2.0, 3.0], dtype=torch.float64)}
    state = opt.init(params)
    for _ in range(5):
        params, state = opt.step(params, {"w": 2 * params["w"]}, state)
    (grad,) = torch.autograd.grad((params["w"] ** 2).sum(), lr)
    assert torch.isfinite(grad) and grad != 0
    assert torch.autograd.gradcheck(
        lambda lr: FACTORIES[name](lr=lr).step(
            {"w": torch.tensor([1.0, -2.0], dtype=torch.float64)},
            {"w": torch.tensor([0.0, 2.0], dtype=torch.float64)},
            FACTORIES[name]().init({"w": torch.zeros(2, dtype=torch.float64)}),
        )[0]["w"],
        (lr,),
    )


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize(("name", "factory", "torch_class", "options"), CASES, ids=IDS)
def test_vmapped_members_step_as_separate_optimizers(name, factory, torch_class, options, dtype):
    members = 3
    opt = factory(**options)
    stacked = ms.tree.map(
        lambda p: (
            torch.stack([p] * members) + torch.arange(members, dtype=dtype).view(-1, *[1] * p.dim())
        ),
        make_params(dtype),
    )
    grads_per_step = []
    generator = torch.Generator().manual_seed(1)
    for step in range(15):
        grads_per_step.append(gradients(stacked, generator, step))
    params, state = stacked, torch.vmap(opt.init)(stacked)
    for grads in grads_per_step:
        params, state = torch.vmap(opt.step)(params, grads, state)
    for m in range(members):
        alone = ms.tree.map(lambda p, m=m: p[m], stacked)
        alone_state = opt.init(alone)
        for grads in grads_per_step:
            alone, alone_state = opt.step(
                alone, ms.tree.map(lambda g, m=m: g[m], grads), alone_state
            )
        for a, b in zip(leaves(alone), leaves(params), strict=True):
            # Same ops; the CPU kernels may round the last element of a vector chunk apart.
            eps = torch.finfo(dtype).eps
            torch.testing.assert_close(a, b[m], rtol=4 * eps, atol=4 * eps * a.abs().max())


def test_sgd_dampening_under_vmap_keeps_float64():
    """The coefficient ``1 - dampening`` stays a Python float (it once became float32)."""
    opt = optim.sgd(lr=0.1, momentum=0.9, dampening=0.3)
    params = {"w": torch.randn(2, 5, dtype=torch.float64)}
    grads = [{"w": torch.randn(2, 5, dtype=torch.float64)} for _ in range(5)]
    batched, state = params, torch.vmap(opt.init)(params)
    for g in grads:
        batched, state = torch.vmap(opt.step)(batched, g, state)
    alone, alone_state = {"w": params["w"][0]}, opt.init({"w": params["w"][0]})
    for g in grads:
        alone, alone_state = opt.step(alone, {"w": g["w"][0]}, alone_state)
    assert torch.equal(batched["w"][0], alone["w"])


@pytest.mark.parametrize("name", sorted(FACTORIES))
def test_per_member_learning_rates_under_vmap(name):
    lrs = torch.tensor([0.01, 0.1], dtype=torch.float64)
    params = {"w": torch.ones(2, 4, dtype=torch.float64)}
    grads = {"w": torch.linspace(-1, 1, 8, dtype=torch.float64).view(2, 4)}

    def member(p, g, lr):
        opt = FACTORIES[name](lr=lr)
        return opt.step(p, g, opt.init(p))[0]

    stepped = torch.vmap(member)(params, grads, lrs)
    for m in range(2):
        opt = FACTORIES[name](lr=lrs[m].item())
        p = {"w": params["w"][m]}
        expected = opt.step(p, {"w": grads["w"][m]}, opt.init(p))[0]
        torch.testing.assert_close(stepped["w"][m], expected["w"], rtol=1e-15, atol=0)


def test_a_schedule_as_lr_matches_torch_with_its_scheduler():
    params = make_params()
    torch_params = [p.clone().requires_grad_() for p in leaves(params)]
    torch_opt = torch.optim.AdamW(torch_params, lr=0.01)
    scheduler = torch.optim.lr_scheduler.CosineAnnealingLR(torch_opt, T_max=30)
    opt = optim.adamw(lr=optim.schedules.cosine(0.01, T_max=30))
    state = opt.init(params)
    generator = torch.Generator().manual_seed(1)
    for step in range(40):
        grads = gradients(params, generator, step)
        for param, grad in zip(torch_params, leaves(grads), strict=True):
            param.grad = grad.clone()
        torch_opt.step()
        scheduler.step()
        params, state = opt.step(params, grads, state)
        assert all(
            torch.equal(a, b.detach()) for a, b in zip(leaves(params), torch_params, strict=True)
        )


def test_a_schedule_runs_under_vmap_with_its_closed_form():
    schedule = optim.schedules.exponential(0.1, gamma=0.5)
    opt = optim.sgd(lr=schedule)
    params = {"w": torch.zeros(2, 3, dtype=torch.float64)}
    state = torch.vmap(opt.init)(params)
    grads = {"w": torch.ones(2, 3, dtype=torch.float64)}
    for _ in range(3):
        params, state = torch.vmap(opt.step)(params, grads, state)
    torch.testing.assert_close(params["w"], torch.full((2, 3), -0.175, dtype=torch.float64))


def test_hyperparameters_are_checked_like_torch():
    with pytest.raises(ValueError, match=r"^rmsprop: 'lr': invalid value -1 "):
        optim.rmsprop(lr=-1)
    with pytest.raises(ValueError, match=r"^nadam: 'beta2': invalid value 1\.0 "):
        optim.nadam(betas=(0.9, 1.0))
    with pytest.raises(ValueError, match=r"^sgd: 'nesterov': Nesterov momentum requires"):
        optim.sgd(nesterov=True)
    assert optim.sgd(nesterov=True, momentum=0.9).nesterov  # the fix the message names
    with pytest.raises(ValueError, match=r"^adagrad: 'lr': a tensor of shape \(2, 2\)"):
        optim.adagrad(lr=torch.ones(2, 2))  # 1-D is one value per member (test_per_member)
    assert optim.adadelta(rho=1.0).rho == 1.0  # torch accepts rho in [0, 1]
    with pytest.raises(
        ValueError, match=r"^adadelta: 'rho': invalid value 1\.5 .*in \[0\.0, 1\.0\]"
    ):
        optim.adadelta(rho=1.5)
