"""Peak memory of loading a big checkpoint into a model, beside torch's own low-memory recipe.

    python benchmarks/checkpoint_memory.py            # a 384 MiB checkpoint (6 x Linear(4096, 4096))
    python benchmarks/checkpoint_memory.py --mib 96 --json

Each case runs in a fresh process that reads its memory from ``/proc/self/status``: ``VmRSS``
(resident now) and ``VmHWM`` (the peak), the peak reset just before the load by writing 5 to
``/proc/self/clear_refs``. "peak rise" is the peak during the load minus the resident memory
before it, reported in MiB and as a fraction of the file's size; then the case checks that the
model holds the saved weights, bit for bit. Cases:

- ``modstate mmap+assign``: a model built on the meta device, ``checkpoint.load(path, mmap=True)``
  and ``ms.load(model, tree, assign=True)``; then one forward pass ("after use": the weights
  are read, so the file's pages come in).
- ``modstate load (copy)``: today's recipe: a real model, ``checkpoint.load(path)`` and
  ``ms.load(model, tree)`` (the tree is a second copy of the weights while it lives).
- ``torch mmap+assign`` (the peer): ``torch.load(path, mmap=True, weights_only=True)`` and
  ``load_state_dict(..., assign=True)`` into a meta model.

Linux only (``/proc``). Memory is not time: the side-by-side timing report does not read this;
run it by hand, or through tests/checkpoint/test_mmap.py, which checks the figures on a smaller
file.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

CASES = ("modstate mmap+assign", "modstate load (copy)", "torch mmap+assign")
WIDTH = 4096


def make_model(layers: int):
    from torch import nn

    return nn.Sequential(*(nn.Linear(WIDTH, WIDTH) for _ in range(layers)))


def layers_for(mib: float) -> int:
    return max(1, round(mib * 2**20 / ((WIDTH * WIDTH + WIDTH) * 4)))


def status() -> dict[str, int]:
    """VmRSS and VmHWM of this process, in bytes."""
    values = {}
    with open("/proc/self/status") as handle:
        for line in handle:
            key, _, value = line.partition(":")
            if key in ("VmRSS", "VmHWM"):
                values[key] = int(value.split()[0]) * 1024
    return values


def reset_peak() -> None:
    with open("/proc/self/clear_refs", "w") as handle:
        handle.write("5")


def run_case(case: str, directory: str, layers: int) -> dict[str, float]:
    """In this process: build, load, measure (bytes)."""
    import torch

    import modstate as ms
    from modstate import checkpoint

    path = os.path.join(directory, "model.safetensors")
    torch.set_num_threads(1)
    warm = os.path.join(directory, "warm.safetensors")  # imports and first-call costs, not load
    checkpoint.save({"w": torch.ones(4)}, warm)
    checkpoint.load(warm, mmap=True)
    checkpoint.load(warm)
    torch.load(os.path.join(directory, "warm.pt"), mmap=True, weights_only=True)

    if case == "modstate load (copy)":
        model = make_model(layers)
    else:
        with torch.device("meta"):
            model = make_model(layers)
    before = status()["VmRSS"]
    reset_peak()
    if case == "modstate mmap+assign":
        ms.load(model, checkpoint.load(path, mmap=True), assign=True)
    elif case == "modstate load (copy)":
        ms.load(model, checkpoint.load(path))
    else:
        model.load_state_dict(
            torch.load(os.path.join(directory, "model.pt"), mmap=True, weights_only=True),
            assign=True,
        )
    loaded = status()
    with torch.no_grad():
        model(torch.ones(1, WIDTH))
    used = status()
    assert all(t.device.type == "cpu" for t in model.parameters())
    check_loaded(model, directory)  # after the figures: the check reads every weight
    return {
        "before": before,
        "peak rise": loaded["VmHWM"] - before,
        "after load": loaded["VmRSS"] - before,
        "after use": used["VmRSS"] - before,
    }


def check_loaded(model, directory: str) -> None:
    """The model holds what was saved, bit for bit, whichever case loaded it: read back with
    ``torch.load`` from torch's own file, not through modstate."""
    import torch

    from _timing import assert_same_trees

    saved = torch.load(os.path.join(directory, "model.pt"), mmap=True, weights_only=True)
    assert_same_trees(saved, model.state_dict(), what="checkpoint_memory: the loaded model")


def write_checkpoints(directory: str, layers: int) -> int:
    """The checkpoint (modstate's file, and torch.save's for the peer); its size in bytes."""
    import torch

    import modstate as ms
    from modstate import checkpoint

    torch.manual_seed(0)
    model = make_model(layers)
    checkpoint.save(ms.extract(model), os.path.join(directory, "model.safetensors"))
    torch.save(model.state_dict(), os.path.join(directory, "model.pt"))
    torch.save({"w": torch.ones(4)}, os.path.join(directory, "warm.pt"))
    return os.path.getsize(os.path.join(directory, "model.safetensors"))


def measure(mib: float = 384, cases: tuple[str, ...] = CASES) -> dict[str, object]:
    """Write a checkpoint of about ``mib`` MiB, run each case in a fresh process; the figures."""
    layers = layers_for(mib)
    with tempfile.TemporaryDirectory(prefix="modstate-memory-") as directory:
        size = write_checkpoints(directory, layers)  # here: the cases' processes start clean
        results = {}
        for case in cases:
            done = subprocess.run(
                [sys.executable, __file__, "--case", case, directory, str(layers)],
                capture_output=True, text=True,
            )  # fmt: skip
            if done.returncode:  # a failed check: say what the case's process said
                raise RuntimeError(f"{case}: exit status {done.returncode}\n{done.stderr[-3000:]}")
            results[case] = json.loads(done.stdout.splitlines()[-1])
    return {"file bytes": size, "cases": results}


def report(figures: dict) -> str:
    size = figures["file bytes"]
    mib = 2**20
    lines = [
        f"checkpoint: {size / mib:.1f} MiB (safetensors)",
        f"{'case':<24}{'peak rise':>22}{'after load':>14}{'after use':>14}",
    ]
    for case, values in figures["cases"].items():
        rise = values["peak rise"]
        lines.append(
            f"{case:<24}{rise / mib:>10.1f} MiB ({rise / size:>5.1%}){values['after load'] / mib:>10.1f} MiB"
            f"{values['after use'] / mib:>10.1f} MiB"
        )
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--mib", type=float, default=384, help="checkpoint size (default 384)")
    parser.add_argument("--json", action="store_true", help="print the figures as JSON")
    parser.add_argument("--cases", nargs="+", choices=CASES, default=CASES, help="which cases")
    parser.add_argument(
        "--case", nargs=3, metavar=("CASE", "DIR", "LAYERS"), help=argparse.SUPPRESS
    )
    args = parser.parse_args()
    if args.case:
        print(json.dumps(run_case(args.case[0], args.case[1], int(args.case[2]))))
    else:
        figures = measure(args.mib, tuple(args.cases))
        print(json.dumps(figures) if args.json else report(figures))


if __name__ == "__main__":
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "src"))
    main()
