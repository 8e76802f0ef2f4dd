"""Attention with the members folded into the attention batch: ``nn.MultiheadAttention`` and
calls of ``F.scaled_dot_product_attention`` made by a model's own code.

torch has no batching rule for the CPU attention kernel: under plain vmap it runs once per member
(and warns so). Folding the member dim into the batch dim makes it one call, which is also what
the members would compute one by one.
"""

from __future__ import annotations

import math
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from .._functorch import VmapSetAside, as_member_view, members_of
from .base import KernelContext, NoKernel, member_front
from .linear import stacked_affine

_SDPA_NAMES = (
    "query",
    "key",
    "value",
    "attn_mask",
    "dropout_p",
    "is_causal",
    "scale",
    "enable_gqa",
)


def folded_attention(
    count: int, level: int, randomness: str, args: tuple[Any, ...], kwargs: dict[str, Any]
) -> Tensor | None:
    """``F.scaled_dot_product_attention(*args, **kwargs)`` for member views of ``level``, run
    once with the members folded into dim 0; None when no input is a member view of ``level``,
    or when the call has no folded form (inputs without a batch dim, dropout with randomness
    other than ``"different"``): the caller then runs it as it is."""
    # The positional arguments name a prefix of the signature; the rest come by keyword.
    given = dict(zip(_SDPA_NAMES, args, strict=False))
    given.update(kwargs)
    inputs = [members_of(given[name], level) for name in ("query", "key", "value")]
    if all(bdim is None for _, bdim in inputs):
        return None
    (query, query_bdim) = inputs[0]
    if query.dim() - (query_bdim is not None) < 3:
        return None
    if given.get("dropout_p", 0.0) > 0.0 and randomness != "different":
        return None
    mask, mask_bdim = members_of(given.get("attn_mask"), level)
    with VmapSetAside():
        query, key, value = (member_front(t, bdim, count) for t, bdim in inputs)
        batch = query.shape[1]
        options = {k: v for k, v in given.items() if k not in ("query", "key", "value")}
        if mask is not None:
            options["attn_mask"] = _fold_mask(mask, mask_bdim, count, batch, query.dim() - 1)
        out = F.scaled_dot_product_attention(
            query.flatten(0, 1), key.flatten(0, 1), value.flatten(0, 1), **options
        )
        out = out.view(count, batch, *out.shape[1:])
    return as_member_view(out, 0, level)


def _fold_mask(mask: Tensor, bdim: int | None, count: int, batch: int, member_dims: int) -> Tensor:
    """An attention mask for the folded batch ``(count * batch, ...)``: a shared mask with a
    per-sample dim is repeated for every member; a per-member mask is laid out member-major."""
    if bdim is None:
        if mask.dim() == member_dims and mask.shape[0] != 1:
            return mask.repeat(count, *(1,) * (mask.dim() - 1))
        return mask
    mask = mask if bdim == 0 else mask.movedim(bdim, 0)
    while mask.dim() < member_dims + 1:
        mask = mask.unsqueeze(1)
    return mask.expand(count, batch, *mask.shape[2:]).flatten(0, 1)


def _additive(mask: Tensor, dtype: torch.dtype) -> Tensor:
    """``nn.MultiheadAttention``'s masks as an additive float mask (True means: do not attend)."""
    if mask.dtype == torch.bool:
        return torch.zeros(mask.shape, dtype=dtype, device=mask.device).masked_fill_(
            mask, float("-inf")
        )
    return mask.to(dtype)


