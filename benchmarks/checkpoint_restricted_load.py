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

Also ``.metadata`` alone: the restricted read (unpickler and field checks) beside ``pickle.load``.
Before timing, every case's result is checked against the saved tree. Figures: median and min
seconds per load, and each case's median over ``before``'s. Run it by hand; nothing else reads it.
"""

from __future__ import annotations

import argparse
import json
import os
import pickle
import random
import statistics
import sys
import tempfile
import time
import warnings

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


def save_rank(rank: int, world_size: int, directory: str, layers: int) -> None:
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    import modstate as ms
    from modstate import checkpoint

    os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
    dist.init_process_group(
        "gloo", init_method=f"file://{directory}/rendezvous", rank=rank, world_size=world_size
    )
    mesh = init_device_mesh("cpu", (world_size,))
    model = make_model(layers)
    for layer in model:
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    checkpoint.save_distributed({"model": ms.extract(model), **extras()}, f"{directory}/ckpt")
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
    with _dcp.single_process_quietly(None) as no_dist:
        dcp.load(state, checkpoint_id=directory, no_dist=no_dist)
    return ms.unflatten(dict(state))


def measure(mib: float = 100, rounds: int = 15) -> dict[str, object]:
    import torch
    import torch.multiprocessing as mp
    from torch.distributed.checkpoint.metadata import Metadata

    import modstate as ms
    import modstate.tree  # ms.tree
    from modstate import checkpoint
    from modstate.checkpoint import _dcp_reader

    torch.set_num_threads(1)
    layers = layers_for(mib)
    with tempfile.TemporaryDirectory(prefix="modstate-restricted-") as root:
        mp.start_processes(save_rank, args=(2, root, layers), nprocs=2, start_method="spawn")
        directory = f"{root}/ckpt"
        size = sum(os.path.getsize(f"{directory}/{name}") for name in os.listdir(directory))
        saved = {"model": ms.extract(make_model(layers), detach=True), **extras()}
        like = {"model": ms.tree.zeros_like(saved["model"]), "step": None, "param_groups": None}

        cases = {
            "restricted": lambda: checkpoint.load_distributed(directory, like),
            "before": lambda: load_as_before(directory, like),
            "weights_only=False": lambda: checkpoint.load_distributed(
                directory, like, weights_only=False
            ),
        }
        for name, case in cases.items():  # the check, and the warm-up
            loaded = case()
            assert loaded["step"] == saved["step"], name
            assert loaded["param_groups"] == saved["param_groups"], name
            for path, want in ms.flatten(saved["model"]).items():
                assert torch.equal(ms.flatten(loaded["model"])[path], want), (name, path)

        def read_restricted() -> Metadata:
            with open(f"{directory}/.metadata", "rb") as stream:
                return _dcp_reader.read_metadata_file(stream, directory)

        def read_pickle() -> Metadata:
            with open(f"{directory}/.metadata", "rb") as stream:
                return pickle.load(stream)  # what FileSystemReader does: our own checkpoint

        reads = {"metadata restricted": read_restricted, "metadata pickle.load": read_pickle}
        samples: dict[str, list[float]] = {name: [] for name in [*cases, *reads]}
        order = list(cases)
        for _ in range(rounds):
            random.shuffle(order)
            for name in order:
                start = time.perf_counter()
                cases[name]()
                samples[name].append(time.perf_counter() - start)
            for name, read in reads.items():  # 100 reads per sample: each is well under 1 ms
                start = time.perf_counter()
                for _ in range(100):
                    read()
                samples[name].append((time.perf_counter() - start) / 100)

    figures = {
        name: {"median": statistics.median(values), "min": min(values)}
        for name, values in samples.items()
    }
    for name in cases:
        figures[name]["vs before"] = figures[name]["median"] / figures["before"]["median"]
    return {"checkpoint bytes": size, "layers": layers, "rounds": rounds, "seconds": figures}


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
        f"saved by 2 ranks; loaded in one process, {result['rounds']} rounds"
    )
    for name, figure in result["seconds"].items():  # type: ignore[attr-defined]
        ratio = f"  {figure['vs before']:.3f}x before" if "vs before" in figure else ""
        scale, unit = (1e3, "ms") if figure["median"] > 1e-3 else (1e6, "us")
        print(
            f"  {name:22s} median {figure['median'] * scale:8.2f} {unit}  "
            f"min {figure['min'] * scale:8.2f} {unit}{ratio}"
        )


if __name__ == "__main__":
    main()
