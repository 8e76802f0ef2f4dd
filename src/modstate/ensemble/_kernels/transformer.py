"""torch's transformer blocks: one kernel per layer, or their layer-by-layer path.

``nn.TransformerEncoderLayer`` (and ``nn.TransformerEncoder`` with a padding mask) switch to a
fused inference kernel in eval mode without grad, which has no batching rule: under vmap it runs
once per member, and has no derivative. The layer kernels here compute what a layer's own
layer-by-layer path computes (the path it takes in training) on plain tensors, every member at
once, from the kernels of its attention, linear and norm layers: one step into and out of vmap
per transformer layer instead of one per sublayer and per residual add. Where a layer kernel has
no batched form for a call (dropout with randomness other than ``"different"``, hooks on a
sublayer, an activation that is not elementwise), the layer runs its layer-by-layer path with
each sublayer's own kernel (`encoder_layer_forward`), or its own forward.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from .._functorch import VmapSetAside, as_member_view, members_of
from .attention import MultiheadAttentionKernel
from .base import KernelContext, NoKernel, member_front
from .linear import LinearKernel
from .norm import LayerNormKernel

_ELEMENTWISE_FUNCTIONS = (F.relu, F.gelu, torch.relu, torch.tanh, torch.sigmoid, F.silu)
_HOOKS = ("_forward_pre_hooks", "_forward_hooks", "_backward_hooks", "_backward_pre_hooks")


class _LayerParts:
    """What the encoder and decoder layer kernels share: the sublayers' kernels, dropout as the
    ensemble's randomness says, the activation on plain tensors."""

    def __init__(
        self,
        layer: nn.TransformerEncoderLayer | nn.TransformerDecoderLayer,
        context: KernelContext,
        norms: int,
    ) -> None:
        self.layer = layer
        self.count = context.count
        self.randomness = context.randomness
        self.linear1 = LinearKernel(layer.linear1, context)
        self.linear2 = LinearKernel(layer.linear2, context)
        self.norms = [
            LayerNormKernel(getattr(layer, f"norm{i}"), context) for i in range(1, norms + 1)
        ]
        self.dropouts = [layer.dropout] + [
            getattr(layer, f"dropout{i}") for i in range(1, norms + 1)
        ]
        self.activation: Callable[[Tensor], Tensor] = layer.activation  # type: ignore[assignment]

    def runnable(self) -> bool:
        """Whether this call can run as one kernel: no random draw the ensemble's randomness
        does not allow here, no hooks to run on a sublayer."""
        layer = self.layer
        if (
            layer.training
            and self.randomness != "different"
            and any(d.p > 0 for d in self.dropouts)
        ):
            return False
        return not any(getattr(m, name, None) for m in layer.modules() for name in _HOOKS)

    def dropout(self, x: Tensor, index: int) -> Tensor:
        p = self.dropouts[index].p
        return F.dropout(x, p, True) if self.layer.training and p > 0 else x

    def norm(self, x: Tensor, index: int) -> Tensor:
        return _done(self.norms[index](x, 0))

    def feed_forward(self, x: Tensor) -> Tensor:
        x = _done(self.linear1(x, 0))
        return _done(self.linear2(self.dropout(self.activation(x), 0), 0))


def _done(result: tuple[Tensor, int] | None) -> Tensor:
    """A sublayer kernel's output, member dim first (the inputs it gets here always have a
    batched form: member dim first, the sizes the layer checked)."""
    assert result is not None and result[1] == 0
    return result[0]


def _exact_parts(layer: nn.Module, attention_names: tuple[str, ...], norms: int) -> str | None:
    """Why ``layer``'s parts have no layer kernel, or None when they all do."""
    if any(type(getattr(layer, name)) is not nn.MultiheadAttention for name in attention_names):
        return "its attention is not an nn.MultiheadAttention"
    if type(layer.linear1) is not nn.Linear or type(layer.linear2) is not nn.Linear:
        return "its feed-forward layers are not nn.Linear"
    if any(type(getattr(layer, f"norm{i}")) is not nn.LayerNorm for i in range(1, norms + 1)):
        return "its norms are not nn.LayerNorm"
    activation = layer.activation
    elementwise = activation in _ELEMENTWISE_FUNCTIONS or (
        isinstance(activation, nn.Module) and type(activation) in _ELEMENTWISE_MODULES
    )
    return None if elementwise else "its activation is not a known elementwise function"


