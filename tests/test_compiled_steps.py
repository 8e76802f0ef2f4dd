"""Compile the whole pure step, as JAX's ``jit`` does: one graph, no recompile, eager's numbers.

Each case is a step a user writes (a forward through ``ms.call`` / ``ms.apply`` / an
``Ensemble``, ``ms.grad``, an ``ms.optim`` step, tree ops), compiled with ``fullgraph=True``
under a counting backend (``aot_eager``: the graph Dynamo captured, run through AOT autograd).
Over 12 steps whose step count, learning rate (a schedule) and batch change, it compiles once
(``error_on_recompile`` turns a recompile into a failure), and every tree it returns equals the
eager step's. One case per family runs under inductor as well.
"""

from __future__ import annotations

import re
from collections.abc import Callable
from typing import Any

import pytest
import torch
import torch._dynamo
from torch import nn
from torch._dynamo.testing import CompileCounterWithBackend

import modstate as ms

pytestmark = pytest.mark.slow

STEPS = 12


def batch(i: int, shape: tuple[int, ...] = (4, 8), dtype: torch.dtype = torch.float32) -> tuple:
    g = torch.Generator().manual_seed(i)
    return torch.randn(*shape, generator=g, dtype=dtype), torch.randn(
        shape[0], 2, generator=g, dtype=dtype
    )


def mlp(dtype: torch.dtype = torch.float32) -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 2)).to(dtype)


def members(n: int = 4) -> list[nn.Module]:
    return [mlp() for _ in range(n)]


OPTIMIZERS: dict[str, Callable[[], Any]] = {
    "sgd": lambda: ms.optim.sgd(lr=0.1, momentum=0.9, nesterov=True, weight_decay=1e-4),
    "adam": lambda: ms.optim.adam(lr=1e-3, amsgrad=True),
    "adamw": lambda: ms.optim.adamw(lr=1e-3),
    "rmsprop": lambda: ms.optim.rmsprop(lr=1e-3, centered=True, momentum=0.5),
    "adagrad": lambda: ms.optim.adagrad(lr=1e-2, lr_decay=1e-3),
    "adamax": lambda: ms.optim.adamax(lr=1e-3),
    "nadam": lambda: ms.optim.nadam(lr=1e-3),
    "radam": lambda: ms.optim.radam(lr=1e-3),
    "adadelta": lambda: ms.optim.adadelta(lr=1.0),
    "warmup_cosine": lambda: ms.optim.adam(
        lr=ms.optim.schedules.warmup_cosine(1e-2, warmup_iters=3, T_max=STEPS)
    ),
    "tensor_lr": lambda: ms.optim.adam(lr=torch.tensor(1e-3)),
    "masked": lambda: ms.optim.masked(ms.optim.adam(lr=1e-3), "0.*"),
}


