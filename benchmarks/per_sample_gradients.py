"""Per-sample gradients: modstate's recipe beside torch.func's and a loop over the samples.

    python benchmarks/per_sample_gradients.py                 # time and peak memory, both models
    python benchmarks/per_sample_gradients.py --models cnn --rounds 9

The three ways compute every sample's gradient of a batch, as a tree of ``(batch, *shape)``
tensors, and are checked against each other (within 1e-5) before anything is timed:

- ``modstate``: ``torch.vmap(ms.grad(sample_loss), in_dims=(None, 0, 0))(params, x, y)``, the
  README's recipe, ``sample_loss`` calling the model with ``ms.call``;
- ``torch.func``: ``torch.vmap(torch.func.grad(f), in_dims=(None, 0, 0))`` with ``f`` calling
  ``torch.func.functional_call``, the recipe of torch's per-sample-gradients tutorial;
- ``loop``: one ``backward()`` per sample on the module, the gradients stacked.

Models: a small CNN (two convolutions, 1x28x28 inputs, batch 64) and a small transformer
(embedding 64, two ``TransformerEncoderLayer`` s, dropout 0, sequences of 32 tokens, batch 16,
a language-model loss). Time: ``_timing.interleave`` (warmed up, rounds interleaved; median and
min, milliseconds per batch). Memory: each way in a fresh process, the peak resident memory
(``VmHWM``, reset just before) minus the resident memory before the call, as
``checkpoint_memory.py`` reads it, the median of three calls after a warm-up, the allocator's
free memory given back before each (Linux and glibc only). One thread (``torch.set_num_threads(1)``), so
that the figures do not depend on the machine's other load as much.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
from pathlib import Path

WAYS = ("modstate", "torch.func", "loop")
MODELS = ("cnn", "transformer")


def build(name: str):
    """The model (eval mode: no dropout, BatchNorm-free), a batch, and the per-sample loss."""
    import torch
    import torch.nn.functional as F
    from torch import nn

    torch.manual_seed(0)
    if name == "cnn":
        model = nn.Sequential(
            nn.Conv2d(1, 16, 3), nn.ReLU(), nn.MaxPool2d(2), nn.Conv2d(16, 32, 3), nn.ReLU(),
            nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(32, 10),
        )  # fmt: skip
        x, y = torch.randn(64, 1, 28, 28), torch.randint(0, 10, (64,))

        def loss(out, target):
            return F.cross_entropy(out, target)
    else:
        model = TinyLM()
        x = torch.randint(0, 1000, (16, 32))
        y = torch.roll(x, -1, dims=1)

        def loss(out, target):
            return F.cross_entropy(out.flatten(0, -2), target.flatten())

    return model.eval(), x, y, loss


class TinyLM:  # built lazily so that importing this file needs no torch
    def __new__(cls):
        from torch import nn

        class Model(nn.Module):
            def __init__(self) -> None:
                super().__init__()
                self.embed = nn.Embedding(1000, 64)
                layer = nn.TransformerEncoderLayer(64, 4, 128, dropout=0.0, batch_first=True)
                self.encoder = nn.TransformerEncoder(layer, 2, enable_nested_tensor=False)
                self.head = nn.Linear(64, 1000)

            def forward(self, tokens):
                return self.head(self.encoder(self.embed(tokens)))

        return Model()


def ways(name: str):
    """Each way as a function of no arguments returning the per-sample gradients."""
    import torch

    import modstate as ms

    model, x, y, loss = build(name)
    params = ms.extract(model, detach=True)
    named = {path: p.detach() for path, p in model.named_parameters()}

    def sample_loss(params, xi, yi):
        return loss(ms.call(model, params, xi[None]), yi[None])

    def func_loss(named, xi, yi):
        return loss(torch.func.functional_call(model, named, (xi[None],)), yi[None])

    by_modstate = torch.vmap(ms.grad(sample_loss), in_dims=(None, 0, 0))
    by_func = torch.vmap(torch.func.grad(func_loss), in_dims=(None, 0, 0))
    parameters = dict(model.named_parameters())

    def loop():
        grads: dict[str, list] = {path: [] for path in parameters}
        for i in range(len(x)):
            model.zero_grad(set_to_none=True)
            loss(model(x[i : i + 1]), y[i : i + 1]).backward()
            for path, p in parameters.items():
                grads[path].append(p.grad)
        return {path: torch.stack(g) for path, g in grads.items()}

    return {
        "modstate": lambda: ms.flatten(by_modstate(params, x, y)),
        "torch.func": lambda: by_func(named, x, y),
        "loop": loop,
    }


def check(name: str, made: dict) -> None:
    from _timing import assert_same_trees

    reference = made["loop"]()
    for way in ("modstate", "torch.func"):
        assert_same_trees(
            reference, made[way](), what=f"{name}: {way} against the loop", atol=1e-5, rtol=1e-4
        )


def timing(name: str, rounds: int) -> dict[str, dict[str, float]]:
    import torch

    from _timing import interleave, summarize

    torch.set_num_threads(1)
    made = ways(name)
    check(name, made)
    samples = interleave(made, rounds=rounds, warmup_s=1.0, round_s=0.2)
    return {way: summarize(values) for way, values in samples.items()}


def peak_rise(name: str, way: str, calls: int = 3) -> int:
    """In this process: the median peak memory rise of ``calls`` calls (bytes), after a warm-up
    call. Before each, the C allocator gives its free memory back to the system
    (``malloc_trim``), so that a call's new pages show instead of being reused unseen."""
    import ctypes
    import statistics

    import torch

    from checkpoint_memory import reset_peak, status

    trim = ctypes.CDLL("libc.so.6").malloc_trim
    torch.set_num_threads(1)
    made = ways(name)
    made[way]()  # first-call costs (plans, caches) are not per-sample-gradient memory
    rises = []
    for _ in range(calls):
        trim(0)
        before = status()["VmRSS"]
        reset_peak()
        out = made[way]()
        rises.append(status()["VmHWM"] - before)
        del out
    return int(statistics.median(rises))


def memory(name: str) -> dict[str, int]:
    figures = {}
    for way in WAYS:
        done = subprocess.run(
            [sys.executable, __file__, "--peak", name, way], capture_output=True, text=True
        )
        if done.returncode:
            raise RuntimeError(
                f"{name} {way}: exit status {done.returncode}\n{done.stderr[-3000:]}"
            )
        figures[way] = int(done.stdout.splitlines()[-1])
    return figures


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", nargs="+", choices=MODELS, default=MODELS)
    parser.add_argument("--rounds", type=int, default=15)
    parser.add_argument("--json", action="store_true", help="print the figures as JSON")
    parser.add_argument("--peak", nargs=2, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.peak:
        print(peak_rise(*args.peak))
        return
    figures = {
        name: {"time": timing(name, args.rounds), "peak": memory(name)} for name in args.models
    }
    if args.json:
        print(json.dumps(figures))
        return
    for name, result in figures.items():
        base_time = result["time"]["torch.func"]["median"]
        base_peak = result["peak"]["torch.func"]
        print(f"{name}: ms per batch (median, min), peak memory rise, each vs torch.func")
        for way in WAYS:
            t, peak = result["time"][way], result["peak"][way]
            print(
                f"  {way:<11}{t['median'] * 1e3:8.2f} {t['min'] * 1e3:8.2f}  "
                f"({t['median'] / base_time:4.2f}x)  {peak / 2**20:7.1f} MiB "
                f"({peak / max(base_peak, 1):4.2f}x)"
            )


if __name__ == "__main__":
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "src"))
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    main()
