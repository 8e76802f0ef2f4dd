"""Which way an ensemble's forward runs: all members at once, or one member at a time.

The batched forward (the kernels, the chain, vmap) is not faster everywhere: on a 2-core CPU a
4-member ResNet-18 at 32x32 ran at 1.0-1.24x a loop over the members, where a transformer
encoder runs at 0.6x. So at the first call with a new input signature (the tensors' shapes,
dtypes and devices, the other arguments, train or eval, grad or not), ``route="auto"``
measures both ways on those inputs and keeps the faster for that signature:

- ``"batched"``: the ensemble's batched forward (see ``Ensemble.plan``);
- ``"loop"``: each member by itself, a plain call of a per-thread copy of the template holding
  views of the stacked tensors (``_loop.py``), outputs stacked: the members' own layers, no
  kernel and no vmap. Gradients reach the stacked parameters through the views, BatchNorm
  updates the stacked statistics in place, as a loop over the member models does.

Measuring runs each way once to warm up, once counting memory (``_memory.py``), then three to
twelve timed times, interleaved, and takes the medians: more rounds while they cost under a
quarter second in all, or, up to a second, while the two are within a few percent of the
margin (on a busy 2-core machine runs of one route differ by several percent). A run is the
forward and, when autograd records, the backward of the outputs' sum with respect to the
stacked parameters (``torch.autograd.grad``: no ``.grad`` is written); the stacked buffers and
the random state are put back after each, so measuring changes nothing the call that follows
can see. The loop is kept where it measured at least `LOOP_MARGIN` faster (the minimum of a
few runs favoured the loop wrongly: the routes benchmark, torchvision ResNet-18 of 4 members,
batch 64, training: the loop chosen, at 1.48 of a loop over the models, where the batched
forward ran at 1.19), and wherever the batched forward's peak of tensor memory exceeds the
loop's plus the stacked tensors' bytes plus `ALLOWANCE`, whatever the times: the batched
forward holds every member's activations at once. Its cost (once per signature), the times
and the peaks that chose are in ``Ensemble.plan``. Only the first 8 signatures are measured:
inputs of ever new shapes (a growing sequence) then take the route chosen for most of them,
without measuring.

Not measured (batched, as before): while compiling or under a ``torch.func`` transform (the
forward then is part of a larger program), ``compile=True``, ``fast=False``, and a forward in
training mode with ``randomness`` other than ``"error"`` (a loop would draw other dropout masks
than the batched forward's, and the masks are promised not to depend on the route).
"""

from __future__ import annotations

import statistics
import threading
import time
from collections.abc import Callable, Hashable
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor, nn
from torch.utils import _pytree as pytree

from modstate._core.torch_facts import functorch_active

from ._memory import held_bytes, peak_bytes

ROUTES = ("auto", "batched", "loop")
_ROUNDS = 3  # timed rounds, after a warm-up and the memory pass
_MAX_ROUNDS = 12
_CHEAP_S = 0.25  # measuring time below which more rounds are taken
_CLOSE = (0.85, 1.05)  # loop / batched time ratios near the margin: timed longer, up to
_CLOSE_S = 1.0
_MAX_MEASURED = 8  # signatures measured; later new ones take the route chosen most often
LOOP_MARGIN = 0.95
"""The loop is chosen only when its measured time is below this fraction of the batched one's."""
ALLOWANCE = 64 * 2**20
"""Bytes the batched forward may take beyond the loop's peak plus the stacked tensors: without
it, every model whose forward holds a few MiB would lose the batched route, which holds M
members' activations at once where the loop holds one member's (a 4-member GPT-2 without grad:
5 MiB against 2, at 0.9 of the loop's time)."""


