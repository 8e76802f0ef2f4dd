"""Normalization layers: BatchNorm with per-member statistics, LayerNorm and GroupNorm with
per-member affine parameters."""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from .base import KernelContext, NoKernel, channels_side_by_side, fresh_view, member_front

_BATCH_NORM_DIMS: dict[type[nn.Module], tuple[int, ...]] = {
    nn.BatchNorm1d: (2, 3),
    nn.BatchNorm2d: (4,),
    nn.BatchNorm3d: (5,),
}


class BatchNormKernel:
    """N ``nn.BatchNorm1d/2d/3d`` layers are one BatchNorm over ``N * channels`` channels, the
    members' channels side by side: each channel's statistics are its own member's, and the
    stacked running statistics, viewed flat, are updated in place by the kernel itself. Train
    and eval mode, with or without running statistics, as ``nn.BatchNorm`` decides."""

    route = "batch norm over the members' channels (per-member statistics)"
    # momentum=None (a cumulative average) divides by each member's own batch count.
    fresh = True  # batch_norm's backward does not keep its output

    def __init__(
        self,
        module: nn.modules.batchnorm._BatchNorm,
        context: KernelContext,
        kind: type[nn.Module] | None = None,
    ) -> None:
        self.module = module  # read at call time: its training flag
        self.count = context.count
        self.dims = _BATCH_NORM_DIMS[kind or type(module)]  # kind: the torch class it computes as
        self.weight = context.maybe_home(module.weight)
        self.bias = context.maybe_home(module.bias)
        self.tracked = module.track_running_stats
        self.mean = context.maybe_home(module.running_mean)
        self.var = context.maybe_home(module.running_var)
        self.counter = context.maybe_home(module.num_batches_tracked)
        self.momentum = module.momentum
        self.eps = module.eps

    def __call__(self, x: Tensor, bdim: int | None) -> tuple[Tensor, int] | None:
        if x.dim() - (bdim is not None) not in self.dims:
            return None
        arguments = self._arguments()
        if arguments is None:
            return None
        if isinstance(arguments, list):  # members whose batch counts differ
            return self._one_by_one(x, bdim, arguments)
        out = F.batch_norm(channels_side_by_side(x, bdim, self.count), *arguments)
        return fresh_view(out, out.shape[0], self.count, -1, *out.shape[2:]), 1

    def features_first(self, h: Tensor) -> Tensor | None:
        """A ``BatchNorm1d`` on rows held features first: ``h`` is ``(members, features,
        batch)``, and so is the result. One batch norm over ``(1, members * features, batch)``:
        each channel's statistics are still its member's, over the batch. None where it cannot
        (a cumulative average, ``momentum=None``, in training, or statistics not contiguous)."""
        if self.momentum is None and self.module.training and self.tracked:
            return None
        arguments = self._arguments()
        if not isinstance(arguments, tuple):
            return None
        members, features, batch = h.shape
        out = F.batch_norm(h.reshape(1, members * features, batch), *arguments)
        return fresh_view(out, members, features, batch)

    def _arguments(self) -> tuple[Any, ...] | list[float] | None:
        """``F.batch_norm``'s arguments after the input, for the members' channels side by side
        (the batch counter moves, as ``nn.BatchNorm`` moves it); each member's momentum where
        ``momentum=None`` and their batch counts differ; None where the stacked statistics are
        not contiguous (the flat view the kernel updates in place needs them so)."""
        running_mean = self.mean.get() if self.mean is not None else None
        running_var = self.var.get() if self.var is not None else None
        if not all(t is None or t.is_contiguous() for t in (running_mean, running_var)):
            return None
        training = self.module.training
        momentum = self.momentum
        if training and self.tracked and self.counter is not None:
            counter = self.counter.get()
            counter.add_(1)
            if momentum is None:  # the cumulative average: 1 / each member's own batch count
                counts = counter.tolist()
                if len(set(counts)) > 1:
                    return [1.0 / c for c in counts]
                momentum = 1.0 / counts[0]
        keep_statistics = not training or self.tracked
        return (
            running_mean.view(-1) if keep_statistics and running_mean is not None else None,
            running_var.view(-1) if keep_statistics and running_var is not None else None,
            self.weight.get().flatten() if self.weight is not None else None,
            self.bias.get().flatten() if self.bias is not None else None,
            training or running_mean is None,
            0.0 if momentum is None else momentum,
            self.eps,
        )

    def _one_by_one(self, x: Tensor, bdim: int | None, momenta: list[float]) -> tuple[Tensor, int]:
        """Members whose batch counts differ, under ``momentum=None``: one batch norm each."""
        x = member_front(x, bdim, self.count)
        mean, var = self.mean.get(), self.var.get()  # type: ignore[union-attr]
        weight = self.weight.get() if self.weight is not None else None
        bias = self.bias.get() if self.bias is not None else None
        outs = [
            F.batch_norm(
                x[i], mean[i], var[i], None if weight is None else weight[i],
                None if bias is None else bias[i], True, momentum, self.eps,
            )
            for i, momentum in enumerate(momenta)
        ]  # fmt: skip
        return torch.stack(outs), 0


