"""Ensembles of real architectures: ``ms.Ensemble`` (and ``ms.vmap_call`` on stacked trees) beside a
loop, ``vmap(functional_call)`` and
the hand-written batched limit; and the peak memory of ``Ensemble.from_factory``.

Cases (issue 17), each timed with the ``compare`` fixture (warmed up, interleaved rounds):

- an 8-member transformer encoder (2 layers, d=64, 4 heads, feed-forward 128, 8x32 tokens),
  train step (forward and backward), beside the hand-written batched form;
- an 8-member small ResNet (stem + 2 basic blocks, BatchNorm2d, c=16, 8x3x16x16), train step,
  beside the hand-written batched form;
- 4 torchvision ResNets and 4 Hugging Face GPT-2s (the tiny configurations of
  ``tests/ecosystem/models.py``), forward without grad and train step (GPT-2 with dropout,
  ``randomness="different"``).

Every implementation is checked against the loop first: outputs, and in a train step gradients.
The ratio table of all ensemble cases, the Sequential ones of ``ensemble_benchmarks_test.py``
included, prints in about a minute on 2 cores::

    python benchmarks/ensemble_architectures_benchmarks_test.py            # wall time
    python benchmarks/ensemble_architectures_benchmarks_test.py --threads 1 --cpu-time

``--cpu-time`` times the calling thread's CPU time instead of wall time (with ``--threads 1``):
steadier on a machine shared with other work. ``--memory`` runs the memory case alone.
"""

from __future__ import annotations

import argparse
import copy
import functools
import json
import resource
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

if __name__ == "__main__":  # measure this checkout's modstate, whatever is installed
    from pathlib import Path

    sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "src"))

import pytest
import torch
from torch import Tensor, nn
from torch.func import functional_call, stack_module_state

import modstate as ms
from _ensemble_models import (
    SmallResNet,
    encoder,
    hand_batched_encoder,
    hand_batched_resnet,
    zoo,
)
from modstate.ensemble._factory import (  # the seeds from_factory gives its members
    draw_base_seed,
    member_seed,
)


@dataclass(frozen=True)
class Case:
    name: str
    build: Callable[[], nn.Module]
    count: int
    input: Callable[[], Any]
    train_step: bool  # forward and backward; else forward without grad (eval mode)
    hand: Callable[[list[nn.Module]], tuple[Callable[[Tensor], Tensor], list[Tensor]]] | None = None
    output: Callable[[Any], Tensor] = lambda out: out
    randomness: str = "error"
    library: str = "torch"
    rounds: int = 15


def _gpt2() -> nn.Module:
    return zoo().gpt2()


def _resnet() -> nn.Module:
    return zoo().resnet()


def _logits(out: Any) -> Tensor:
    return out.logits


def _tokens() -> Tensor:
    return torch.randint(0, 64, (4, 32), generator=torch.Generator().manual_seed(1))


CASES = [
    Case(
        "transformer encoder (8 x 2 layers, d=64, 4 heads, 8x32 tokens), train step",
        encoder, 8, lambda: torch.randn(8, 32, 64), True, hand_batched_encoder,
    ),
    Case(
        "small ResNet (8 x stem + 2 blocks, BatchNorm2d, c=16, 8x3x16x16), train step",
        SmallResNet, 8, lambda: torch.randn(8, 3, 16, 16), True, hand_batched_resnet,
    ),
    Case(
        "torchvision ResNet (4 x zoo config, 8x3x64x64), forward",
        _resnet, 4, lambda: torch.randn(8, 3, 64, 64), False, library="torchvision", rounds=7,
    ),
    Case(
        "torchvision ResNet (4 x zoo config, 8x3x64x64), train step",
        _resnet, 4, lambda: torch.randn(8, 3, 64, 64), True, library="torchvision", rounds=5,
    ),
    Case(
        "GPT-2 (4 x zoo config, 4x32 tokens), forward",
        _gpt2, 4, _tokens, False, output=_logits, library="transformers",
    ),
    Case(
        "GPT-2 (4 x zoo config, 4x32 tokens), train step, randomness='different'",
        _gpt2, 4, _tokens, True, output=_logits, randomness="different", library="transformers",
    ),
]  # fmt: skip


