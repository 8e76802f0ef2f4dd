"""Shared set-up for the benchmark suites.

Run them with ``python -m pytest benchmarks/`` (or ``python -m modstate bench`` for the
side-by-side report). Every benchmark sets ``benchmark.group`` to its case and
``benchmark.extra_info["impl"]`` to ``"modstate"`` or the peer's name, so that the report can pair
them; within a group exactly one impl is ``"modstate"``.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any

import pytest

try:
    import modstate  # noqa: F401
except ImportError:
    # Running from a source checkout that is not installed: use the package next door.
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "src"))

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _timing import interleave, summarize

QUICK = os.environ.get("MODSTATE_BENCH_QUICK") == "1"


@pytest.fixture
def compare(benchmark) -> Callable[..., dict[str, dict[str, float]] | None]:
    """Time several implementations of one case fairly, and record them for the report.

    ``compare(case, {"modstate": fn, "torch.func": fn2, "baseline: plain forward": fn0})``
    warms every zero-argument ``fn`` up, times them in interleaved rounds (``_timing``), and
    stores each one's median, min and interquartile range in the benchmark's
    ``extra_info["interleaved"]``, which ``python -m modstate bench`` reads. Exactly one impl is
    ``"modstate"``; an impl starting with ``"baseline"`` is the work every implementation does
    anyway. ``missing`` names peers that could not run here (not installed, see `optional`):
    the report lists them. Under ``--benchmark-disable`` (the CI smoke run) every fn runs once,
    untimed.
    """

    def run(
        case: str,
        impls: dict[str, Callable[[], Any]],
        *,
        rounds: int | None = None,
        missing: Iterable[str] = (),
    ):
        if "modstate" not in impls:
            raise ValueError(f"{case}: no 'modstate' entry among {sorted(impls)}")
        benchmark.group = case
        benchmark.extra_info["impl"] = "modstate"
        if missing:
            benchmark.extra_info["missing"] = list(missing)
        if benchmark.disabled:
            for impl, fn in impls.items():
                if impl != "modstate":
                    fn()
            benchmark(impls["modstate"])  # runs it once, untimed
            return None
        count = rounds if rounds is not None else (5 if QUICK else 15)
        samples = interleave(impls, rounds=count, warmup_s=0.05 if QUICK else 0.3)
        stats = {impl: summarize(values) for impl, values in samples.items()}
        benchmark.extra_info["interleaved"] = stats
        # pytest-benchmark wants one measurement of its own; one call is enough.
        benchmark.pedantic(impls["modstate"], rounds=1, iterations=1)
        return stats

    return run
