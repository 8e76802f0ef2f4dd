"""Time of ``load_distributed`` with its restricted reader, beside the unrestricted reads it replaced.

    python benchmarks/checkpoint_restricted_load.py              # about 100 MiB, saved by 2 ranks
    python benchmarks/checkpoint_restricted_load.py --mib 20 --rounds 5 --json

The checkpoint: layers of ``Linear(2048, 2048)`` sharded with ``fully_shard`` over 2 gloo ranks on
127.0.0.1, plus non-tensor leaves (a step count, ``param_groups`` with tuple ``betas``), written
by ``save_distributed`` on the 2 ranks. It is then loaded in this one process (no process group:
2 ranks -> full tensors), each round running every case once, in a shuffled order, after one
untimed warm-up load each:

- ``restricted``: ``load_distributed(directory, like)``, the default: ``.metadata`` through the
  allowlist unpickler (read once, by the reader DCP is given), values through
  ``torch.load(weights_only=True)``;
- ``before``: ``load_distributed`` as it was before: the same checks and targets, ``.metadata``
  read by ``FileSystemReader.read_metadata`` (``pickle.load``), then ``dcp.load(checkpoint_id=...)``
  (which reads ``.metadata`` again, and the values with ``weights_only=False``);
- ``weights_only=False``: ``load_distributed(..., weights_only=False)``.

The same cases then run on 2 gloo ranks loading into the ``fully_shard`` layout (every rank runs
each case at once, the order shuffled alike on all ranks, each case starting at a barrier; rank
0's times are reported). Also the reads alone: ``.metadata`` through the restricted read
(unpickler and field checks) beside ``pickle.load``, and a value (a tuple, as DCP writes it)
through ``torch.load`` with ``weights_only=True`` beside ``False``.

Before timing, every case's result is checked against the saved tree. Figures: median and min
seconds per call; each load's median over ``before``'s, and the median of its per-round ratios
to ``before`` (both ran in the same round, so a busy machine's drift between rounds cancels).
Run it by hand; nothing else reads it.
"""

from __future__ import annotations

import argparse
import io
import json
import os
import pickle
import random
import statistics
import sys
import tempfile
import time
import warnings
from datetime import timedelta

WIDTH = 2048


def layers_for(mib: float) -> int:
    return max(1, round(mib * 2**20 / ((WIDTH * WIDTH + WIDTH) * 4)))


def make_model(layers: int):
    import torch
    from torch import nn

    torch.manual_seed(0)
    return nn.Sequential(*(nn.Linear(WIDTH, WIDTH) for _ in range(layers)))


def extras() -> dict:
    """The non-tensor leaves: what an optimizer's state and a training loop add."""
    return {"step": 1000, "param_groups": [{"lr": 1e-3, "betas": (0.9, 0.999), "eps": 1e-8}]}


def join_group(rank: int, world_size: int, port: int) -> None:
    """Join the gloo group whose store this script's first process holds on ``port``."""
    import torch
    import torch.distributed as dist

    os.environ["GLOO_SOCKET_IFNAME"] = "lo"
    torch.set_num_threads(1)
    store = dist.TCPStore("127.0.0.1", port, is_master=False, timeout=timedelta(seconds=300))
    dist.init_process_group("gloo", store=store, rank=rank, world_size=world_size)


def in_ranks(function, *args) -> None:
    """``function(rank, 2, port, *args)`` on 2 spawned ranks."""
    import torch.distributed as dist
    import torch.multiprocessing as mp

    store = dist.TCPStore("127.0.0.1", 0, 3, is_master=True, wait_for_workers=False)
    mp.spawn(function, args=(2, store.port, *args), nprocs=2, join=True)
    del store