def models_of(case: Case) -> list[nn.Module]:
    torch.manual_seed(0)
    return [case.build().train(case.train_step) for _ in range(case.count)]


def runners(
    case: Case, models: list[nn.Module]
) -> dict[str, tuple[Callable[[Any], Tensor], list[Tensor]]]:
    """Every implementation: a function of the input returning the stacked outputs, and the
    tensors whose gradients a train step makes (cleared after each step). Each gets its own
    copies of the models (BatchNorm statistics move on every training call)."""
    output = case.output
    out: dict[str, tuple[Callable[[Any], Tensor], list[Tensor]]] = {}
    ensemble = ms.Ensemble(copy.deepcopy(models), randomness=case.randomness)
    out["modstate"] = (lambda x: output(ensemble(x)), list(ensemble.parameters()))
    stacked = ms.stack_modules(copy.deepcopy(models))
    template = copy.deepcopy(models[0])
    out["modstate vmap_call"] = (
        lambda x: output(ms.vmap_call(template, stacked, x, randomness=case.randomness)),
        # each tensor once (a tie is one tensor at two paths)
        list({id(t): t for t in ms.flatten(stacked).values() if t.requires_grad}.values()),
    )
    loop = copy.deepcopy(models)
    out["loop"] = (
        lambda x: torch.stack([output(m(x)) for m in loop]),
        [p for m in loop for p in m.parameters()],
    )
    params, buffers = stack_module_state(copy.deepcopy(models))
    base = copy.deepcopy(models[0])  # not on meta: Hugging Face models make tensors on self.device

    def member(p: Any, b: Any, x: Any) -> Tensor:
        return output(functional_call(base, (p, b), (x,)))

    vmapped = torch.vmap(member, in_dims=(0, 0, None), randomness=case.randomness)
    out["torch.func.functional_call"] = (
        lambda x: vmapped(params, buffers, x),
        list(params.values()),
    )
    if case.hand is not None:
        out["hand-batched"] = case.hand(copy.deepcopy(models))
    return out


# Batched kernels (bmm, grouped convolutions) sum in another order than each member's own: the
# outputs and gradients of these small nets differ from the loop's in the last bits.
TOLERANCE = {"atol": 1e-4, "rtol": 1e-4}


def check_against_the_loop(case: Case, models: list[nn.Module], x: Any) -> None:
    """Every implementation's outputs equal the loop's; in a train step its gradients too. Where
    members draw dropout masks apart (``randomness="different"``) the same step runs in eval
    mode (no dropout) for the check: draws cannot match a loop's."""
    deterministic = case.randomness == "error"
    if not deterministic:
        for m in models:
            m.eval()
    fresh = runners(case, models)
    loop, loop_params = fresh.pop("loop")
    # The timed step's loss is a mean; its gradients are too small for TOLERANCE's atol to see
    # a wrong one (measured: 2x gradients passed), so the check's loss is the sum.
    with torch.set_grad_enabled(case.train_step):
        expected = loop(x)
        if case.train_step:
            expected.square().sum().backward()
        for name, (run, params) in fresh.items():
            out = run(x)
            torch.testing.assert_close(
                out, expected.detach(), **TOLERANCE, msg=lambda m, name=name: f"{name}: {m}"
            )
            if case.train_step:
                out.square().sum().backward()
                _assert_same_grads(params, loop_params, case.count, name)
    for m in models:
        m.train(case.train_step)


def _assert_same_grads(stacked: list[Tensor], loop: list[Tensor], count: int, name: str) -> None:
    """The stacked tensors' gradients are the members' own, member by member, in order."""
    per_member = len(loop) // count
    assert len(stacked) == per_member, f"{name}: {len(stacked)} tensors, {per_member} per member"
    for j, grad in enumerate(p.grad for p in stacked):
        want = torch.stack([loop[i * per_member + j].grad for i in range(count)])
        torch.testing.assert_close(
            grad, want, **TOLERANCE, msg=lambda m, j=j: f"{name}: gradient {j}: {m}"
        )


def timed_impls(case: Case, models: list[nn.Module], x: Any) -> dict[str, Callable[[], Any]]:
    impls = {}
    for name, (run, params) in runners(case, models).items():
        if case.train_step:

            def step(run: Callable[[Any], Tensor] = run, params: list[Tensor] = params) -> None:
                run(x).square().mean().backward()
                for p in params:
                    p.grad = None

            impls[name] = step
        else:
            impls[name] = functools.partial(_no_grad, run, x)
    return impls


