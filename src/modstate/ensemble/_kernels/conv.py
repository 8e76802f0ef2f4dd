"""Convolutions as one grouped convolution: the members' channels side by side, a group each; on
the CPU, 2-D convolutions with small output maps as one batched matmul over unfolded patches."""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from .base import KernelContext, channels_side_by_side, fresh_view
from .forms import FormChoice, timed_run

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
    first, as ``nn.Conv2d`` does.

    On the CPU, a ``Conv2d`` (``groups=1``) whose output maps have at most `MATMUL_POSITIONS`
    positions (the last layers of a CNN: 2x2) runs as one batched matmul over the members
    instead, on its unfolded input patches (``F.unfold``), with the same layout out; up to 4x4
    maps it does so for a small batch (at most `MATMUL_COLUMNS` columns, batch x positions); a
    1x1 convolution (a ResNet's downsampling shortcut) does so up to 4x4 maps whatever the
    batch, its patches being its input's pixels (a strided slice, no unfold). There oneDNN's
    grouped convolution is slow: measured on a 2-core x86 server for torchvision ResNet-18's
    layer4 shapes, 4 members, it took 1.5-3x the matmul. On 4x4 maps and a batch of 8, a 3x3
    convolution is faster grouped: unfolding (``im2col``) costs about what the matmul saves
    (ResNet-18 of 4 members, 8x3x64x64, forward: 0.76 of a loop with layer3 as matmuls, 0.70
    grouped); with a batch of 2 the matmul is faster (0.75 against 0.78 on 2x3x64x64; each
    pair interleaved in one process).

    In inference on the CPU (autograd off), a shared 4-D input with ``groups=1`` (the stem of a
    CNN) goes in in channels-last memory format, which oneDNN keeps in its output, and so do the
    BatchNorm, activations, pooling and convolutions after it: max pooling is about 18x faster on
    channels-last maps than on contiguous ones, and torchvision ResNet-18 of 4 members went from
    0.9 to 0.74 of a loop (``benchmarks/ensemble_architectures_benchmarks_test.py``). Outputs
    that are feature maps come back with channels-last strides (contiguous after a deep
    convolution, see below). With autograd on, the format stays contiguous: there the gradients
    through channels-last BatchNorm and convolutions were 3-4x further from float64 than the
    loop's own (2e-4 against 5e-5, relative). On the CPU, a convolution whose filters outnumber
    its input's elements (the deep layers: many channels, small maps) takes its input contiguous
    instead: on a channels-last input oneDNN copies the filters into channels-last at every
    call, a transposing copy (ResNet-18's layer3, 4 members: 3.9 ms a call beside a 5.5 ms
    convolution; from a contiguous input the convolution takes 6.9 ms, and there is no copy),
    where making the small input contiguous costs little (ResNet-18 of 4 members, forward: 0.73
    of a loop against 0.78)."""

    route = "grouped convolution"
    fresh = True

    def __init__(
        self,
        module: nn.modules.conv._ConvNd,
        context: KernelContext,
        kind: type[nn.Module] | None = None,
    ) -> None:
        kind = kind or type(module)  # the torch class it computes as (a subclass's base)
        self.count = context.count
        self.convolve = _CONVOLUTIONS[kind]
        self.spatial = len(module.kernel_size)
        self.weight = context.home(module.weight)
        self.forms = context.forms
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
        self.kernel_size = module.kernel_size
        # Unfold takes 2-D inputs and padding as numbers; "same" padding stays a convolution.
        self.matmul_ok = (
            kind is nn.Conv2d and module.groups == 1 and not isinstance(self.padding, str)
        )
        self.pointwise = self.matmul_ok and self.kernel_size == (1, 1) and self.padding == (0, 0)

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
            if x.is_cpu and x.dim() == 4 and not torch.is_grad_enabled():
                # the stem of a CNN, in inference: see the class docstring
                channels = x.contiguous(memory_format=torch.channels_last)
        else:
            channels, groups = channels_side_by_side(x, bdim, count), self.groups * count
        if self.pad_first:
            channels = F.pad(channels, self.pad_first, mode=self.padding_mode)
        if (
            channels.is_cpu
            and not channels.is_contiguous()
            and channels.is_contiguous(memory_format=torch.channels_last)
            and weight.numel() > channels.numel()
        ):
            channels = channels.contiguous()  # see the class docstring: filters outnumber inputs
        if groups == count and self.matmul_ok and channels.is_cpu:
            out_hw = self._output_maps(channels)
            if self._form(channels, weight, bias, out_hw) == "matmul":
                out = self._matmul(channels, weight, bias, out_hw)
                return (out.squeeze(0), 0) if unbatched else (out, 1)
        out = self._grouped(channels, weight, bias, groups)
        if unbatched:
            return out.squeeze(0), 0
        return out, 1

    def _grouped(
        self, channels: Tensor, weight: Tensor, bias: Tensor | None, groups: int
    ) -> Tensor:
        """``(batch, members, out channels, ...)`` by one convolution of ``groups`` groups."""
        out = self.convolve(
            channels,
            weight.flatten(0, 1),
            bias,
            self.stride,
            self.padding,
            self.dilation,
            groups,
        )
        return fresh_view(out, out.shape[0], self.count, weight.shape[1], *out.shape[2:])

    def _output_maps(self, channels: Tensor) -> list[int]:
        """The output maps' height and width for ``channels`` ``(batch, channels, H, W)``."""
        assert not isinstance(self.padding, str)
        return [
            (size + 2 * pad - dilation * (kernel - 1) - 1) // stride + 1
            for size, pad, dilation, kernel, stride in zip(
                channels.shape[2:],
                self.padding,
                self.dilation,
                self.kernel_size,
                self.stride,
                strict=True,
            )
        ]

    def _form(
        self, channels: Tensor, weight: Tensor, bias: Tensor | None, out_hw: list[int]
    ) -> str:
        """``"matmul"`` or ``"grouped"`` for a CPU ``Conv2d`` of ``groups=1``: measured
        (``forms.py``) where both may win, else the cost model (`cost_model_form`)."""
        positions = out_hw[0] * out_hw[1]
        model = cost_model_form(self.pointwise, channels.shape[0], positions)
        if not 0 < positions <= MEASURED_POSITIONS or not self.forms.may_measure(channels, weight):
            return model
        records = torch.is_grad_enabled() and (channels.requires_grad or weight.requires_grad)
        signature = (channels.shape, channels.stride(), channels.dtype, records)
        groups = self.groups * self.count

        def words() -> str:
            grad = ", grad" if records else ""
            return (
                f"input {tuple(channels.shape)} {str(channels.dtype).removeprefix('torch.')}{grad}"
            )

        def matmul(c: Tensor, w: Tensor, b: Tensor | None) -> Tensor:
            return self._matmul(c, w, b, out_hw)

        def grouped(c: Tensor, w: Tensor, b: Tensor | None) -> Tensor:
            return self._grouped(c, w, b, groups)

        def forms() -> dict[str, Callable[[], object]]:
            return {
                "grouped": timed_run(grouped, channels, weight, bias),
                "matmul": timed_run(matmul, channels, weight, bias),
            }

        # the layer's key: its stacked weight's Home, the same object in every runner and chain
        # of the ensemble (each builds kernels of its own)
        return self.forms.choose(self.weight, signature, words, forms, model)

    def choices(self) -> list[FormChoice]:
        """The forms measured for this layer so far (``Ensemble.plan`` lists them)."""
        return self.forms.choices(self.weight)

    def _matmul(
        self, channels: Tensor, weight: Tensor, bias: Tensor | None, out_hw: list[int]
    ) -> Tensor:
        """``(batch, members, out channels, h, w)`` by one ``baddbmm`` over the members, from
        ``channels`` ``(batch, members * in channels, H, W)``."""
        assert not isinstance(self.padding, str)  # matmul_ok: "same" stays a convolution
        batch = channels.shape[0]
        positions = out_hw[0] * out_hw[1]
        count, out_channels = weight.shape[0], weight.shape[1]
        if self.pointwise:  # each patch is one input pixel: the strided pixels, in one copy
            pixels = channels[:, :, :: self.stride[0], :: self.stride[1]]
            depth = pixels.shape[1] // count
            patches = pixels.unflatten(1, (count, depth)).permute(1, 2, 0, 3, 4)
        else:
            patches = F.unfold(channels, self.kernel_size, self.dilation, self.padding, self.stride)
            # (batch, members * in channels * kh * kw, positions), member-major, as the weights
            depth = patches.shape[1] // count
            patches = patches.view(batch, count, depth, positions).permute(1, 2, 0, 3)
        patches = patches.reshape(count, depth, batch * positions)
        filters = weight.reshape(count, out_channels, depth)
        if bias is None:
            out = torch.bmm(filters, patches)
        else:
            out = torch.baddbmm(bias.view(count, out_channels, 1), filters, patches)
        out = out.view(count, out_channels, batch, *out_hw).permute(2, 0, 1, 3, 4)
        return out.contiguous()


def cost_model_form(pointwise: bool, batch: int, positions: int) -> str:
    """The form a CPU ``Conv2d`` (``groups=1``) takes where nothing is measured: a batched
    matmul on output maps of at most `MATMUL_POSITIONS` positions, or `MATMUL_SMALL_BATCH_POSITIONS`
    for a small batch, or `POINTWISE_MATMUL_POSITIONS` for a 1x1 convolution; else grouped."""
    if pointwise:
        limit = POINTWISE_MATMUL_POSITIONS
    elif batch * positions <= MATMUL_COLUMNS:
        limit = MATMUL_SMALL_BATCH_POSITIONS
    else:
        limit = MATMUL_POSITIONS
    return "matmul" if 0 < positions <= limit else "grouped"


MEASURED_POSITIONS = 16
"""The most positions per output map (4x4) at which an ensemble that measures times both forms;
on larger maps the grouped convolution runs (the matmul's unfolded patches grow with the maps)."""

MATMUL_POSITIONS = 4
"""The most positions per output map (2x2) at which a CPU ``Conv2d`` runs as a batched matmul."""

MATMUL_SMALL_BATCH_POSITIONS = 16
MATMUL_COLUMNS = 64
"""Up to `MATMUL_SMALL_BATCH_POSITIONS` positions (4x4), a ``Conv2d`` runs as a batched matmul
too when its matmul has at most `MATMUL_COLUMNS` columns (batch x positions: a batch of 4 or
less on 4x4 maps)."""

POINTWISE_MATMUL_POSITIONS = 16
"""The most positions (4x4) at which a 1x1 ``Conv2d`` without padding runs as a batched matmul,
whose patches need no unfolding."""


def _explicit_padding(module: nn.modules.conv._ConvNd) -> list[int]:
    """The ``F.pad`` amounts (last dim first) that ``module``'s padding means."""
    amounts: list[int] = []
    if isinstance(module.padding, str):
        for dilation, size in zip(
            reversed(module.dilation), reversed(module.kernel_size), strict=True
        ):
            total = 0 if module.padding == "valid" else dilation * (size - 1)
            amounts += [total // 2, total - total // 2]
        return amounts
    for pad in reversed(module.padding):
        amounts += [pad, pad]
    return amounts