_ELEMENTWISE_MODULES = (nn.ReLU, nn.GELU, nn.SiLU, nn.Tanh, nn.Sigmoid, nn.LeakyReLU, nn.ELU)


class EncoderLayerKernel:
    """N ``nn.TransformerEncoderLayer`` s as one kernel: attention, feed-forward, norms, dropout
    and residual adds on plain tensors, every member at once (see the module docstring)."""

    route = "one kernel: attention, feed-forward, norms and residuals on the stacked weights"
    fresh = False

    def __init__(self, layer: nn.TransformerEncoderLayer, context: KernelContext) -> None:
        self.parts = _LayerParts(layer, context, norms=2)
        self.attention = MultiheadAttentionKernel(layer.self_attn, context)
        self.norm_first = layer.norm_first
        self.fallback = encoder_layer_forward(layer)

    def run(
        self,
        level: int,
        src: Tensor,
        src_mask: Tensor | None = None,
        src_key_padding_mask: Tensor | None = None,
        is_causal: bool = False,
    ) -> Tensor | None:
        parts, attention = self.parts, self.attention
        if not parts.runnable() or not attention.accepts(src_mask, is_causal):
            return None
        x, bdim = members_of(src, level)
        if x.dim() - (bdim is not None) not in (2, 3):
            return None
        mask, mask_bdim = members_of(src_mask, level)
        padding, padding_bdim = members_of(src_key_padding_mask, level)

        def attend(h: Tensor) -> Tensor:
            out = attention.attend(
                h, None, None, padding, padding_bdim, mask, mask_bdim, False, True, is_causal
            )[0]
            return parts.dropout(out, 1)

        with VmapSetAside():
            x = member_front(x, bdim, parts.count)
            if self.norm_first:
                x = x + attend(parts.norm(x, 0))
                x = x + parts.dropout(parts.feed_forward(parts.norm(x, 1)), 2)
            else:
                x = parts.norm(x + attend(x), 0)
                x = parts.norm(x + parts.dropout(parts.feed_forward(x), 2), 1)
        return as_member_view(x, 0, level)


class DecoderLayerKernel:
    """N ``nn.TransformerDecoderLayer`` s as one kernel: self-attention, attention over the
    memory, feed-forward, norms, dropout and residual adds, every member at once."""

    route = "one kernel: attentions, feed-forward, norms and residuals on the stacked weights"
    fresh = False

    def __init__(self, layer: nn.TransformerDecoderLayer, context: KernelContext) -> None:
        self.parts = _LayerParts(layer, context, norms=3)
        self.self_attention = MultiheadAttentionKernel(layer.self_attn, context)
        self.cross_attention = MultiheadAttentionKernel(layer.multihead_attn, context)
        self.norm_first = layer.norm_first
        self.fallback = type(layer).forward.__get__(layer)

    def run(
        self,
        level: int,
        tgt: Tensor,
        memory: Tensor,
        tgt_mask: Tensor | None = None,
        memory_mask: Tensor | None = None,
        tgt_key_padding_mask: Tensor | None = None,
        memory_key_padding_mask: Tensor | None = None,
        tgt_is_causal: bool = False,
        memory_is_causal: bool = False,
    ) -> Tensor | None:
        parts = self.parts
        if (
            not parts.runnable()
            or not self.self_attention.accepts(tgt_mask, tgt_is_causal)
            or not self.cross_attention.accepts(memory_mask, memory_is_causal)
        ):
            return None
        x, bdim = members_of(tgt, level)
        if x.dim() - (bdim is not None) not in (2, 3):
            return None
        mem, mem_bdim = members_of(memory, level)
        masks = [members_of(m, level) for m in (tgt_key_padding_mask, tgt_mask)]
        memory_masks = [members_of(m, level) for m in (memory_key_padding_mask, memory_mask)]
        count = parts.count

        def self_attend(h: Tensor) -> Tensor:
            (padding, pb), (mask, mb) = masks
            out = self.self_attention.attend(
                h, None, None, padding, pb, mask, mb, False, True, tgt_is_causal
            )[0]
            return parts.dropout(out, 1)

        def cross_attend(h: Tensor, source: Tensor) -> Tensor:
            (padding, pb), (mask, mb) = memory_masks
            out = self.cross_attention.attend(
                h, source, None, padding, pb, mask, mb, False, True, memory_is_causal
            )[0]
            return parts.dropout(out, 2)

        with VmapSetAside():
            x = member_front(x, bdim, count)
            source = member_front(mem, mem_bdim, count)
            if self.norm_first:
                x = x + self_attend(parts.norm(x, 0))
                x = x + cross_attend(parts.norm(x, 1), source)
                x = x + parts.dropout(parts.feed_forward(parts.norm(x, 2)), 3)
            else:
                x = parts.norm(x + self_attend(x), 0)
                x = parts.norm(x + cross_attend(x, source), 1)
                x = parts.norm(x + parts.dropout(parts.feed_forward(x), 3), 2)
        return as_member_view(x, 0, level)


