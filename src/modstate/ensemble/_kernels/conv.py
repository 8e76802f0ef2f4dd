"""Convolutions as one grouped convolution: the members' channels side by side, a group each."""

from __future__ import annotations

from collections.abc import Callable

import torch.nn.functional as F
from torch import Tensor, nn

from .base import KernelContext, channels_side_by_side

_CONVOLUTIONS: dict[type[nn.Module], Callable[..., Tensor]] = {
    nn.Conv1d: F.conv1d,
    nn.Conv2d: F.conv2d,
    nn.Conv3d: F.conv3d,
}


class ConvolutionKernel:
    """N ``nn.Conv1d/2d/3d`` layers: one convolution with ``groups * N`` groups over the members'
    channels side by side, which keeps the output in that layout (member dim 1 of ``(batch,
    members, channels, ...)``) for the next convolution or BatchNorm, at no copy.

    A shared input (the stem of a network, ``in_dims=None``) with ``groups=1`` is one ordinary
    convolution with the members' filters side by side. Padding modes other than zeros pad
    first, as ``nn.Conv2d`` does."""

    route = "grouped convolution"
    fresh = True

    def __init__(self, module: nn.modules.conv._ConvNd, context: KernelContext) -> None:
        self.count = context.count
        self.convolve = _CONVOLUTIONS[type(module)]
        self.spatial = len(module.kernel_size)
        self.weight = context.home(module.weight)
        self.bias = context.maybe_home(module.bias)
        self.stride = module.stride
        self.dilation = module.dilation
        self.groups = module.groups
        self.padding_mode = module.padding_mode
        self.padding: str | tuple[int, ...] = module.padding
        self.pad_first: list[int] = []
        if module.padding_mode != "zeros":
            self.pad_first = _explicit_padding(module)
            self.padding = (0,) * self.spatial

    def __call__(self, x: Tensor, bdim: int | None) -> tuple[Tensor, int] | None:
        spatial, count = self.spatial, self.count
        member_dims = x.dim() - (bdim is not None)
        unbatched = member_dims == spatial + 1  # one sample, no batch dim
        if not unbatched and member_dims != spatial + 2:
            return None
        if unbatched:
            x = x.unsqueeze(0 if bdim is None else (1 if bdim == 0 else 0))
            bdim = None if bdim is None else (0 if bdim == 0 else bdim + 1)
        weight = self.weight.get()
        bias = self.bias.get().flatten() if self.bias is not None else None
        if bdim is None and self.groups == 1:
            channels, groups = x, 1
        else:
            channels, groups = channels_side_by_side(x, bdim, count), self.groups * count
        if self.pad_first:
            channels = F.pad(channels, self.pad_first, mode=self.padding_mode)
        out = self.convolve(
            channels,
            weight.flatten(0, 1),
            bias,
            self.stride,
            self.padding,
            self.dilation,
            groups,
        )
        out = out.view(out.shape[0], count, weight.shape[1], *out.shape[2:])
        if unbatched:
            return out.squeeze(0), 0
        return out, 1


def _explicit_padding(module: nn.modules.conv._ConvNd) -> list[int]:
    """The ``F.pad`` amounts (last dim first) that ``module``'s padding means."""
    amounts: list[int] = []
    if isinstance(module.padding, str):
        for dilation, size in zip(reversed(module.dilation), reversed(module.kernel_size)):
            total = 0 if module.padding == "valid" else dilation * (size - 1)
            amounts += [total // 2, total - total // 2]
        return amounts
    for pad in reversed(module.padding):
        amounts += [pad, pad]
    return amounts
