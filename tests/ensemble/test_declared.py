"""Kernels declared for a user's own layer classes (``Ensemble(..., kernels={MyNorm:
nn.LayerNorm})``, ``ensemble/_declared.py``): the declared layers run the torch class's kernel,
the plan says so, the results equal a loop of copies, and a declaration the layers do not fit
is refused before anything is built, naming the layer and a fix that works."""

from __future__ import annotations

import copy
import importlib.util
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import modstate as ms

from loop_reference import assert_like_the_loop, seeded_members


class FastNorm(nn.LayerNorm):
    """Overrides forward, as timm's LayerNorm does, with what nn.LayerNorm computes."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.layer_norm(x, self.normalized_shape, self.weight, self.bias, self.eps)


class OwnBatchNorm(nn.BatchNorm2d):
    """Its own forward, nn.BatchNorm2d's computation (running statistics included)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return super().forward(x)


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.conv = nn.Conv2d(3, 4, 3, padding=1)
        self.bn = OwnBatchNorm(4)
        self.norm = FastNorm(4)
        self.proj = nn.Linear(4, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.bn(self.conv(x)).mean((2, 3))
        return self.proj(self.norm(h) + h)


DECLARED = {FastNorm: nn.LayerNorm, OwnBatchNorm: nn.BatchNorm2d}


def test_declared_layers_run_the_kernel_and_equal_the_loop_in_training_and_eval():
    make_inputs = lambda: (torch.randn(5, 3, 6, 6),)  # noqa: E731
    ensemble = assert_like_the_loop(Block, make_inputs, kernels=DECLARED)
    routes = {route.path: route.how for route in ensemble.plan.routes}
    assert routes["norm"] == (
        "layer norm, per-member affine (nn.LayerNorm's kernel: declared by kernels=)"
    )
    assert "nn.BatchNorm2d's kernel: declared by kernels=" in routes["bn"]
    assert ensemble.plan.fallbacks == []
    # Without the declaration the same layers run their own forward under vmap.
    plain = ms.Ensemble(seeded_members(Block), route="batched")
    assert {route.path for route in plain.plan.fallbacks} == {"bn", "norm"}


def test_the_declared_route_equals_the_vmap_route():
    models = seeded_members(Block)
    fast = ms.Ensemble(copy.deepcopy(models), kernels=DECLARED, route="batched")
    reference = ms.Ensemble(copy.deepcopy(models), fast=False, route="batched")
    x = torch.randn(4, 3, 6, 6)
    for training in (True, False):
        fast.train(training)
        reference.train(training)
        out, want = fast(x), reference(x)
        torch.testing.assert_close(out, want, atol=1e-5, rtol=1e-5)
        out.sum().backward()
        want.sum().backward()
        for (name, a), (_, b) in zip(
            fast.named_parameters(), reference.named_parameters(), strict=True
        ):
            torch.testing.assert_close(a.grad, b.grad, atol=1e-4, rtol=1e-4, msg=name)
            a.grad = b.grad = None
    for (name, a), (_, b) in zip(fast.named_buffers(), reference.named_buffers(), strict=True):
        torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-5, msg=name)


class SubNorm(FastNorm):
    """Keeps FastNorm's forward: takes its declaration."""


def test_from_factory_takes_kernels_and_subclasses_keep_the_declaration():
    def factory() -> nn.Module:
        return nn.Sequential(nn.Linear(3, 4), SubNorm(4), nn.Tanh())

    ensemble = ms.Ensemble.from_factory(
        factory, 3, seeds=[0, 1, 2], kernels={FastNorm: nn.LayerNorm}, route="batched"
    )
    (route,) = [r for r in ensemble.plan.routes if r.path == "1"]
    assert route.how.endswith("(nn.LayerNorm's kernel: declared by kernels= for FastNorm)")
    assert "without vmap" in ensemble.plan.summary
    x = torch.randn(5, 3)
    expected = torch.stack([m(x) for m in ensemble.members()])
    torch.testing.assert_close(ensemble(x), expected, atol=1e-5, rtol=1e-5)


def test_the_fallback_names_the_declaration_and_the_declaration_batches_it():
    ensemble = ms.Ensemble(seeded_members(Block), route="batched")
    reason = next(r.fallback for r in ensemble.plan.fallbacks if r.path == "norm")
    assert "kernels={FastNorm: nn.LayerNorm}" in reason
    fixed = assert_like_the_loop(
        Block, lambda: (torch.randn(2, 3, 6, 6),), kernels={FastNorm: nn.LayerNorm}
    )
    assert "norm" not in {r.path for r in fixed.plan.fallbacks}


class Patches(nn.Module):
    """Holds a 4-D weight: not a Linear, whatever it is declared as."""

    def __init__(self) -> None:
        super().__init__()
        self.in_features, self.out_features = 3, 4
        self.weight = nn.Parameter(torch.randn(4, 3, 1, 1))
        self.bias = nn.Parameter(torch.zeros(4))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.conv2d(x, self.weight, self.bias)


