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
min, milliseconds per batch). Memory: the peak of the tensor memory allocated during one call
(after a warm-up call), from ``torch.profiler``'s record of every allocation and free
(``profile_memory=True``): exact, unlike the process's resident memory, which the C
allocator's reuse of freed pages blurs. One thread (``torch.set_num_threads(1)``), so that the
figures do not depend on the machine's other load as much.
"""

from __future__ import annotations

import argparse
import json
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


def memory(name: str) -> dict[str, int]:
    import torch

    from _timing import peak_allocated

    torch.set_num_threads(1)
    made = ways(name)
    figures = {}
    for way, fn in made.items():
        fn()  # first-call costs (plans, caches) are not per-sample-gradient memory
        figures[way] = peak_allocated(fn)
    return figures


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", nargs="+", choices=MODELS, default=MODELS)
    parser.add_argument("--rounds", type=int, default=15)
    parser.add_argument("--json", action="store_true", help="print the figures as JSON")
    args = parser.parse_args()
    figures = {
        name: {"time": timing(name, args.rounds), "peak": memory(name)} for name in args.models
    }
    if args.json:
        print(json.dumps(figures))
        return
    for name, result in figures.items():
        base_time = result["time"]["torch.func"]["median"]
        base_peak = result["peak"]["torch.func"]
        print(f"{name}: ms per batch (median, min), peak tensor memory, each vs torch.func")
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
