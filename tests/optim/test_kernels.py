"""foreach= and fused=, with torch.optim's meaning: every optimizer, every flag torch has for it,
gives that torch.optim path's numbers bit for bit; a differentiated step takes the differentiable
path whatever the flags; pure fused steps write no input."""

from __future__ import annotations

import pytest
import torch
from test_optimizers import CASES, gradients, leaves, make_params

import modstate as ms
from modstate import optim

STEPS = 100
FUSED = {"sgd", "adam", "adamw", "adagrad"}  # the optimizers torch.optim has fused kernels for
FLAGS = [{"foreach": True}, {"foreach": False}, {"fused": True}]
DTYPES = [torch.float32, torch.float64, torch.bfloat16]
# foreach=False is torch's default path on the CPU, whose float32/float64 numbers
# test_optimizers.py checks for every option; here it runs in bfloat16.
KERNEL_CASES = [
    (name, factory, torch_class, options, flags, dtype)
    for name, factory, torch_class, options in CASES
    for flags in FLAGS
    for dtype in DTYPES
    if ("fused" not in flags or name in FUSED)
    and (flags != {"foreach": False} or dtype == torch.bfloat16)
]
KERNEL_IDS = [f"{n}-{o}-{f}-{str(d)[6:]}" for n, _, _, o, f, d in KERNEL_CASES]


@pytest.mark.parametrize(
    ("name", "factory", "torch_class", "options", "flags", "dtype"), KERNEL_CASES, ids=KERNEL_IDS
)
def test_each_flag_gives_torch_optims_numbers_for_that_flag(
    name, factory, torch_class, options, flags, dtype
):
    """Pure and donated steps side by side, each equal to torch.optim after every step."""
    pure = make_params(dtype)
    donated = ms.tree.clone(pure)
    torch_params = [p.clone().requires_grad_() for p in leaves(pure)]
    torch_opt = torch_class(torch_params, **options, **flags)
    opt = factory(**options, **flags)
    pure_state, donated_state = opt.init(pure), opt.init(donated)
    generator = torch.Generator().manual_seed(1)
    for step in range(STEPS):
        grads = gradients(pure, generator, step)
        for param, grad in zip(torch_params, leaves(grads), strict=True):
            param.grad = grad.clone()
        torch_opt.step()
        pure, pure_state = opt.step(pure, grads, pure_state)
        donated, donated_state = opt.step(donated, grads, donated_state, donate=True)
        for ours, again, theirs in zip(leaves(pure), leaves(donated), torch_params, strict=True):
            assert torch.equal(ours, theirs.detach()), f"{name} {flags} differs at step {step + 1}"
            assert torch.equal(again, theirs.detach()), f"donated, at step {step + 1}"


@pytest.mark.parametrize("name", sorted(FUSED))
def test_a_pure_fused_step_writes_no_input(name):
    opt = getattr(optim, name)(fused=True, **({"momentum": 0.9} if name == "sgd" else {}))
    params = make_params()
    state = opt.init(params)
    params, state = opt.step(params, gradients(params, torch.Generator(), 1), state)
    grads = gradients(params, torch.Generator().manual_seed(2), 1)
    inputs = leaves(params) + leaves(grads) + leaves(state)
    before = [(t.clone(), t._version) for t in inputs]
    new_params, new_state = opt.step(params, grads, state)
    assert all(
        torch.equal(t, copy) and t._version == v
        for t, (copy, v) in zip(inputs, before, strict=True)
    )
    outputs = leaves(new_params) + leaves(new_state)
    assert not {t.data_ptr() for t in outputs} & {t.data_ptr() for t in inputs}
    # ... and a donated one reuses them, as torch.optim steps in place.
    donated_params, donated_state = opt.step(params, grads, state, donate=True)
    assert {t.data_ptr() for t in leaves(donated_params) + leaves(donated_state)} <= {
        t.data_ptr() for t in leaves(params) + leaves(state)
    }
    for a, b in zip(leaves(new_params), leaves(donated_params), strict=True):
        assert torch.equal(a, b)


@pytest.mark.parametrize("donate", [False, True], ids=["pure", "donated"])
def test_leaves_of_several_dtypes_are_stepped_group_by_group_as_torch_groups_them(donate):
    generator = torch.Generator().manual_seed(0)
    params = {
        "a": torch.randn(30, 30, generator=generator),
        "b": torch.randn(7, generator=generator, dtype=torch.float64),
        "c": torch.randn(5, generator=generator),
    }
    torch_params = [p.clone().requires_grad_() for p in params.values()]
    torch_opt = torch.optim.Adam(torch_params, lr=0.1, fused=True)
    opt = optim.adam(lr=0.1, fused=True)
    state = opt.init(params)
    for _ in range(3):
        grads = ms.tree.map(
            lambda p: torch.randn(p.shape, generator=generator, dtype=p.dtype), params
        )
        for param, grad in zip(torch_params, grads.values(), strict=True):
            param.grad = grad.clone()
        torch_opt.step()
        params, state = opt.step(params, grads, state, donate=donate)
    for ours, theirs in zip(params.values(), torch_params, strict=True):
        assert ours.dtype == theirs.dtype and torch.equal(ours, theirs.detach())


