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
- FSDP2, a chain of 8 and of 16 units of ``Linear(256, 256)`` (each ``fully_shard``-ed, and the
  root), batch 32: ``ms.call(model, tree, x)`` beside the module's own forward, interleaved inside
  the ranks (time; target ≤ 1.2x), and the extra live bytes each holds at its peak (peak minus
  before, every CPU allocation of the process as the profiler's memory events give them, gloo's
  worker threads included), in units' worth (one unit: 256x257 float32): without grad the call
  against the own forward (target ≤ 1.2x, flat from 8 to 16 units), with grad
  ``torch.func.grad`` through the call and ``.backward()`` through it against the module's own
  forward + backward. Memory is the median over rounds (gloo frees its buffers from a worker
  thread, so one round can catch one more buffer alive); the max is printed beside it.

Inside the ranks every implementation runs a fixed number of calls per round (the ranks must
make the same collectives), each round starting at a barrier; rank 0's times are reported.

Before timing, the ranks check every case (a failed check fails the ranks, so every test here):
one member-parallel step against an ordinary Ensemble's from the same seed; both saves read
back with ``dcp.load`` against the state saved; the FSDP2 call's output against the module's
forward, and its gradients (``torch.func.grad`` and ``.backward()``) against the module's own.
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
from _timing import assert_same_trees, flat, summarize
from conftest import QUICK

pytestmark = pytest.mark.skipif(
    not (dist.is_available() and dist.is_gloo_available()), reason="needs torch.distributed gloo"
)

MEMBERS, BATCH = 8, 128
FSDP_UNITS = (8, 16)
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


# Checks before timing. An FSDP2 call and the module's forward run the same ops on the same
# gathered tensors: bit for bit. A member-parallel step runs each rank's members in batched
# kernels of another size than one process's, which may round apart in the last bits.
PARALLEL_TOLERANCE = {"atol": 1e-6, "rtol": 1e-5}


def _local(tree: Any) -> dict[str, Any]:
    """A flat tree with each DTensor replaced by this rank's shard."""
    return {k: v.to_local() if hasattr(v, "to_local") else v for k, v in flat(tree).items()}


def _check_member_parallel(ensemble: nn.Module, step: Callable[[], None], seed: int) -> None:
    """One training step of the member-parallel ensemble, built after ``manual_seed(seed)``,
    gives an ordinary Ensemble's from the same seed in this process: every param and Adam's
    update, gathered."""
    torch.manual_seed(seed)  # on one process from_factory draws the same members as the ranks
    alone = ms.Ensemble.from_factory(mlp, MEMBERS)
    training_step(alone, torch.optim.Adam(alone.parameters(), lr=1e-3))()
    step()
    gathered = {k: v.full_tensor() for k, v in ensemble.state_dict().items()}
    what = "member-parallel training step vs one process"
    assert_same_trees(alone.state_dict(), gathered, what=what, **PARALLEL_TOLERANCE)


def _check_saves(flat_state: dict[str, Any], saved_by: dict[str, Path]) -> None:
    """What each save wrote: the same keys, and read back with ``dcp.load`` (not modstate's
    loader), every tensor of this rank equal to the state saved, bit for bit."""
    import torch.distributed.checkpoint as dcp

    tensors = {k: v.detach() for k, v in flat_state.items() if isinstance(v, torch.Tensor)}
    keys = {}
    for impl, directory in saved_by.items():
        keys[impl] = sorted(dcp.FileSystemReader(directory).read_metadata().state_dict_metadata)
        loaded = {k: torch.zeros_like(v) for k, v in tensors.items()}
        dcp.load(loaded, checkpoint_id=directory)
        assert_same_trees(_local(tensors), _local(loaded), what=f"save: read back from {impl}")
    assert len(set(map(tuple, keys.values()))) == 1, f"save: the checkpoints' keys differ: {keys}"


def _check_fsdp(model: nn.Module, tree: dict, leaves: dict, x: torch.Tensor, what: str) -> None:
    """ms.call with a tree gives the module's own forward, and the gradients that
    ``.backward()`` through the module gives, through ``torch.func.grad`` and through
    ``.backward()``: each rank's shards, bit for bit."""
    with torch.no_grad():
        expected = model(x)
        model.reshard()
        assert_same_trees(expected, ms.call(model, tree, x), what=f"{what}: ms.call vs forward")
    model(x).pow(2).sum().backward()
    own = {name: p.grad.to_local() for name, p in model.named_parameters()}
    for parameter in model.parameters():
        parameter.grad = None
    by_func = torch.func.grad(lambda t: ms.call(model, t, x).pow(2).sum())(tree)
    assert_same_trees(own, _local(by_func), what=f"{what}: torch.func.grad through ms.call")
    ms.call(model, leaves, x).pow(2).sum().backward()
    by_backward = {path: leaf.grad for path, leaf in flat(leaves).items()}
    for leaf in flat(leaves).values():
        leaf.grad = None
    assert_same_trees(own, _local(by_backward), what=f"{what}: .backward() through ms.call")


UNIT_WIDTH, UNIT_BATCH = 256, 32
UNIT_BYTES = UNIT_WIDTH * (UNIT_WIDTH + 1) * 4  # one Linear(256, 256): weight and bias


def _peak_bytes(fn: Callable[[], Any]) -> int:
    """Peak minus before of the bytes the process holds allocated while ``fn`` runs, from the
    profiler's memory events (every thread's CPU allocations and frees, in time order)."""
    import gc

    from torch.profiler import ProfilerActivity, profile

    gc.collect()
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        fn()
    events = [e for e in prof.profiler.kineto_results.events() if e.name() == "[memory]"]
    events.sort(key=lambda e: e.start_ns())
    now = peak = 0
    for event in events:
        now += event.nbytes()
        peak = max(peak, now)
    return peak


