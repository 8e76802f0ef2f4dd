"""torch's transformer blocks, run through their layer-by-layer path so that every layer inside
takes its batched kernel.

``nn.TransformerEncoderLayer`` (and ``nn.TransformerEncoder`` with a padding mask) switch to a
fused inference kernel in eval mode without grad, which has no batching rule: under vmap it runs
once per member, and has no derivative. These forwards compute what the module's own
layer-by-layer path computes (the path it takes in training), calling the module's own children,
so each child runs as the ensemble runs it.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch import Tensor, nn


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
