"""Pooling layers: one pooling over the members' channels side by side."""

from __future__ import annotations

from torch import Tensor, nn

from .base import KernelContext, NoKernel, channels_side_by_side, fresh_view

POOLS: dict[type[nn.Module], int] = {
    pool: spatial
    for spatial, pools in (
        (1, (nn.MaxPool1d, nn.AvgPool1d, nn.AdaptiveMaxPool1d, nn.AdaptiveAvgPool1d)),
        (2, (nn.MaxPool2d, nn.AvgPool2d, nn.AdaptiveMaxPool2d, nn.AdaptiveAvgPool2d)),
        (3, (nn.MaxPool3d, nn.AvgPool3d, nn.AdaptiveMaxPool3d, nn.AdaptiveAvgPool3d)),
    )
    for pool in pools
}
"""The pooling layers with a kernel, and how many spatial dims each pools over."""


class PoolKernel:
    """N pooling layers are the layer itself over ``(batch, members * channels, ...)``: pooling
    treats every channel alone, so the members' channels side by side (the layout that
    convolutions and BatchNorm keep) need no folding into the batch, which under vmap is a copy;
    the pooling runs in whatever memory format its input has (channels-last included)."""

    route = "pooling over the members' channels"
    fresh = True  # pooling's backward keeps its input's shape and indices, not its output

    def __init__(
        self, module: nn.Module, context: KernelContext, kind: type[nn.Module] | None = None
    ) -> None:
        self.module = module
        self.count = context.count
        self.spatial = POOLS[kind or type(module)]  # kind: the torch class it computes as

    def __call__(self, x: Tensor, bdim: int | None) -> tuple[Tensor, int] | None:
        if x.dim() - (bdim is not None) != self.spatial + 2:
            return None  # an unbatched sample: vmap runs the layer
        channels = channels_side_by_side(x, bdim, self.count)
        out = self.module(channels)
        return fresh_view(out, out.shape[0], self.count, -1, *out.shape[2:]), 1


def pool_kernel(
    module: nn.Module, context: KernelContext, kind: type[nn.Module] | None = None
) -> PoolKernel | NoKernel:
    if getattr(module, "return_indices", False):
        return NoKernel("return_indices=True: it returns the indices too")
    return PoolKernel(module, context, kind)
