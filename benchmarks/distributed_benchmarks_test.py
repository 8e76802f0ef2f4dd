"""Many processes: a member-parallel ensemble's training step, ``save_distributed``, and a stateless
call on an FSDP2 module, on real gloo process groups on 127.0.0.1.

Cases (8-member ensembles of 64→256→256→10 MLPs, batch 128; FSDP2 on the same MLP, per layer):

- the ensemble's training step (forward, per-member MSE, backward, Adam) as a member-parallel
  ``Ensemble(mesh=...)`` on 2 ranks with 1 thread each, beside an ordinary ``Ensemble`` in one
  process with 2 threads. The two cannot be interleaved (they would share the 2 cores), so the
  ranks run first, then the single process; on a 2-core machine this figure checks that the
  member split scales correctly (each rank does half the work), it is not a speed claim.
- ``save_distributed`` of the ensemble's state and Adam state, beside ``dcp.save`` of the same
  flat state dict, interleaved round by round inside the ranks; the seconds per MB are printed.
- FSDP2: ``ms.call(model, tree, x)`` (the unsharded computation: gathers the tree) beside the
  module's own forward (FSDP's all-gather), interleaved inside the ranks; target ≤ 1.2x.

Inside the ranks every implementation runs a fixed number of calls per round (the ranks must
make the same collectives), each round starting at a barrier; rank 0's times are reported.
"""

from __future__ import annotations

import os
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from datetime import timedelta
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch import nn

import modstate as ms
from _timing import summarize
from conftest import QUICK

pytestmark = pytest.mark.skipif(
    not (dist.is_available() and dist.is_gloo_available()), reason="needs torch.distributed gloo"
)

MEMBERS, BATCH = 8, 128
SIZES = (64, 256, 256, 10)


def mlp() -> nn.Sequential:
    return nn.Sequential(
        nn.Linear(SIZES[0], SIZES[1]), nn.ReLU(), nn.Linear(SIZES[1], SIZES[2]), nn.ReLU(),
        nn.Linear(SIZES[2], SIZES[3]),
    )  # fmt: skip