def _no_grad(run: Callable[[Any], Tensor], x: Any) -> Tensor:
    with torch.no_grad():
        return run(x)


def _available(case: Case) -> bool:
    """Whether the case's library is installed; any other failure to import it is raised (the
    skip of a missing library fails the run unless tests/allowed_skips.toml lists it)."""
    if case.library != "torch":
        zoo()  # first: it makes torchvision importable where its C++ extension cannot load
    try:
        __import__(case.library)
    except ImportError:
        return False
    return True


@pytest.mark.parametrize(
    "case", CASES, ids=lambda c: c.name.split(" (")[0] + (" train" if c.train_step else " forward")
)
def test_ensemble_architecture(compare, case: Case) -> None:
    if not _available(case):
        pytest.skip(f"{case.library} is not installed")
    models = models_of(case)
    torch.manual_seed(1)
    x = case.input()
    check_against_the_loop(case, models, x)
    compare(f"ensemble: {case.name}", timed_impls(case, models, x), rounds=case.rounds)


# -- from_factory's peak memory --------------------------------------------------------------------

MEMORY_MEMBERS = 48  # 48 members of 2 x Linear(1000, 1000): 384 MB (366.6 MiB) stacked


def memory_factory() -> nn.Module:
    return nn.Sequential(nn.Linear(1000, 1000), nn.Linear(1000, 1000))


def _peak_growth(how: str) -> dict[str, float]:
    """Run in a fresh process: build the ensemble ``how`` and report the peak RSS growth."""
    torch.manual_seed(0)
    memory_factory()  # torch's first allocations are not the ensemble's
    before = _resident_mb()
    _reset_peak()
    if how == "Ensemble.from_factory":
        built = ms.Ensemble.from_factory(memory_factory, MEMORY_MEMBERS)
        tensors = {name.removeprefix("stacked."): t for name, t in built.named_parameters()}
    elif how == "Ensemble(list of models)":
        built = ms.Ensemble(_members_as_from_factory_seeds_them())
        tensors = {name.removeprefix("stacked."): t for name, t in built.named_parameters()}
    else:  # torch.func.stack_module_state, the tutorial's recipe
        tensors, _ = stack_module_state(_members_as_from_factory_seeds_them())
    growth = _peak_mb() - before
    stacked = sum(t.numel() * t.element_size() for t in tensors.values())
    # What was built, for the check that the three ways build the same ensemble.
    sums = {name: t.detach().sum(dtype=torch.float64).item() for name, t in tensors.items()}
    return {"growth_mb": growth, "stacked_mb": stacked / 2**20, "sums": sums}


def _members_as_from_factory_seeds_them() -> list[nn.Module]:
    """The members, each built under the seed from_factory gives it, so that every way of
    building makes the same ensemble (the check compares them)."""
    base = draw_base_seed()
    members = []
    for index in range(MEMORY_MEMBERS):
        torch.manual_seed(member_seed(base, index))
        members.append(memory_factory())
    return members


def _status_mb(field: str) -> float | None:
    try:
        with open("/proc/self/status") as status:
            for line in status:
                if line.startswith(field + ":"):
                    return int(line.split()[1]) / 1024
    except OSError:
        pass
    return None


def _resident_mb() -> float:
    now = _status_mb("VmRSS")
    return now if now is not None else resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def _reset_peak() -> None:
    """Start the peak RSS afresh (Linux: ``/proc/self/clear_refs``); ``ru_maxrss`` cannot be
    used here, since it keeps the parent's peak across the ``exec`` of a child process."""
    try:
        with open("/proc/self/clear_refs", "w") as clear:
            clear.write("5")
    except OSError:
        pass


def _peak_mb() -> float:
    peak = _status_mb("VmHWM")
    return peak if peak is not None else resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def memory_report() -> dict[str, dict[str, float]]:
    """Peak RSS growth of each way to build a 384 MB ensemble, each in its own process."""
    out = {}
    for how in (
        "Ensemble.from_factory",
        "Ensemble(list of models)",
        "torch.func.stack_module_state",
    ):
        done = subprocess.run(
            [sys.executable, __file__, "--memory-child", how],
            capture_output=True, text=True, check=True,
        )  # fmt: skip
        out[how] = json.loads(done.stdout.strip().splitlines()[-1])
    return out


