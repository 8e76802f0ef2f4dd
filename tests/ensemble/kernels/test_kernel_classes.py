"""Which class takes which kernel (``_kernels.kernel_class``): torch's layers their own, and a
subclass its base's when it keeps every method the base's ``forward`` runs; one that overrides
any of them runs its own code under vmap, and the plan names what it overrides."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

import modstate as ms

from loop_reference import assert_like_the_loop


class TaggedLinear(nn.Linear):
    """Only adds attributes: computes what ``nn.Linear`` computes."""

    def __init__(self, *args, tag: str = "head", **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.tag = tag


class TaggedConv(nn.Conv2d):
    kind = "stem"


class TaggedBatchNorm(nn.BatchNorm2d):
    kind = "norm"


class TaggedPool(nn.MaxPool2d):
    kind = "pool"


class Residual(nn.Module):
    """Not a Sequential: the members' forward runs under vmap, each layer as its kernel."""

    def __init__(self) -> None:
        super().__init__()
        self.conv = TaggedConv(3, 4, 3, padding=1)
        self.norm = TaggedBatchNorm(4)
        self.pool = TaggedPool(2)
        self.head = TaggedLinear(4 * 4 * 4, 3, tag="out")

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.pool(F.relu(self.norm(self.conv(x)) + self.conv(x)))
        return self.head(h.flatten(1))


def test_subclasses_that_keep_the_forward_take_their_bases_kernels_and_equal_the_loop():
    ensemble = assert_like_the_loop(Residual, lambda: (torch.randn(5, 3, 8, 8),))
    assert ensemble.plan.fallbacks == []
    routes = {route.path: route.how for route in ensemble.plan.routes}
    assert routes["conv"] == "grouped convolution (nn.Conv2d's kernel: TaggedConv keeps " + (
        "nn.Conv2d's forward)"
    )
    assert routes["norm"].startswith("batch norm over the members' channels")
    assert "nn.BatchNorm2d's kernel" in routes["norm"]
    assert "nn.MaxPool2d's kernel" in routes["pool"]
    assert "nn.Linear's kernel: TaggedLinear keeps" in routes["head"]


def test_a_sequential_of_them_runs_as_a_chain():
    def model() -> nn.Module:
        return nn.Sequential(TaggedLinear(4, 8), nn.ReLU(), TaggedLinear(8, 2))

    ensemble = assert_like_the_loop(model, lambda: (torch.randn(6, 4),))
    assert "without vmap" in ensemble.plan.summary


class OwnConvForward(nn.Conv2d):
    """Keeps ``forward`` but overrides the ``_conv_forward`` it runs."""

    def _conv_forward(self, x, weight, bias):
        return super()._conv_forward(x, weight.flip(-1), bias)


class Mixin:
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return nn.Linear.forward(self, x) + 1  # type: ignore[arg-type]


class MixedLinear(Mixin, nn.Linear):
    """Its forward comes from the mixin, before nn.Linear in the MRO."""


def test_a_subclass_that_overrides_what_forward_runs_falls_back_and_names_it():
    def model() -> nn.Module:
        return nn.Sequential(OwnConvForward(2, 2, 3), nn.Flatten(), MixedLinear(2, 2))

    ensemble = assert_like_the_loop(model, lambda: (torch.randn(3, 2, 3, 3),))
    reasons = {route.path: route.fallback for route in ensemble.plan.fallbacks}
    assert set(reasons) == {"0", "2"}
    assert "a subclass of nn.Conv2d with its own _conv_forward" in reasons["0"]
    assert "a subclass of nn.Linear with its own forward" in reasons["2"]


def test_a_parametrized_subclass_still_falls_back_as_parametrized():
    def model() -> nn.Module:
        return nn.Sequential(nn.utils.parametrizations.weight_norm(TaggedLinear(3, 2)))

    ensemble = ms.Ensemble([model() for _ in range(2)], route="batched")
    (route,) = ensemble.plan.fallbacks
    assert "parametrize" in route.fallback
