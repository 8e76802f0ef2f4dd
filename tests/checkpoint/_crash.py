"""Savers that the tests kill: a program run in a fresh process (``python _crash.py SCENARIO ...``).

Several scenarios run in one process when separated by ``+``; each prints ``{"scenario": name}``
before its reports. A fresh process that never runs a parallel kernel before it forks is the safe place to fork
savers from (a process forked after OpenMP ran hangs in its first parallel kernel), so each
scenario runs here, forks the processes it kills, and prints one JSON line per trial: what the
killed savers reported as complete. The test that ran it then loads what is on disk and judges.

Scenarios:
- ``file-size-limit PATH LIMIT``: save over PATH under ``RLIMIT_FSIZE`` (a full disk, to the
  writer), SIGXFSZ ignored; prints the exception's type, errno and message.
- ``kill-saves DIRECTORY TRIALS SEED``: per trial, a forked process saves ``tree_number(i)``
  (i = 1, 2, ...) to ``DIRECTORY/trial-<n>/model.safetensors``, and is SIGKILLed at a random
  moment after its first complete save.
- ``kill-distributed-saves DIRECTORY TRIALS SEED RANKS``: per trial, RANKS forked processes join
  a gloo group and save ``distributed_tree(i)`` (i = 1, 2, ...) with ``save_distributed`` to
  ``DIRECTORY/trial-<n>/latest`` (over the previous checkpoint) and to ``.../step-<i>`` (a new
  directory), over and over; all are SIGKILLed at a random moment after the first complete
  round. RANKS=0: one process, no process group.
- ``refused-on-every-rank DIRECTORY RANKS``: every rank saves into a path that is a file.
- ``die-in-distributed-save DIRECTORY``: save_distributed of a tree holding a leaf whose
  pickling (DCP pickles non-tensor leaves while it writes) SIGKILLs the process: a save killed
  half-way, deterministically.
"""

from __future__ import annotations

import collections
import functools
import json
import os
import random
import resource
import signal
import sys
import time

import torch

torch.set_num_threads(1)  # before any kernel: no OpenMP pool exists when this process forks

from _savers import tree_number  # noqa: E402

from modstate import checkpoint  # noqa: E402


def file_size_limit(path: str, limit: str) -> None:
    read_end, write_end = os.pipe()
    pid = os.fork()
    if pid == 0:  # the limit holds in this child only
        signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # else the kernel kills the writer
        resource.setrlimit(resource.RLIMIT_FSIZE, (int(limit), resource.RLIM_INFINITY))
        try:
            checkpoint.save(tree_number(1), path)
            report = {"kind": "saved"}
        except BaseException as error:  # reported to the test, which judges it
            report = {
                "kind": type(error).__name__,
                "is_oserror": isinstance(error, OSError),
                "errno": getattr(error, "errno", None),
                "message": str(error),
            }
        os.write(write_end, json.dumps(report).encode())
        os._exit(0)
    os.close(write_end)
    report = _read_all(read_end).decode()
    os.waitpid(pid, 0)
    print(report, flush=True)


def _report_each(save, first: int, done: int) -> None:
    for i in range(first, first + 100_000):
        save(i)
        os.write(done, i.to_bytes(4, "little"))


def _killed_at_random(targets: list, rng: random.Random, at_most: float) -> list[int]:
    """Fork one process per target, let them run, SIGKILL them all at a random moment after
    the first completed save; returns the last number each reported complete (-1: none)."""
    pipes, pids = [], []
    for target in targets:
        read_end, write_end = os.pipe()
        pid = os.fork()
        if pid == 0:  # the saver
            os.close(read_end)
            try:
                target(write_end)
            finally:
                os._exit(0)
        os.close(write_end)
        pipes.append(read_end)
        pids.append(pid)
    first = os.read(pipes[0], 4)  # the first save completed: now any moment of the next ones
    time.sleep(rng.uniform(0.0, at_most))
    for pid in pids:
        os.kill(pid, signal.SIGKILL)
    for pid in pids:
        os.waitpid(pid, 0)
    completed = []
    for n, read_end in enumerate(pipes):
        data = (first if n == 0 else b"") + _read_all(read_end)
        os.close(read_end)
        completed.append(int.from_bytes(data[-4:], "little") if data else -1)
    return completed


def _read_all(descriptor: int) -> bytes:
    chunks = []
    while chunk := os.read(descriptor, 1 << 16):
        chunks.append(chunk)
    return b"".join(chunks)


def _warm_up(directory: str, save) -> None:
    """One save here first: the savers forked later start with everything imported (a first
    save imports for a second), so a kill lands at a moment of saving, not of importing."""
    save(os.path.join(directory, "warm-up"))


def _saver(path: str):
    return lambda i: checkpoint.save(tree_number(i), path)


def kill_saves(directory: str, trials: str, seed: str) -> None:
    rng = random.Random(int(seed))
    _warm_up(directory, lambda path: checkpoint.save(tree_number(0), path))
    for trial in range(int(trials)):
        path = os.path.join(directory, f"trial-{trial}", "model.safetensors")
        os.mkdir(os.path.dirname(path))
        (completed,) = _killed_at_random(
            [lambda done, path=path: _report_each(_saver(path), 1, done)],
            rng,
            at_most=0.05,  # a save takes 2-200 ms (tmpfs, disk): any moment of one or more
        )
        print(json.dumps({"path": path, "completed": completed}), flush=True)


