"""Stateless calls from several threads on one module: throughput, and who gets the right answer.

The issue-19 case: ``Sequential(Linear(256, 256), ReLU(), Linear(256, 256))``, batch 64, no
grad; every thread calls the one module with a tree of its own (a server answering requests with
per-request weights). Each output is compared exactly with ``functional_call``'s, computed
beforehand in a single thread. ``torch.func.functional_call`` is timed beside ``ms.call`` but is not a peer on
correctness: it swaps the tensors into the module for every thread, so from two threads on most of
its outputs are wrong (and on exit it writes what the module holds, another thread's tensors, into
the caller's dict); its wrong-output count is in the impl's name (and ``extra_info``).

Two kinds of case, each timed with the ``compare`` fixture (interleaved rounds):

- ``ms.call N threads x M calls vs 1 x N*M``: the same work from N threads and from one; the
  ratio is N threads' time over one's (below 1: threads help; the issue measured 1.40 for two
  threads before modstate's calls became per-thread);
- ``N x M calls, ms.call beside functional_call``: both, from N threads.

Both with torch's default intra-op threads and with ``torch.set_num_threads(1)`` (one core per
calling thread, the usual server set-up). :func:`thread_throughput` gives the same figures as a
table for a report: ``python benchmarks/threads_benchmarks_test.py`` prints it.
"""

from __future__ import annotations

import sys
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import pytest
import torch
from torch import nn
from torch.func import functional_call

import modstate as ms
from _timing import assert_same_trees
from conftest import QUICK

BATCH, WIDTH = 64, 256
CALLS = 50  # per thread, per timed run
MODEL = "Sequential(Linear(256,256), ReLU(), Linear(256,256)), batch 64"
SHORT = "MLP 256, batch 64"

Call = Callable[[nn.Module, dict[str, Any], torch.Tensor], torch.Tensor]
IMPLS: dict[str, Call] = {
    "ms.call": lambda model, tree, x: ms.call(model, tree, x),
    "torch.func.functional_call": lambda model, flat, x: functional_call(model, flat, (x,)),
}


class Setup:
    """One module, one tree per thread (nested for ``ms.call``, flat for ``functional_call``),
    one input, and each thread's expected output: ``functional_call``'s from this one thread,
    which ``ms.call``'s here must equal bit for bit (the same ops on the same tensors)."""

    def __init__(self, threads: int) -> None:
        torch.manual_seed(0)
        self.model = nn.Sequential(nn.Linear(WIDTH, WIDTH), nn.ReLU(), nn.Linear(WIDTH, WIDTH))
        self.x = torch.randn(BATCH, WIDTH)
        self.trees = [
            ms.tree.map(torch.randn_like, ms.extract(self.model, detach=True))
            for _ in range(threads)
        ]
        self.flats = [ms.flatten(tree) for tree in self.trees]
        with torch.no_grad():
            self.expected = [functional_call(self.model, f, (self.x,)) for f in self.flats]
            for tree, expected in zip(self.trees, self.expected, strict=True):
                what = f"{MODEL}: ms.call vs functional_call, one thread"
                assert_same_trees(expected, ms.call(self.model, tree, self.x), what=what)
        self.own = [dict(m._parameters) for m in self.model.modules()]

    def argument(self, impl: str, i: int) -> dict[str, Any]:
        return self.trees[i] if impl == "ms.call" else self.flats[i]


def run_threads(setup: Setup, impl: str, threads: int, calls: int) -> tuple[float, int]:
    """``threads`` threads, started together, each making ``calls`` calls with its own tree;
    the seconds from the start to the last one's end, and how many outputs were wrong."""
    fn = IMPLS[impl]
    barrier = threading.Barrier(threads + 1)
    outputs: list[list[torch.Tensor]] = [[] for _ in range(threads)]

    def work(i: int) -> None:
        argument, out = setup.argument(impl, i), outputs[i]
        with torch.no_grad():  # grad mode is per thread
            barrier.wait()
            for _ in range(calls):
                out.append(fn(setup.model, argument, setup.x))

    pool = [threading.Thread(target=work, args=(i,)) for i in range(threads)]
    for thread in pool:
        thread.start()
    barrier.wait()
    start = time.perf_counter()
    for thread in pool:
        thread.join()
    elapsed = time.perf_counter() - start
    wrong = sum(
        not torch.equal(out, setup.expected[i]) for i in range(threads) for out in outputs[i]
    )
    _repair(setup)
    return elapsed, wrong


def _repair(setup: Setup) -> None:
    """functional_call from several threads leaves the module holding some thread's tree, and
    writes what the module held on exit into the caller's dict (another thread's tensors): put
    the module's own tensors back and make the dicts again, so that every run starts afresh."""
    for module, own in zip(setup.model.modules(), setup.own, strict=True):
        module._parameters.update(own)
    setup.flats = [ms.flatten(tree) for tree in setup.trees]


@contextmanager
def intra_op_threads(count: int | None) -> Iterator[None]:
    """``torch.set_num_threads(count)`` for the block (None: leave torch's default)."""
    before = torch.get_num_threads()
    if count is not None:
        torch.set_num_threads(count)
    try:
        yield
    finally:
        torch.set_num_threads(before)