def data() -> tuple[torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(0)
    return torch.randn(BATCH, SIZES[0], generator=generator), torch.randn(
        BATCH, SIZES[-1], generator=generator
    )


def training_step(ensemble: nn.Module, adam: torch.optim.Optimizer) -> Callable[[], None]:
    x, y = data()

    def step() -> None:
        out = ensemble(x)
        out = out.to_local() if hasattr(out, "to_local") else out  # this rank's members
        # Per-member losses, summed: each member's gradient is its own, wherever it lives.
        (out - y).pow(2).mean(dim=(1, 2)).sum().backward()
        adam.step()
        adam.zero_grad()

    return step


# -- in the ranks ------------------------------------------------------------------------------


def _rounds(impls: dict[str, Callable[[], Any]], rounds: int, calls: int) -> dict[str, list]:
    """Seconds per call, one sample per round, impls rotating; the same calls on every rank."""
    names = list(impls)
    for name in names:  # warm-up
        for _ in range(2):
            impls[name]()
    samples: dict[str, list[float]] = {name: [] for name in names}
    for index in range(rounds):
        shift = index % len(names)
        for name in names[shift:] + names[:shift]:
            dist.barrier()
            start = time.perf_counter()
            for _ in range(calls):
                impls[name]()
            samples[name].append((time.perf_counter() - start) / calls)
    return samples


def _in_ranks(rank: int, world_size: int, port: int, rounds: int, calls: int, out: str) -> None:
    os.environ["GLOO_SOCKET_IFNAME"] = "lo"
    torch.set_num_threads(1)
    store = dist.TCPStore("127.0.0.1", port, is_master=False, timeout=timedelta(seconds=300))
    dist.init_process_group("gloo", store=store, rank=rank, world_size=world_size)
    try:
        import torch.distributed.checkpoint as dcp
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import fully_shard

        from modstate import checkpoint

        mesh = init_device_mesh("cpu", (world_size,))
        results: dict[str, Any] = {}

        ensemble = ms.Ensemble.from_factory(mlp, MEMBERS, mesh=mesh)
        adam = torch.optim.Adam(ensemble.parameters(), lr=1e-3)
        results["step"] = _rounds({"modstate": training_step(ensemble, adam)}, rounds, calls)

        state = {
            "model": ms.extract(ensemble),
            "optimizer": ms.optim.optimizer_state(adam, ensemble),
        }
        flat = ms.flatten(state)
        local_bytes = sum(
            leaf.to_local().nbytes if hasattr(leaf, "to_local") else leaf.nbytes
            for leaf in flat.values()
            if isinstance(leaf, torch.Tensor)
        )
        total = torch.tensor([local_bytes], dtype=torch.float64)
        dist.all_reduce(total)
        scratch = Path(out) / "saves"
        count = iter(range(10**6))

        def save_modstate() -> None:
            checkpoint.save_distributed(state, scratch / f"ms-{next(count)}")

        def save_dcp() -> None:
            dcp.save(
                {k: v.detach() if isinstance(v, torch.Tensor) else v for k, v in flat.items()},
                checkpoint_id=scratch / f"dcp-{next(count)}",
            )

        results["save"] = _rounds(
            {"modstate": save_modstate, "torch.distributed.checkpoint: dcp.save": save_dcp},
            rounds,
            1,
        )
        results["save_mb"] = total.item() / 2**20

        torch.manual_seed(0)
        model = mlp()
        for index in (0, 2, 4):
            fully_shard(model[index], mesh=mesh)
        fully_shard(model, mesh=mesh, reshard_after_forward=True)
        tree = ms.extract(model, detach=True)
        x, _ = data()

        @torch.no_grad()
        def own_forward() -> None:
            model(x)

        @torch.no_grad()
        def stateless() -> None:
            ms.call(model, tree, x)

        results["fsdp"] = _rounds(
            {"modstate": stateless, "torch FSDP2: the module's own forward": own_forward},
            rounds,
            calls,
        )
        if rank == 0:
            torch.save(results, Path(out) / "results.pt")
        dist.barrier()
    finally:
        dist.destroy_process_group()


@pytest.fixture(scope="module")
def two_ranks(request) -> dict[str, Any]:
    disabled = request.config.getoption("benchmark_disable", False)
    rounds, calls = (1, 1) if disabled else ((5, 3) if QUICK else (15, 5))
    store = dist.TCPStore("127.0.0.1", 0, 3, is_master=True, wait_for_workers=False)
    with tempfile.TemporaryDirectory(prefix="modstate-bench-") as out:
        mp.spawn(_in_ranks, args=(2, store.port, rounds, calls, out), nprocs=2, join=True)
        results = torch.load(Path(out) / "results.pt")
    del store
    results["rounds"] = rounds
    return results


def _record(benchmark, case: str, samples: dict[str, list[float]]) -> dict[str, dict]:
    benchmark.group = case
    benchmark.extra_info["impl"] = "modstate"
    stats = {impl: summarize(values) for impl, values in samples.items()}
    benchmark.extra_info["interleaved"] = stats
    benchmark.pedantic(lambda: None, rounds=1, iterations=1)
    return stats


def _say(line: str) -> None:
    print(line, file=sys.stderr)


def test_member_parallel_training_step(benchmark, two_ranks):
    ensemble = ms.Ensemble.from_factory(mlp, MEMBERS)
    adam = torch.optim.Adam(ensemble.parameters(), lr=1e-3)
    step = training_step(ensemble, adam)
    threads = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        for _ in range(2):
            step()
        single = []
        for _ in range(two_ranks["rounds"]):
            start = time.perf_counter()
            for _ in range(5):
                step()
            single.append((time.perf_counter() - start) / 5)
    finally:
        torch.set_num_threads(threads)
    samples = {
        "modstate": two_ranks["step"]["modstate"],
        "ms.Ensemble: 1 process, 2 threads": single,
    }
    stats = _record(
        benchmark,
        "distributed: 8-member ensemble 64-256-256-10 training step, 2 ranks x 1 thread "
        "(scaling check on 2 cores, not a speed claim)",
        samples,
    )
    _say(
        f"training step: 2 ranks x 1 thread {stats['modstate']['median'] * 1e3:.2f} ms, "
        f"1 process x 2 threads {stats['ms.Ensemble: 1 process, 2 threads']['median'] * 1e3:.2f} ms "
        "(not interleaved; a correctness-of-scaling check on this 2-core machine)"
    )


def test_save_distributed_per_megabyte(benchmark, two_ranks):
    stats = _record(
        benchmark,
        f"distributed: save_distributed of an 8-member ensemble + Adam state "
        f"({two_ranks['save_mb']:.1f} MB), 2 ranks",
        two_ranks["save"],
    )
    megabytes = two_ranks["save_mb"]
    _say(
        f"save_distributed: {statistics.median(two_ranks['save']['modstate']) / megabytes * 1e3:.2f}"
        f" ms/MB ({megabytes:.1f} MB); dcp.save "
        f"{stats['torch.distributed.checkpoint: dcp.save']['median'] / megabytes * 1e3:.2f} ms/MB"
    )


def test_fsdp2_call_with_a_tree(benchmark, two_ranks):
    stats = _record(
        benchmark,
        "distributed: FSDP2 (per layer) 64-256-256-10, ms.call with a tree vs own forward, 2 ranks",
        two_ranks["fsdp"],
    )
    ratio = stats["modstate"]["median"] / stats["torch FSDP2: the module's own forward"]["median"]
    _say(f"FSDP2 ms.call / own forward: {ratio:.2f}x (target <= 1.2x)")