def _affine(
    out: Tensor, weight: Tensor | None, bias: Tensor | None, shape: tuple[int, ...]
) -> Tensor:
    if weight is not None and bias is not None:
        return torch.addcmul(bias.view(shape), out, weight.view(shape))
    if weight is not None:
        return out * weight.view(shape)
    if bias is not None:
        return out + bias.view(shape)
    return out


class LayerNormKernel:
    """N ``nn.LayerNorm`` layers: one ``layer_norm`` without affine over every member (it
    normalizes each row alone), then the members' weights and biases in one ``addcmul``."""

    route = "layer norm, per-member affine"
    fresh = False

    def __init__(self, module: nn.LayerNorm, context: KernelContext) -> None:
        self.count = context.count
        self.shape = tuple(module.normalized_shape)
        self.eps = module.eps
        self.weight = context.maybe_home(module.weight)
        self.bias = context.maybe_home(module.bias)

    def __call__(self, x: Tensor, bdim: int | None) -> tuple[Tensor, int] | None:
        normalized = self.shape
        if x.dim() - (bdim is not None) < len(normalized):
            return None
        if bdim is not None and bdim >= x.dim() - len(normalized):
            x, bdim = x.movedim(bdim, 0), 0  # the member dim among the normalized ones
        out = self._normalize(x)
        if out is None:
            return None
        if self.weight is None and self.bias is None:
            return (out, bdim) if bdim is not None else (out.expand(self.count, *out.shape), 0)
        if bdim is None:
            out, bdim = out.unsqueeze(0), 0
        # (1, ..., count at bdim, ..., 1, *normalized): broadcasts over every other dim.
        shape = [1] * (out.dim() - len(normalized)) + list(normalized)
        shape[bdim] = self.count
        weight = self.weight.get() if self.weight is not None else None
        bias = self.bias.get() if self.bias is not None else None
        out = _affine(out, weight, bias, tuple(shape))
        if out.shape[bdim] != self.count:  # no affine term reached the member dim
            out = out.expand(*out.shape[:bdim], self.count, *out.shape[bdim + 1 :])
        return out, bdim

    def _normalize(self, x: Tensor) -> Tensor | None:
        return F.layer_norm(x, self.shape, None, None, self.eps)


class RMSNormKernel(LayerNormKernel):
    """N ``nn.RMSNorm`` layers: one ``rms_norm`` without weight over every member (it
    normalizes each row alone), then the members' weights in one multiplication: the very ops
    of ``F.rms_norm`` with a weight, in float32 and float64. In lower precisions torch scales
    by the weight before rounding back, so those run the layer's own code under vmap."""

    route = "RMS norm, per-member weight"

    def __init__(self, module: nn.RMSNorm, context: KernelContext) -> None:
        self.count = context.count
        self.shape = tuple(module.normalized_shape)
        self.rms_eps = module.eps  # None: torch's default for the dtype
        self.weight = context.maybe_home(module.weight)
        self.bias = None

    def _normalize(self, x: Tensor) -> Tensor | None:
        if x.dtype not in (torch.float32, torch.float64):
            return None
        return F.rms_norm(x, self.shape, None, self.rms_eps)


def rms_norm_kernel(module: nn.RMSNorm, context: KernelContext) -> RMSNormKernel | NoKernel:
    weight = module.weight
    if weight is not None and weight.dtype not in (torch.float32, torch.float64):
        return NoKernel(
            f"a {weight.dtype} weight: torch scales by it before rounding, which a per-member "
            "weight applied after the norm would not"
        )
    return RMSNormKernel(module, context)


class GroupNormKernel:
    """N ``nn.GroupNorm`` layers: the members folded into the batch for one ``group_norm``
    without affine (it normalizes each sample alone), then the members' affine parameters."""

    route = "group norm with the members in the batch, per-member affine"
    fresh = False

    def __init__(self, module: nn.GroupNorm, context: KernelContext) -> None:
        self.count = context.count
        self.groups = module.num_groups
        self.eps = module.eps
        self.weight = context.maybe_home(module.weight)
        self.bias = context.maybe_home(module.bias)

    def __call__(self, x: Tensor, bdim: int | None) -> tuple[Tensor, int] | None:
        if x.dim() - (bdim is not None) < 2:
            return None
        count = self.count
        x = member_front(x, bdim, count)
        out = F.group_norm(x.reshape(-1, *x.shape[2:]), self.groups, None, None, self.eps)
        out = out.view(x.shape)
        shape = (count, 1, x.shape[2]) + (1,) * (x.dim() - 3)
        weight = self.weight.get() if self.weight is not None else None
        bias = self.bias.get() if self.bias is not None else None
        return _affine(out, weight, bias, shape), 0
