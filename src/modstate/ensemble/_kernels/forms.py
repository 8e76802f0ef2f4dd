"""Which of a kernel's batched forms runs a layer, measured on the layer's own inputs.

Some kernels have more than one batched form, and which is faster depends on the machine, the
sizes and whether autograd records. A convolution with small output maps runs on the CPU as one
grouped convolution or as one batched matmul over its unfolded patches: in inference oneDNN's
grouped convolution is the slow one there, but in training the matmul's backward can lose
(ResNet-18's ``256 -> 256`` convolutions on 2x2 maps, 4 members, a batch of 64, forward and
backward on a 2-core x86 server: 43 ms as a matmul, 31 ms grouped, 27 ms for the 4 members'
own convolutions). A fixed rule is right for some of these and wrong for others.

So an ensemble built with ``route="auto"`` times the forms where more than one applies: at the
first call of each layer with an input signature (its shape and strides, dtype, and whether
autograd records), each form runs on detached copies of that input and the stacked tensors,
forward and, when autograd records, backward, in interleaved rounds (the first a warm-up, then
the fastest of the others). The faster is kept for that layer and signature: one choice per
ensemble, shared by its threads (the first thread to meet a signature measures, the others wait
for its choice) and its chain, so every call after it runs the same form. Measuring writes no
tensor and draws no random numbers. Its times and cost are in ``Ensemble.plan``.

Where nothing is measured, a cost model decides instead: the kernel's own rule (for a
convolution, the output-map sizes in `conv.py`, set from measurements in inference). That is so
with a pinned route (``route="batched"`` or ``"loop"``), with ``compile=True``, while
``torch.compile`` traces, and under a ``torch.func`` transform around the ensemble (then the
forms run on wrapped tensors as part of a larger program), and for a layer's signatures after its
first `MAX_SIGNATURES` (inputs of ever new shapes).
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Hashable
from dataclasses import dataclass

import torch
from torch import Tensor

from modstate._core.vmap_levels import unwrapped

MAX_SIGNATURES = 8
"""Input signatures measured per layer; later new ones take the cost model's form."""

_ROUNDS = 3  # the first is a warm-up


@dataclass(frozen=True)
class FormChoice:
    """The form chosen for one layer and input signature, and the times that chose it.

    Attributes:
        signature: the input in words (shape, dtype, grad or not).
        form: the form that runs.
        times: each form's fastest time (seconds).
        measuring_s: what measuring cost.
    """

    signature: str
    form: str
    times: dict[str, float]
    measuring_s: float

    def line(self) -> str:
        times = ", ".join(f"{name} {seconds * 1e3:.3g} ms" for name, seconds in self.times.items())
        return f"{self.signature}: {self.form} ({times}, measured in {self.measuring_s:.3g} s)"


class LayerForms:
    """One ensemble's measured forms, per layer (a key the kernel gives) and input signature."""

    def __init__(self, measure: bool) -> None:
        self.measure = measure
        self._chosen: dict[Hashable, dict[Hashable, FormChoice]] = {}
        self._lock = threading.Lock()

    def may_measure(self, *tensors: Tensor) -> bool:
        """Whether measuring is on here: an unpinned ensemble, in eager mode, on plain tensors."""
        if not self.measure or torch.compiler.is_compiling():
            return False
        return all(unwrapped(tensor) is tensor for tensor in tensors)

    def choose(
        self,
        layer: Hashable,
        signature: Hashable,
        words: Callable[[], str],
        forms: Callable[[], dict[str, Callable[[], object]]],
        model: str,
    ) -> str:
        """The form for ``layer`` at ``signature``: measured on its first meeting (``forms()``
        maps each name to a run of that form, forward and backward; it and ``words()`` are
        called only then), else the one chosen then; ``model`` (the cost model's form) past the
        first `MAX_SIGNATURES`."""
        chosen = self._chosen.get(layer)
        choice = None if chosen is None else chosen.get(signature)
        if choice is not None:
            return choice.form
        with self._lock:
            chosen = self._chosen.setdefault(layer, {})
            choice = chosen.get(signature)
            if choice is None:
                if len(chosen) >= MAX_SIGNATURES:
                    return model
                choice = _measure(words(), forms())
                chosen[signature] = choice
        return choice.form

    def choices(self, layer: Hashable) -> list[FormChoice]:
        """The choices made for ``layer`` so far, oldest first."""
        with self._lock:
            return list(self._chosen.get(layer, {}).values())


def _measure(words: str, forms: dict[str, Callable[[], object]]) -> FormChoice:
    started = time.perf_counter()
    times: dict[str, list[float]] = {name: [] for name in forms}
    for _ in range(_ROUNDS):
        for name, run in forms.items():  # interleaved rounds
            start = time.perf_counter()
            run()
            times[name].append(time.perf_counter() - start)
    best = {name: min(values[1:]) for name, values in times.items()}
    form = min(best, key=best.__getitem__)  # a tie: the first listed
    return FormChoice(words, form, best, time.perf_counter() - started)


def timed_run(
    form: Callable[[Tensor, Tensor, Tensor | None], Tensor],
    x: Tensor,
    weight: Tensor,
    bias: Tensor | None,
) -> Callable[[], object]:
    """A run of ``form(x, weight, bias)`` on detached copies (leaves that require grad where the
    originals do, with autograd on): the forward, and then the backward of a gradient of ones
    into them, as training runs it. Nothing the caller holds is written."""
    records = torch.is_grad_enabled() and any(
        t is not None and t.requires_grad for t in (x, weight, bias)
    )
    inputs = [
        None if t is None else t.detach().requires_grad_(records and t.requires_grad)
        for t in (x, weight, bias)
    ]
    leaves = [t for t in inputs if t is not None and t.requires_grad]

    def run() -> object:
        out = form(*inputs)  # type: ignore[arg-type]
        if leaves:
            torch.autograd.grad(out, leaves, torch.ones_like(out))
        return out

    return run
