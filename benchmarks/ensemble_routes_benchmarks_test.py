"""An ``Ensemble`` beside the loop it replaces, at the sizes people train (issue 40).

Each cell: 4 members of one model, a shared input batch, forward without grad ("fwd") or a
train step ("train": forward, the outputs' sum, backward into the parameters). Timed in
interleaved rounds (``_timing.interleave``, median), in one process:

- ``loop``: a Python loop over the 4 member models, the baseline;
- ``auto``: ``Ensemble(models)``, which measured its two routes at its first call (for ViT-Tiny
  with timm's ``LayerNorm`` declared, ``kernels={timm.layers.LayerNorm: nn.LayerNorm}``, as
  docs/semantics.md shows; the other ensembles of the cell too);
- ``batched``: ``Ensemble(models, route="batched")``, the batched kernels and vmap;
- ``loop route``: ``Ensemble(models, route="loop")``, each member by itself on views of the
  stacked tensors;
- ``loop, stacked``: the loop with its outputs stacked, as an ``Ensemble`` returns them (and in
  training one backward through every member's graph, as an ensemble's caller runs it): what the
  loop route adds to it is the loop route's own cost.

The table gives ``auto``, ``batched``, ``loop route`` and ``loop, stacked`` as ratios to the loop
(the median over the rounds of each round's ratio), the route
``auto`` chose, what its first call's measuring cost (and the whole first call), and the peak of
the tensor memory one call allocates, for the loop, the batched route and the loop route, from
``torch.profiler``'s allocation record (the stacked weights are held before the call and not
counted). ``--plan`` also prints ``auto``'s plan notes: each route and each layer's form chosen,
with the times that chose them. Run::

    python benchmarks/ensemble_routes_benchmarks_test.py            # the matrix (minutes)
    python benchmarks/ensemble_routes_benchmarks_test.py --only resnet18 --batches 16
    python benchmarks/ensemble_routes_benchmarks_test.py --only resnet18 --shapes 32x32 --modes train

On Linux, glibc serves each allocation of 32 MiB or more with fresh pages from the kernel; the
stacked gradients and activations of an ensemble cross that size where a member's do not, and
page-fault again at every step. Run the same command under
``MALLOC_MMAP_MAX_=0 MALLOC_TRIM_THRESHOLD_=68719476736`` (glibc then reuses its heap) to see
that cost: the ratios are within one process, so the two runs compare.

Under pytest the smoke test checks one small cell's routes against the loop (no timing).
"""

from __future__ import annotations

import argparse
import copy
import statistics
import sys
import time
from collections.abc import Callable
from typing import Any

if __name__ == "__main__":  # measure this checkout's modstate, whatever is installed
    from pathlib import Path

    sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "src"))
    sys.path.insert(0, str(Path(__file__).resolve().parent))

import torch
from torch import nn

import modstate as ms
from _ensemble_models import SmallResNet, encoder, zoo
from _timing import interleave, peak_allocated

MEMBERS = 4


def resnet18() -> nn.Module:
    zoo()  # torchvision's import, with the tests' stand-in where its C++ ops cannot load
    import torchvision

    return torchvision.models.resnet18(num_classes=10)


def vit_tiny() -> nn.Module:
    zoo()
    import timm

    return timm.create_model(
        "vit_tiny_patch16_224", pretrained=False, img_size=32, patch_size=4, num_classes=10
    )


def convnext_atto() -> nn.Module:
    zoo()
    import timm

    return timm.create_model("convnext_atto", pretrained=False, num_classes=10)


def gpt2() -> nn.Module:
    return zoo().gpt2()


def images(size: int) -> Callable[[int], tuple[torch.Tensor]]:
    return lambda batch: (torch.randn(batch, 3, size, size),)


def tokens(batch: int) -> tuple[torch.Tensor]:
    return (torch.randint(0, 64, (batch, 32)),)


def sequences(batch: int) -> tuple[torch.Tensor]:
    return (torch.randn(batch, 32, 64),)


def logits(out: Any) -> torch.Tensor:
    return out.logits if hasattr(out, "logits") else out


