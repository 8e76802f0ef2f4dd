"""Normalization layers (``_kernels/norm.py``): BatchNorm with per-member statistics in training
and eval mode, LayerNorm and GroupNorm with per-member affine terms, alone and inside blocks."""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

import modstate as ms

from loop_reference import assert_like_the_loop, seeded_members


class NormedResidual(nn.Module):
    """A pre-norm residual block on tokens, as transformer blocks are built."""

    def __init__(self, width: int = 8) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(width)
        self.fc = nn.Linear(width, width)
        self.group = nn.GroupNorm(2, width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.fc(self.norm(x))
        return self.group(x.transpose(1, 2)).transpose(1, 2)


BATCH_NORMS = {
    "bn1d_features": (lambda: nn.Sequential(nn.Linear(5, 4), nn.BatchNorm1d(4)), (8, 5)),
    "bn1d_then_relu_then_linear": (
        lambda: nn.Sequential(nn.Linear(5, 4), nn.BatchNorm1d(4), nn.ReLU(), nn.Linear(4, 3)),
        (8, 5),
    ),
    "bn1d_channels_length": (lambda: nn.BatchNorm1d(3), (6, 3, 4)),
    "bn2d_after_conv": (
        lambda: nn.Sequential(nn.Conv2d(2, 4, 3, bias=False), nn.BatchNorm2d(4), nn.ReLU()),
        (5, 2, 6, 6),
    ),
    "bn3d": (lambda: nn.BatchNorm3d(2), (4, 2, 3, 3, 3)),
    "no_affine_other_momentum": (lambda: nn.BatchNorm1d(4, affine=False, momentum=0.3), (8, 4)),
    "no_running_statistics": (lambda: nn.BatchNorm1d(4, track_running_stats=False), (8, 4)),
    "cumulative_average": (lambda: nn.BatchNorm1d(4, momentum=None), (8, 4)),
}


@pytest.mark.parametrize("case", BATCH_NORMS)
@pytest.mark.parametrize("in_dims", [None, 0])
def test_batch_norm_equals_the_members_one_by_one_in_training_and_eval(case, in_dims):
    factory, shape = BATCH_NORMS[case]
    lead = () if in_dims is None else (3,)
    # Two training calls (the statistics move), then eval (which reads them).
    ensemble = assert_like_the_loop(factory, lambda: (torch.randn(*lead, *shape),), in_dims=in_dims)
    norm = next(r for r in ensemble.plan.routes if r.layer.startswith("BatchNorm"))
    assert norm.fallback is None and "per-member statistics" in norm.how


def test_the_cumulative_average_follows_each_members_own_batch_count():
    factory = lambda: nn.BatchNorm1d(4, momentum=None)  # noqa: E731
    models = seeded_members(factory)
    models[1].num_batches_tracked.fill_(5)  # this member has seen more batches
    references = [copy.deepcopy(m) for m in models]
    ensemble = ms.Ensemble(models, route="batched")
    x = torch.randn(8, 4)
    torch.testing.assert_close(ensemble(x), torch.stack([r(x) for r in references]))
    stacked = ms.flatten(ms.stack([ms.extract(r) for r in references]))
    assert ms.flatten(ensemble.tree()).keys() == stacked.keys()
    for path, leaf in ms.flatten(ensemble.tree()).items():
        torch.testing.assert_close(leaf, stacked[path], msg=path)


def test_batch_norm_statistics_after_training_round_trip_through_state_dict():
    factory = lambda: nn.Sequential(nn.Linear(3, 4), nn.BatchNorm1d(4))  # noqa: E731
    ensemble = ms.Ensemble(seeded_members(factory), route="batched")
    ensemble(torch.randn(8, 3))
    fresh = ms.Ensemble(seeded_members(factory), route="batched")
    fresh.load_state_dict(ensemble.state_dict())
    x = torch.randn(8, 3)
    torch.testing.assert_close(fresh.eval()(x), ensemble.eval()(x))
    assert fresh.state_dict()["stacked.1.num_batches_tracked"].tolist() == [1, 1, 1]


LAYER_NORMS = {
    "layer_norm": (lambda: nn.LayerNorm(6), (3, 6)),
    "layer_norm_2d_no_bias": (lambda: nn.LayerNorm((2, 6), bias=False), (3, 2, 6)),
    "layer_norm_no_affine": (
        lambda: nn.Sequential(nn.Linear(6, 6), nn.LayerNorm(6, elementwise_affine=False)),
        (3, 6),
    ),
    "group_norm": (lambda: nn.GroupNorm(2, 4), (3, 4, 5)),
    "group_norm_no_affine_images": (lambda: nn.GroupNorm(1, 4, affine=False), (2, 4, 3, 3)),
    "normed_residual_block": (NormedResidual, (2, 5, 8)),
    "rms_norm": (lambda: nn.RMSNorm(6), (3, 6)),
    "rms_norm_2d_default_eps": (lambda: nn.RMSNorm((2, 6), eps=None), (3, 2, 6)),
    "rms_norm_no_weight": (
        lambda: nn.Sequential(nn.Linear(6, 6), nn.RMSNorm(6, elementwise_affine=False)),
        (3, 6),
    ),
}


@pytest.mark.parametrize("case", LAYER_NORMS)
@pytest.mark.parametrize("in_dims", [None, 0])
def test_layer_group_and_rms_norm_equal_the_members_one_by_one(case, in_dims):
    factory, shape = LAYER_NORMS[case]
    lead = () if in_dims is None else (3,)
    ensemble = assert_like_the_loop(factory, lambda: (torch.randn(*lead, *shape),), in_dims=in_dims)
    assert not ensemble.plan.fallbacks


def test_rms_norm_equals_the_members_bit_for_bit_and_runs_its_own_code_in_bfloat16():
    torch.manual_seed(0)
    members = [nn.RMSNorm(6) for _ in range(3)]
    with torch.no_grad():
        for member in members:
            member.weight.normal_()
    ensemble, x = ms.Ensemble(members, route="batched"), torch.randn(4, 6)
    assert ensemble.plan.routes[0].how == "RMS norm, per-member weight"
    assert torch.equal(ensemble(x), torch.stack([member(x) for member in members]))
    # torch scales by the weight before rounding back to bfloat16: the kernel would differ
    low_members = [copy.deepcopy(member).to(torch.bfloat16) for member in members]
    low = ms.Ensemble(low_members, route="batched")
    assert [route.how for route in low.plan.fallbacks] == ["its own forward under vmap"]
    assert "bfloat16 weight" in str(low.plan.fallbacks[0].fallback)
    y = x.to(torch.bfloat16)
    assert torch.equal(low(y), torch.stack([member(y) for member in low_members]))
    # a float32 weight with a bfloat16 input: the kernel steps aside at call time
    assert torch.equal(ensemble(y), torch.stack([member(y) for member in members]))
