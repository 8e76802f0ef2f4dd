"""Compiled steps: the whole pure training step under ``torch.compile``, beside every other way
to train the same model, in one process (the ``compare`` fixture: warmed up, interleaved).

Each model case times one training step (Adam, lr 1e-3) in five setups:

- (a) ``eager: backward + torch.optim (fused)``: the stateful loop with torch.optim's fastest
  CPU flag;
- (b) ``compiled: torch.compile(model) + compiled opt.step()``: PyTorch's compile recipe;
- (c) ``reference: by-hand pure step, compiled``: ``torch.func.functional_call`` +
  ``torch.func.grad`` + a pure Adam over dicts written here, ``torch.compile(fullgraph=True)``;
- (d) ``modstate eager``: ``ms.split`` / ``ms.apply`` + ``ms.grad`` + ``ms.optim.adam(fused=True)``;
- (e) ``modstate``: the same step under ``torch.compile(fullgraph=True)``. Before timing it is
  checked to make one graph over three steps (a counting backend) and to give (d)'s numbers.

The optimizer case times Adam alone on a 10M-parameter tree: torch.optim's fused step in place,
the allocation floor of a pure step (new params and buffers, allocated and written once), the
compiled by-hand pure Adam, and modstate's pure step eager (fused) and compiled.

Each compiled setup's first call (its compile time) is timed apart, and each setup's peak memory
over two steps above what is live before them (`step_peaks`). The run prints one table,
each setup's median as a ratio to (a) (to the fused step for the optimizer case)::

    python -m pytest benchmarks/compiled_steps_benchmarks_test.py -p no:cacheprovider -q

``--device cuda`` is not an option of this file: set ``MODSTATE_BENCH_DEVICE=cuda`` to run the
same cases on a GPU (torch.optim's fused Adam exists there too).
"""

from __future__ import annotations

import ctypes
import gc
import os
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import pytest
import torch
import torch._dynamo
import torch._functorch.config
import torch._inductor.config
from torch import nn

import modstate as ms
from _tables import show
from _timing import assert_same_trees

LR = 1e-3
DEVICE = torch.device(os.environ.get("MODSTATE_BENCH_DEVICE", "cpu"))
_ROWS: list[str] = []
_HEADER = [
    "| case | (a) | ratio to (a), median | first call (compile) | step peak over live, MiB |",
    "|---|---|---|---|---|",
]


