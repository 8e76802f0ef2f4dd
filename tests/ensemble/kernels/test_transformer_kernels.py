"""torch's transformer blocks through their layer-by-layer path (``_kernels/transformer.py``):
encoder and decoder layers in training and eval mode (where torch itself would take a fused
kernel without a batched form), with masks, and the whole ``nn.Transformer``."""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

import modstate as ms

from loop_reference import assert_like_the_loop

WIDTH = 8


def encoder_layer(**options) -> nn.Module:
    return nn.TransformerEncoderLayer(
        WIDTH, nhead=2, dim_feedforward=16, dropout=0.0, batch_first=True, **options
    )


def tokens(*lead: int) -> tuple[torch.Tensor]:
    return (torch.randn(*lead, 2, 5, WIDTH),)


CAUSAL = torch.triu(torch.full((5, 5), float("-inf")), diagonal=1)
PADDING = torch.tensor([[False] * 5, [False, False, False, True, True]])


@pytest.mark.parametrize(
    ("factory", "kwargs"),
    [
        (encoder_layer, {}),
        (lambda: encoder_layer(norm_first=True, activation="gelu"), {}),
        (encoder_layer, {"src_mask": CAUSAL, "is_causal": True}),
        (encoder_layer, {"src_key_padding_mask": PADDING}),
        (lambda: nn.TransformerEncoder(encoder_layer(), 2), {"mask": CAUSAL}),
        # In eval mode with a padding mask, torch's encoder would convert to nested tensors.
        (lambda: nn.TransformerEncoder(encoder_layer(), 2), {"src_key_padding_mask": PADDING}),
    ],
    ids=["post_norm", "pre_norm_gelu", "causal", "padding", "encoder_causal", "encoder_padding"],
)
def test_encoder_layers_equal_the_members_one_by_one(factory, kwargs):
    ensemble = _like_the_loop(factory, kwargs, in_dims=None)
    layers = [r for r in ensemble.plan.routes if r.layer.startswith("TransformerEncoderLayer")]
    assert layers and all(r.how.startswith("one kernel") for r in layers)
    assert not ensemble.plan.fallbacks


@pytest.mark.parametrize(
    "kwargs", [{}, {"src_key_padding_mask": PADDING}], ids=["plain", "padding"]
)
def test_encoder_layers_with_inputs_per_member(kwargs):
    _like_the_loop(encoder_layer, kwargs, in_dims=0)


def _like_the_loop(factory, kwargs, in_dims):
    lead = () if in_dims is None else (3,)
    return assert_like_the_loop(factory, lambda: tokens(*lead), in_dims=in_dims, kwargs=kwargs)


def test_the_eval_path_without_grad_equals_the_loop():
    models_out = assert_like_the_loop(encoder_layer, tokens, modes=(False,))
    with torch.no_grad():  # torch's fused inference kernel would run here for a plain layer
        x = tokens()[0]
        expected = torch.stack([models_out.member(i)(x) for i in range(3)])
        torch.testing.assert_close(models_out(x), expected, atol=1e-5, rtol=1e-5)


class Seq2Seq(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.model = nn.Transformer(
            WIDTH, nhead=2, num_encoder_layers=2, num_decoder_layers=2, dim_feedforward=16,
            dropout=0.0, batch_first=True,
        )  # fmt: skip

    def forward(self, src: torch.Tensor) -> torch.Tensor:
        target = src[:, :3]
        mask = nn.Transformer.generate_square_subsequent_mask(3)
        return self.model(src, target, tgt_mask=mask, tgt_is_causal=True)


def test_a_whole_transformer_equals_the_members_one_by_one():
    ensemble = assert_like_the_loop(Seq2Seq, tokens)
    assert not ensemble.plan.fallbacks
    decoder = [r for r in ensemble.plan.routes if r.layer.startswith("TransformerDecoderLayer")]
    assert decoder and all(r.how.startswith("one kernel") for r in decoder)


def pre_norm_decoder_layer() -> nn.Module:
    return nn.TransformerDecoderLayer(
        WIDTH, nhead=2, dim_feedforward=16, dropout=0.0, batch_first=True, norm_first=True
    )


class Decoder(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.layer = pre_norm_decoder_layer()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.layer(x, x[:, :4], tgt_key_padding_mask=PADDING, memory_mask=None)


def test_a_pre_norm_decoder_layer_with_a_padding_mask():
    assert_like_the_loop(Decoder, tokens)


class Sublayer(nn.Module):
    """An encoder layer whose sublayer has a hook: it runs its layer-by-layer path."""

    def __init__(self) -> None:
        super().__init__()
        self.layer = encoder_layer()
        self.layer.linear1.register_forward_hook(lambda module, args, out: out * 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.layer(x)


def test_a_hook_on_a_sublayer_runs_through_the_layer_by_layer_path():
    assert_like_the_loop(Sublayer, tokens)


def test_dropout_with_randomness_same_runs_the_layer_by_layer_path():
    torch.manual_seed(0)
    layer = nn.TransformerEncoderLayer(WIDTH, 2, 16, dropout=0.5, batch_first=True)
    ensemble = ms.Ensemble([layer, copy.deepcopy(layer)], randomness="same", route="batched")
    out = ensemble(tokens()[0])
    torch.testing.assert_close(out[0], out[1])  # one mask for both members, identical weights
    different = ms.Ensemble([layer, copy.deepcopy(layer)], randomness="different", route="batched")
    out = different(tokens()[0])
    assert not torch.equal(out[0], out[1])