def save_rank(rank: int, world_size: int, port: int, directory: str, layers: int) -> None:
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    import modstate as ms
    from modstate import checkpoint

    join_group(rank, world_size, port)
    mesh = init_device_mesh("cpu", (world_size,))
    model = make_model(layers)
    for layer in model:
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    checkpoint.save_distributed({"model": ms.extract(model), **extras()}, f"{directory}/ckpt")
    dist.barrier()  # no rank tears the group down while another still uses it
    dist.destroy_process_group()


def load_as_before(directory: str, like: dict) -> dict:
    """``load_distributed`` as it was before the restricted reader (strict, no ``as_saved``)."""
    import torch.distributed.checkpoint as dcp

    import modstate as ms
    from modstate.checkpoint import _dcp

    flat_like = ms.flatten(like)
    metadata = _dcp.read_metadata(directory, dcp.FileSystemReader(directory))
    _dcp.check_compatible(directory, flat_like, metadata, strict=True)
    state = _dcp.empty_targets(flat_like, metadata)
    with _dcp.single_process_quietly(None) as no_dist:  # the default group, if there is one
        dcp.load(state, checkpoint_id=directory, no_dist=no_dist)
    return ms.unflatten(dict(state))


def cases_for(directory: str, like: dict) -> dict:
    from modstate import checkpoint

    return {
        "restricted": lambda: checkpoint.load_distributed(directory, like),
        "before": lambda: load_as_before(directory, like),
        "weights_only=False": lambda: checkpoint.load_distributed(
            directory, like, weights_only=False
        ),
    }


def check(name: str, loaded: dict, saved: dict) -> None:
    """``loaded`` holds ``saved`` (DTensor leaves are gathered: a collective on ranks)."""
    import torch
    from torch.distributed.tensor import DTensor

    import modstate as ms

    assert loaded["step"] == saved["step"], name
    assert loaded["param_groups"] == saved["param_groups"], name
    for path, want in ms.flatten(saved["model"]).items():
        got = ms.flatten(loaded["model"])[path]
        got = got.full_tensor() if isinstance(got, DTensor) else got
        assert torch.equal(got, want), (name, path)


def timed_rounds(cases: dict, rounds: int, seed: int, barrier=None) -> dict[str, list[float]]:
    """Seconds per call of each case, ``rounds`` times in an order shuffled by ``seed``."""
    samples: dict[str, list[float]] = {name: [] for name in cases}
    order, shuffle = list(cases), random.Random(seed)
    for _ in range(rounds):
        shuffle.shuffle(order)
        for name in order:
            if barrier is not None:
                barrier()
            start = time.perf_counter()
            cases[name]()
            samples[name].append(time.perf_counter() - start)
    return samples


def load_rank(rank: int, world_size: int, port: int, root: str, layers: int, rounds: int) -> None:
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    import modstate as ms
    import modstate.tree  # ms.tree

    join_group(rank, world_size, port)
    mesh = init_device_mesh("cpu", (world_size,))
    model = make_model(layers)
    for layer in model:
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    like = {"model": ms.tree.detach(ms.extract(model)), "step": None, "param_groups": None}
    saved = {"model": ms.extract(make_model(layers), detach=True), **extras()}
    cases = cases_for(f"{root}/ckpt", like)
    for name, case in cases.items():  # the check, and the warm-up
        check(name, case(), saved)
    samples = timed_rounds(cases, rounds, seed=rounds, barrier=dist.barrier)
    if rank == 0:
        with open(f"{root}/ranks.json", "w") as handle:
            json.dump(samples, handle)
    dist.barrier()  # no rank tears the group down while another still uses it
    dist.destroy_process_group()


def figures_of(samples: dict[str, list[float]]) -> dict[str, dict[str, float]]:
    figures = {
        name: {"median": statistics.median(values), "min": min(values)}
        for name, values in samples.items()
    }
    if "before" in samples:
        for name, figure in figures.items():
            figure["vs before"] = figure["median"] / figures["before"]["median"]
            # A busy machine drifts between rounds: each round's pair, then their median.
            pairs = zip(samples[name], samples["before"], strict=True)
            figure["paired"] = statistics.median(mine / theirs for mine, theirs in pairs)
    return figures