@dataclass(frozen=True)
class Choice:
    """The way chosen for one input signature, and what chose it.

    Attributes:
        signature: the inputs in words (shapes, dtype, mode).
        route: ``"batched"`` or ``"loop"``.
        batched_s: the batched forward's time (seconds; None where pinned).
        loop_s: the loop's time.
        measuring_s: what measuring cost, in all.
        batched_bytes: the peak of the tensor memory the batched forward (and its backward)
            made; None where not counted (under another dispatch mode).
        loop_bytes: the loop's.
        bound_bytes: the most the batched forward may take: the loop's peak plus the stacked
            tensors' bytes plus `ALLOWANCE`. Above it the loop is chosen, whatever the times.
    """

    signature: str
    route: str
    batched_s: float | None = None
    loop_s: float | None = None
    measuring_s: float = 0.0
    batched_bytes: int | None = None
    loop_bytes: int | None = None
    bound_bytes: int | None = None

    def line(self) -> str:
        if self.batched_s is None or self.loop_s is None:
            return f"{self.signature}: {self.route} (pinned)"
        over = _over_bound(self.batched_bytes, self.bound_bytes)
        memory = (
            ""
            if self.bound_bytes is None
            else f", peak MiB batched {_mib(self.batched_bytes)}, loop {_mib(self.loop_bytes)}"
            + (f", over the bound {_mib(self.bound_bytes)}" if over else "")
        )
        return (
            f"{self.signature}: {self.route} (batched {self.batched_s * 1e3:.3g} ms, loop "
            f"{self.loop_s * 1e3:.3g} ms{memory}, measured in {self.measuring_s:.3g} s)"
        )


def _over_bound(peak: int | None, bound: int | None) -> bool:
    """Whether the batched forward's peak exceeds the bound (False where either was not
    counted)."""
    return peak is not None and bound is not None and peak > bound


def _mib(size: int | None) -> str:
    return "?" if size is None else f"{size / 2**20:.3g}"


class ForwardChoice:
    """The choice of one ensemble, per input signature; safe under threads (the first thread
    with a new signature measures, the others with that signature wait for its choice)."""

    def __init__(self, route: str, randomness: str) -> None:
        self.route = route
        self._randomness = randomness
        self._chosen: dict[Hashable, Choice] = {}
        self._lock = threading.Lock()

    @property
    def choices(self) -> list[Choice]:
        """Every choice made so far, oldest first."""
        with self._lock:
            return list(self._chosen.values())

    def run(
        self,
        owner: nn.Module,
        args: tuple,
        kwargs: dict[str, Any],
        batched: Callable[[tuple, dict[str, Any]], Any],
        loop: Callable[[tuple, dict[str, Any]], Any],
        stacked: Callable[[], list[Tensor]],
    ) -> Any:
        """The forward by the way chosen for these inputs (measured first if they are new):
        ``batched(args, kwargs)`` or ``loop(args, kwargs)``. ``stacked`` gives the tensors
        the forward reads, as this thread sees them."""
        if self.route == "loop":  # asked for: ms.call runs under compile and torch.func too
            return loop(args, kwargs)
        if self.route == "batched" or not self._may_measure(owner):
            return batched(args, kwargs)
        key = _signature(owner, args, kwargs)
        choice = self._chosen.get(key)
        if choice is None:
            with self._lock:  # one measurement per signature, whichever thread comes first
                choice = self._chosen.get(key)
                if choice is None and len(self._chosen) >= _MAX_MEASURED:
                    # inputs of ever new shapes (a growing sequence): measuring each would
                    # cost more than any route saves, so they take the route chosen most
                    way = loop if self._usual() == "loop" else batched
                    return way(args, kwargs)
                if choice is None:
                    choice = _measure(
                        _in_words(owner, args, kwargs),
                        lambda: batched(args, kwargs),
                        lambda: loop(args, kwargs),
                        stacked(),
                    )
                    self._chosen[key] = choice
        return (loop if choice.route == "loop" else batched)(args, kwargs)

    def _usual(self) -> str:
        """The route chosen for most signatures so far (batched on a tie)."""
        loops = sum(choice.route == "loop" for choice in self._chosen.values())
        return "loop" if 2 * loops > len(self._chosen) else "batched"

    def _may_measure(self, owner: nn.Module) -> bool:
        if torch.compiler.is_compiling() or functorch_active():
            return False
        return not (owner.training and self._randomness != "error")


def _signature(owner: nn.Module, args: tuple, kwargs: dict[str, Any]) -> Hashable:
    """What makes a forward's cost: every tensor's shape, dtype and device, the other
    arguments (by value where hashable), train or eval, and whether autograd records."""
    mode = (owner.training, torch.is_grad_enabled())
    if not kwargs and all(type(a) is Tensor for a in args):  # the usual call, at 1 µs
        return (*mode, *((a.shape, a.dtype, a.device, a.requires_grad) for a in args))
    leaves, spec = pytree.tree_flatten((args, kwargs))
    parts: list[Hashable] = [*mode, str(spec)]
    for leaf in leaves:
        if isinstance(leaf, Tensor):
            parts.append((leaf.shape, leaf.dtype, leaf.device, leaf.requires_grad))
        else:
            parts.append((type(leaf), leaf if isinstance(leaf, Hashable) else None))
    return tuple(parts)