# model name -> (factory, {input name: inputs(batch)})
MODELS: dict[str, tuple[Callable[[], nn.Module], dict[str, Callable[[int], tuple]]]] = {
    "resnet18": (resnet18, {"32x32": images(32), "64x64": images(64)}),
    "vit_tiny": (vit_tiny, {"32x32": images(32)}),
    "convnext_atto": (convnext_atto, {"32x32": images(32), "64x64": images(64)}),
    "gpt2": (gpt2, {"32 tokens": tokens}),
    "encoder": (encoder, {"32x64": sequences}),
    "small_resnet": (SmallResNet, {"32x32": images(32)}),
}


def members(factory: Callable[[], nn.Module]) -> list[nn.Module]:
    models = []
    for seed in range(MEMBERS):
        torch.manual_seed(seed)
        models.append(factory())
    return models


def declared(model: str) -> dict | None:
    """The kernels a user declares for ``model``, as docs/semantics.md shows for timm: timm's
    ``LayerNorm`` computes ``nn.LayerNorm``'s ``F.layer_norm`` while its fast norm is off."""
    if model != "vit_tiny":
        return None
    import timm

    return {timm.layers.LayerNorm: nn.LayerNorm}


def draws(model: nn.Module) -> bool:
    """Whether ``model`` draws random numbers in training (a dropout with ``p > 0``)."""
    return any(
        isinstance(layer, nn.modules.dropout._DropoutNd) and layer.p > 0
        for layer in model.modules()
    )


def steps(
    models: list[nn.Module], inputs: tuple, train: bool, kernels: dict | None = None
) -> tuple[dict[str, Callable[[], Any]], ms.Ensemble]:
    """The four implementations of one cell, and the ``auto`` ensemble (for its plan);
    ``kernels`` as ``Ensemble(kernels=...)`` takes them."""
    for model in models:
        model.train(train)
    # a member that draws random numbers in training (GPT-2's dropout) needs a draw per member;
    # auto then runs batched unmeasured (a loop would draw other masks); the others keep vmap's
    # default, and auto measures
    randomness = "different" if train and draws(models[0]) else "error"
    options: dict[str, Any] = {"randomness": randomness, "kernels": kernels}
    auto = ms.Ensemble(copy.deepcopy(models), **options).train(train)
    batched = ms.Ensemble(copy.deepcopy(models), route="batched", **options)
    batched.train(train)
    looped = ms.Ensemble(copy.deepcopy(models), route="loop", **options)
    looped.train(train)

    def loop_fwd() -> Any:
        with torch.no_grad():
            return [model(*inputs) for model in models]

    def loop_train() -> None:
        for model in models:
            logits(model(*inputs)).sum().backward()

    # what the Ensemble returns, from a loop: the outputs stacked (and in training one backward
    # through every member's graph, which the ensemble's caller runs): the loop route's floor
    def stacked_fwd() -> Any:
        with torch.no_grad():
            return torch.stack([logits(model(*inputs)) for model in models])

    def stacked_train() -> None:
        torch.stack([logits(model(*inputs)) for model in models]).sum().backward()

    def ensemble_fwd(ensemble: ms.Ensemble) -> Callable[[], Any]:
        def run() -> Any:
            with torch.no_grad():
                return ensemble(*inputs)

        return run

    def ensemble_train(ensemble: ms.Ensemble) -> Callable[[], None]:
        def run() -> None:
            logits(ensemble(*inputs)).sum().backward()

        return run

    step = ensemble_train if train else ensemble_fwd
    impls = {
        "loop": loop_train if train else loop_fwd,
        "loop, stacked": stacked_train if train else stacked_fwd,
        "auto": step(auto),
        "batched": step(batched),
        "loop route": step(looped),
    }
    return impls, auto


