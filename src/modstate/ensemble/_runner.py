"""The members' own ``forward``, run once for all of them under ``torch.vmap``, each layer with a
batched kernel running it on the stacked tensors.

The runner is a private copy of the model (its tensors shared with the ensemble's template, so
it costs no memory) whose batched layers have their ``forward`` replaced, on the copy only, by
their kernel: the template, ``member(i)`` and the user's models stay as they were, and nothing
global is touched. The glue between layers (residual adds, reshapes, pooling, the model's own
tensor code) is the model's own code under ``torch.vmap``, which batches it with its own rules;
a layer without a kernel is that code too.

Every stacked tensor also goes into the vmapped call as the member's own tensor (through
[`modstate.call`][modstate.call]), so code that reads a layer's tensors directly, or a kernel
that refuses an input it has no batched form for and calls the layer's own forward, computes
with the right member's values.

Threads: each thread that calls the ensemble gets a runner of its own (`ThreadRunners`),
built on its first call, sharing the template's tensors: the stateless call puts the member
views into that thread's copy only, so concurrent calls never see each other's state, and the
ensemble's own modules are never changed by a forward (kernels read the stacked tensors; only
BatchNorm's running statistics are updated in place, as ``nn.BatchNorm`` does).

Attention written as ``F.scaled_dot_product_attention`` in a model's own code (Hugging Face,
timm) is folded too: on the first call in each mode (training, eval) a ``TorchFunctionMode``
watches the whole forward and notes which layers call it; afterwards the mode is entered only
inside those layers, so the rest of the model does not pay for it.

In-place ops of a model's own code on a kernel's output (torchvision's ``ReLU(inplace=True)``,
``out += identity``) are learned the same way: on the first call with autograd on, the runner
notes which kernels' outputs were written in place, and from then on hands those outputs to
vmap with the member dim first (`fresh_members_first`), where vmap writes into them without
autograd rewriting a view (the other outputs stay as they are, at no cost).
"""

from __future__ import annotations

import sys
import threading
from collections.abc import Callable, Mapping
from typing import Any, Generic, Protocol, TypeVar

import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torch.overrides import TorchFunctionMode

from modstate._core.extract import extract
from modstate._core.module.anatomy import buffer_paths
from modstate._core.trees.flat import flatten

from ._functorch import VmapSetAside, as_member_view, ensemble_level, members_of, running
from ._kernels import Home, KernelContext, MultiheadAttentionKernel, folded_attention
from ._kernels.base import fresh_members_first
from ._kernels.forms import LayerForms
from ._kernels.transformer import DecoderLayerKernel, EncoderLayerKernel
from ._plan import Installed, plan_layers
from ._stacked_state import sharing_copy
from ._vmap import InDims, StackedCall