def _in_words(owner: nn.Module, args: tuple, kwargs: dict[str, Any]) -> str:
    tensors = [leaf for leaf in pytree.tree_leaves((args, kwargs)) if isinstance(leaf, Tensor)]
    shapes = ", ".join(f"{tuple(t.shape)} {str(t.dtype).removeprefix('torch.')}" for t in tensors)
    mode = "train" if owner.training else "eval"
    grad = ", grad" if torch.is_grad_enabled() else ""
    return f"inputs {shapes or 'none'} ({mode}{grad})"


def _measure(
    words: str, batched: Callable[[], Any], loop: Callable[[], Any], stacked: list[Tensor]
) -> Choice:
    started = time.perf_counter()
    ways = {"batched": batched, "loop": loop}
    buffers = [t for t in dict.fromkeys(stacked) if not t.requires_grad]
    saved = [t.clone() for t in buffers]
    trained = [t for t in dict.fromkeys(stacked) if t.requires_grad]
    rng = torch.random.get_rng_state()

    def once(run: Callable[..., Any], way: Callable[[], Any]) -> Any:
        try:
            return run(way, trained)
        finally:  # after every run, also one that raised: what it changed in place
            with torch.no_grad():  # (BatchNorm's statistics) and the random state
                for tensor, value in zip(buffers, saved, strict=True):
                    tensor.copy_(value)
            torch.random.set_rng_state(rng)

    for way in ways.values():  # a warm-up: caches, the kernels' first-call learning (forms)
        once(_timed, way)
    # the memory pass, apart from the timed ones: counting slows every op
    peaks = {name: once(_counted, way) for name, way in ways.items()}
    times: dict[str, list[float]] = {"batched": [], "loop": []}
    while _more_rounds(times):
        for name, way in ways.items():  # interleaved rounds
            times[name].append(once(_timed, way))
    batched_s, loop_s = (statistics.median(times[name]) for name in ("batched", "loop"))
    bound = None if peaks["loop"] is None else peaks["loop"] + held_bytes(stacked) + ALLOWANCE
    faster = loop_s < LOOP_MARGIN * batched_s
    return Choice(
        words,
        "loop" if faster or _over_bound(peaks["batched"], bound) else "batched",
        batched_s,
        loop_s,
        time.perf_counter() - started,
        peaks["batched"],
        peaks["loop"],
        bound,
    )


def _more_rounds(times: dict[str, list[float]]) -> bool:
    """Whether to time one more round: at least `_ROUNDS`; more while they are cheap (small
    models: their times are noisier), or while the routes are close to the margin and it
    costs under `_CLOSE_S` in all."""
    rounds = len(times["batched"])
    if rounds < _ROUNDS:
        return True
    if rounds >= _MAX_ROUNDS:
        return False
    spent = _spent(times)
    ratio = statistics.median(times["loop"]) / statistics.median(times["batched"])
    return spent < _CHEAP_S or (_CLOSE[0] < ratio < _CLOSE[1] and spent < _CLOSE_S)


def _spent(times: dict[str, list[float]]) -> float:
    return sum(map(sum, times.values()))


def _counted(way: Callable[[], Any], trained: list[Tensor]) -> int | None:
    """The peak of the tensor bytes one run of `_timed` makes (see ``_memory.py``)."""
    return peak_bytes(lambda: _timed(way, trained))


def _timed(way: Callable[[], Any], trained: list[Tensor]) -> float:
    """One forward (and, when autograd records, the backward of the outputs' sum into
    ``trained``), in seconds."""
    _synchronize(trained)
    start = time.perf_counter()
    out = way()
    if trained and torch.is_grad_enabled():
        total = sum(
            (
                leaf.float().sum()
                for leaf in pytree.tree_leaves(out)
                if isinstance(leaf, Tensor) and leaf.requires_grad
            ),
            torch.zeros((), device=trained[0].device),
        )
        if total.requires_grad:
            torch.autograd.grad(total, trained, allow_unused=True)
    _synchronize(trained)
    return time.perf_counter() - start


def _synchronize(tensors: list[Tensor]) -> None:
    if tensors and tensors[0].device.type == "cuda":
        torch.cuda.synchronize(tensors[0].device)