def _fsdp_units(mesh: Any, units: int, rounds: int, calls: int) -> dict[str, Any]:
    """Time and peak memory of a call with a tree beside the module's own forward, on a chain of
    ``units`` FSDP units; memory in units' worth, one sample per round."""
    from torch.distributed.fsdp import fully_shard

    torch.manual_seed(0)
    model = nn.Sequential(*[nn.Linear(UNIT_WIDTH, UNIT_WIDTH) for _ in range(units)])
    for layer in model:
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    tree = ms.extract(model, detach=True)
    leaves = ms.tree.map(lambda t: t.detach().requires_grad_(), tree)
    x = torch.randn(UNIT_BATCH, UNIT_WIDTH, generator=torch.Generator().manual_seed(0))

    @torch.no_grad()
    def own_forward() -> None:
        model(x)
        model.reshard()  # the root keeps its parameters gathered after a forward otherwise

    @torch.no_grad()
    def stateless() -> None:
        ms.call(model, tree, x)

    def own_training() -> None:
        model(x).pow(2).sum().backward()
        for parameter in model.parameters():
            parameter.grad = None

    def func_grad() -> None:
        torch.func.grad(lambda t: ms.call(model, t, x).pow(2).sum())(tree)

    def backward() -> None:
        ms.call(model, leaves, x).pow(2).sum().backward()
        for leaf in ms.flatten(leaves).values():
            leaf.grad = None

    _check_fsdp(model, tree, leaves, x, f"FSDP2 {units} units")
    memory = {
        "ms.call, no grad": stateless,
        "own forward, no grad": own_forward,
        "torch.func.grad through ms.call": func_grad,
        ".backward() through ms.call": backward,
        "own forward + backward": own_training,
    }
    for fn in memory.values():
        fn()
    peaks: dict[str, list[float]] = {name: [] for name in memory}
    for _ in range(min(rounds, 5)):  # the profiler is slow; ms.call's figure does not vary
        for name, fn in memory.items():
            dist.barrier()
            peaks[name].append(_peak_bytes(fn) / UNIT_BYTES)
    times = _rounds(
        {"modstate": stateless, "torch FSDP2: the module's own forward": own_forward},
        rounds,
        calls,
    )
    return {"memory": peaks, "time": times}


def _in_ranks(rank: int, world_size: int, port: int, rounds: int, calls: int, out: str) -> None:
    os.environ["GLOO_SOCKET_IFNAME"] = "lo"
    torch.set_num_threads(1)
    store = dist.TCPStore("127.0.0.1", port, is_master=False, timeout=timedelta(seconds=300))
    dist.init_process_group("gloo", store=store, rank=rank, world_size=world_size)
    try:
        import torch.distributed.checkpoint as dcp
        from torch.distributed.device_mesh import init_device_mesh

        from modstate import checkpoint

        mesh = init_device_mesh("cpu", (world_size,))
        results: dict[str, Any] = {}

        torch.manual_seed(0)  # the first rank's random state decides the members
        ensemble = ms.Ensemble.from_factory(mlp, MEMBERS, mesh=mesh)
        adam = torch.optim.Adam(ensemble.parameters(), lr=1e-3)
        step = training_step(ensemble, adam)
        _check_member_parallel(ensemble, step, seed=0)
        results["step"] = _rounds({"modstate": step}, rounds, calls)

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

        save_modstate()  # the check reads these two; the timed saves write new directories
        save_dcp()
        _check_saves(flat, {"save_distributed": scratch / "ms-0", "dcp.save": scratch / "dcp-1"})
        results["save"] = _rounds(
            {"modstate": save_modstate, "torch.distributed.checkpoint: dcp.save": save_dcp},
            rounds,
            1,
        )
        results["save_mb"] = total.item() / 2**20

        for units in FSDP_UNITS:
            results[f"fsdp{units}"] = _fsdp_units(mesh, units, rounds, calls)
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


@pytest.mark.parametrize("units", FSDP_UNITS)
def test_fsdp2_call_with_a_tree(benchmark, two_ranks, units):
    case = two_ranks[f"fsdp{units}"]
    stats = _record(
        benchmark,
        f"distributed: FSDP2, {units} units of Linear(256, 256), batch 32, ms.call with a tree "
        "vs the module's own forward, no grad, 2 ranks",
        case["time"],
    )
    ratio = stats["modstate"]["median"] / stats["torch FSDP2: the module's own forward"]["median"]
    memory = {name: statistics.median(values) for name, values in case["memory"].items()}
    worst = {name: max(values) for name, values in case["memory"].items()}
    benchmark.extra_info["peak_units"] = memory
    no_grad = memory["ms.call, no grad"] / memory["own forward, no grad"]
    _say(
        f"FSDP2 {units} units: time ms.call / own forward {ratio:.2f}x (target <= 1.2x); "
        f"extra live bytes without grad, in units' worth: ms.call {memory['ms.call, no grad']:.2f} "
        f"(max {worst['ms.call, no grad']:.2f}), own forward "
        f"{memory['own forward, no grad']:.2f} (max {worst['own forward, no grad']:.2f}): "
        f"{no_grad:.2f}x (target <= 1.2x)"
    )
    _say(
        f"FSDP2 {units} units, with grad, in units' worth: torch.func.grad through ms.call "
        f"{memory['torch.func.grad through ms.call']:.2f}, .backward() through ms.call "
        f"{memory['.backward() through ms.call']:.2f}, own forward + backward "
        f"{memory['own forward + backward']:.2f} (max {worst['own forward + backward']:.2f})"
    )