class VmapRunner:
    """``template``'s forward for every member at once (see the module docstring).

    Built once per ensemble (and again after a copy or unpickling); ``__call__(args, kwargs,
    in_dims)`` runs it. ``routes`` is the plan of its layers; ``batched=False`` installs no
    kernel but ``nn.Dropout``'s (the whole model under vmap: the reference path; the dropout
    kernel only draws the masks as the batched routes do)."""

    def __init__(
        self,
        template: nn.Module,
        homes: dict[int, Home],
        count: int,
        randomness: str,
        batched: bool,
        kernels: Mapping[type, type[nn.Module]] | None = None,
        forms: LayerForms | None = None,
    ) -> None:
        self.count = count
        self.randomness = randomness
        self.module = sharing_copy(template)
        context = KernelContext(count, randomness, homes, kernels, forms)
        self.routes, installed = plan_layers(self.module, context, batched)
        self.installed = installed
        for path, what in installed.items():
            layer = self.module.get_submodule(path)
            layer.forward = _forward_of(what, layer, self)  # type: ignore[method-assign]
        flat = flatten(extract(self.module))
        self.call = StackedCall(
            list(flat), list(flat.values()), buffer_paths(self.module), "Ensemble"
        )
        # Where the stacked form of each path's tensor lives, in the call's orders.
        self.path_homes = [homes[id(flat[path])] for path in self.call.paths]
        self.distinct_homes = self.call.distinct([homes[id(t)] for t in flat.values()])
        self.folding = AttentionFolding(self)
        self._watched: set[bool] = set()  # training modes whose first call was watched
        self.written_in_place: set[nn.Module] = set()  # layers whose output forward writes
        self.outputs_watched: list[tuple[nn.Module, Tensor]] | None = None
        self._in_place_learned = False
        self._scopes: dict[str, nn.Module] = {}
        self._lock = threading.Lock()

    def __call__(self, args: tuple[Any, ...], kwargs: dict[str, Any], in_dims: InDims) -> Any:
        if self._in_place_learned or not torch.is_grad_enabled():
            return self._run(args, kwargs, in_dims)
        self.outputs_watched = []
        try:
            out = self._run(args, kwargs, in_dims)
            watched = self.outputs_watched
        finally:
            self.outputs_watched = None
        self.written_in_place.update(layer for layer, made in watched if made._version)
        self._in_place_learned = bool(watched)
        return out

    def _run(self, args: tuple[Any, ...], kwargs: dict[str, Any], in_dims: InDims) -> Any:
        training = self.module.training
        watch = training not in self._watched
        distinct = [home.get() for home in self.distinct_homes]
        run = self.call.run
        if watch:
            with self.folding.watching():
                out, reassigned = run(
                    self.module, distinct, args, kwargs, in_dims, self.randomness,
                    count=self.count, inside=self._inside, views_inside=True,
                )  # fmt: skip
            self._scope_attention(training)
        else:
            out, reassigned = run(
                self.module, distinct, args, kwargs, in_dims, self.randomness,
                count=self.count, inside=self._inside, views_inside=True,
            )  # fmt: skip
        for k, value in reassigned.items():
            home = self.path_homes[k]
            home.table[home.name] = value
        return out

    def _inside(self) -> Any:
        return running(self)

    def _scope_attention(self, training: bool) -> None:
        """After a watched call: enter the folding mode only inside the layers seen calling
        attention from then on."""
        with self._lock:
            for path in self.folding.callers:
                if path in self._scopes:
                    continue
                layer = self.module.get_submodule(path)
                scoped = _folding_forward(layer.forward, self.folding)
                layer.forward = scoped  # type: ignore[method-assign]
                self._scopes[path] = layer
            self._watched.add(training)

    def notes(self) -> list[str]:
        """What the plan says about folded attention, and the forms measured per layer."""
        notes = [
            f"layer {path!r}, {choice.line()}"
            for path, what in self.installed.items()
            for choice in (what.choices() if hasattr(what, "choices") else [])
        ]
        if not self.folding.callers:
            return notes
        where = ", ".join(repr(p) if p else "the model" for p in sorted(self.folding.callers))
        return [
            "F.scaled_dot_product_attention runs with the members folded into its batch "
            f"(called in {where})",
            *notes,
        ]

    def train(self, mode: bool) -> None:
        self.module.train(mode)


class _Trains(Protocol):
    def train(self, mode: bool) -> Any: ...


Made = TypeVar("Made", bound=_Trains)


class ThreadRunners(Generic[Made]):
    """One `VmapRunner` (or other per-thread copy of the template: the loop route's
    `MemberCopies`) per calling thread, made by ``build`` on the thread's first call;
    ``train(mode)`` reaches every one made so far."""

    def __init__(self, build: Callable[[], Made]) -> None:
        self._build = build
        self._local = threading.local()
        self._made: list[Made] = []
        self._lock = threading.Lock()

    def mine(self) -> Made:
        """This thread's runner."""
        runner: Made | None = getattr(self._local, "runner", None)
        if runner is None:
            runner = self._build()  # a copy of the template: in the template's modes
            with self._lock:
                self._made.append(runner)
            self._local.runner = runner
        return runner

    def train(self, mode: bool) -> None:
        with self._lock:
            for runner in self._made:
                runner.train(mode)


def _forward_of(what: Installed, layer: nn.Module, owner: VmapRunner) -> Callable[..., Any]:
    if isinstance(what, MultiheadAttentionKernel):
        return _attention_forward(what, layer, owner)
    if isinstance(what, (EncoderLayerKernel, DecoderLayerKernel)):
        return _block_forward(what, owner)
    if hasattr(what, "route"):
        return _layer_forward(what, layer, owner)  # type: ignore[arg-type]
    return what  # type: ignore[return-value]  # a replacement forward (transformer blocks)