def encoder_layer_kernel(
    layer: nn.TransformerEncoderLayer, context: KernelContext
) -> EncoderLayerKernel | NoKernel:
    why = _exact_parts(layer, ("self_attn",), norms=2)
    if why is None and (layer.self_attn.bias_k is not None or layer.self_attn.add_zero_attn):
        why = "its attention appends keys (bias_k, add_zero_attn)"
    return NoKernel(why) if why is not None else EncoderLayerKernel(layer, context)


def decoder_layer_kernel(
    layer: nn.TransformerDecoderLayer, context: KernelContext
) -> DecoderLayerKernel | NoKernel:
    why = _exact_parts(layer, ("self_attn", "multihead_attn"), norms=3)
    attentions = (layer.self_attn, layer.multihead_attn)
    if why is None and any(a.bias_k is not None or a.add_zero_attn for a in attentions):
        why = "its attention appends keys (bias_k, add_zero_attn)"
    return NoKernel(why) if why is not None else DecoderLayerKernel(layer, context)


def encoder_layer_forward(layer: nn.TransformerEncoderLayer) -> Callable[..., Tensor]:
    """``layer.forward``, always by its layer-by-layer path."""

    def attention(x: Tensor, mask: Any, padding: Any, is_causal: bool) -> Tensor:
        out = layer.self_attn(
            x,
            x,
            x,
            attn_mask=mask,
            key_padding_mask=padding,
            need_weights=False,
            is_causal=is_causal,
        )[0]
        return layer.dropout1(out)

    def feed_forward(x: Tensor) -> Tensor:
        return layer.dropout2(layer.linear2(layer.dropout(layer.activation(layer.linear1(x)))))

    def forward(
        src: Tensor,
        src_mask: Tensor | None = None,
        src_key_padding_mask: Tensor | None = None,
        is_causal: bool = False,
    ) -> Tensor:
        x = src
        if layer.norm_first:
            x = x + attention(layer.norm1(x), src_mask, src_key_padding_mask, is_causal)
            return x + feed_forward(layer.norm2(x))
        x = layer.norm1(x + attention(x, src_mask, src_key_padding_mask, is_causal))
        return layer.norm2(x + feed_forward(x))

    return forward


def encoder_forward(encoder: nn.TransformerEncoder) -> Callable[..., Tensor]:
    """``encoder.forward`` without its nested-tensor conversion of padded inputs."""
    batch_first = encoder.layers[0].self_attn.batch_first

    def forward(
        src: Tensor,
        mask: Tensor | None = None,
        src_key_padding_mask: Tensor | None = None,
        is_causal: bool | None = None,
    ) -> Tensor:
        length = src.shape[1 if batch_first and src.dim() == 3 else 0]
        causal = _is_causal(mask, is_causal, length)
        out = src
        for layer in encoder.layers:
            out = layer(
                out, src_mask=mask, is_causal=causal, src_key_padding_mask=src_key_padding_mask
            )
        if encoder.norm is not None:
            out = encoder.norm(out)
        return out

    return forward


def plain_encoder(encoder: nn.TransformerEncoder) -> bool:
    """Whether every layer of ``encoder`` is an ``nn.TransformerEncoderLayer`` (what its
    forward assumes)."""
    return all(type(layer) is nn.TransformerEncoderLayer for layer in encoder.layers)


def _is_causal(mask: Tensor | None, hint: bool | None, length: int) -> bool:
    """What ``nn.TransformerEncoder`` concludes: the hint when given, else whether ``mask`` is
    the square causal mask of ``length``."""
    if hint is not None or mask is None:
        return hint is True
    if mask.shape != (length, length):
        return False
    if mask.dtype == torch.bool:
        return bool((mask == torch.ones_like(mask).triu(1)).all())
    causal = torch.full_like(mask, float("-inf")).triu(1)
    return bool((mask == causal).all())
