"""The call overhead and tree-op figures of two revisions of modstate, timed in one run.

    python benchmarks/revisions.py 70cc49c^ HEAD            # before the _core moves, and now
    python benchmarks/revisions.py 70cc49c^ HEAD --rounds 9 --json

A refactor that moves code should leave these figures where they were. Each revision is checked
out (``git worktree add --detach`` into a temporary folder, removed afterwards; ``HEAD`` with the
working tree's uncommitted changes is ``.``) and imported from its ``src`` in a subprocess of its
own; the rounds alternate the two revisions (in a rotating order), so drift in the machine's load
reaches both alike. Each subprocess warms every case up, then times it in blocks of calls and
reports the fastest block's time per call; the figures are the median over rounds of those, and
each case's median over rounds of the round's ratio, second revision over first.

The cases (one thread, CPU):

- ``call MLP``: ``ms.call(model, tree, x)`` on a 7-layer MLP with BatchNorm (batch 1), minus the
  plain forward ``model(x)``: the overhead a stateless call adds;
- ``call (params, state)``: the same with the ``ms.split`` halves;
- ``extract resnet``: ``ms.extract`` of a ResNet-style tree of 62 leaves;
- ``tree.map / add / mul resnet``: ``ms.tree.map(torch.neg, ...)``, ``ms.tree.add(a, b)``,
  ``ms.tree.mul(floats, 0.5)`` on that tree (the floating-point half);
- ``flatten / unflatten resnet``: ``ms.flatten`` and ``ms.unflatten`` of it.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent

# Run in each subprocess, against the revision on sys.path; prints {case: seconds per call}.
CASES = r"""
import json, sys, time
import torch
from torch import nn
import modstate as ms

torch.set_num_threads(1)
torch.manual_seed(0)
blocks, calls = int(sys.argv[1]), int(sys.argv[2])

layers = []
for _ in range(3):
    layers += [nn.Linear(64, 64), nn.BatchNorm1d(64), nn.ReLU()]
mlp = nn.Sequential(*layers, nn.Linear(64, 10)).eval()
x = torch.randn(1, 64)
tree = ms.extract(mlp)
params, state = ms.split(mlp)


def block(channels):
    return nn.Sequential(
        nn.Conv2d(channels, channels, 3, padding=1, bias=False), nn.BatchNorm2d(channels),
        nn.ReLU(), nn.Conv2d(channels, channels, 3, padding=1, bias=False),
        nn.BatchNorm2d(channels),
    )


resnet = nn.Sequential(*[block(8) for _ in range(6)], nn.Flatten(), nn.Linear(8, 10))
big = ms.extract(resnet)
floats, _ = ms.tree.partition(big, ms.tree.is_float)
other = ms.tree.map(torch.clone, big)
flat = ms.flatten(big)

cases = {
    "plain forward MLP": lambda: mlp(x),
    "call MLP": lambda: ms.call(mlp, tree, x),
    "call (params, state)": lambda: ms.call(mlp, (params, state), x),
    "extract resnet": lambda: ms.extract(resnet),
    "tree.map resnet": lambda: ms.tree.map(torch.neg, big),
    "tree.add resnet": lambda: ms.tree.add(big, other),
    "tree.mul resnet": lambda: ms.tree.mul(floats, 0.5),
    "flatten resnet": lambda: ms.flatten(big),
    "unflatten resnet": lambda: ms.unflatten(flat),
}
best = {}
with torch.no_grad():
    for name, fn in cases.items():
        for _ in range(calls):
            fn()
        times = []
        for _ in range(blocks):
            start = time.perf_counter()
            for _ in range(calls):
                fn()
            times.append((time.perf_counter() - start) / calls)
        best[name] = min(times)
best["call MLP"] -= best["plain forward MLP"]
best["call (params, state)"] -= best["plain forward MLP"]
best["module file"] = ms.__file__
print(json.dumps(best))
"""


def checkout(revision: str, into: Path) -> Path:
    """The ``src`` folder of ``revision`` (``.``: this working tree)."""
    if revision == ".":
        return ROOT / "src"
    subprocess.run(
        ["git", "-C", str(ROOT), "worktree", "add", "--detach", "--quiet", str(into), revision],
        check=True,
    )
    return into / "src"


def run(src: Path, blocks: int, calls: int) -> dict[str, float]:
    env = {**os.environ, "PYTHONPATH": str(src), "OMP_NUM_THREADS": "1"}
    out = subprocess.run(
        [sys.executable, "-c", CASES, str(blocks), str(calls)],
        env=env,
        check=True,
        capture_output=True,
        text=True,
        cwd=tempfile.gettempdir(),  # not the checkout: import modstate from src only
    )
    figures = json.loads(out.stdout.splitlines()[-1])
    where = Path(figures.pop("module file"))
    if not where.is_relative_to(src):  # an editable install's finder could win over PYTHONPATH
        raise SystemExit(f"modstate was imported from {where}, not from {src}")
    return figures


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("before", help="a git revision, or . for this working tree")
    parser.add_argument("after", help="a git revision, or . for this working tree")
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--blocks", type=int, default=7)
    parser.add_argument("--calls", type=int, default=200)
    parser.add_argument("--json", action="store_true", help="print the figures as JSON")
    options = parser.parse_args()
    with tempfile.TemporaryDirectory() as scratch:
        revisions = [options.before, options.after]
        made = [Path(scratch) / f"rev{i}" for i in range(2)]
        try:
            sources = [checkout(r, m) for r, m in zip(revisions, made, strict=True)]
            samples: list[list[dict[str, float]]] = [[], []]
            for round_ in range(options.rounds):
                order = [0, 1] if round_ % 2 == 0 else [1, 0]
                for i in order:
                    samples[i].append(run(sources[i], options.blocks, options.calls))
        finally:
            for revision, folder in zip(revisions, made, strict=True):
                if revision != "." and folder.exists():
                    subprocess.run(
                        ["git", "-C", str(ROOT), "worktree", "remove", "--force", str(folder)],
                        check=True,
                    )
    medians = [
        {case: statistics.median(s[case] for s in runs) for case in runs[0]} for runs in samples
    ]
    # The two runs of a round ran next to each other, so their ratio cancels the drift of the
    # machine's speed between rounds, which on a shared VM is larger than what is measured.
    ratios = {
        case: statistics.median(
            b[case] / a[case] for a, b in zip(samples[0], samples[1], strict=True)
        )
        for case in medians[0]
    }
    if options.json:
        print(
            json.dumps(
                {"revisions": revisions, "median_seconds": medians, "round_ratios": ratios},
                indent=2,
            )
        )
        return
    print(
        f"{options.rounds} rounds; microseconds per call, the median over rounds of each run's "
        "fastest block; ratio: the median of the rounds' ratios (second / first). The plain "
        "forward runs no modstate code: its ratio is the noise"
    )
    print(f"{'case':24} {revisions[0]:>12} {revisions[1]:>12}  ratio")
    for case in medians[0]:
        a, b = medians[0][case] * 1e6, medians[1][case] * 1e6
        print(f"{case:24} {a:12.1f} {b:12.1f}  {ratios[case]:5.2f}x")


if __name__ == "__main__":
    main()