class TinyLM(nn.Module):
    """A 2-layer transformer language model, d 256 (4 heads, feed-forward 1024), vocabulary 1000."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(1000, 256)
        layer = nn.TransformerEncoderLayer(256, 4, 1024, dropout=0.0, batch_first=True)
        self.encoder = nn.TransformerEncoder(layer, 2, enable_nested_tensor=False)
        self.head = nn.Linear(256, 1000)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        return self.head(self.encoder(self.embed(tokens)))


def mlp() -> nn.Module:
    return nn.Sequential(
        nn.Linear(512, 512), nn.ReLU(), nn.Linear(512, 512), nn.ReLU(), nn.Linear(512, 10)
    )


def bn_cnn() -> nn.Module:
    return nn.Sequential(
        nn.Conv2d(3, 32, 3, padding=1), nn.BatchNorm2d(32), nn.ReLU(),
        nn.Conv2d(32, 32, 3, padding=1), nn.BatchNorm2d(32), nn.ReLU(),
        nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(32, 10),
    )  # fmt: skip


def small_mlp() -> nn.Module:
    return nn.Sequential(nn.Linear(64, 128), nn.ReLU(), nn.Linear(128, 10))


def ensemble() -> nn.Module:
    return ms.Ensemble([small_mlp() for _ in range(8)])


def functional_forward(model: nn.Module) -> Callable[[dict, dict, torch.Tensor], torch.Tensor]:
    return lambda p, b, x: torch.func.functional_call(model, (p, b), (x,))


def ensemble_by_hand(model: nn.Module) -> Callable[[dict, dict, torch.Tensor], torch.Tensor]:
    """The members' forward written as torch.func's ensembling recipe: vmap over one member."""
    base = model.member(0)

    def forward(p: dict, b: dict, x: torch.Tensor) -> torch.Tensor:
        members = {k.removeprefix("stacked."): v for k, v in {**p, **b}.items()}
        return torch.vmap(lambda t: torch.func.functional_call(base, t, (x,)))(members)

    return forward


@dataclass
class Case:
    build: Callable[[], nn.Module]
    batch: Callable[[torch.Generator], tuple[torch.Tensor, torch.Tensor]]
    loss: Callable[[torch.Tensor, torch.Tensor], torch.Tensor]
    # (c)'s forward, by hand, made from its model: functional_call unless the case says otherwise
    by_hand: Callable[[nn.Module], Callable[[dict, dict, torch.Tensor], torch.Tensor]] = (
        functional_forward
    )


def classes(shape: tuple[int, ...], count: int) -> Callable[[torch.Generator], tuple]:
    return lambda g: (
        torch.randn(*shape, generator=g),
        torch.randint(0, count, shape[:1], generator=g),
    )


def tokens(g: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    seq = torch.randint(0, 1000, (16, 65), generator=g)
    return seq[:, :-1], seq[:, 1:]


def cross_entropy(out: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    return nn.functional.cross_entropy(out.reshape(-1, out.shape[-1]), y.reshape(-1))


def members_cross_entropy(out: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    # out: (members, batch, classes); every member sees the same labels
    return nn.functional.cross_entropy(out.flatten(0, 1), y.repeat(out.shape[0])) * out.shape[0]


CASES: dict[str, Case] = {
    "MLP 512-512-512-10, batch 256": Case(mlp, classes((256, 512), 10), cross_entropy),
    "transformer LM, 2 layers d 256, 16x64 tokens": Case(TinyLM, tokens, cross_entropy),
    "BN CNN (train mode, through apply), batch 64 at 32x32": Case(
        bn_cnn, classes((64, 3, 32, 32), 10), cross_entropy
    ),
    "Ensemble of 8 MLPs 64-128-10, batch 128": Case(
        ensemble, classes((128, 64), 10), members_cross_entropy, ensemble_by_hand
    ),
}


def built(case: Case) -> nn.Module:
    torch.manual_seed(0)  # every setup starts from the same weights
    return case.build().to(DEVICE).train()


def pure_adam(params: dict, grads: dict, state: dict) -> tuple[dict, dict]:
    """Adam over flat dicts in torch.optim's single-tensor order, written for the reference."""
    t = state["step"] + 1
    b1, b2, eps = 0.9, 0.999, 1e-8
    m = {k: state["m"][k].lerp(g, 1 - b1) for k, g in grads.items()}
    v = {k: state["v"][k] * b2 + (1 - b2) * g * g for k, g in grads.items()}
    step_size = LR / (1 - b1**t)
    root = (1 - b2**t) ** 0.5
    new = {k: p - step_size * m[k] / (v[k].sqrt() / root + eps) for k, p in params.items()}
    return new, {"step": t, "m": m, "v": v}


def adam_state(params: dict) -> dict:
    zeros = {k: torch.zeros_like(v) for k, v in params.items()}
    return {"step": torch.tensor(0.0, device=DEVICE), "m": zeros, "v": dict(zeros)}


def first_call(fn: Callable[[], Any]) -> float:
    """Seconds of `fn`'s first call: its compile, with inductor's and AOT autograd's on-disk
    caches off (a warm cache from an earlier run would hide the compile)."""
    with (
        torch._inductor.config.patch(fx_graph_cache=False),
        torch._functorch.config.patch(enable_autograd_cache=False),
    ):
        start = time.perf_counter()
        fn()
        return time.perf_counter() - start


def graphs_of(step: Callable, carry: tuple, data: tuple, calls: int = 3) -> int:
    """How many graphs Dynamo makes of `step` over `calls` calls (its trace only: the graphs run
    as they are, uncompiled)."""
    count = {"graphs": 0}

    def counting(gm: torch.fx.GraphModule, example_inputs: Any) -> Callable:
        count["graphs"] += 1
        return gm.forward

    compiled = torch.compile(step, backend=counting, fullgraph=True)
    for _ in range(calls):
        carry = compiled(*carry, *data)
    torch._dynamo.reset()
    return count["graphs"]


def _status_bytes(key: str) -> int:
    with open("/proc/self/status") as status:
        for line in status:
            if line.startswith(key):
                return int(line.split()[1]) * 1024
    raise KeyError(key)


