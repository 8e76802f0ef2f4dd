"""Run a function on N fresh processes joined in a gloo process group on 127.0.0.1.

``run_ranks(fn, world_size, *args)`` spawns ``world_size`` processes, each of which joins one
gloo group and calls ``fn(rank, world_size, *args)``; it returns the per-rank return values
(small picklable values: no tensors, which would travel as shared memory) in rank order.

- Ports: this process owns the rendezvous ``TCPStore``, bound to port 0 so the OS picks a free
  port, and keeps it until the ranks are done: no port can be taken between choosing and using.
- Bounded: everything (start-up included) must finish within ``timeout`` seconds, and gloo's
  own timeout is the same, so a rank stuck in a collective cannot hang the test run.
- Clean shutdown: as soon as one rank fails (exception or death), the others (likely blocked in
  a collective waiting for it) are terminated, then killed, and ``RankFailed`` reports the
  failing rank's traceback. No process outlives the call.

``fn`` must be importable by name (a module-level function) since the processes are spawned.

Starting a group costs seconds (every process imports torch), so the test files register their
per-rank code as *stages* (``@stage(2)``): ``run_stages(2, directory)`` runs every stage
registered for 2 ranks, in registration order, in one launch, each as
``fn(rank, world_size, directory)``, and returns ``{name: per-rank results}``.
"""

from __future__ import annotations

import multiprocessing
import os
import queue
import sys
import time
import traceback
from collections.abc import Callable
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

HOST = "127.0.0.1"


class RankFailed(RuntimeError):
    """A rank raised, died, or the group ran out of time; the message says which and why."""


_STAGES: dict[int, list[Callable[..., Any]]] = {}


def stage(world_size: int) -> Callable[[Callable[..., Any]], Callable[..., Any]]:
    """Register ``fn(rank, world_size, directory)`` to run in the shared launch of
    ``world_size`` ranks (see :func:`run_stages`)."""

    def register(fn: Callable[..., Any]) -> Callable[..., Any]:
        _STAGES.setdefault(world_size, []).append(fn)
        return fn

    return register


def run_stages(world_size: int, directory: str, *, timeout: float = 300.0) -> dict[str, list]:
    """Every stage registered for ``world_size`` ranks, in one launch: ``{name: results}``."""
    stages = _STAGES.get(world_size, [])
    results = run_ranks(_run_stages, world_size, stages, directory, timeout=timeout)
    return {fn.__name__: [per_rank[i] for per_rank in results] for i, fn in enumerate(stages)}


def _run_stages(rank: int, world_size: int, stages: list, directory: str) -> list[Any]:
    return [fn(rank, world_size, directory) for fn in stages]


def run_ranks(
    fn: Callable[..., Any], world_size: int, *args: Any, timeout: float = 90.0
) -> list[Any]:
    context = multiprocessing.get_context("spawn")
    store = dist.TCPStore(
        HOST, 0, world_size + 1, is_master=True, wait_for_workers=False,
        timeout=timedelta(seconds=timeout),
    )  # fmt: skip
    outcomes: Any = context.Queue()
    processes = [
        context.Process(
            target=_rank_main,
            args=(rank, world_size, store.port, timeout, fn, args, outcomes),
            name=f"rank{rank}",
            daemon=True,
        )
        for rank in range(world_size)
    ]
    finished = False
    try:
        for process in processes:
            process.start()
        results = _collect(processes, outcomes, timeout)
        finished = True
        return results
    finally:
        _stop(processes, grace=5.0 if finished else 0.0)
        outcomes.close()
        del store


def _collect(processes: list[Any], outcomes: Any, timeout: float) -> list[Any]:
    deadline = time.monotonic() + timeout
    results: dict[int, Any] = {}
    errors: dict[int, str] = {}  # in the order they arrived: the first is usually the cause
    while len(results) < len(processes):
        _drain(outcomes, results, errors, wait=0.1)
        if errors or _silent_deaths(processes, results, errors):
            # One failure makes the others fail soon after (a collective breaks): give them a
            # moment so the report shows the whole picture, the silent deaths first.
            time.sleep(1.0)
            _drain(outcomes, results, errors, wait=0.0)
            raise RankFailed(_report(processes, results, errors))
        if time.monotonic() > deadline:
            missing = [rank for rank in range(len(processes)) if rank not in results]
            raise RankFailed(
                f"timed out after {timeout:.0f}s waiting for rank(s) {missing} of {len(processes)}"
            )
    return [results[rank] for rank in range(len(processes))]


def _drain(outcomes: Any, results: dict, errors: dict, wait: float) -> None:
    while True:
        try:
            rank, ok, value = outcomes.get(timeout=wait) if wait else outcomes.get_nowait()
        except queue.Empty:
            return
        (results if ok else errors)[rank] = value
        wait = 0.0


def _silent_deaths(processes: list[Any], results: dict, errors: dict) -> list[int]:
    """Ranks that exited without reporting (a crash, os._exit, a signal)."""
    return [
        rank
        for rank, process in enumerate(processes)
        if process.exitcode not in (None, 0) and rank not in results and rank not in errors
    ]


def _report(processes: list[Any], results: dict, errors: dict) -> str:
    world_size = len(processes)
    lines = [
        f"rank {rank} of {world_size} died with exit code {processes[rank].exitcode} "
        "without reporting"
        for rank in _silent_deaths(processes, results, errors)
    ]
    lines += [f"rank {rank} of {world_size} failed:\n{trace}" for rank, trace in errors.items()]
    return "\n".join(lines)


def _stop(processes: list[Any], grace: float) -> None:
    # After success the ranks are only tearing down; after a failure they may be blocked in a
    # collective that will never complete, so they are terminated at once.
    for process in processes:
        process.join(timeout=grace)
    for process in processes:
        if process.is_alive():
            process.terminate()
    for process in processes:
        process.join(timeout=5)
        if process.is_alive():
            process.kill()
            process.join()


def _rank_main(
    rank: int,
    world_size: int,
    port: int,
    timeout: float,
    fn: Callable[..., Any],
    args: tuple,
    outcomes: Any,
) -> None:
    if sys.platform.startswith("linux"):
        os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
    torch.set_num_threads(1)  # N ranks share a few cores
    try:
        store = dist.TCPStore(HOST, port, is_master=False, timeout=timedelta(seconds=timeout))
        dist.init_process_group(
            "gloo", store=store, rank=rank, world_size=world_size,
            timeout=timedelta(seconds=timeout),
        )  # fmt: skip
        outcome = (rank, True, fn(rank, world_size, *args))
    except BaseException:
        outcome = (rank, False, traceback.format_exc())
    outcomes.put(outcome)
    outcomes.close()
    outcomes.join_thread()
    if dist.is_initialized():
        dist.destroy_process_group()