@pytest.mark.parametrize("flags", FLAGS, ids=str)
def test_a_differentiated_step_runs_the_differentiable_path_whatever_the_flags(flags):
    """Params that require grad, a learnable hyperparameter, or a torch.func transform: torch.optim
    refuses fused/foreach with differentiable=True; here the flags give way, and the numbers are
    the single-tensor path's."""
    params = make_params(torch.float64)
    grads = gradients(params, torch.Generator().manual_seed(3), 1)
    plain = optim.adam(lr=0.1, foreach=False)
    want, _ = plain.step(params, grads, plain.init(params))
    opt = optim.adam(lr=0.1, **flags)
    recorded = ms.tree.map(lambda p: p.clone().requires_grad_(), params)
    got, _ = opt.step(recorded, grads, opt.init(recorded))
    assert got["head"]["weight"].grad_fn is not None  # autograd saw the step
    for a, b in zip(leaves(got), leaves(want), strict=True):
        assert torch.equal(a.detach(), b)
    lr = torch.tensor(0.1, dtype=torch.float64, requires_grad=True)
    learnable = optim.adam(lr=lr, **flags)
    new, _ = learnable.step(params, grads, learnable.init(params))
    (meta,) = torch.autograd.grad(new["head"]["weight"].sum(), lr)
    assert torch.isfinite(meta) and meta != 0


@pytest.mark.parametrize("name", sorted(FUSED))
def test_vmap_over_a_fused_optimizer_gives_per_member_numbers(name):
    kwargs = {"lr": 0.1, "fused": True, **({"momentum": 0.9} if name == "sgd" else {})}
    opt = getattr(optim, name)(**kwargs)
    members = 3
    stacked = ms.tree.map(
        lambda p: torch.stack([p + m for m in range(members)]), make_params(torch.float64)
    )
    generator = torch.Generator().manual_seed(4)
    steps = [gradients(stacked, generator, step) for step in range(5)]
    params, state = stacked, torch.vmap(opt.init)(stacked)
    for grads in steps:
        params, state = torch.vmap(opt.step)(params, grads, state)
    for m in range(members):
        alone = ms.tree.map(lambda p, m=m: p[m], stacked)
        alone_state = opt.init(alone)
        for grads in steps:
            alone, alone_state = opt.step(
                alone, ms.tree.map(lambda g, m=m: g[m], grads), alone_state
            )
        for a, b in zip(leaves(alone), leaves(params), strict=True):
            # The member alone ran the fused kernel, the vmapped step the differentiable path:
            # different roundings of the same update.
            torch.testing.assert_close(b[m], a, rtol=1e-12, atol=1e-12)


def test_the_flags_are_checked_as_torch_checks_them():
    with pytest.raises(ValueError, match=r"^adam: 'fused': fused=True and foreach=True cannot"):
        optim.adam(fused=True, foreach=True)
    assert optim.adam(fused=True).fused  # the fix: one of them
    with pytest.raises(ValueError, match=r"^radam: 'fused': torch\.optim has no fused kernel"):
        optim.RAdam(fused=True)
    assert optim.radam(foreach=True).foreach  # the fix the message names
    with pytest.raises(TypeError, match=r"^sgd: 'foreach': got str; pass None"):
        optim.sgd(foreach="yes")  # type: ignore[arg-type]
    complex_params = {"z": torch.ones(2, dtype=torch.complex64)}
    opt = optim.adam(fused=True)
    with pytest.raises(TypeError, match=r"^adam\.step: 'z': a torch\.complex64 leaf; fused=True"):
        opt.step(complex_params, complex_params, opt.init(complex_params))
    for fix in (optim.adam(), optim.adam(foreach=True)):  # the fixes the message names
        fix.step(complex_params, complex_params, fix.init(complex_params))


def test_the_default_is_torchs_default_for_the_device():
    """On the CPU torch.optim's default is its single-tensor path: foreach=None and
    foreach=False give the same numbers, and fused=False alone is the single-tensor path too
    (torch applies its default only when both flags are None)."""
    params = make_params()
    generator = torch.Generator().manual_seed(5)
    steps = [gradients(params, generator, step) for step in range(20)]
    results = []
    for flags in ({}, {"foreach": False}, {"fused": False}):
        opt = optim.nadam(**{k: v for k, v in flags.items() if k == "foreach"})
        if "fused" in flags:
            opt = optim.NAdam(fused=False)
        p, s = params, opt.init(params)
        for grads in steps:
            p, s = opt.step(p, grads, s)
        results.append(leaves(p))
    for other in results[1:]:
        assert all(torch.equal(a, b) for a, b in zip(results[0], other, strict=True))


