"""Pooling layers as one pooling over the members' channels side by side (``_kernels/pool.py``):
every pooling type, shared and per-member inputs, after a convolution stem (whose channels-last
output the pooling keeps), and the layers that keep their vmap route."""

from __future__ import annotations

import pytest
import torch
from torch import nn

import modstate as ms

from loop_reference import assert_like_the_loop


class Stem(nn.Module):
    """A CNN's stem: a convolution of the shared input, BatchNorm, ReLU, then the pooling."""

    def __init__(self, pool: nn.Module) -> None:
        super().__init__()
        self.conv = nn.Conv2d(3, 4, 3, padding=1, bias=False)
        self.bn = nn.BatchNorm2d(4)
        self.pool = pool

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.pool(torch.relu(self.bn(self.conv(x))))


POOLS = {
    "max1d": (lambda: nn.MaxPool1d(3, stride=2, padding=1), (2, 4, 9)),
    "avg1d_ceil": (lambda: nn.AvgPool1d(2, ceil_mode=True), (2, 4, 7)),
    "adaptive_avg1d": (lambda: nn.AdaptiveAvgPool1d(3), (2, 4, 8)),
    "max2d": (lambda: nn.MaxPool2d(3, stride=2, padding=1), (2, 4, 8, 8)),
    "max2d_dilated": (lambda: nn.MaxPool2d(2, dilation=2), (2, 4, 7, 7)),
    "avg2d_no_pad_count": (lambda: nn.AvgPool2d(3, 2, 1, count_include_pad=False), (2, 4, 7, 7)),
    "adaptive_max2d": (lambda: nn.AdaptiveMaxPool2d((2, 3)), (2, 4, 6, 6)),
    "adaptive_avg2d": (lambda: nn.AdaptiveAvgPool2d(1), (2, 4, 5, 5)),
    "max3d": (lambda: nn.MaxPool3d(2), (1, 4, 4, 4, 4)),
    "avg3d": (lambda: nn.AvgPool3d(2, stride=1), (1, 4, 3, 4, 4)),
    "stem_then_max2d": (lambda: Stem(nn.MaxPool2d(3, stride=2, padding=1)), (2, 3, 8, 8)),
    "stem_then_adaptive_avg2d": (lambda: Stem(nn.AdaptiveAvgPool2d(1)), (2, 3, 8, 8)),
}


@pytest.mark.parametrize("case", POOLS)
@pytest.mark.parametrize("in_dims", [None, 0])
def test_pooling_equals_the_members_one_by_one(case, in_dims):
    factory, shape = POOLS[case]
    lead = () if in_dims is None else (3,)
    ensemble = assert_like_the_loop(factory, lambda: (torch.randn(*lead, *shape),), in_dims=in_dims)
    (pool,) = [r for r in ensemble.plan.routes if "Pool" in r.layer]
    assert pool.how == "pooling over the members' channels" and pool.fallback is None


def test_in_inference_a_stem_keeps_channels_last_through_the_pooling():
    torch.manual_seed(0)
    members = [Stem(nn.MaxPool2d(2)).eval() for _ in range(3)]
    ensemble = ms.Ensemble(members, route="batched").eval()
    x = torch.randn(2, 3, 8, 8)
    with torch.no_grad():
        out = ensemble(x)
        want = torch.stack([member(x) for member in members])
    assert torch.allclose(out, want, atol=1e-6)
    # (members, batch, channels, h, w) over channels-last maps of the members' channels side
    # by side: a channel is the next element, a column the next members * channels elements
    assert out.stride(2) == 1 and out.stride(4) == 3 * 4
    # With autograd on, the maps stay contiguous (channels-last gradients round worse)
    assert ensemble(x).stride(-1) == 1


def test_pooling_that_returns_indices_and_unbatched_samples_keep_the_vmap_route():
    torch.manual_seed(0)
    indices = ms.Ensemble([nn.MaxPool2d(2, return_indices=True) for _ in range(2)], route="batched")
    (route,) = indices.plan.routes
    assert route.fallback is not None and "return_indices=True" in route.fallback
    out, where = indices(torch.randn(2, 3, 4, 4))
    assert out.shape == (2, 2, 3, 2, 2) and where.shape == out.shape
    sample = torch.randn(3, 4, 4)  # no batch dim: vmap runs the layer
    pooled = ms.Ensemble([nn.MaxPool2d(2) for _ in range(2)], route="batched")(sample)
    assert torch.equal(pooled, nn.MaxPool2d(2)(sample).expand(2, 3, 2, 2))