def optimizer_case(name: str, dtype: torch.dtype = torch.float32) -> tuple:
    """``params, state = step(params, state, x, y)``: ms.grad of an MSE through ms.call."""
    model = mlp(dtype)
    opt = OPTIMIZERS[name]()
    params = ms.extract(model, detach=True)

    def loss(p: Any, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        return ((ms.call(model, p, x) - y) ** 2).mean()

    def step(p: Any, s: Any, x: torch.Tensor, y: torch.Tensor) -> tuple:
        return opt.step(p, ms.grad(loss)(p, x, y), s)

    return step, (params, opt.init(params)), lambda i: batch(i, dtype=dtype)


def bn_apply_ema() -> tuple:
    """A BatchNorm CNN in train mode through ms.apply, clipped gradients, an EMA of the params."""
    torch.manual_seed(0)
    cnn = nn.Sequential(
        nn.Conv2d(3, 4, 3, padding=1), nn.BatchNorm2d(4), nn.ReLU(),
        nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(4, 2),
    ).train()  # fmt: skip
    params, state = ms.split(cnn, detach=True)
    opt = ms.optim.sgd(lr=0.1, momentum=0.9)

    def loss(p: Any, s: Any, x: torch.Tensor, y: torch.Tensor) -> tuple:
        out, new_s = ms.apply(cnn, p, s, x)
        return ((out - y) ** 2).mean(), new_s

    def step(p: Any, s: Any, o: Any, e: Any, x: torch.Tensor, y: torch.Tensor) -> tuple:
        g, new_s = ms.grad(loss, has_aux=True)(p, s, x, y)
        g, _ = ms.optim.clip_grad_norm(g, 1.0)
        new_p, o = opt.step(p, g, o)
        return new_p, new_s, o, ms.tree.lerp(e, new_p, 0.01)

    carry = (params, state, opt.init(params), ms.tree.clone(params))
    return step, carry, lambda i: batch(i, (4, 3, 8, 8))


def ensemble_step(lr: Any = 1e-3) -> tuple:
    """A 4-member Ensemble trained through ms.apply, one Adam over the stacked trees."""
    ens = ms.Ensemble(members(), route="batched")
    params, state = ms.split(ens, detach=True)
    opt = ms.optim.adam(lr=lr)

    def loss(p: Any, s: Any, x: torch.Tensor, y: torch.Tensor) -> tuple:
        out, s = ms.apply(ens, p, s, x)
        return ((out - y) ** 2).mean(), s

    def step(p: Any, s: Any, o: Any, x: torch.Tensor, y: torch.Tensor) -> tuple:
        g, s = ms.grad(loss, has_aux=True)(p, s, x, y)
        p, o = opt.step(p, g, o)
        return p, s, o

    return step, (params, state, opt.init(params)), batch


def vmap_member_step() -> tuple:
    """torch.vmap over one member's step: per-member gradients and optimizer states."""
    model = mlp()
    stacked = ms.tree.detach(
        ms.stack_modules(members())
    )  # trained functionally: no autograd leaves
    opt = ms.optim.adam(lr=1e-3)

    def member(p: Any, s: Any, x: torch.Tensor, y: torch.Tensor) -> tuple:
        g = ms.grad(lambda q: ((ms.call(model, q, x) - y) ** 2).mean())(p)
        return opt.step(p, g, s)

    def step(p: Any, s: Any, x: torch.Tensor, y: torch.Tensor) -> tuple:
        return torch.vmap(member, in_dims=(0, 0, None, None))(p, s, x, y)

    # torch.vmap hands back what every member shares (the step count) expanded, with stride 0;
    # a clone lays it out as the step's outputs are, so the first step is no special case.
    return step, (stacked, ms.tree.clone(torch.vmap(opt.init)(stacked))), batch


def vmap_call_and_tree_ops() -> tuple:
    """vmap_call over a stacked tree, tree ops on its result (no optimizer: the carry is kept)."""
    model = mlp()
    stacked = ms.stack_modules(members())

    def step(t: Any, x: torch.Tensor, y: torch.Tensor) -> tuple:
        out = ms.vmap_call(model, t, x)
        t = ms.tree.add(t, ms.tree.mul(t, (out - y).mean()), alpha=0.5)
        t = ms.tree.map_with_path(lambda path, leaf: leaf * 0.5, t)
        return (ms.tree.combine(*ms.tree.partition(t, ms.tree.is_float)),)

    return step, (stacked,), batch


def call_partial_step() -> tuple:
    """call_partial with one layer's tree (the rest of the module's own tensors)."""
    model = mlp()
    first = ms.tree.select(ms.extract(model, detach=True), "0.*")
    opt = ms.optim.sgd(lr=0.1)

    def step(p: Any, s: Any, x: torch.Tensor, y: torch.Tensor) -> tuple:
        g = ms.grad(lambda q: ((ms.call_partial(model, q, x) - y) ** 2).mean())(p)
        return opt.step(p, g, s)

    return step, (first, opt.init(first)), batch


CASES: dict[str, Callable[[], tuple]] = {
    **{name: (lambda name=name: optimizer_case(name)) for name in OPTIMIZERS},
    "bn_apply_ema": bn_apply_ema,
    "ensemble_step": ensemble_step,
    "ensemble_lr_sweep": lambda: ensemble_step(torch.tensor([1e-3, 3e-3, 1e-2, 3e-2])),
    "vmap_member_step": vmap_member_step,
    "vmap_call_and_tree_ops": vmap_call_and_tree_ops,
    "call_partial": call_partial_step,
}


def run(step: Callable, carry: tuple, data: Callable, steps: int = STEPS) -> list[tuple]:
    outs = []
    for i in range(steps):
        carry = step(*carry, *data(i))
        outs.append(carry)
    return outs


def assert_close(compiled: list, eager: list, rtol: float, atol: float = 0.0) -> None:
    for got, want in zip(compiled, eager, strict=True):
        got_leaves, got_def = torch.utils._pytree.tree_flatten(got)
        want_leaves, want_def = torch.utils._pytree.tree_flatten(want)
        assert got_def == want_def
        for a, b in zip(got_leaves, want_leaves, strict=True):
            torch.testing.assert_close(a, b, rtol=rtol, atol=atol)


@pytest.fixture(autouse=True)
def fresh_dynamo():
    torch._dynamo.reset()
    with torch._dynamo.config.patch(error_on_recompile=True):
        yield
    torch._dynamo.reset()


@pytest.mark.parametrize("name", list(CASES))
def test_one_graph_eager_numbers(name: str) -> None:
    step, carry, data = CASES[name]()
    eager = run(step, carry, data)
    counter = CompileCounterWithBackend("aot_eager")
    compiled = run(torch.compile(step, backend=counter, fullgraph=True), carry, data)
    assert counter.frame_count == 1
    assert_close(compiled, eager, rtol=1e-6, atol=1e-7)


@pytest.mark.parametrize("name", ["adam", "sgd", "rmsprop"])
def test_float64_matches_eager_to_1e_12(name: str) -> None:
    step, carry, data = optimizer_case(name, torch.float64)
    eager = run(step, carry, data)
    counter = CompileCounterWithBackend("aot_eager")
    compiled = run(torch.compile(step, backend=counter, fullgraph=True), carry, data)
    assert counter.frame_count == 1
    assert_close(compiled, eager, rtol=1e-12, atol=1e-14)


@pytest.mark.parametrize("name", ["adam", "bn_apply_ema"])
def test_inductor_100_steps(name: str) -> None:
    step, carry, data = CASES[name]()
    eager = run(step, carry, data, steps=100)
    compiled = run(torch.compile(step, fullgraph=True), carry, data, steps=100)
    assert_close(compiled[-1:], eager[-1:], rtol=1e-5, atol=1e-6)


def test_a_schedule_over_1000_steps_compiles_once() -> None:
    step, carry, data = optimizer_case("warmup_cosine")
    counter = CompileCounterWithBackend("eager")
    compiled = torch.compile(step, backend=counter, fullgraph=True)
    for i in range(1000):
        carry = compiled(*carry, *data(i % 7))
    assert counter.frame_count == 1
    assert float(carry[1]["step"]) == 1000


def test_a_wrong_tree_is_refused_while_compiling_as_in_eager() -> None:
    step, (params, state), data = optimizer_case("adam")
    wrong = {"0": params["0"]}  # the second layer's state is missing
    bad_state = {**state, "exp_avg": wrong}
    with pytest.raises(ValueError, match="'2.bias'|'2.weight'"):
        step(params, bad_state, *data(0))
    with pytest.raises(Exception, match="'2.bias'|'2.weight'"):
        torch.compile(step, backend="eager", fullgraph=True)(params, bad_state, *data(0))


def test_grads_of_another_dtype_are_refused_while_compiling_as_in_eager() -> None:
    opt = ms.optim.adam(lr=0.1)
    params = ms.extract(mlp(), copy=True)
    grads = ms.tree.to(ms.tree.zeros_like(params), torch.float64)
    message = r"'0\.weight': grads is torch\.float64, but the param there is torch\.float32"
    with pytest.raises(ValueError, match=message):
        opt.step(params, grads, opt.init(params))
    with pytest.raises(Exception, match=message):
        torch.compile(opt.step, backend="eager", fullgraph=True)(params, grads, opt.init(params))
    step = torch.compile(opt.step, backend="eager", fullgraph=True)
    new_params, _ = step(params, ms.tree.to(grads, torch.float32), opt.init(params))  # the fix
    assert new_params["0"]["weight"].dtype == torch.float32


def test_donate_is_accepted_while_compiling() -> None:
    model = mlp()
    opt = ms.optim.adam(lr=1e-3)
    params = ms.extract(model, detach=True)

    def step(p: Any, s: Any, x: torch.Tensor, y: torch.Tensor) -> tuple:
        g = ms.grad(lambda q: ((ms.call(model, q, x) - y) ** 2).mean())(p)
        return opt.step(p, g, s, donate=True)

    # A donated eager step writes its carry in place: only the last step's trees are its own.
    eager = run(step, (ms.tree.clone(params), opt.init(params)), batch)[-1]
    compiled = run(
        torch.compile(step, backend="aot_eager", fullgraph=True), (params, opt.init(params)), batch
    )[-1]
    assert_close([compiled], [eager], rtol=1e-6, atol=1e-7)


def test_an_ensemble_forward_compiles_once() -> None:
    ens = ms.Ensemble(members(), route="batched")
    counter = CompileCounterWithBackend("aot_eager")
    compiled = torch.compile(ens, backend=counter, fullgraph=True)
    for i in range(STEPS):
        x, _ = batch(i)
        torch.testing.assert_close(compiled(x), ens(x), rtol=1e-6, atol=1e-7)
    assert counter.frame_count == 1


WRONG_TREES = {
    "an unknown path": (
        lambda t: {**t, "5": {"weight": torch.ones(1)}},
        "'5.weight': unknown path",
    ),
    "a missing layer": (lambda t: {"0": t["0"]}, "'2.weight': the tree has no tensor there"),
    "another shape": (
        lambda t: {**t, "2": {**t["2"], "weight": torch.ones(2, 5)}},
        "'2.weight': shape (2, 5) in the tree, (2, 16) in the module",
    ),
    "another dtype": (
        lambda t: {**t, "2": {**t["2"], "weight": t["2"]["weight"].double()}},
        "'2.weight': dtype torch.float64 in the tree, torch.float32 in the module",
    ),
}


@pytest.mark.parametrize("mistake", list(WRONG_TREES))
def test_call_names_the_path_while_compiling(mistake: str) -> None:
    model = mlp()
    wrong, expected = WRONG_TREES[mistake]
    tree = wrong(ms.extract(model, detach=True))
    x, _ = batch(0)
    message = re.escape(f"call: {expected}")

    def forward(t: Any) -> torch.Tensor:
        return ms.call(model, t, x)

    with pytest.raises(Exception, match=message) as eager:
        forward(tree)
    # fullgraph: Dynamo reports the builtin error the trace raised, with modstate's message
    with pytest.raises(torch._dynamo.exc.Unsupported, match=message):
        torch.compile(forward, backend="eager", fullgraph=True)(tree)
    # without fullgraph the frame falls back to eager, which raises modstate's own error (Dynamo
    # then traces the engine's functions one by one: recompiles are expected here)
    torch._dynamo.reset()
    with torch._dynamo.config.patch(error_on_recompile=False):
        with pytest.raises(type(eager.value), match=message):
            torch.compile(forward, backend="eager")(tree)


def test_a_wrappers_prefix_gets_the_eager_hint_while_compiling() -> None:
    model = mlp()
    tree = {"_orig_mod": ms.extract(model, detach=True)}  # a tree from torch.compile(model)
    x, _ = batch(0)
    message = re.escape("call: '_orig_mod.0.weight': the tree's paths start with '_orig_mod.'")

    def forward(t: Any) -> torch.Tensor:
        return ms.call(model, t, x)

    with pytest.raises(KeyError, match=message):
        forward(tree)
    with pytest.raises(torch._dynamo.exc.Unsupported, match=message):
        torch.compile(forward, backend="eager", fullgraph=True)(tree)
    torch._dynamo.reset()
    with torch._dynamo.config.patch(error_on_recompile=False):
        with pytest.raises(KeyError, match=message):
            torch.compile(forward, backend="eager")(tree)


def compiled_frames(fn: Callable) -> int:
    """How many compiled versions of ``fn``'s frame Dynamo keeps."""
    return len(torch._C._dynamo.eval_frame._debug_get_cache_entry_list(fn.__code__))


def test_a_frame_dynamo_gave_up_on_runs_the_engine_untraced() -> None:
    """After a wrong tree's error, Dynamo runs the frame eagerly with its hook still installed;
    the engine then runs with Dynamo off, not traced function by function (which guarded on the
    anatomy cache, a weak dictionary, and failed with an IndexError when the collector freed a
    module mid-compile)."""
    from modstate._core.module.anatomy import anatomy_of
    from modstate._core.swap.prepare import prepare

    model = mlp()
    x, _ = batch(0)
    good = ms.extract(model, detach=True)
    wrong = {**good, "2": {**good["2"], "weight": torch.ones(2, 5)}}

    def forward(t: Any) -> torch.Tensor:
        return ms.call(model, t, x)

    with torch._dynamo.config.patch(error_on_recompile=False):
        with pytest.raises(ValueError, match=re.escape("'2.weight': shape (2, 5)")):
            torch.compile(forward, backend="eager")(wrong)
    assert compiled_frames(anatomy_of) == 0
    assert compiled_frames(prepare) == 0


def test_calls_past_the_recompile_limit_run_eagerly_and_exactly() -> None:
    """Past ``recompile_limit`` Dynamo runs the frame eagerly: ms.call, ms.apply and inject then
    run the eager engine, with eager's numbers, and leave the module as it was."""
    model = nn.Sequential(nn.Linear(8, 16), nn.BatchNorm1d(16), nn.Linear(16, 2))
    own = {k: v.clone() for k, v in model.state_dict().items()}
    params, state = ms.split(model, detach=True)

    def step(t: Any, s: Any, x: torch.Tensor) -> tuple:
        out, new_state = ms.apply(model, t, s, x)
        with ms.inject(model, ms.tree.combine(t, new_state)):
            again = model.eval()(x)
        model.train()
        return ms.call(model, (t, new_state), x) + out, again

    compiled = torch.compile(step, backend="eager")
    with torch._dynamo.config.patch(error_on_recompile=False, recompile_limit=1):
        for n in range(2, 8):  # a new batch size each call: past the first, no compile
            t = ms.tree.map(torch.randn_like, params)
            x = torch.randn(n, 8)
            got, expected = compiled(t, state, x), step(t, state, x)
            assert all(torch.equal(a, b) for a, b in zip(got, expected, strict=True))
            assert all(torch.equal(own[k], v) for k, v in model.state_dict().items())


def tied_and_shared() -> nn.Module:
    torch.manual_seed(0)
    shared = nn.Linear(4, 4)
    model = nn.Sequential(nn.Linear(4, 4), nn.BatchNorm1d(4), shared, nn.ReLU(), shared)
    model[0].weight = model[2].weight  # tied across modules
    model.register_buffer("scale", torch.ones(()), persistent=False)
    return model


@pytest.mark.parametrize("buffers", [True, False])
def test_extract_while_compiling_is_eagers_tree(buffers: bool) -> None:
    model = tied_and_shared()
    eager = ms.extract(model, buffers=buffers)
    counter = CompileCounterWithBackend("aot_eager")

    @torch.compile(backend=counter, fullgraph=True)
    def read(x: torch.Tensor) -> tuple:
        return ms.extract(model, buffers=buffers), x + 1

    compiled, _ = read(torch.ones(()))
    assert leaves_by_path(compiled).keys() == leaves_by_path(eager).keys()
    assert list(leaves_by_path(compiled)) == list(leaves_by_path(eager))  # in the same order
    for path, leaf in leaves_by_path(compiled).items():
        assert torch.equal(leaf, leaves_by_path(eager)[path]), path
    assert compiled["0"]["weight"] is compiled["2"]["weight"]  # the tie stays a tie
    assert counter.frame_count == 1


def leaves_by_path(tree: Any) -> dict[str, torch.Tensor]:
    found: dict[str, torch.Tensor] = {}
    ms.tree.map_with_path(lambda path, leaf: found.setdefault(path, leaf), tree)
    return found
