"""The plan of an ensemble: which layer runs how, decided once, shown by ``ensemble.plan``.

Every layer of the model is looked at once, when the ensemble is built: a layer with a batched
kernel (``_kernels``) runs it on the stacked tensors, torch's transformer blocks run their
layer-by-layer path, and everything else runs as the model's own code under ``torch.vmap``.
Code without tensors of its own (activations, pooling, reshapes, residual adds) is batched by
vmap's own rules and is no fallback; a layer with tensors but no kernel is one, and the plan
says why.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from torch import nn
from torch.nn.utils import parametrize

from ._kernels import (
    ELEMENTWISE,
    KERNEL_TYPES,
    DropoutKernel,
    Kernel,
    KernelContext,
    MultiheadAttentionKernel,
    NoKernel,
    kernel_class,
    kernel_for,
    overridden,
)
from ._kernels.transformer import (
    DecoderLayerKernel,
    EncoderLayerKernel,
    decoder_layer_kernel,
    encoder_forward,
    encoder_layer_forward,
    encoder_layer_kernel,
    plain_encoder,
)

_DROPOUT = (nn.Dropout, nn.Dropout1d, nn.Dropout2d, nn.Dropout3d, nn.AlphaDropout)


@dataclass(frozen=True)
class Route:
    """One layer of the plan.

    Attributes:
        path: the layer's dotted path in the model (``""`` for the model itself).
        layer: the layer's class and settings, as its ``repr`` shows them.
        how: how the ensemble runs it.
        fallback: None for a batched route; else why the layer's tensors are used by its own
            code under ``torch.vmap`` (the same results, at vmap's speed).
    """

    path: str
    layer: str
    how: str
    fallback: str | None = None


class Plan:
    """How an [`Ensemble`][modstate.Ensemble] runs its members' forward: every layer with the route
    it takes (`Route`), and notes on functions it folds (attention), as ``repr`` shows.

    Attributes:
        summary: the path of the whole forward, in one line.
        routes: every layer that holds tensors or computes on its own, in module order.
        notes: other things the forward does (the attention calls it folds, once seen).
    """

    def __init__(self, summary: str, routes: list[Route], notes: list[str]) -> None:
        self.summary = summary
        self.routes = routes
        self.notes = notes

    @property
    def fallbacks(self) -> list[Route]:
        """The routes that run under plain ``torch.vmap``, each with its reason."""
        return [route for route in self.routes if route.fallback is not None]

    @property
    def batched(self) -> list[Route]:
        """The routes that run a batched kernel or torch's layer-by-layer path."""
        return [route for route in self.routes if route.fallback is None]

    def lines(self) -> list[str]:
        """The plan as text lines: path, layer, route (and why, for a fallback)."""
        width = max((len(route.path or "(model)") for route in self.routes), default=0)
        lines = [self.summary]
        for route in self.routes:
            how = route.how if route.fallback is None else f"{route.how}: {route.fallback}"
            lines.append(f"  {route.path or '(model)':<{width}}  {route.layer}  -> {how}")
        lines += [f"  note: {note}" for note in self.notes]
        return lines

    def __repr__(self) -> str:
        return "\n".join(self.lines())


Installed = (
    Kernel | MultiheadAttentionKernel | EncoderLayerKernel | DecoderLayerKernel | Callable[..., Any]
)
"""What a layer of the runner gets: a kernel, the attention kernel, a transformer layer kernel,
or a replacement forward (torch's transformer blocks)."""


def layer_repr(module: nn.Module) -> str:
    """The layer's class and settings on one line."""
    return f"{type(module).__name__}({module.extra_repr()})"


def plan_layers(
    module: nn.Module, context: KernelContext, batched: bool
) -> tuple[list[Route], dict[str, Installed]]:
    """Every layer's route, and what to install on which path of ``module`` (the runner copy)
    for the batched routes. ``batched=False`` plans the whole model under vmap, but for
    ``nn.Dropout``'s kernel (its masks must not depend on the route)."""
    routes: list[Route] = []
    installed: dict[str, Installed] = {}
    _visit(module, "", context, batched, routes, installed, set())
    return routes, installed


def _visit(
    module: nn.Module,
    path: str,
    context: KernelContext,
    batched: bool,
    routes: list[Route],
    installed: dict[str, Installed],
    seen: set[int],
) -> None:
    if id(module) in seen:
        return  # a shared submodule: planned at its first path, as named_modules visits it
    seen.add(id(module))
    own = [
        name for name, t in (*module._parameters.items(), *module._buffers.items()) if t is not None
    ]
    layer = layer_repr(module)
    if batched:
        if parametrize.is_parametrized(module):
            routes.append(
                Route(path, layer, "its own forward under vmap", "a parametrized tensor "
                      "(torch.nn.utils.parametrize) is computed by the parametrization")
            )  # fmt: skip
            return
        kernel = kernel_for(module, context)
        if isinstance(kernel, NoKernel):
            routes.append(Route(path, layer, "its own forward under vmap", kernel.reason))
            return
        if kernel is not None:
            routes.append(Route(path, layer, kernel.route + _whose(module, context)))
            installed[path] = kernel
            return
        if type(module) in (nn.TransformerEncoderLayer, nn.TransformerDecoderLayer):
            block = (
                encoder_layer_kernel(module, context)  # type: ignore[arg-type]
                if type(module) is nn.TransformerEncoderLayer
                else decoder_layer_kernel(module, context)  # type: ignore[arg-type]
            )
            if isinstance(block, NoKernel):
                how = f"its layer-by-layer path, each layer batched ({block.reason})"
                if type(module) is nn.TransformerEncoderLayer:
                    installed[path] = encoder_layer_forward(module)  # type: ignore[arg-type]
            else:
                how, installed[path] = block.route, block
            routes.append(Route(path, layer, how))
        elif type(module) is nn.TransformerEncoder and plain_encoder(module):
            routes.append(Route(path, layer, "its layers in turn (no nested-tensor conversion)"))
            installed[path] = encoder_forward(module)
    children = list(module.named_children())
    if own:
        why = (
            "fast=False: the whole model runs under vmap"
            if not batched
            else _no_kernel_reason(module, context)
        )
        routes.append(Route(path, layer, f"its own code under vmap, reading {', '.join(own)}", why))
    elif type(module) is nn.Dropout and not batched:
        # The one kernel of fast=False: its masks are drawn as on the batched routes.
        kernel = DropoutKernel(module, context)  # type: ignore[arg-type]
        routes.append(Route(path, layer, kernel.route))
        installed[path] = kernel
    elif not children:
        routes.append(Route(path, layer, _stateless_route(module, context)))
    for name, child in children:
        _visit(child, f"{path}.{name}" if path else name, context, batched, routes, installed, seen)


def _whose(module: nn.Module, context: KernelContext) -> str:
    """For a layer that runs another class's kernel, whose and why (the plan shows it)."""
    kind = type(module)
    if kind in KERNEL_TYPES:
        return ""
    found = kernel_class(kind, context.kernels)
    if found is None:
        return ""  # Hugging Face's Conv1D
    target, base = found
    if base in context.kernels:
        how = "declared by kernels=" + ("" if base is kind else f" for {base.__name__}")
    else:
        how = f"{kind.__name__} keeps nn.{target.__name__}'s forward"
    return f" (nn.{target.__name__}'s kernel: {how})"


def _no_kernel_reason(module: nn.Module, context: KernelContext) -> str:
    kind = type(module)
    name = f"no batched kernel for {kind.__name__}"
    base = next((b for b in kind.__mro__[1:] if b in KERNEL_TYPES or b in context.kernels), None)
    if base is None:
        return name
    target = base if base in KERNEL_TYPES else context.kernels[base]
    # A subclass that overrides what the base's forward runs may compute something else.
    own = ", ".join(overridden(kind, base, target))
    return (
        f"{name} ({kind.__module__}.{kind.__qualname__}, a subclass of {_name(base)} with its "
        f"own {own}; if it computes what nn.{target.__name__} computes, declare it: "
        f"Ensemble(..., kernels={{{kind.__name__}: nn.{target.__name__}}}))"
    )


def _name(kind: type) -> str:
    return f"nn.{kind.__name__}" if kind in KERNEL_TYPES else kind.__name__


def _stateless_route(module: nn.Module, context: KernelContext) -> str:
    if isinstance(module, ELEMENTWISE):
        return "elementwise"
    if isinstance(module, _DROPOUT):
        return f"dropout, randomness={context.randomness!r}"
    return "no tensors of its own"