class MultiheadAttentionKernel:
    """N ``nn.MultiheadAttention`` layers: batched matmuls for the projections on the stacked
    weights, and one attention call with the members folded into the batch (explicit
    ``softmax(q k^T) v`` when the attention weights are asked for). Takes the module's own
    arguments (see `run`)."""

    route = "batched projections, attention with the members folded into the batch"
    fresh = False

    def __init__(self, module: nn.MultiheadAttention, context: KernelContext) -> None:
        self.module = module  # read at call time: its training flag
        self.count = context.count
        self.randomness = context.randomness
        self.packed = module._qkv_same_embed_dim
        self.in_weight = context.maybe_home(module.in_proj_weight)
        self.q_weight = context.maybe_home(module.q_proj_weight)
        self.k_weight = context.maybe_home(module.k_proj_weight)
        self.v_weight = context.maybe_home(module.v_proj_weight)
        self.in_bias = context.maybe_home(module.in_proj_bias)
        self.out_weight = context.home(module.out_proj.weight)
        self.out_bias = context.maybe_home(module.out_proj.bias)
        self.heads = module.num_heads
        self.embed = module.embed_dim
        self.batch_first = module.batch_first

    def run(
        self,
        level: int,
        query: Tensor,
        key: Tensor,
        value: Tensor,
        key_padding_mask: Tensor | None = None,
        need_weights: bool = True,
        attn_mask: Tensor | None = None,
        average_attn_weights: bool = True,
        is_causal: bool = False,
    ) -> tuple[Tensor, Tensor | None] | None:
        """``module(query, key, value, ...)`` for member views of ``level``; None where it has no
        batched form here (the caller runs the module's own forward)."""
        if not self.accepts(attn_mask, is_causal):
            return None
        q, q_bdim = members_of(query, level)
        if q.dim() - (q_bdim is not None) not in (2, 3):
            return None
        k, k_bdim = members_of(key, level)
        v, v_bdim = members_of(value, level)
        padding, padding_bdim = members_of(key_padding_mask, level)
        mask, mask_bdim = members_of(attn_mask, level)
        with VmapSetAside():
            count = self.count
            out, weights = self.attend(
                member_front(q, q_bdim, count),
                None if key is query else member_front(k, k_bdim, count),
                None if value is key else member_front(v, v_bdim, count),
                padding,
                padding_bdim,
                mask,
                mask_bdim,
                need_weights,
                average_attn_weights,
                is_causal,
            )
        return (
            as_member_view(out, 0, level),
            None if weights is None else as_member_view(weights, 0, level),
        )

    def accepts(self, attn_mask: Tensor | None, is_causal: bool) -> bool:
        """Whether a call with these settings has a batched form here."""
        dropout = self.module.dropout if self.module.training else 0.0
        if dropout > 0.0 and self.randomness != "different":
            return False
        return not (
            is_causal and attn_mask is None
        )  # the module's own forward says what is missing

    def attend(
        self,
        q: Tensor,
        k: Tensor | None,
        v: Tensor | None,
        padding: Tensor | None,
        padding_bdim: int | None,
        mask: Tensor | None,
        mask_bdim: int | None,
        need_weights: bool,
        average_attn_weights: bool,
        is_causal: bool,
    ) -> tuple[Tensor, Tensor | None]:
        """The module's computation on plain tensors, every member at once: ``q`` (``k``,
        ``v``) has the member dim first and the module's own layout after it; ``k`` None means
        ``k`` is ``q``, ``v`` None means ``v`` is ``k``. Returns the output in that layout and
        the attention weights if asked for (member dim first)."""
        count = self.count
        dropout = self.module.dropout if self.module.training else 0.0
        sample_dims = q.dim() - 1
        self_attention = k is None and v is None
        # (members, batch, length, embed) in every case: one layout from here on.
        q = self._canonical(q, sample_dims)
        k = q if k is None else self._canonical(k, sample_dims)
        v = k if v is None else self._canonical(v, sample_dims)
        batch, length, source = q.shape[1], q.shape[2], k.shape[2]
        qp, kp, vp = self._project(q, k, v, self_attention)
        merged = self._merged_mask(
            mask, mask_bdim, padding, padding_bdim, batch, length, source, q.dtype
        )
        causal = is_causal and padding is None and not need_weights
        if causal:
            merged = None
        out, weights = self._attend(
            qp, kp, vp, merged, causal, dropout, need_weights, average_attn_weights
        )
        out = out.transpose(1, 2).reshape(count, batch * length, self.embed)
        out_bias = None if self.out_bias is None else self.out_bias.get()
        out = stacked_affine(out, self.out_weight.get(), out_bias)
        out = out.view(count, batch, length, self.embed)
        if sample_dims == 2:
            out = out.squeeze(1)
            weights = None if weights is None else weights.squeeze(1)
        elif not self.batch_first:
            out = out.transpose(1, 2)
        return out, weights

    def _canonical(self, x: Tensor, sample_dims: int) -> Tensor:
        if sample_dims == 2:
            return x.unsqueeze(1)
        return x if self.batch_first else x.transpose(1, 2)

    def _project(
        self, q: Tensor, k: Tensor, v: Tensor, self_attention: bool
    ) -> tuple[Tensor, Tensor, Tensor]:
        """The members' q, k, v projections, each ``(members * batch, heads, length, head)``."""
        embed = self.embed
        bias = self.in_bias.get() if self.in_bias is not None else None
        if self.packed:
            assert self.in_weight is not None
            weight = self.in_weight.get()
            if self_attention:
                return tuple(  # type: ignore[return-value]
                    self._heads(part) for part in _affine(q, weight, bias).chunk(3, dim=-1)
                )
            weights = weight.split(embed, dim=1)
        else:
            assert self.q_weight and self.k_weight and self.v_weight
            weights = (self.q_weight.get(), self.k_weight.get(), self.v_weight.get())
        biases = (None, None, None) if bias is None else bias.split(embed, dim=1)
        qp = _affine(q, weights[0], biases[0])
        kp = _affine(k, weights[1], biases[1])
        vp = _affine(v, weights[2], biases[2])
        return self._heads(qp), self._heads(kp), self._heads(vp)

    def _heads(self, x: Tensor) -> Tensor:
        count, batch, length = x.shape[:3]
        head = self.embed // self.heads
        return x.reshape(count * batch, length, self.heads, head).transpose(1, 2)

    def _merged_mask(
        self,
        mask: Tensor | None,
        mask_bdim: int | None,
        padding: Tensor | None,
        padding_bdim: int | None,
        batch: int,
        length: int,
        source: int,
        dtype: torch.dtype,
    ) -> Tensor | None:
        """``attn_mask`` and ``key_padding_mask`` as one additive mask that broadcasts to
        ``(members * batch, heads, length, source)``."""
        count, heads = self.count, self.heads
        merged = None
        if mask is not None:
            mask = _additive(mask, dtype)
            if mask_bdim is None:
                if mask.dim() == 2:
                    merged = mask.view(1, 1, length, source)
                else:
                    merged = mask.view(batch, heads, length, source).repeat(count, 1, 1, 1)
            else:
                mask = mask if mask_bdim == 0 else mask.movedim(mask_bdim, 0)
                if mask.dim() == 3:
                    merged = mask.view(count, 1, 1, length, source).expand(
                        count, batch, 1, length, source
                    )
                    merged = merged.reshape(count * batch, 1, length, source)
                else:
                    merged = mask.reshape(count * batch, heads, length, source)
        if padding is not None:
            padding = _additive(padding, dtype)
            if padding_bdim is None:
                padding = padding.reshape(batch, 1, 1, source).repeat(count, 1, 1, 1)
            else:
                padding = padding if padding_bdim == 0 else padding.movedim(padding_bdim, 0)
                padding = padding.reshape(count * batch, 1, 1, source)
            merged = padding if merged is None else merged + padding
        return merged

    def _attend(
        self,
        q: Tensor,
        k: Tensor,
        v: Tensor,
        mask: Tensor | None,
        causal: bool,
        dropout: float,
        need_weights: bool,
        average: bool,
    ) -> tuple[Tensor, Tensor | None]:
        if not need_weights:
            out = F.scaled_dot_product_attention(
                q, k, v, attn_mask=mask, dropout_p=dropout, is_causal=causal
            )
            return out, None
        # What the module computes when the weights are asked for: softmax(q k^T / sqrt(d)).
        scores = (q * math.sqrt(1.0 / q.shape[-1])) @ k.transpose(-2, -1)
        if mask is not None:
            scores = scores + mask
        weights = torch.softmax(scores, dim=-1)
        if dropout > 0.0:
            weights = F.dropout(weights, p=dropout)
        out = weights @ v
        weights = weights.view(self.count, -1, *weights.shape[1:])
        return out, weights.mean(dim=2) if average else weights


def _affine(x: Tensor, weight: Tensor, bias: Tensor | None) -> Tensor:
    """``x @ weight^T + bias`` for every member: ``x`` is ``(members, ..., in)``."""
    out = stacked_affine(x.reshape(x.shape[0], -1, x.shape[-1]), weight, bias)
    return out.view(*x.shape[:-1], out.shape[-1])


def multihead_attention_kernel(
    module: nn.MultiheadAttention, context: KernelContext
) -> MultiheadAttentionKernel | NoKernel:
    if module.bias_k is not None or module.bias_v is not None:
        return NoKernel("bias_k / bias_v append a learned key and value")
    if module.add_zero_attn:
        return NoKernel("add_zero_attn appends a zero key and value")
    return MultiheadAttentionKernel(module, context)
