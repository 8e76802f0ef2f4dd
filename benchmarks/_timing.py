"""Fair timing of several implementations of one case: warmed up, then interleaved round by round.

On a shared machine what is timed first is slow (caches, allocator, CPU frequency), and load
drifts over seconds. Timing implementation A for a second and then B for a second turns that drift
into a bias. Here every implementation is warmed up first, then each *round* times every
implementation once, in an order that rotates from round to round; the figures are the median and
min over rounds, with the interquartile range as the spread.

    >>> samples = interleave({"a": lambda: sum(range(100)), "b": lambda: sum(range(200))}, rounds=5)
    >>> sorted(samples), len(samples["a"])
    (['a', 'b'], 5)
"""

from __future__ import annotations

import gc
import importlib
import statistics
import time
from collections.abc import Callable
from types import ModuleType
from typing import Any

Impl = Callable[[], Any]


def _time_calls(fn: Impl, calls: int) -> float:
    start = time.perf_counter()
    for _ in range(calls):
        fn()
    return (time.perf_counter() - start) / calls


def _calls_per_round(fn: Impl, round_s: float) -> int:
    """How many calls of ``fn`` fill about ``round_s`` seconds (at least one)."""
    calls = 1
    while True:
        elapsed = _time_calls(fn, calls) * calls
        if elapsed >= round_s / 4 or calls >= 1 << 20:
            return max(1, round(calls * round_s / max(elapsed, 1e-9)))
        calls *= 4


def interleave(
    impls: dict[str, Impl], *, rounds: int = 15, warmup_s: float = 0.2, round_s: float = 0.02
) -> dict[str, list[float]]:
    """Seconds per call of each implementation, one sample per round, rounds interleaved.

    Each implementation first runs for at least ``warmup_s`` seconds (and at least three times).
    Then, ``rounds`` times, every implementation is timed over enough calls to fill about
    ``round_s`` seconds, the order rotating by one each round. The garbage collector is paused
    while timing.
    """
    names = list(impls)
    for name in names:
        fn = impls[name]
        deadline, done = time.perf_counter() + warmup_s, 0
        while done < 3 or time.perf_counter() < deadline:
            fn()
            done += 1
    calls = {name: _calls_per_round(impls[name], round_s) for name in names}
    samples: dict[str, list[float]] = {name: [] for name in names}
    was_enabled = gc.isenabled()
    gc.disable()
    try:
        for index in range(rounds):
            shift = index % len(names)
            for name in names[shift:] + names[:shift]:
                samples[name].append(_time_calls(impls[name], calls[name]))
            gc.collect()
    finally:
        if was_enabled:
            gc.enable()
    return samples


def summarize(samples: list[float]) -> dict[str, float]:
    """Median, min, max and interquartile range (q1, q3) of one implementation's samples."""
    ordered = sorted(samples)
    if len(ordered) >= 2:
        q1, _, q3 = statistics.quantiles(ordered, n=4, method="inclusive")
    else:
        q1 = q3 = ordered[0]
    return {
        "median": statistics.median(ordered),
        "min": ordered[0],
        "max": ordered[-1],
        "q1": q1,
        "q3": q3,
        "rounds": len(ordered),
    }


def optional(module: str) -> ModuleType | None:
    """A peer's package, or None when it is not installed: leave its entry out and name it in
    ``compare(..., missing=[...])``."""
    try:
        return importlib.import_module(module)
    except ImportError:
        return None
