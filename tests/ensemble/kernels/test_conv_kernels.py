"""Convolutions as one grouped convolution (``_kernels/conv.py``): every setting of
``nn.Conv1d/2d/3d``, shared and per-member inputs, inside a residual block; and small output maps
on the CPU as one batched matmul over unfolded patches."""

from __future__ import annotations

import functools

import pytest
import torch
from torch import nn

import modstate as ms

from loop_reference import assert_like_the_loop


class ResidualBlock(nn.Module):
    def __init__(self, channels: int = 4) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(channels, channels, 3, padding=1, bias=False)
        self.bn1 = nn.BatchNorm2d(channels)
        self.conv2 = nn.Conv2d(channels, channels, 3, padding=1, bias=False)
        self.bn2 = nn.BatchNorm2d(channels)
        self.pool = nn.AdaptiveAvgPool2d(2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = torch.relu(self.bn1(self.conv1(x)))
        return self.pool(torch.relu(x + self.bn2(self.conv2(out))))


CONVOLUTIONS = {
    "conv1d_same": (lambda: nn.Conv1d(2, 4, 3, padding="same"), (2, 2, 9)),
    "conv2d_grouped_strided": (lambda: nn.Conv2d(4, 6, 3, stride=2, groups=2), (2, 4, 9, 9)),
    "conv2d_no_bias_dilated": (lambda: nn.Conv2d(3, 2, 2, bias=False, dilation=2), (1, 3, 7, 7)),
    "conv2d_unbatched_input": (lambda: nn.Conv2d(3, 2, 3), (3, 6, 6)),
    "conv3d": (lambda: nn.Conv3d(2, 2, 2), (1, 2, 4, 4, 4)),
    "conv2d_reflect": (lambda: nn.Conv2d(2, 2, 3, padding=1, padding_mode="reflect"), (1, 2, 5, 5)),
    "conv2d_circular_same": (
        lambda: nn.Conv2d(2, 3, 3, padding="same", padding_mode="circular"),
        (2, 2, 5, 5),
    ),
    "conv1d_replicate": (
        lambda: nn.Conv1d(2, 2, 4, padding=2, padding_mode="replicate"),
        (2, 2, 7),
    ),
    "residual_block": (ResidualBlock, (2, 4, 6, 6)),
    # output maps of at most 4 positions (16 for a 1x1 convolution, or for a small batch): a
    # batched matmul over unfolded patches (with in_dims=0)
    "conv2d_small_maps": (lambda: nn.Conv2d(4, 6, 3, padding=1), (2, 4, 2, 2)),
    "conv2d_1x1_strided_small_maps": (lambda: nn.Conv2d(4, 6, 1, stride=2), (2, 4, 6, 6)),
    "conv2d_1x1_reflect_small_maps": (
        lambda: nn.Conv2d(4, 6, 1, stride=2, padding=1, padding_mode="reflect"),
        (2, 4, 5, 5),
    ),
    "conv2d_reflect_dilated_small_maps": (
        lambda: nn.Conv2d(2, 3, 3, padding=1, dilation=2, padding_mode="reflect", bias=False),
        (1, 2, 4, 4),
    ),
    "residual_block_small_maps": (ResidualBlock, (2, 4, 2, 2)),
    "stem_then_grouped": (
        lambda: nn.Sequential(nn.Conv2d(3, 4, 3), nn.ReLU(), nn.Conv2d(4, 4, 3, groups=2)),
        (2, 3, 8, 8),
    ),
}


@pytest.mark.parametrize("case", CONVOLUTIONS)
@pytest.mark.parametrize("in_dims", [None, 0])
def test_convolutions_equal_the_members_one_by_one(case, in_dims):
    factory, shape = CONVOLUTIONS[case]
    lead = () if in_dims is None else (3,)
    ensemble = assert_like_the_loop(factory, lambda: (torch.randn(*lead, *shape),), in_dims=in_dims)
    convolutions = [r for r in ensemble.plan.routes if r.layer.startswith("Conv")]
    assert convolutions and all(r.how == "grouped convolution" for r in convolutions)


def test_unmeasured_small_output_maps_run_as_a_batched_matmul_and_larger_ones_grouped(
    monkeypatch,
):
    # the cost model: a pinned route measures nothing (assert_like_the_loop pins "batched")
    from modstate.ensemble._kernels import conv

    routes = []
    original = conv.ConvolutionKernel._form

    def spy(self, *args):
        form = original(self, *args)
        routes.append(form)
        return form

    monkeypatch.setattr(conv.ConvolutionKernel, "_form", spy)
    conv3x3, conv1x1 = (lambda: nn.Conv2d(4, 6, 3, padding=1)), (lambda: nn.Conv2d(4, 6, 1))
    cases = [  # (layer, batch, side of the maps, route)
        (conv3x3, 20, 2, "matmul"),  # 4 positions: a matmul whatever the batch
        (conv3x3, 4, 4, "matmul"),  # 16 positions, 64 columns (batch x positions)
        (conv3x3, 5, 4, "grouped"),  # 16 positions, 80 columns
        (conv3x3, 1, 5, "grouped"),  # 25 positions
        (conv1x1, 5, 4, "matmul"),  # 1x1: 16 positions whatever the batch, no unfolding
        (lambda: nn.Conv2d(4, 6, 1, stride=2), 5, 7, "matmul"),  # 1x1, strided: 4x4 of 7x7
        (conv1x1, 1, 5, "grouped"),  # 1x1: 25
    ]
    for layer, batch, side, route in cases:
        routes.clear()
        inputs = functools.partial(lambda b, side: (torch.randn(3, b, 4, side, side),), batch, side)
        assert_like_the_loop(layer, inputs, in_dims=0)
        assert routes and set(routes) == {route}, (layer(), batch, side)


def test_in_inference_deep_convolutions_take_their_input_contiguous():
    # After a stem the maps are channels-last (inference); a convolution with more filter
    # elements than input elements takes its input contiguous, which oneDNN keeps in its output
    # (else it copies the filters into channels-last at every call). Same numbers as the loop.
    torch.manual_seed(0)
    members = [
        nn.Sequential(nn.Conv2d(3, 4, 3), nn.ReLU(), nn.Conv2d(4, 32, 3, padding=1)).eval()
        for _ in range(3)
    ]
    ensemble = ms.Ensemble(members, route="batched").eval()
    x = torch.randn(2, 3, 7, 7)
    with torch.no_grad():
        out = ensemble(x)
        want = torch.stack([member(x) for member in members])
    torch.testing.assert_close(out, want, atol=1e-6, rtol=1e-5)
    # filters: 3 x 32 x 4 x 9 elements; the stem's maps: 2 x 3 x 4 x 25
    assert out.stride(-1) == 1 and out.stride(2) == 25