def thread_throughput(
    threads: tuple[int, ...] = (1, 2, 4),
    *,
    calls: int = CALLS,
    rounds: int = 5,
    intra_op: int | None = None,
) -> list[dict[str, Any]]:
    """Calls per second of ``ms.call`` and ``functional_call`` on one module from 1, 2, 4 threads.

    Every thread makes ``calls`` calls with its own tree; runs are interleaved over ``rounds``
    rounds (every impl and thread count once per round) and the fastest round counts. Returns one
    row per impl and thread count: ``impl``, ``threads``, ``calls_per_s`` (all threads together),
    ``vs_1_thread`` (throughput over the same impl's with one thread), ``wrong`` and ``outputs``
    (wrong outputs over all rounds, out of how many), ``wrong_per_1000``. ``intra_op``: torch's
    intra-op threads during the runs (``torch.set_num_threads``), None for torch's default.
    """
    setup = Setup(max(threads))
    best: dict[tuple[str, int], float] = {}
    wrong: dict[tuple[str, int], int] = {}
    with intra_op_threads(intra_op):
        for impl in IMPLS:  # warm-up
            run_threads(setup, impl, 1, calls // 4 + 1)
        for _ in range(rounds):
            for impl in IMPLS:
                for count in threads:
                    elapsed, bad = run_threads(setup, impl, count, calls)
                    key = (impl, count)
                    best[key] = min(best.get(key, float("inf")), elapsed)
                    wrong[key] = wrong.get(key, 0) + bad
    rows = []
    for impl in IMPLS:
        single = calls / best[(impl, 1)] if 1 in threads else None
        for count in threads:
            rate = count * calls / best[(impl, count)]
            outputs = rounds * count * calls
            rows.append(
                {
                    "impl": impl,
                    "threads": count,
                    "calls_per_s": rate,
                    "vs_1_thread": None if single is None else rate / single,
                    "wrong": wrong[(impl, count)],
                    "outputs": outputs,
                    "wrong_per_1000": 1000 * wrong[(impl, count)] / outputs,
                }
            )
    return rows


def format_throughput(rows: list[dict[str, Any]], intra_op: int | None = None) -> str:
    threads = "torch default" if intra_op is None else str(intra_op)
    lines = [
        f"threads calling one module: {MODEL}, no grad (intra-op threads: {threads})",
        f"  {'impl':<28}{'threads':>8}{'calls/s':>10}{'vs 1 thread':>13}{'wrong per 1000':>16}",
    ]
    for row in rows:
        ratio = "-" if row["vs_1_thread"] is None else f"{row['vs_1_thread']:.2f}x"
        lines.append(
            f"  {row['impl']:<28}{row['threads']:>8}{row['calls_per_s']:>10.0f}{ratio:>13}"
            f"{row['wrong_per_1000']:>16.0f}"
        )
    return "\n".join(lines)


# -- the pytest-benchmark cases (python -m modstate bench) -----------------------------------------

INTRA_OP = [None, 1]
INTRA_OP_IDS = ["default intra-op threads", "1 intra-op thread"]
ROUNDS = 3 if QUICK else 7


def _label(intra_op: int | None) -> str:
    return "threads" if intra_op is None else "threads, set_num_threads(1)"


@pytest.mark.parametrize("intra_op", INTRA_OP, ids=INTRA_OP_IDS)
@pytest.mark.parametrize("threads", [2, 4])
def test_thread_scaling(compare, threads, intra_op):
    """The same work, ``threads`` x CALLS calls, from ``threads`` threads and from one (a thread
    too, not the main one, so that both start alike)."""
    setup = Setup(threads)
    wrong = {"n": 0}

    def run(count: int, calls: int) -> Callable[[], None]:
        def timed() -> None:
            wrong["n"] += run_threads(setup, "ms.call", count, calls)[1]

        return timed

    with intra_op_threads(intra_op):
        run(threads, 2)()  # checked before timing too: every output right from the threads
        assert wrong["n"] == 0
        compare(
            f"{_label(intra_op)}: ms.call {threads} threads x {CALLS} calls vs 1 x "
            f"{threads * CALLS} ({SHORT})",
            {"modstate": run(threads, CALLS), "1 thread": run(1, threads * CALLS)},
            rounds=ROUNDS,
        )
    assert wrong["n"] == 0


@pytest.mark.parametrize("intra_op", INTRA_OP, ids=INTRA_OP_IDS)
@pytest.mark.parametrize("threads", [1, 2, 4])
def test_threads_beside_functional_call(compare, benchmark, threads, intra_op):
    setup = Setup(threads)
    counts = {impl: [0, 0] for impl in IMPLS}  # wrong, outputs

    def runner(impl: str) -> Callable[[], None]:
        def run() -> None:
            counts[impl][0] += run_threads(setup, impl, threads, CALLS)[1]
            counts[impl][1] += threads * CALLS

        return run

    with intra_op_threads(intra_op):
        runner("ms.call")()  # checked before timing too: every output right from the threads
        assert counts["ms.call"][0] == 0
        runner("torch.func.functional_call")()  # its wrong-output count goes in its name
        wrong, outputs = counts["torch.func.functional_call"]
        peer = f"torch.func.functional_call ({wrong}/{outputs} wrong)"
        compare(
            f"{_label(intra_op)}: {threads} x {CALLS} calls, ms.call vs functional_call ({SHORT})",
            {"modstate": runner("ms.call"), peer: runner("torch.func.functional_call")},
            rounds=ROUNDS,
        )
    benchmark.extra_info["wrong_outputs"] = {impl: count for impl, count in counts.items()}
    assert counts["ms.call"][0] == 0


if __name__ == "__main__":
    for intra_op in (None, 1):
        print(format_throughput(thread_throughput(intra_op=intra_op), intra_op))
        sys.stdout.flush()
