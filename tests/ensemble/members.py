"""Small member models of the ensemble tests, and the loop their ensembles must equal."""

from __future__ import annotations

import torch
from torch import nn

from together import run_together

ATOL = 1e-5


def seeded(factory, n, seed=0):
    """``n`` models from ``factory``, drawn one after the other after ``manual_seed(seed)``."""
    torch.manual_seed(seed)
    return [factory() for _ in range(n)]


def loop(models, x, in_dims=None):
    """The members' outputs stacked, each on ``x`` (or on its slice ``x[i]`` with in_dims=0)."""
    return torch.stack([m(x if in_dims is None else x[i]) for i, m in enumerate(models)])


def from_threads(ensemble, inputs, threads=8):
    """``ensemble(x)`` under ``no_grad`` for every input, from ``threads`` real threads started
    together (thread k takes inputs k, k + threads, ...): the outputs by input index. An error in
    any thread fails the caller."""
    results: dict[int, torch.Tensor] = {}

    def work(first: int) -> int:
        for i in range(first, len(inputs), threads):
            with torch.no_grad():
                results[i] = ensemble(inputs[i])
        return 0

    run_together(work, threads)
    return results


def mlp():
    return nn.Sequential(nn.Linear(5, 16), nn.GELU(), nn.Linear(16, 3))


def cnn():
    return nn.Sequential(
        nn.Conv2d(3, 4, 3, padding=1),
        nn.BatchNorm2d(4),
        nn.ReLU(),
        nn.Conv2d(4, 4, 3, stride=2, groups=2),
        nn.Flatten(),
        nn.Linear(4 * 3 * 3, 2),
    )


def encoder_layer():
    return nn.TransformerEncoderLayer(8, nhead=2, dim_feedforward=16, dropout=0.0, batch_first=True)