class NoSettings(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.randn(4, 3))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x @ self.weight.T


def model_with(layer: type[nn.Module]) -> nn.Module:
    return nn.Sequential(nn.Identity(), nn.Sequential(layer()))


@pytest.mark.parametrize(
    ("layer", "found"),
    [
        (Patches, "its weight has shape (4, 3, 1, 1) where nn.Linear built from its settings"),
        (NoSettings, "it has no in_features, out_features"),
    ],
)
def test_a_layer_that_does_not_fit_the_declared_kernel_is_refused_with_a_fix(layer, found):
    models = seeded_members(lambda: model_with(layer))
    before = [copy.deepcopy(m.state_dict()) for m in models]
    with pytest.raises(ValueError) as caught:
        ms.Ensemble(models, kernels={layer: nn.Linear}, route="batched")
    message = str(caught.value)
    assert f"layer '1.0' ({layer.__name__})" in message and found in message
    assert f"leave {layer.__name__} out of kernels" in message
    for model, state in zip(models, before, strict=True):  # nothing was changed
        for name, tensor in model.state_dict().items():
            assert torch.equal(tensor, state[name])
    with pytest.raises(ValueError, match="layer '1.0'"):
        ms.Ensemble.from_factory(
            lambda: model_with(layer), 2, kernels={layer: nn.Linear}, route="batched"
        )
    # The fix: leave it out of kernels; it runs its own forward under vmap.
    fixed = assert_like_the_loop(lambda: model_with(layer), lambda: (torch.randn(2, 3, 5, 5),)
                                 if layer is Patches else (torch.randn(2, 3),))  # fmt: skip
    assert [r.path for r in fixed.plan.fallbacks] == ["1.0"]


@pytest.mark.parametrize(
    ("kernels", "error", "words"),
    [
        ([(FastNorm, nn.LayerNorm)], TypeError, "kernels is a list; give a dict"),
        ({"FastNorm": nn.LayerNorm}, TypeError, "the key 'FastNorm', which is not a layer class"),
        ({FastNorm: "layer_norm"}, ValueError, "'layer_norm' has no batched kernel"),
        ({FastNorm: nn.ReLU}, ValueError, "nn.ReLU has no batched kernel"),
        ({FastNorm: nn.MultiheadAttention}, ValueError, "give one of nn.AdaptiveAvgPool1d"),
        ({nn.Linear: nn.Linear}, ValueError, "nn.Linear is torch's own layer"),
    ],
)
def test_a_bad_declaration_is_refused_naming_the_entry(kernels, error, words):
    with pytest.raises(error, match=words.replace("(", r"\(").replace(")", r"\)")):
        ms.Ensemble(seeded_members(Block), kernels=kernels, route="batched")
    with pytest.raises(error, match="Ensemble.from_factory"):
        ms.Ensemble.from_factory(Block, 2, kernels=kernels, route="batched")


def _timm():
    """timm, importable as a user imports it (with the ecosystem tests' stand-in for
    torchvision's missing operators where that is needed, and not defined twice)."""
    if not hasattr(torch.ops.torchvision, "nms"):
        path = Path(__file__).parents[1] / "ecosystem" / "conftest.py"
        spec = importlib.util.spec_from_file_location("ecosystem_stand_in", path)
        assert spec is not None and spec.loader is not None
        spec.loader.exec_module(importlib.util.module_from_spec(spec))
    return pytest.importorskip("timm")


def test_a_timm_user_declares_timms_layer_norm_and_vit_batches_every_norm():
    timm = _timm()

    def vit() -> nn.Module:
        return timm.create_model(
            "vit_tiny_patch16_224", img_size=32, patch_size=8, embed_dim=32, depth=2,
            num_heads=2, num_classes=5,
        )  # fmt: skip

    # timm's LayerNorm overrides forward (a fast-norm switch); with timm's default, fast norm
    # off, it computes what nn.LayerNorm computes: the user says so.
    assert not timm.layers.is_fast_norm()
    plain = ms.Ensemble(seeded_members(vit, 2), route="batched")
    assert any("timm.layers.norm.LayerNorm" in r.fallback for r in plain.plan.fallbacks)
    ensemble = assert_like_the_loop(
        vit, lambda: (torch.randn(2, 3, 32, 32),), count=2,
        kernels={timm.layers.LayerNorm: nn.LayerNorm}, atol=1e-4, rtol=1e-4,
    )  # fmt: skip
    # Left: the model itself, which reads its class token and position embedding.
    assert [r.path for r in ensemble.plan.fallbacks] == [""]


def test_a_copy_of_the_ensemble_keeps_its_declarations():
    ensemble = ms.Ensemble(seeded_members(Block), kernels=DECLARED, route="batched")
    twin = copy.deepcopy(ensemble)
    assert twin.plan.fallbacks == []
    x = torch.randn(3, 3, 6, 6)
    torch.testing.assert_close(twin(x), ensemble(x))
