"""Affine layers as one batched matmul: ``nn.Linear`` and Hugging Face's ``Conv1D`` (GPT-2)."""

from __future__ import annotations

import torch
from torch import Tensor, nn

from .base import KernelContext


class LinearKernel:
    """N ``nn.Linear`` layers: one ``torch.baddbmm`` over the stacked weights.

    A shared input (the first layer, ``in_dims=None``) is expanded to every member without a
    copy. (Measured: one matmul against the members' weights side by side, which reads the input
    once, is slower on CPU, and leaves its output in a layout the next layer must copy.)"""

    route = "batched matmul"
    fresh = True

    def __init__(self, module: nn.Linear, context: KernelContext) -> None:
        self.count = context.count
        weight = context.home(module.weight)
        bias = context.maybe_home(module.bias)
        # The tables and names themselves: this runs for every layer of every call.
        self.weights, self.weight_name = weight.table, weight.name
        self.biases: dict[str, Tensor | None] | None = None
        self.bias_name = ""
        if bias is not None:
            self.biases, self.bias_name = bias.table, bias.name

    def __call__(self, x: Tensor, bdim: int | None) -> tuple[Tensor, int] | None:
        count = self.count
        dims = x.dim()
        if bdim is None:
            if dims == 2:
                lead, rows = None, x.expand(count, -1, -1)
            elif dims == 0:
                return None
            else:
                lead, rows = x.shape[:-1], x.reshape(-1, x.shape[-1]).expand(count, -1, -1)
        else:
            if dims < 2:
                return None
            if bdim != 0:
                x = x.movedim(bdim, 0)
            if dims == 3:
                lead, rows = None, x
            else:
                lead, rows = x.shape[1:-1], x.reshape(count, -1, x.shape[-1])
        transposed = self.weights[self.weight_name].transpose(1, 2)  # type: ignore[union-attr]
        if self.biases is None:
            out = torch.bmm(rows, transposed)
        else:
            bias = self.biases[self.bias_name]
            assert bias is not None
            out = torch.baddbmm(bias.unsqueeze(1), rows, transposed)
        return (out, 0) if lead is None else (out.view(count, *lead, out.shape[-1]), 0)


class TransposedLinearKernel:
    """N Hugging Face ``Conv1D`` layers (GPT-2's projections: ``x @ weight + bias`` with the
    weight stored ``(in, out)``): ``torch.baddbmm`` over the stacked weights."""

    route = "batched matmul"
    fresh = True

    def __init__(self, module: nn.Module, context: KernelContext) -> None:
        self.count = context.count
        self.weight = context.home(module.weight)
        self.bias = context.maybe_home(module.bias)

    def __call__(self, x: Tensor, bdim: int | None) -> tuple[Tensor, int] | None:
        if x.dim() - (bdim is not None) < 1:
            return None
        count = self.count
        weight = self.weight.get()
        if bdim is None:
            lead = x.shape[:-1]
            rows = x.reshape(-1, x.shape[-1]).expand(count, -1, -1)
        else:
            x = x if bdim == 0 else x.movedim(bdim, 0)
            lead = x.shape[1:-1]
            rows = x.reshape(count, -1, x.shape[-1])
        if self.bias is None:
            out = torch.bmm(rows, weight)
        else:
            out = torch.baddbmm(self.bias.get().unsqueeze(1), rows, weight)
        return out.view(count, *lead, out.shape[-1]), 0


def is_hugging_face_conv1d(module: nn.Module) -> bool:
    """Whether ``module`` is exactly ``transformers.pytorch_utils.Conv1D`` (told by name, so that
    transformers is never imported)."""
    kind = type(module)
    return kind.__name__ == "Conv1D" and kind.__module__ == "transformers.pytorch_utils"
