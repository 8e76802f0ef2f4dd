"""Attention with the members folded into the attention batch (``_kernels/attention.py``):
``nn.MultiheadAttention`` in every form it is called in, and ``F.scaled_dot_product_attention``
called by a model's own code, alone and inside residual attention blocks."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import modstate as ms

from loop_reference import assert_like_the_loop, seeded_members

WIDTH, HEADS = 8, 2


class SelfAttention(nn.Module):
    def __init__(self, batch_first: bool = True, **options) -> None:
        super().__init__()
        self.attention = nn.MultiheadAttention(WIDTH, HEADS, batch_first=batch_first, **options)
        self.options: dict = {}

    def forward(self, x: torch.Tensor, **call) -> torch.Tensor:
        out, weights = self.attention(x, x, x, **call)
        return out if weights is None else out.sum() + weights.sum() * out


class CrossAttention(nn.Module):
    """Queries from one sequence, keys and values from another of other widths."""

    def __init__(self) -> None:
        super().__init__()
        self.attention = nn.MultiheadAttention(WIDTH, HEADS, kdim=5, vdim=3, batch_first=True)

    def forward(self, x: torch.Tensor, memory: torch.Tensor) -> torch.Tensor:
        return self.attention(x, memory[..., :5], memory[..., 5:], need_weights=False)[0]


class AttentionBlock(nn.Module):
    """A pre-norm residual attention block."""

    def __init__(self) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(WIDTH)
        self.attention = nn.MultiheadAttention(WIDTH, HEADS, batch_first=True)
        self.feed = nn.Sequential(nn.Linear(WIDTH, 16), nn.GELU(), nn.Linear(16, WIDTH))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.norm(x)
        x = x + self.attention(h, h, h, need_weights=False)[0]
        return x + self.feed(x)


def tokens(*lead: int) -> tuple[torch.Tensor]:
    return (torch.randn(*lead, 2, 5, WIDTH),)


CAUSAL = torch.triu(torch.ones(5, 5, dtype=torch.bool), diagonal=1)
PADDING = torch.tensor([[False] * 5, [False, False, False, True, True]])

CALLS = {
    "need_weights": {},
    "weights_per_head": {"average_attn_weights": False},
    "no_weights": {"need_weights": False},
    "bool_causal_mask": {"attn_mask": CAUSAL, "need_weights": False},
    "float_mask_is_causal": {
        "attn_mask": torch.zeros(5, 5).masked_fill(CAUSAL, float("-inf")),
        "is_causal": True,
        "need_weights": False,
    },
    "key_padding_mask": {"key_padding_mask": PADDING, "need_weights": False},
    "padding_and_3d_mask_with_weights": {
        "key_padding_mask": PADDING,
        "attn_mask": torch.randn(2 * HEADS, 5, 5, generator=torch.Generator().manual_seed(3)),
    },
}


@pytest.mark.parametrize("call", CALLS)
@pytest.mark.parametrize("in_dims", [None, 0])
def test_multihead_attention_equals_the_members_one_by_one(call, in_dims):
    lead = () if in_dims is None else (3,)
    # The members' weights are drawn at std 0.5, so outputs reach ~90; float32 rounding there is
    # ~2.5e-5 from the float64 result for the loop and the ensemble alike (measured over random
    # masks), past the default atol of 1e-5. A wrong mask or head layout is off by O(1).
    ensemble = assert_like_the_loop(
        SelfAttention, lambda: tokens(*lead), in_dims=in_dims, kwargs=CALLS[call], atol=1e-4
    )
    route = next(r for r in ensemble.plan.routes if r.layer.startswith("MultiheadAttention"))
    assert "folded into the batch" in route.how


@pytest.mark.parametrize(
    ("factory", "make_inputs"),
    [
        (lambda: SelfAttention(batch_first=False), lambda: (torch.randn(5, 2, WIDTH),)),
        (SelfAttention, lambda: (torch.randn(5, WIDTH),)),  # one sequence, no batch dim
        (lambda: SelfAttention(bias=False), tokens),
        (CrossAttention, lambda: (torch.randn(2, 5, WIDTH), torch.randn(2, 7, 8))),
        (AttentionBlock, tokens),
    ],
    ids=["sequence_first", "unbatched", "no_bias", "cross_attention_kdim_vdim", "residual_block"],
)
def test_multihead_attention_layouts_and_blocks(factory, make_inputs):
    ensemble = assert_like_the_loop(factory, make_inputs)
    assert not ensemble.plan.fallbacks


def test_bias_kv_falls_back_and_still_equals_the_loop():
    ensemble = assert_like_the_loop(
        lambda: SelfAttention(add_bias_kv=True), tokens, kwargs={"need_weights": False}
    )
    (fallback,) = ensemble.plan.fallbacks
    assert "bias_k" in fallback.fallback


def test_attention_dropout_draws_a_mask_per_member_or_is_refused():
    models = seeded_members(lambda: SelfAttention(dropout=0.5), 2)
    models[1].load_state_dict(models[0].state_dict())  # identical: only the masks differ
    x = tokens()[0]
    out = ms.Ensemble(models, randomness="different", route="batched")(x, need_weights=False)
    assert not torch.equal(out[0], out[1])
    with pytest.raises(RuntimeError, match="randomness"):
        ms.Ensemble(models, route="batched")(x, need_weights=False)


class OwnAttention(nn.Module):
    """Attention written with ``F.scaled_dot_product_attention``, as Hugging Face and timm write
    it: its own projections, a mask built in forward, grouped-query heads."""

    def __init__(self, causal: bool = False, grouped: bool = False) -> None:
        super().__init__()
        self.q = nn.Linear(WIDTH, WIDTH)
        self.kv = nn.Linear(WIDTH, WIDTH if grouped else 2 * WIDTH)
        self.out = nn.Linear(WIDTH, WIDTH)
        self.causal, self.grouped = causal, grouped

    def forward(self, x: torch.Tensor, mask: torch.Tensor | None = None) -> torch.Tensor:
        batch, length, _ = x.shape
        q = self.q(x).view(batch, length, 4, 2).transpose(1, 2)
        k, v = self.kv(x).view(batch, length, -1, 2).transpose(1, 2).chunk(2, dim=1)
        out = F.scaled_dot_product_attention(
            q, k, v, attn_mask=mask, is_causal=self.causal, enable_gqa=self.grouped
        )
        return self.out(out.transpose(1, 2).reshape(batch, length, WIDTH))


@pytest.mark.parametrize(
    ("factory", "kwargs"),
    [
        (OwnAttention, {}),
        (lambda: OwnAttention(causal=True), {}),
        (lambda: OwnAttention(grouped=True), {}),
        (OwnAttention, {"mask": torch.randn(2, 1, 5, 5)}),  # per sample
        (OwnAttention, {"mask": CAUSAL.logical_not()}),  # the same for every sample
    ],
    ids=["plain", "causal", "grouped_query", "float_mask_per_sample", "bool_mask"],
)
def test_scaled_dot_product_attention_in_a_models_own_code_is_folded(factory, kwargs):
    ensemble = assert_like_the_loop(factory, tokens, kwargs=kwargs)
    assert any("called in the model" in note for note in ensemble.plan.notes)


class PerMemberMask(nn.Module):
    """A mask computed from per-member tensors: each member's mask differs."""

    def __init__(self) -> None:
        super().__init__()
        self.attention = OwnAttention()
        self.scale = nn.Linear(WIDTH, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        bias = self.scale(x)  # (batch, length, 1): a learned bias on the keys
        return self.attention(x, mask=bias.transpose(1, 2).unsqueeze(1))


def test_a_per_member_mask_is_folded_with_its_member():
    ensemble = assert_like_the_loop(PerMemberMask, tokens)
    assert any("'attention'" in note for note in ensemble.plan.notes)
