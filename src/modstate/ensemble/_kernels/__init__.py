"""The batched kernels, one file per family of layers, and which layer type takes which.

``kernel_for(module, context)`` is the one lookup: a kernel for ``module`` (a layer of the
template), a `NoKernel` saying why this instance has none, or None when its type has no kernel
at all. Which kernel a class takes is `kernel_class`'s answer: torch's own layer classes take
theirs; a subclass takes its base's only when it keeps every method the base's ``forward``
runs (`RUNS`), for a subclass that overrides ``forward`` may compute something else; and a
class the user declared (``Ensemble(..., kernels={MyNorm: nn.LayerNorm})``, carried by the
`KernelContext`) takes the kernel of the torch class it is declared to compute as.

A kernel with two batched forms (a CPU convolution on small maps: grouped, or a matmul over
unfolded patches) asks the ensemble's `forms.LayerForms` which to run: measured on the layer's
first input of each signature, or the kernel's cost model where nothing is measured.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from functools import partial
from typing import Any

from torch import nn
from torch.nn.utils import parametrize

from .attention import MultiheadAttentionKernel, folded_attention, multihead_attention_kernel
from .base import Home, Kernel, KernelContext, NoKernel, NotStacked
from .conv import ConvolutionKernel
from .dropout import DropoutKernel, dropout_members
from .embedding import embedding_kernel
from .linear import LinearKernel, TransposedLinearKernel, is_hugging_face_conv1d
from .norm import BatchNormKernel, GroupNormKernel, LayerNormKernel, rms_norm_kernel
from .pool import POOLS, pool_kernel

Builder = Callable[[Any, KernelContext], "Kernel | MultiheadAttentionKernel | NoKernel"]

_BUILDERS: dict[type[nn.Module], Builder] = {
    nn.Linear: LinearKernel,
    # These three read settings of their torch class (its convolution, its input dims), told
    # here: the layer may be a subclass or a declared class of the user's.
    **{kind: partial(ConvolutionKernel, kind=kind) for kind in (nn.Conv1d, nn.Conv2d, nn.Conv3d)},
    **{
        kind: partial(BatchNormKernel, kind=kind)
        for kind in (nn.BatchNorm1d, nn.BatchNorm2d, nn.BatchNorm3d)
    },
    nn.LayerNorm: LayerNormKernel,
    nn.RMSNorm: rms_norm_kernel,
    nn.GroupNorm: GroupNormKernel,
    nn.Embedding: embedding_kernel,
    nn.MultiheadAttention: multihead_attention_kernel,
    nn.Dropout: DropoutKernel,
    **{kind: partial(pool_kernel, kind=kind) for kind in POOLS},
}

KERNEL_TYPES: frozenset[type[nn.Module]] = frozenset(_BUILDERS)
"""torch's layer classes with a kernel."""

RUNS: dict[type[nn.Module], tuple[str, ...]] = {
    kind: ("forward", "__call__", "_call_impl")
    + (("_conv_forward",) if issubclass(kind, nn.modules.conv._ConvNd) else ())
    + (("_check_input_dim",) if issubclass(kind, nn.modules.batchnorm._BatchNorm) else ())
    for kind in KERNEL_TYPES
}
"""The methods each torch class's ``forward`` runs (its own included): a subclass that keeps
them all computes what the class computes, and takes its kernel."""


def kernel_class(
    kind: type, declared: Mapping[type, type[nn.Module]]
) -> tuple[type[nn.Module], type] | None:
    """The torch class whose kernel runs layers of class ``kind``, and the class of ``kind``'s
    MRO that gets it (``kind`` itself, or the base whose methods it keeps); None when none.

    ``declared`` maps a user's classes to the torch class each computes as. The nearest class
    of the MRO with a kernel decides: a subclass that overrides one of the methods it runs
    (`RUNS`) gets no kernel from it or from any class further up."""
    for base in kind.__mro__:
        target = base if base in KERNEL_TYPES else declared.get(base)
        if target is None:
            continue
        if base is not kind and overridden(kind, base, target):
            return None
        return target, base
    return None


def overridden(kind: type, base: type, target: type[nn.Module]) -> list[str]:
    """The methods that ``target``'s ``forward`` runs that ``kind`` does not take from ``base``."""
    return [name for name in RUNS[target] if getattr(kind, name, None) is not getattr(base, name)]


ELEMENTWISE: tuple[type[nn.Module], ...] = (
    nn.CELU,
    nn.ELU,
    nn.GELU,
    nn.Hardshrink,
    nn.Hardsigmoid,
    nn.Hardswish,
    nn.Hardtanh,
    nn.LeakyReLU,
    nn.LogSigmoid,
    nn.Mish,
    nn.ReLU,
    nn.ReLU6,
    nn.SELU,
    nn.SiLU,
    nn.Sigmoid,
    nn.Softplus,
    nn.Softshrink,
    nn.Softsign,
    nn.Tanh,
    nn.Tanhshrink,
)
"""Layers that compute each element alone: the same for any number of members."""


def kernel_for(
    module: nn.Module, context: KernelContext
) -> Kernel | MultiheadAttentionKernel | NoKernel | None:
    """The batched kernel of ``module`` (see the module docstring)."""
    builder: Builder | None = _BUILDERS.get(type(module))
    if builder is None and is_hugging_face_conv1d(module):
        builder = TransposedLinearKernel
    if builder is None and not parametrize.is_parametrized(module):
        # (a parametrized layer's class is a subclass made on the fly: the plan says why it
        # falls back)
        found = kernel_class(type(module), context.kernels)
        builder = None if found is None else _BUILDERS[found[0]]
    if builder is None:
        return None
    try:
        return builder(module, context)
    except NotStacked:
        return NoKernel(
            "it computes with a tensor that is not one of its parameters or buffers (set by a "
            "hook, as legacy weight_norm and spectral_norm do)"
        )


__all__ = [
    "ELEMENTWISE",
    "KERNEL_TYPES",
    "RUNS",
    "DropoutKernel",
    "Home",
    "Kernel",
    "KernelContext",
    "MultiheadAttentionKernel",
    "NoKernel",
    "dropout_members",
    "folded_attention",
    "kernel_class",
    "kernel_for",
    "overridden",
]