def cell(model: str, shape: str, batch: int, train: bool, rounds: int) -> dict[str, Any]:
    factory, inputs_of = MODELS[model]
    torch.manual_seed(100)
    inputs = inputs_of[shape](batch)
    impls, auto = steps(members(factory), inputs, train, declared(model))
    start = time.perf_counter()
    impls["auto"]()  # the first call measures the routes
    first = time.perf_counter() - start
    # a round of a small cell times several calls (0.05 s), of a large one a single call
    samples = interleave(impls, rounds=rounds, warmup_s=0.0, round_s=0.05)
    loop_ms = statistics.median(samples["loop"]) * 1e3
    # the median of each round's ratio: a round runs every way back to back, so a slow spell of
    # the machine slows them alike
    ratio = {
        name: statistics.median(a / b for a, b in zip(values, samples["loop"], strict=True))
        for name, values in samples.items()
    }
    chosen = [note for note in auto.plan.notes if note.startswith("forward for")]
    route = chosen[-1].split(": ")[1].split(" ")[0] if chosen else "batched"
    measured = chosen[-1].rsplit("measured in ", 1)[-1].rstrip(")") if chosen else "-"
    # the peak of the tensor memory one call allocates (the stacked weights are held before),
    # after a call that made what stays (.grad)
    peaks = {}
    for name, fn in impls.items():
        if name not in ("auto", "loop, stacked"):
            fn()
            peaks[name] = peak_allocated(fn) / 2**20
    return {
        "model": model,
        "input": shape,
        "batch": batch,
        "mode": "train" if train else "fwd",
        "loop_ms": loop_ms,
        **{name: ratio[name] for name in ("auto", "batched", "loop route", "loop, stacked")},
        "route": route,
        "measuring": measured,
        "first_call_s": first,
        "peak_mib": peaks,
        "weights_mib": sum(t.numel() * t.element_size() for t in auto.parameters()) / 2**20,
        "notes": auto.plan.notes,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--only", nargs="*", default=list(MODELS), choices=list(MODELS))
    parser.add_argument("--batches", nargs="*", type=int, default=[8, 16, 64])
    parser.add_argument("--shapes", nargs="*", help="only these inputs (for example 32x32)")
    parser.add_argument("--modes", nargs="*", default=["fwd", "train"], choices=["fwd", "train"])
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--threads", type=int, default=torch.get_num_threads())
    parser.add_argument(
        "--plan", action="store_true", help="print auto's plan notes (routes and forms chosen)"
    )
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    print(
        f"torch {torch.__version__}, {args.threads} threads, {MEMBERS} members, median of "
        f"{args.rounds} interleaved rounds of each round's ratio to the loop (< 1: faster than "
        "the loop)"
    )
    print(
        "| model | input | batch | mode | loop ms | auto | route chosen | batched | loop route "
        "| loop, stacked | measuring "
        "| first call | peak MiB: loop, batched, loop route (stacked weights) |"
    )
    print("|---|---|---|---|---|---|---|---|---|---|---|---|---|")
    notes = []
    for model in args.only:
        for shape in MODELS[model][1]:
            if args.shapes and shape not in args.shapes:
                continue
            for batch in args.batches:
                for train in [mode == "train" for mode in args.modes]:
                    row = cell(model, shape, batch, train, args.rounds)
                    peaks = row["peak_mib"]
                    print(
                        f"| {row['model']} | {row['input']} | {row['batch']} | {row['mode']} | "
                        f"{row['loop_ms']:.1f} | {row['auto']:.2f} | {row['route']} | "
                        f"{row['batched']:.2f} | {row['loop route']:.2f} | "
                        f"{row['loop, stacked']:.2f} | {row['measuring']} | "
                        f"{row['first_call_s']:.3g} s | {peaks['loop']:.0f}, "
                        f"{peaks['batched']:.0f}, {peaks['loop route']:.0f} "
                        f"({row['weights_mib']:.0f}) |",
                        flush=True,
                    )
                    where = f"{row['model']} {row['input']} batch {row['batch']} {row['mode']}"
                    notes += [f"- {where}: {note}" for note in row["notes"]]
    if args.plan:
        print("\nauto's plan notes (the routes and the forms chosen, with their times):")
        print("\n".join(notes))


def test_every_route_of_a_small_cell_computes_the_loops_outputs() -> None:
    models = members(SmallResNet)
    inputs = images(32)(8)
    for model in models:
        model.eval()
    expected = torch.stack([model(*inputs) for model in models])
    for route in ("auto", "batched", "loop"):
        ensemble = ms.Ensemble(copy.deepcopy(models), route=route).eval()
        with torch.no_grad():
            torch.testing.assert_close(ensemble(*inputs), expected, atol=1e-5, rtol=1e-5)


if __name__ == "__main__":
    main()