def _layer_forward(kernel: Any, layer: nn.Module, owner: VmapRunner) -> Callable[..., Any]:
    """``layer.forward`` for one input: the kernel inside ``owner``'s forward, the layer's own
    forward elsewhere or where the kernel has no batched form for the input."""
    own_forward = type(layer).forward

    def forward(x: Any, *rest: Any, **options: Any) -> Any:
        level = ensemble_level(owner)
        if level is not None and not rest and not options and isinstance(x, Tensor):
            tensor, bdim = members_of(x, level)
            with VmapSetAside():
                done = kernel(tensor, bdim)
                if done is not None and done[1] != 0 and kernel.fresh and done[0].requires_grad:
                    if layer in owner.written_in_place:
                        done = fresh_members_first(*done), 0
                    elif owner.outputs_watched is not None:
                        owner.outputs_watched.append((layer, done[0]))
            if done is not None:
                return as_member_view(done[0], done[1], level)
        return own_forward(layer, x, *rest, **options)

    return forward


def _attention_forward(
    kernel: MultiheadAttentionKernel, layer: nn.Module, owner: object
) -> Callable[..., Any]:
    own_forward = type(layer).forward

    def forward(query: Any, key: Any, value: Any, *rest: Any, **options: Any) -> Any:
        level = ensemble_level(owner)
        if level is not None and all(isinstance(t, Tensor) for t in (query, key, value)):
            done = kernel.run(level, query, key, value, *rest, **options)
            if done is not None:
                return done
        return own_forward(layer, query, key, value, *rest, **options)

    return forward


def _block_forward(
    kernel: EncoderLayerKernel | DecoderLayerKernel, owner: object
) -> Callable[..., Any]:
    """A transformer layer's forward: its kernel inside ``owner``'s forward, else its
    layer-by-layer path (each sublayer with its own kernel)."""

    def forward(*args: Any, **kwargs: Any) -> Any:
        level = ensemble_level(owner)
        if level is not None:
            done = kernel.run(level, *args, **kwargs)
            if done is not None:
                return done
        return kernel.fallback(*args, **kwargs)

    return forward


class AttentionFolding(TorchFunctionMode):
    """Runs ``F.scaled_dot_product_attention`` on the runner's member views with the members
    folded into its batch; while `watching`, also notes which layer made each call."""

    def __init__(self, runner: VmapRunner) -> None:
        super().__init__()
        self.runner = runner
        self.callers: set[str] = set()
        self.state = threading.local()  # per thread: watching, and how deep inside the mode

    def watching(self) -> _Inside:
        """Enter the mode for a whole call, noting which layers call attention."""
        return _Inside(self, watch=True)

    def inside(self) -> _Inside:
        """Enter the mode (once, however deeply nested)."""
        return _Inside(self, watch=False)

    def __torch_function__(
        self, func: Any, types: Any, args: tuple[Any, ...] = (), kwargs: Any = None
    ) -> Any:
        kwargs = kwargs or {}
        if func is F.scaled_dot_product_attention:
            runner = self.runner
            level = ensemble_level(runner)
            if level is not None:
                out = folded_attention(runner.count, level, runner.randomness, args, kwargs)
                if out is not None:
                    if getattr(self.state, "watching", False):
                        self.callers.add(_calling_layer(runner.module))
                    return out
        return func(*args, **kwargs)


class _Inside:
    """Enters ``folding`` unless this thread is inside it already."""

    __slots__ = ("entered", "folding", "watch")

    def __init__(self, folding: AttentionFolding, watch: bool) -> None:
        self.folding = folding
        self.watch = watch
        self.entered = False

    def __enter__(self) -> None:
        state = self.folding.state
        if self.watch:
            state.watching = True
        if not getattr(state, "on", False):
            state.on = self.entered = True
            self.folding.__enter__()

    def __exit__(self, *exc: object) -> None:
        state = self.folding.state
        if self.entered:
            self.folding.__exit__(*exc)
            state.on = False
        if self.watch:
            state.watching = False


def _folding_forward(forward: Callable[..., Any], folding: AttentionFolding) -> Callable[..., Any]:
    def scoped(*args: Any, **kwargs: Any) -> Any:
        with folding.inside():
            return forward(*args, **kwargs)

    return scoped


def _calling_layer(root: nn.Module) -> str:
    """The path of the innermost layer of ``root`` whose code is running now (found by walking
    up the Python frames to the nearest one whose ``self`` is such a layer)."""
    paths = {id(m): p for p, m in root.named_modules(remove_duplicate=False)}
    frame = sys._getframe(1)
    while frame is not None:
        owner = frame.f_locals.get("self")
        if owner is not None and id(owner) in paths:
            return paths[id(owner)]
        frame = frame.f_back  # type: ignore[assignment]
    return ""