@pytest.mark.parametrize("donate", [False, True], ids=["", "donate"])
@pytest.mark.parametrize("name", sorted(FUSED))
def test_fused_steps_take_gradients_in_any_memory_layout(name, donate):
    """torch's fused kernels walk param, gradient and state memory in step, and torch.optim's
    gradients always share their param's layout; ``torch.autograd.grad`` (so ``ms.grad``) may
    return a transposed view (a batched matmul's gradient). The step lays them out first."""
    kwargs = {"lr": 0.1, "fused": True, **({"momentum": 0.9} if name == "sgd" else {})}
    opt = getattr(optim, name)(**kwargs)
    generator = torch.Generator().manual_seed(6)
    params = {"w": torch.randn(4, 6, 5, generator=generator)}
    transposed = {"w": torch.randn(4, 5, 6, generator=generator).transpose(1, 2)}
    assert not transposed["w"].is_contiguous()
    contiguous = {"w": transposed["w"].contiguous()}
    want, want_state = opt.step(params, contiguous, opt.init(params))
    got, got_state = opt.step(ms.tree.clone(params), transposed, opt.init(params), donate=donate)
    assert torch.equal(got["w"], want["w"])
    for a, b in zip(leaves(got_state), leaves(want_state), strict=True):
        assert torch.equal(a, b)


@pytest.mark.parametrize("name", sorted(FUSED))
def test_a_donated_loop_lays_out_transposed_gradients_at_every_repeated_step(name):
    """From its second step a donated loop reuses the first step's analysis, which knows the
    state shares the params' layout; a gradient laid out otherwise is still laid out first."""
    kwargs = {"lr": 0.1, "fused": True, **({"momentum": 0.9} if name == "sgd" else {})}
    opt = getattr(optim, name)(**kwargs)
    generator = torch.Generator().manual_seed(8)
    start = {
        "w": torch.randn(4, 6, 5, generator=generator),
        "b": torch.randn(6, generator=generator),
    }
    grads = [
        {"w": torch.randn(4, 5, 6, generator=generator).transpose(1, 2), "b": torch.randn(6)}
        for _ in range(5)
    ]
    grads[0]["w"] = grads[0]["w"].contiguous()  # the first step sees torch's layout
    donated, donated_state = ms.tree.clone(start), opt.init(start)
    pure, pure_state = ms.tree.clone(start), opt.init(start)
    for step_grads in grads:
        before = donated["w"]
        donated, donated_state = opt.step(donated, step_grads, donated_state, donate=True)
        assert donated["w"] is before  # written in place, step after step
        contiguous = {k: v.contiguous() for k, v in step_grads.items()}
        pure, pure_state = opt.step(pure, contiguous, pure_state)
        assert all(torch.equal(a, b) for a, b in zip(leaves(donated), leaves(pure), strict=True))
        for a, b in zip(leaves(donated_state), leaves(pure_state), strict=True):
            assert torch.equal(a, b)


@pytest.mark.parametrize("flags", [{"foreach": True}, {"foreach": False}], ids=str)
@pytest.mark.parametrize(("name", "factory", "torch_class", "options"), CASES[::2], ids=str)
def test_large_trees_stepped_chunk_by_chunk_keep_torchs_numbers(
    name, factory, torch_class, options, flags
):
    """An eager step runs its update a chunk of leaves at a time (cache-sized, as torch's
    single-tensor loop runs one param at a time); the numbers stay torch.optim's."""
    generator = torch.Generator().manual_seed(7)
    shapes = [(300, 300), (300,), (7,), (200, 400), (5, 5), (100, 700)]
    pure = {f"p{i}": torch.randn(shape, generator=generator) for i, shape in enumerate(shapes)}
    donated = ms.tree.clone(pure)
    torch_params = [p.clone().requires_grad_() for p in pure.values()]
    torch_opt = torch_class(torch_params, **options, **flags)
    opt = factory(**options, **flags)
    pure_state, donated_state = opt.init(pure), opt.init(donated)
    for step in range(4):
        grads = ms.tree.map(lambda p: torch.randn(p.shape, generator=generator), pure)
        for param, grad in zip(torch_params, grads.values(), strict=True):
            param.grad = grad.clone()
        torch_opt.step()
        pure, pure_state = opt.step(pure, grads, pure_state)
        donated, donated_state = opt.step(donated, grads, donated_state, donate=True)
        for ours, again, theirs in zip(pure.values(), donated.values(), torch_params, strict=True):
            assert torch.equal(ours, theirs.detach()), f"{name} differs at step {step + 1}"
            assert torch.equal(again, theirs.detach()), f"donated, at step {step + 1}"
