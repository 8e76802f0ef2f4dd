"""The plan of an ensemble (``ensemble/_plan.py``): each layer with the route it takes and, for a
fallback, why; shown by ``ensemble.plan`` and ``repr(ensemble)``."""

from __future__ import annotations

import re

import torch
import torch.nn.functional as F
from torch import nn
from torch.nn.utils import parametrizations

import modstate as ms


def seeded(factory, n=2):
    torch.manual_seed(0)
    return [factory() for _ in range(n)]


class Scaled(nn.Module):
    """A layer with a tensor of its own and no kernel."""

    def __init__(self) -> None:
        super().__init__()
        self.scale = nn.Parameter(torch.ones(6))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x * self.scale


class WithToken(nn.Module):
    """A model whose own code reads a parameter it holds (as ViT reads its class token)."""

    def __init__(self) -> None:
        super().__init__()
        self.token = nn.Parameter(torch.randn(1, 6))
        self.body = nn.Sequential(nn.Linear(6, 6), nn.ReLU(), Scaled())
        self.attention = nn.MultiheadAttention(6, 2, add_bias_kv=True, batch_first=True)
        self.pool = nn.AdaptiveAvgPool1d(1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = torch.cat([self.token.expand(x.shape[0], 1, 6), self.body(x)], dim=1)
        x = self.attention(x, x, x, need_weights=False)[0]
        return self.pool(x.transpose(1, 2)).squeeze(-1)


def routes_of(ensemble: ms.Ensemble) -> dict[str, ms.ensemble._plan.Route]:
    return {route.path: route for route in ensemble.plan.routes}


def test_every_layer_has_a_route_and_every_fallback_a_reason():
    ensemble = ms.Ensemble(seeded(WithToken), route="batched")
    routes = routes_of(ensemble)
    assert routes["body.0"].how == "batched matmul" and routes["body.0"].fallback is None
    assert routes["body.1"].how == "elementwise"
    assert routes["pool"].how == "pooling over the members' channels"
    assert routes[""].fallback == "no batched kernel for WithToken"  # its own token
    assert "reading token" in routes[""].how
    assert routes["body.2"].fallback == "no batched kernel for Scaled"
    assert "bias_k" in routes["attention"].fallback
    assert "attention.out_proj" not in routes  # computed by the attention layer itself
    assert {r.path for r in ensemble.plan.fallbacks} == {"", "body.2", "attention"}
    assert "3 of" in ensemble.plan.summary and "fall back" in ensemble.plan.summary
    x = torch.randn(4, 3, 6)
    expected = torch.stack([m(x) for m in seeded(WithToken)])
    torch.testing.assert_close(ensemble(x), expected, atol=1e-5, rtol=1e-5)


def test_parametrized_and_hook_computed_weights_fall_back_with_the_reason():
    def model() -> nn.Module:
        return nn.Sequential(
            parametrizations.weight_norm(nn.Linear(3, 4)),
            nn.utils.spectral_norm(nn.Linear(4, 4)),  # legacy: a hook sets .weight
            nn.Linear(4, 2),
        )

    ensemble = ms.Ensemble(seeded(model), route="batched")
    routes = routes_of(ensemble)
    assert "parametrize" in routes["0"].fallback
    assert "hook" in routes["1"].fallback
    assert routes["2"].fallback is None
    assert "parametrizations" not in " ".join(routes)  # inside the parametrized layer


def test_the_summary_says_which_path_runs():
    mlp = lambda: nn.Sequential(nn.Linear(3, 4), nn.ReLU(), nn.Linear(4, 1))  # noqa: E731
    assert "without vmap" in ms.Ensemble(seeded(mlp), route="batched").plan.summary
    assert "fast=False" in ms.Ensemble(seeded(mlp), fast=False, route="batched").plan.summary
    reference = ms.Ensemble(seeded(mlp), fast=False, route="batched").plan
    linears = [route for route in reference.routes if "weight" in route.how]
    assert len(linears) == 2 and all(route.fallback is not None for route in linears)
    tree = ms.Ensemble(seeded(WithToken), route="batched").plan.summary
    assert "under torch.vmap" in tree


def test_repr_shows_the_members_and_the_plan():
    text = repr(ms.Ensemble(seeded(WithToken, 3), route="batched"))
    assert text.startswith("Ensemble(\n  members=3, parameters=")
    assert re.search(
        r"body\.0 +Linear\(in_features=6, out_features=6, bias=True\)  -> batched matmul", text
    )
    assert re.search(
        r"body\.2 +Scaled\(\)  -> its own code under vmap, reading scale: no batched kernel", text
    )


class OwnAttention(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.qkv = nn.Linear(8, 24)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        q, k, v = self.qkv(x).view(x.shape[0], x.shape[1], 3, 2, 4).permute(2, 0, 3, 1, 4)
        return F.scaled_dot_product_attention(q, k, v).transpose(1, 2).flatten(2)


class Blocks(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.first = OwnAttention()
        self.second = OwnAttention()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.second(self.first(x))


def test_folded_attention_is_noted_with_the_layers_that_call_it():
    ensemble = ms.Ensemble(seeded(Blocks), route="batched")
    assert ensemble.plan.notes == []  # seen on the first call
    x = torch.randn(2, 5, 8)
    expected = torch.stack([m(x) for m in seeded(Blocks)])
    for _ in range(3):  # watched, then only inside the layers seen calling it
        torch.testing.assert_close(ensemble(x), expected, atol=1e-5, rtol=1e-5)
    (note,) = ensemble.plan.notes
    assert "folded" in note and "'first'" in note and "'second'" in note


class ScaledLinear(nn.Linear):
    """A subclass of a layer with a kernel: its forward may compute something else."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return super().forward(x) * 2


def test_a_subclass_of_a_kernel_layer_runs_its_own_forward_and_says_why():
    ensemble = ms.Ensemble(
        seeded(lambda: nn.Sequential(ScaledLinear(3, 2), nn.Tanh())), route="batched"
    )
    (fallback,) = ensemble.plan.fallbacks
    assert "ScaledLinear" in fallback.fallback and "a subclass of nn.Linear" in fallback.fallback
    x = torch.randn(4, 3)
    expected = torch.stack(
        [m(x) for m in seeded(lambda: nn.Sequential(ScaledLinear(3, 2), nn.Tanh()))]
    )
    torch.testing.assert_close(ensemble(x), expected)
