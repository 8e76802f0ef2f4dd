"""Embedding tables as one gather (``_kernels/embedding.py``): shared and per-member token ids,
``padding_idx``, a table tied to the output head, and the settings that fall back."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from loop_reference import assert_like_the_loop


class TiedLanguageModel(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(10, 6, padding_idx=0)
        self.body = nn.Linear(6, 6)
        self.head = nn.Linear(6, 10, bias=False)
        self.head.weight = self.embed.weight

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        return self.head(torch.tanh(self.body(self.embed(tokens))))


def tokens(*shape: int) -> tuple[torch.Tensor]:
    ids = torch.randint(0, 10, shape)
    ids.view(-1)[0] = 0  # a padding token
    return (ids,)


@pytest.mark.parametrize(
    "factory",
    [lambda: nn.Embedding(10, 4), lambda: nn.Embedding(10, 4, padding_idx=0), TiedLanguageModel],
    ids=["embedding", "padding_idx", "tied_head"],
)
@pytest.mark.parametrize("in_dims", [None, 0])
def test_embeddings_equal_the_members_one_by_one(factory, in_dims):
    lead = () if in_dims is None else (3,)
    ensemble = assert_like_the_loop(factory, lambda: tokens(*lead, 2, 5), in_dims=in_dims)
    assert not ensemble.plan.fallbacks


def test_max_norm_falls_back_and_still_equals_the_loop():
    # max_norm renormalizes the rows it reads in place: the layer's own forward under vmap.
    ensemble = assert_like_the_loop(
        lambda: nn.Sequential(nn.Embedding(10, 4, max_norm=1.0), nn.Linear(4, 2)),
        lambda: tokens(2, 5),
        modes=(False,),
    )
    (fallback,) = ensemble.plan.fallbacks
    assert "max_norm" in fallback.fallback