def step_peaks(impls: dict[str, Callable[[], Any]]) -> dict[str, float] | None:
    """Each setup's peak memory over two steps, in MiB above what is live before them: on a GPU
    the caching allocator's peak, on Linux the peak resident set (``VmHWM``, reset through
    ``/proc/self/clear_refs``) after the C heap returned its free memory (``malloc_trim``), so
    that a step's new tensors show. None where neither is available."""
    peaks: dict[str, float] = {}
    if DEVICE.type == "cuda":
        for name, fn in impls.items():
            torch.cuda.synchronize()
            base = torch.cuda.memory_allocated()
            torch.cuda.reset_peak_memory_stats()
            fn(), fn()
            torch.cuda.synchronize()
            peaks[name] = (torch.cuda.max_memory_allocated() - base) / 2**20
        return peaks
    try:
        trim = ctypes.CDLL("libc.so.6").malloc_trim
        _status_bytes("VmHWM:")
    except (OSError, KeyError):
        return None
    for name, fn in impls.items():
        gc.collect()
        trim(0)
        base = _status_bytes("VmRSS:")
        with open("/proc/self/clear_refs", "w") as clear:
            clear.write("5")  # resets VmHWM to the resident set now
        fn(), fn()
        peaks[name] = (_status_bytes("VmHWM:") - base) / 2**20
    return peaks


def record(
    request: Any,
    case: str,
    stats: dict,
    base: str,
    firsts: dict[str, float],
    peaks: dict[str, float] | None,
) -> None:
    median = stats[base]["median"]
    ratios = ", ".join(f"{name} {s['median'] / median:.2f}" for name, s in stats.items())
    compile_s = ", ".join(f"{name} {seconds:.1f} s" for name, seconds in firsts.items())
    memory = (
        "not measured here"
        if peaks is None
        else ", ".join(f"{name} {mib:.0f}" for name, mib in peaks.items())
    )
    _ROWS.append(f"| {case} | {median * 1e3:.2f} ms | {ratios} | {compile_s} | {memory} |")
    show(request, [f"compiled steps on {DEVICE.type}:", *_HEADER, *_ROWS])


@pytest.mark.parametrize("name", list(CASES))
def test_compiled_training_step(name: str, compare: Any, request: Any) -> None:
    case = CASES[name]
    x, y = (t.to(DEVICE) for t in case.batch(torch.Generator().manual_seed(1)))

    model_a = built(case)
    opt_a = torch.optim.Adam(model_a.parameters(), lr=LR, fused=True)

    def eager_stateful() -> None:
        opt_a.zero_grad(set_to_none=True)
        case.loss(model_a(x), y).backward()
        opt_a.step()

    model_b = built(case)
    forward_b = torch.compile(model_b)
    opt_b = torch.optim.Adam(model_b.parameters(), lr=LR)

    @torch.compile(fullgraph=False)
    def opt_b_step() -> None:
        opt_b.step()

    def compiled_stateful() -> None:
        opt_b.zero_grad(set_to_none=True)
        case.loss(forward_b(x), y).backward()
        opt_b_step()

    model_c = built(case)
    forward_c = case.by_hand(model_c)

    def by_hand(p: dict, b: dict, s: dict, x: torch.Tensor, y: torch.Tensor) -> tuple:
        def loss(p: dict, b: dict) -> tuple:
            new_b = {k: v.clone() for k, v in b.items()}  # BatchNorm updates these in place
            return case.loss(forward_c(p, new_b, x), y), new_b

        g, new_b = torch.func.grad(loss, has_aux=True)(p, b)
        new_p, new_s = pure_adam(p, g, s)
        return new_p, new_b, new_s

    params_c = {k: v.detach() for k, v in model_c.named_parameters()}
    carry_c = [params_c, {k: v.detach() for k, v in model_c.named_buffers()}, adam_state(params_c)]
    by_hand_compiled = torch.compile(by_hand, fullgraph=True)

    def reference() -> None:
        carry_c[:] = by_hand_compiled(*carry_c, x, y)

    model_m = built(case)
    params, state = ms.split(model_m, detach=True)
    opt = ms.optim.adam(lr=LR, fused=True)

    def loss_m(p: Any, s: Any, x: torch.Tensor, y: torch.Tensor) -> tuple:
        out, new_s = ms.apply(model_m, p, s, x)
        return case.loss(out, y), new_s

    def step(p: Any, s: Any, o: Any, x: torch.Tensor, y: torch.Tensor) -> tuple:
        g, new_s = ms.grad(loss_m, has_aux=True)(p, s, x, y)
        new_p, o = opt.step(p, g, o)
        return new_p, new_s, o

    graphs = graphs_of(step, (params, state, opt.init(params)), (x, y))
    assert graphs == 1, f"{name}: modstate's step made {graphs} graphs"
    step_e = torch.compile(step, fullgraph=True)
    carry_d = [params, state, opt.init(params)]
    carry_e = [params, state, opt.init(params)]

    def modstate_eager() -> None:
        carry_d[:] = step(*carry_d, x, y)

    def modstate_compiled() -> None:
        carry_e[:] = step_e(*carry_e, x, y)

    firsts = {
        "(b)": first_call(compiled_stateful),
        "(c)": first_call(reference),
        "(e)": first_call(modstate_compiled),
    }
    modstate_eager()
    # Adam's first step moves each element by about lr whatever its gradient's size, so where
    # inductor's order of a reduction rounds a near-zero gradient to the other sign, the two
    # steps differ by up to 2 lr there; anything beyond that is a wrong step.
    assert_same_trees(carry_d[0], carry_e[0], what=f"{name}: (e) after one step", atol=2 * LR)
    impls = {
        "(a)": eager_stateful,
        "(b)": compiled_stateful,
        "reference (c)": reference,
        "(d)": modstate_eager,
        "modstate": modstate_compiled,
    }
    stats = compare(f"compiled step: {name}", impls, rounds=9)
    if stats is not None:
        record(request, name, stats, "(a)", firsts, step_peaks(impls))


