"""The small trees the optimizer tests step: seeded parameters and gradients shaped like them."""

from __future__ import annotations

import optree
import torch


def make_params(seed: int = 0, dtype: torch.dtype = torch.float32) -> dict:
    generator = torch.Generator().manual_seed(seed)
    return {
        "encoder": {
            "weight": torch.randn(4, 3, generator=generator).to(dtype),
            "bias": torch.randn(4, generator=generator).to(dtype),
        },
        "head": {"weight": torch.randn(2, 4, generator=generator).to(dtype)},
    }


def grads_like(params: dict, generator: torch.Generator) -> dict:
    return optree.tree_map(
        lambda leaf: torch.randn(leaf.shape, generator=generator).to(leaf.dtype), params
    )