def distributed_tree(i: int, mesh=None) -> dict:
    """``tree_number(i)`` with its weight sharded over the ranks of ``mesh`` (every rank writes)."""
    tree = tree_number(i, size=1 << 15)
    if mesh is not None:
        from torch.distributed.tensor import Shard, distribute_tensor

        tree["layer"]["weight"] = distribute_tensor(tree["layer"]["weight"], mesh, [Shard(0)])
    return tree


def _rank(rank: int, world_size: int, rendezvous: str, directory: str, first: int, done: int):
    mesh = None
    if world_size:
        import torch.distributed as dist
        from torch.distributed.device_mesh import init_device_mesh

        os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
        dist.init_process_group(
            "gloo", init_method=f"file://{rendezvous}", rank=rank, world_size=world_size
        )
        mesh = init_device_mesh("cpu", (world_size,))

    def save(i: int) -> None:
        tree = distributed_tree(i, mesh)
        checkpoint.save_distributed(tree, os.path.join(directory, "latest"))
        checkpoint.save_distributed(tree, os.path.join(directory, f"step-{i}"))

    _report_each(save, first, done)


def kill_distributed_saves(directory: str, trials: str, seed: str, ranks: str) -> None:
    rng = random.Random(int(seed))
    world_size = int(ranks)
    _warm_up(directory, lambda path: checkpoint.save_distributed(tree_number(0), path))
    for trial in range(int(trials)):
        place = os.path.join(directory, f"trial-{trial}")
        os.mkdir(place)
        rendezvous = os.path.join(place, "rendezvous")
        targets = [
            functools.partial(_rank, rank, world_size, rendezvous, place, 1)
            for rank in range(max(world_size, 1))
        ]
        completed = _killed_at_random(targets, rng, at_most=0.4 if world_size else 0.2)
        print(json.dumps({"directory": place, "completed": completed}), flush=True)


def refused_on_every_rank(directory: str, ranks: str) -> None:
    """Every rank of a gloo group calls save_distributed into a path that is a file: the first
    rank refuses it, and every rank must raise (none left waiting in a collective)."""
    world_size = int(ranks)
    target = os.path.join(directory, "a-file")
    with open(target, "w") as handle:
        handle.write("not a checkpoint")
    rendezvous = os.path.join(directory, "rendezvous-refused")
    pipes, pids = [], []
    for rank in range(world_size):
        read_end, write_end = os.pipe()
        pid = os.fork()
        if pid == 0:
            os.close(read_end)
            try:
                import torch.distributed as dist

                os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
                dist.init_process_group(
                    "gloo", init_method=f"file://{rendezvous}", rank=rank, world_size=world_size
                )
                try:
                    checkpoint.save_distributed(tree_number(1), target)
                    outcome = "saved"
                except Exception as error:  # reported
                    outcome = f"{type(error).__name__}: {error}"
                os.write(write_end, outcome.encode())
                dist.destroy_process_group()
            finally:
                os._exit(0)
        os.close(write_end)
        pipes.append(read_end)
        pids.append(pid)
    deadline = time.monotonic() + 120
    for pid in pids:
        while os.waitpid(pid, os.WNOHANG) == (0, 0):
            if time.monotonic() > deadline:  # a rank hangs: the test fails on what it reads
                os.kill(pid, signal.SIGKILL)
            time.sleep(0.05)
    outcomes = []
    for read_end in pipes:
        outcomes.append(_read_all(read_end).decode())
        os.close(read_end)
    print(json.dumps({"outcomes": outcomes}), flush=True)


class DiesWhenPickled:
    """A leaf that SIGKILLs the process when DCP pickles it, in the middle of writing.

    save_distributed first pickles every non-tensor leaf to check that it loads back (before
    anything is written): that pickling gets an empty OrderedDict, which loads back. Once the
    staging directory exists (the write has begun), pickling kills.
    """

    def __init__(self, directory: str) -> None:
        parent, name = os.path.split(os.path.abspath(directory))
        self.staging = os.path.join(parent, f".{name}.modstate-partial")

    def __reduce__(self):
        if os.path.isdir(self.staging):
            os.kill(os.getpid(), signal.SIGKILL)
        return (collections.OrderedDict, ())


def die_in_distributed_save(directory: str) -> None:
    tree = tree_number(7)
    tree["dies"] = DiesWhenPickled(directory)
    pid = os.fork()
    if pid == 0:
        try:
            checkpoint.save_distributed(tree, directory)
        finally:
            os._exit(0)  # not reached: the pickling kills the process
    _, status = os.waitpid(pid, 0)
    print(json.dumps({"killed": os.WIFSIGNALED(status) and os.WTERMSIG(status) == 9}), flush=True)


SCENARIOS = {
    "file-size-limit": file_size_limit,
    "kill-saves": kill_saves,
    "kill-distributed-saves": kill_distributed_saves,
    "die-in-distributed-save": die_in_distributed_save,
    "refused-on-every-rank": refused_on_every_rank,
}

if __name__ == "__main__":
    # Several scenarios may share one process (one torch import): separated by "+".
    words = sys.argv[1:]
    while words:
        end = words.index("+") if "+" in words else len(words)
        scenario, *arguments = words[:end]
        print(json.dumps({"scenario": scenario}), flush=True)
        SCENARIOS[scenario](*arguments)
        words = words[end + 1 :]