def measure(mib: float = 100, rounds: int = 15) -> dict[str, object]:
    import torch
    from torch.distributed.checkpoint.metadata import Metadata

    import modstate as ms
    import modstate.tree  # ms.tree
    from modstate.checkpoint import _dcp_reader

    torch.set_num_threads(1)
    layers = layers_for(mib)
    with tempfile.TemporaryDirectory(prefix="modstate-restricted-") as root:
        in_ranks(save_rank, root, layers)
        directory = f"{root}/ckpt"
        size = sum(os.path.getsize(f"{directory}/{name}") for name in os.listdir(directory))
        saved = {"model": ms.extract(make_model(layers), detach=True), **extras()}
        like = {"model": ms.tree.zeros_like(saved["model"]), "step": None, "param_groups": None}
        cases = cases_for(directory, like)
        for name, case in cases.items():  # the check, and the warm-up
            check(name, case(), saved)

        def read_restricted() -> Metadata:
            with open(f"{directory}/.metadata", "rb") as stream:
                return _dcp_reader.read_metadata_file(stream, directory)

        def read_pickle() -> Metadata:
            with open(f"{directory}/.metadata", "rb") as stream:
                return pickle.load(stream)  # what FileSystemReader does: our own checkpoint

        def hundred(read):  # one read is well under a millisecond: time 100 per sample
            return lambda: [read() for _ in range(100)]

        value = io.BytesIO()
        torch.save(extras()["param_groups"][0]["betas"], value)  # a byte item, as DCP writes it

        def value_restricted() -> object:
            return _dcp_reader.load_value(io.BytesIO(value.getvalue()))

        def value_unrestricted() -> object:
            return torch.load(io.BytesIO(value.getvalue()), weights_only=False)  # as DCP does

        one_process = timed_rounds(cases, rounds, seed=0)
        reads = timed_rounds(
            {
                "metadata restricted": hundred(read_restricted),
                "metadata pickle.load": hundred(read_pickle),
                "value weights_only": hundred(value_restricted),
                "value unrestricted": hundred(value_unrestricted),
            },
            rounds,
            seed=1,
        )
        reads = {name: [t / 100 for t in values] for name, values in reads.items()}
        in_ranks(load_rank, root, layers, rounds)
        with open(f"{root}/ranks.json") as handle:
            on_ranks = json.load(handle)
    return {
        "checkpoint bytes": size,
        "layers": layers,
        "rounds": rounds,
        "one process": figures_of(one_process),
        "2 ranks": figures_of(on_ranks),
        "reads": figures_of(reads),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--mib", type=float, default=100, help="checkpoint size (default 100)")
    parser.add_argument("--rounds", type=int, default=15, help="timed rounds (default 15)")
    parser.add_argument("--json", action="store_true", help="print the figures as JSON")
    arguments = parser.parse_args()
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    warnings.filterwarnings("ignore", message="torch.distributed is disabled")
    result = measure(arguments.mib, arguments.rounds)
    if arguments.json:
        print(json.dumps(result, indent=2))
        return
    print(
        f"checkpoint: {result['checkpoint bytes'] / 2**20:.1f} MiB in {result['layers']} layers, "
        f"saved by 2 ranks; {result['rounds']} rounds; median and min per call"
    )
    for table in ("one process", "2 ranks", "reads"):
        print(f"{table}:")
        for name, figure in result[table].items():  # type: ignore[attr-defined]
            ratio = ""
            if "vs before" in figure:
                ratio = f"  {figure['vs before']:.3f}x before (per round {figure['paired']:.3f}x)"
            scale, unit = (1e3, "ms") if figure["median"] > 1e-3 else (1e6, "us")
            print(
                f"  {name:20s} {figure['median'] * scale:8.2f} {unit}  "
                f"min {figure['min'] * scale:8.2f} {unit}{ratio}"
            )


if __name__ == "__main__":
    main()
