"""Affine layers as one batched matmul: ``nn.Linear`` and Hugging Face's ``Conv1D`` (GPT-2)."""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor, nn

from modstate._core.torch_facts import functorch_active

from .base import KernelContext, fresh_view


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
        weight = self.weights[self.weight_name]
        bias = None if self.biases is None else self.biases[self.bias_name]
        out = stacked_affine(rows, weight, bias)  # type: ignore[arg-type]
        return (out, 0) if lead is None else (fresh_view(out, count, *lead, out.shape[-1]), 0)

    def features_first(self, h: Tensor) -> Tensor:
        """The layers on rows held features first: ``h`` is ``(members, in, batch)``, the
        result ``(members, out, batch)``, ``weight @ h + bias`` per member. Both of its
        gradients come out of ``bmm``'s backward in their tensor's own layout, the weight's
        as ``nn.Linear``'s does."""
        weight: Tensor = self.weights[self.weight_name]  # type: ignore[assignment]
        if self.biases is None:
            return torch.bmm(weight, h)
        bias: Tensor = self.biases[self.bias_name]  # type: ignore[assignment]
        return torch.baddbmm(bias.unsqueeze(2), weight, h)


def stacked_affine(rows: Tensor, weight: Tensor, bias: Tensor | None) -> Tensor:
    """``rows @ weight^T + bias`` for every member: ``rows`` ``(members, n, in)``, ``weight``
    ``(members, out, in)``, ``bias`` ``(members, out)``.

    When plain autograd differentiates the weight, its gradient comes back in the weight's own
    layout (`_AffineInWeightLayout`), as ``nn.Linear``'s does: ``torch.bmm``'s backward gives
    the transpose of a contiguous tensor, and ``.grad`` (torch's gradient layout contract) or a
    fused optimizer (`modstate.optim`) then copies every weight gradient at every step, a
    transposing copy that took 255 µs of an 8-member MLP's 3.3 ms training step (one thread).
    Under ``torch.func`` transforms, ``torch.compile`` and autocast it is plain ``bmm``, and so it
    is for a weight under `LAYOUT_KERNEL_ELEMENTS`, whose copy costs less than the function's
    own overhead (about 20 µs a call with its backward, where the copy takes about 1.2 µs per
    thousand elements)."""
    if (
        weight.requires_grad
        and weight.numel() >= LAYOUT_KERNEL_ELEMENTS
        and torch.is_grad_enabled()
        and weight.dtype.is_floating_point
        and rows.dtype == weight.dtype
        and not functorch_active()
        and not torch.is_autocast_enabled(rows.device.type)
        and not torch.compiler.is_compiling()
    ):
        return _AffineInWeightLayout.apply(rows, weight, bias)  # type: ignore[no-any-return]
    return _affine(rows, weight, bias)


def _affine(rows: Tensor, weight: Tensor, bias: Tensor | None) -> Tensor:
    if bias is None:
        return torch.bmm(rows, weight.transpose(1, 2))
    return torch.baddbmm(bias.unsqueeze(1), rows, weight.transpose(1, 2))


LAYOUT_KERNEL_ELEMENTS = 1 << 15
"""The fewest elements of a stacked weight whose gradient `stacked_affine` lays out as the
weight (8 members of ``Linear(64, 64)`` have this many)."""


class _AffineInWeightLayout(torch.autograd.Function):
    """`stacked_affine` with the weight gradient computed as ``grad^T @ rows`` (what
    ``F.linear``'s backward computes per member), so it is laid out as the weight is. The same
    forward; the input gradient is ``bmm``'s own. The backward is made of differentiable ops, so
    higher-order gradients go through it. Written with ``ctx`` in ``forward`` (no
    ``setup_context``): measured 20 against 66 µs of overhead per call and its backward; the
    ``torch.func`` transforms, which need ``setup_context``, take plain ``bmm`` instead."""

    @staticmethod
    def forward(ctx: Any, rows: Tensor, weight: Tensor, bias: Tensor | None) -> Tensor:  # type: ignore[override]
        ctx.save_for_backward(rows, weight)
        ctx.has_bias = bias is not None
        return _affine(rows, weight, bias)

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> tuple[Tensor | None, ...]:  # type: ignore[override]
        rows, weight = ctx.saved_tensors
        wants_rows, wants_weight, wants_bias = ctx.needs_input_grad
        grad_rows = torch.bmm(grad, weight) if wants_rows else None
        grad_weight = torch.bmm(grad.transpose(1, 2), rows) if wants_weight else None
        grad_bias = grad.sum(1) if ctx.has_bias and wants_bias else None
        return grad_rows, grad_weight, grad_bias


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
        return fresh_view(out, count, *lead, out.shape[-1]), 0


def is_hugging_face_conv1d(module: nn.Module) -> bool:
    """Whether ``module`` is exactly ``transformers.pytorch_utils.Conv1D`` (told by name, so that
    transformers is never imported)."""
    kind = type(module)
    return kind.__name__ == "Conv1D" and kind.__module__ == "transformers.pytorch_utils"
