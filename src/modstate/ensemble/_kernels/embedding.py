"""Embedding tables: one gather from the members' stacked tables."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from .base import KernelContext, NoKernel


class EmbeddingKernel:
    """N ``nn.Embedding`` layers: shared indices (token ids given to every member) gather along
    the stacked table's row dim at once; per-member indices are offset into the tables laid end
    to end. ``padding_idx`` keeps its rows out of the gradient, as ``nn.Embedding`` does."""

    route = "one gather from the stacked tables"
    fresh = False

    def __init__(self, module: nn.Embedding, context: KernelContext) -> None:
        self.count = context.count
        self.weight = context.home(module.weight)
        self.padding_idx = module.padding_idx

    def __call__(self, x: Tensor, bdim: int | None) -> tuple[Tensor, int] | None:
        if x.dtype not in (torch.int64, torch.int32):
            return None
        table = self.weight.get()
        count, rows = self.count, table.shape[1]
        if bdim is None:
            out = table.index_select(1, x.reshape(-1)).view(count, *x.shape, table.shape[2])
            padding = None if self.padding_idx is None else (x == self.padding_idx).unsqueeze(-1)
        else:
            x = x if bdim == 0 else x.movedim(bdim, 0)
            offsets = torch.arange(count, device=x.device, dtype=x.dtype) * rows
            flat = x + offsets.view(count, *(1,) * (x.dim() - 1))
            out = F.embedding(flat, table.reshape(count * rows, table.shape[2]))
            padding = None if self.padding_idx is None else (x == self.padding_idx).unsqueeze(-1)
        if padding is not None:
            out = torch.where(padding, out.detach(), out)
        return out, 0


def embedding_kernel(module: nn.Embedding, context: KernelContext) -> EmbeddingKernel | NoKernel:
    if module.max_norm is not None:
        return NoKernel("max_norm renormalizes the table's rows in place")
    if module.sparse:
        return NoKernel("sparse=True: sparse gradients of a stacked table")
    if module.scale_grad_by_freq:
        return NoKernel("scale_grad_by_freq counts each member's own indices")
    return EmbeddingKernel(module, context)