def test_compiled_optimizer_step(compare: Any, request: Any) -> None:
    """Adam alone on 10 leaves of 1M parameters (10M): the pure step, compiled and not donated,
    beside torch.optim's fused step in place and the allocation floor of a pure step."""
    torch.manual_seed(0)
    params = {f"w{i}": torch.randn(1000, 1000, device=DEVICE) for i in range(10)}
    grads = {k: torch.randn_like(v) for k, v in params.items()}

    tensors = [v.clone() for v in params.values()]
    for t, g in zip(tensors, grads.values(), strict=True):
        t.grad = g
    fused = torch.optim.Adam(tensors, lr=LR, fused=True)

    def floor() -> None:
        for v in params.values():  # params, exp_avg, exp_avg_sq: new, written once
            for _ in range(3):
                torch.empty_like(v).fill_(1.0)

    by_hand_compiled = torch.compile(pure_adam, fullgraph=True)
    carry_c = [params, adam_state(params)]

    def reference() -> None:
        carry_c[:] = by_hand_compiled(carry_c[0], grads, carry_c[1])

    opt = ms.optim.adam(lr=LR, fused=True)
    graphs = graphs_of(lambda p, s, g: opt.step(p, g, s), (params, opt.init(params)), (grads,))
    assert graphs == 1, f"the optimizer step made {graphs} graphs"
    step_e = torch.compile(lambda p, s: opt.step(p, grads, s), fullgraph=True)
    carry_d = [params, opt.init(params)]
    carry_e = [params, opt.init(params)]

    def modstate_eager() -> None:
        carry_d[:] = opt.step(carry_d[0], grads, carry_d[1])

    def modstate_compiled() -> None:
        carry_e[:] = step_e(*carry_e)

    firsts = {"(c)": first_call(reference), "(e)": first_call(modstate_compiled)}
    modstate_eager()
    assert_same_trees(
        carry_d[0], carry_e[0], what="optimizer: (e) after one step", rtol=1e-5, atol=1e-7
    )
    impls = {
        "torch fused, in place": fused.step,
        "floor: allocate + write": floor,
        "reference (c)": reference,
        "(d) eager pure, fused": modstate_eager,
        "modstate": modstate_compiled,
    }
    stats = compare("compiled step: Adam alone, 10M parameters", impls, rounds=9)
    if stats is not None:
        peaks = step_peaks(impls)
        record(request, "Adam alone, 10M parameters", stats, "torch fused, in place", firsts, peaks)
