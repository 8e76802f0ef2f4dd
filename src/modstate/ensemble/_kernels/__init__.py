"""The batched kernels, one file per family of layers, and which layer type takes which.

``kernel_for(module, context)`` is the one lookup: a kernel for ``module`` (a layer of the
template, by its exact type: a subclass may compute something else), a `NoKernel` saying
why this instance has none, or None when its type has no kernel at all.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from torch import nn

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
    nn.Conv1d: ConvolutionKernel,
    nn.Conv2d: ConvolutionKernel,
    nn.Conv3d: ConvolutionKernel,
    nn.BatchNorm1d: BatchNormKernel,
    nn.BatchNorm2d: BatchNormKernel,
    nn.BatchNorm3d: BatchNormKernel,
    nn.LayerNorm: LayerNormKernel,
    nn.RMSNorm: rms_norm_kernel,
    nn.GroupNorm: GroupNormKernel,
    nn.Embedding: embedding_kernel,
    nn.MultiheadAttention: multihead_attention_kernel,
    nn.Dropout: DropoutKernel,
    **dict.fromkeys(POOLS, pool_kernel),
}

KERNEL_TYPES: frozenset[type[nn.Module]] = frozenset(_BUILDERS)
"""The layer types with a kernel (by exact type)."""

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
    builder = _BUILDERS.get(type(module))
    if builder is None and is_hugging_face_conv1d(module):
        builder = TransposedLinearKernel
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
    "DropoutKernel",
    "Home",
    "Kernel",
    "KernelContext",
    "MultiheadAttentionKernel",
    "NoKernel",
    "dropout_members",
    "folded_attention",
    "kernel_for",
]