def test_from_factory_peak_memory() -> None:
    """Peak memory is measured, not timed: each way of building runs in its own process, and
    the figures print (``-s``) beside the peers' (the report shows times only)."""
    report = memory_report()
    built = report["Ensemble.from_factory"]["sums"]
    for how, figures in report.items():
        # The same members stacked: each parameter's sum, bit for bit (same values, same order).
        assert figures["sums"] == built, f"{how} built another ensemble than from_factory"
        print(_memory_line(how, figures))
    mine = report["Ensemble.from_factory"]
    assert mine["growth_mb"] <= 1.25 * mine["stacked_mb"]  # issue 17's bound


def _memory_line(how: str, figures: dict[str, float]) -> str:
    ratio = figures["growth_mb"] / figures["stacked_mb"]
    return (
        f"{how:32s} peak RSS growth {figures['growth_mb']:7.1f} MiB for "
        f"{figures['stacked_mb']:.1f} MiB stacked ({ratio:.2f}x)"
    )


# -- the ratio table -------------------------------------------------------------------------------


def _table(args: argparse.Namespace) -> None:
    import _timing
    import ensemble_benchmarks_test as sequential
    from _timing import interleave, summarize

    if args.cpu_time:
        _timing.time.perf_counter = time.thread_time  # type: ignore[attr-defined]
    rows: list[tuple[str, dict[str, dict[str, float]]]] = []
    for case in CASES:
        if (args.k and args.k not in case.name) or not _available(case):
            continue
        models = models_of(case)
        torch.manual_seed(1)
        x = case.input()
        check_against_the_loop(case, models, x)
        rounds = max(3, case.rounds // 2) if args.quick else case.rounds
        samples = interleave(timed_impls(case, models, x), rounds=rounds, warmup_s=0.3)
        rows.append((case.name, {k: summarize(v) for k, v in samples.items()}))
        _print_row(*rows[-1])
    for seq in sequential.CASES:
        if args.k and args.k not in seq.name:
            continue
        models = sequential.models_of(seq)
        torch.manual_seed(1)
        x = seq.input()
        impls = {}
        with torch.no_grad():
            for impl in ("modstate", "loop", "torch.func.functional_call", "baddbmm chain"):
                if sequential.applies(impl, seq):
                    run = sequential.runner(impl, seq, models)
                    impls[impl] = functools.partial(_no_grad, run, x)
        samples = interleave(impls, rounds=5 if args.quick else 15, warmup_s=0.3)
        rows.append(
            (
                seq.name.removeprefix("ensemble: ") + ", forward",
                {k: summarize(v) for k, v in samples.items()},
            )
        )
        _print_row(*rows[-1])


def _print_row(name: str, stats: dict[str, dict[str, float]]) -> None:
    mine = stats["modstate"]
    print(name)
    for impl, figures in stats.items():
        print(
            f"    {impl:28s} median {figures['median'] * 1e3:9.3f} ms   min "
            f"{figures['min'] * 1e3:9.3f} ms   Ensemble / this: median "
            f"{mine['median'] / figures['median']:5.2f}, min {mine['min'] / figures['min']:5.2f}"
        )
    sys.stdout.flush()


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--threads", type=int, default=None)
    parser.add_argument("--cpu-time", action="store_true")
    parser.add_argument("--quick", action="store_true", help="fewer rounds")
    parser.add_argument("-k", default="", help="only cases whose name contains this")
    parser.add_argument("--memory", action="store_true")
    parser.add_argument("--memory-child", default=None, help=argparse.SUPPRESS)
    arguments = parser.parse_args()
    if arguments.threads:
        torch.set_num_threads(arguments.threads)
    if arguments.memory_child:
        print(json.dumps(_peak_growth(arguments.memory_child)))
    elif arguments.memory:
        for how, figures in memory_report().items():
            print(_memory_line(how, figures))
    else:
        _table(arguments)
        if not arguments.k:
            print("from_factory, 48 members of 8 MB (each way in its own process)")
            for how, figures in memory_report().items():
                print("    " + _memory_line(how, figures))
