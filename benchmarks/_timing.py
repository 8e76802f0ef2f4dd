"""Fair timing of several implementations of one case: warmed up, then interleaved round by round.

On a shared machine what is timed first is slow (caches, allocator, CPU frequency), and load
drifts over seconds. Timing implementation A for a second and then B for a second turns that drift
into a bias. Here every implementation is warmed up first, then each *round* times every
implementation once, in an order that rotates from round to round; the figures are the median and
min over rounds, with the interquartile range as the spread.

    >>> samples = interleave({"a": lambda: sum(range(100)), "b": lambda: sum(range(200))}, rounds=5)
    >>> sorted(samples), len(samples["a"])
    (['a', 'b'], 5)

Every case first checks that its implementations compute the same thing, with
`assert_same_trees`: trees (nested mappings such as dicts and TensorDicts, lists, tuples) are
flattened here, not with modstate's ``flatten``, so that the check does not lean on the code it
checks. (The helper lives here, not in a module of its own, because the report's tests copy a
suite with ``conftest.py`` and ``_timing.py`` only.)
"""

from __future__ import annotations

import gc
import importlib
import json
import os
import statistics
import tempfile
import time
from collections.abc import Callable
from types import ModuleType
from typing import Any

import torch

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


# -- the check before timing -----------------------------------------------------------------------


def flat(tree: Any, prefix: str = "") -> dict[str, Any]:
    """``{"a.b": leaf}`` for a tree of mappings (anything with ``items()``), lists and tuples."""
    if isinstance(tree, torch.Tensor) or not (
        hasattr(tree, "items") or isinstance(tree, (list, tuple))
    ):
        return {prefix: tree}
    pairs = tree.items() if hasattr(tree, "items") else enumerate(tree)
    out: dict[str, Any] = {}
    for key, value in pairs:
        out.update(flat(value, f"{prefix}.{key}" if prefix else str(key)))
    return out


def assert_same_trees(
    expected: Any,
    actual: Any,
    *,
    what: str,
    atol: float = 0.0,
    rtol: float = 0.0,
    same_storage: bool = False,
) -> None:
    """The same paths, and at each one the same leaf: equal within ``atol``/``rtol`` (dtype and
    shape too; bit for bit when both are 0), and with ``same_storage`` also the same memory
    (``data_ptr``), for views and for trees of a module's own tensors. The message names ``what``
    (the case) and the first differing path.

        >>> assert_same_trees({"a": [torch.ones(2)]}, {"a": [torch.ones(2)]}, what="demo")
        >>> assert_same_trees({"a": torch.ones(2)}, {"a": torch.zeros(2)}, what="demo")  # doctest: +ELLIPSIS
        Traceback (most recent call last):
        ...
        AssertionError: demo: at 'a': Tensor-likes are not equal!
        ...
    """
    want, got = flat(expected), flat(actual)
    if want.keys() != got.keys():
        missing, extra = sorted(want.keys() - got.keys()), sorted(got.keys() - want.keys())
        raise AssertionError(f"{what}: paths differ: missing {missing[:5]}, extra {extra[:5]}")
    for key, leaf in want.items():
        other, path = got[key], key or "(the whole tree)"
        if not isinstance(leaf, torch.Tensor):
            assert other == leaf, f"{what}: at {path!r}: {other!r} != {leaf!r}"
            continue
        if same_storage:
            assert other.data_ptr() == leaf.data_ptr(), f"{what}: at {path!r}: not the same memory"
            layout = (other.dtype, other.shape, other.stride())
            if layout == (leaf.dtype, leaf.shape, leaf.stride()):
                continue  # the same memory read the same way: the same values, unread
        torch.testing.assert_close(
            other,
            leaf,
            atol=atol,
            rtol=rtol,
            msg=lambda text, path=path: f"{what}: at {path!r}: {text}",
        )


def peak_allocated(fn) -> int:
    """The peak of the bytes that torch's allocator holds for tensors made during one call of
    ``fn``, as ``torch.profiler`` (``profile_memory=True``) records every allocation and free."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as recorded:
        out = fn()
    handle, path = tempfile.mkstemp(suffix=".json")
    os.close(handle)
    try:
        recorded.export_chrome_trace(path)
        with open(path) as trace:
            events = json.load(trace)["traceEvents"]
    finally:
        os.remove(path)
    del out
    memory = [e["args"] for e in events if e.get("name") == "[memory]"]
    if not memory:
        return 0
    start = memory[0]["Total Allocated"] - memory[0]["Bytes"]  # held before the first event
    return max(m["Total Allocated"] for m in memory) - start
