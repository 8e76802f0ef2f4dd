"""The architectures of the ensemble benchmarks, and hand-written batched forms of two of them.

A hand-written batched form runs the same math as N copies of the model on the stacked weights,
written by hand for that one model: batched matmuls, attention with the members folded into its
batch, grouped convolutions, one ``batch_norm`` over the members' channels side by side. It is
the limit an ensemble library can reach, as the ``baddbmm`` chain is for MLPs.

The zoo models (torchvision ResNet, Hugging Face GPT-2) are built as ``tests/ecosystem`` builds
them, from tiny configurations with random weights.
"""

from __future__ import annotations

import importlib.util
import sys
from collections.abc import Callable
from pathlib import Path
from types import ModuleType

import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torch.func import stack_module_state

ECOSYSTEM = Path(__file__).resolve().parent.parent / "tests" / "ecosystem"

# -- an 8-member transformer encoder ---------------------------------------------------------------

D_MODEL, HEADS, FEED_FORWARD, LAYERS = 64, 4, 128, 2


def encoder() -> nn.Module:
    """2 post-norm layers, d=64, 4 heads, feed-forward 128, ReLU, no dropout, batch first."""
    layer = nn.TransformerEncoderLayer(D_MODEL, HEADS, FEED_FORWARD, dropout=0.0, batch_first=True)
    return nn.TransformerEncoder(layer, LAYERS, enable_nested_tensor=False)


def hand_batched_encoder(
    models: list[nn.Module],
) -> tuple[Callable[[Tensor], Tensor], list[Tensor]]:
    """The encoder's math on the stacked weights, for a shared input ``(batch, tokens, d)``."""
    params, _ = stack_module_state(models)
    count, heads, head = len(models), HEADS, D_MODEL // HEADS

    def linear(h: Tensor, name: str) -> Tensor:
        return torch.baddbmm(params[f"{name}.bias"].unsqueeze(1), h, params[f"{name}.weight"].mT)

    def norm(h: Tensor, name: str) -> Tensor:
        out = F.layer_norm(h, (D_MODEL,))
        return torch.addcmul(
            params[f"{name}.bias"].unsqueeze(1), out, params[f"{name}.weight"].unsqueeze(1)
        )

    def run(x: Tensor) -> Tensor:
        batch, tokens, _ = x.shape
        h = x.reshape(-1, D_MODEL).expand(count, -1, -1)
        for i in range(LAYERS):
            layer = f"layers.{i}"
            qkv = torch.baddbmm(
                params[f"{layer}.self_attn.in_proj_bias"].unsqueeze(1),
                h,
                params[f"{layer}.self_attn.in_proj_weight"].mT,
            )
            q, k, v = (
                t.reshape(count * batch, tokens, heads, head).transpose(1, 2)
                for t in qkv.chunk(3, dim=-1)
            )
            attended = F.scaled_dot_product_attention(q, k, v)
            attended = attended.transpose(1, 2).reshape(count, batch * tokens, D_MODEL)
            h = norm(h + linear(attended, f"{layer}.self_attn.out_proj"), f"{layer}.norm1")
            feed = linear(torch.relu(linear(h, f"{layer}.linear1")), f"{layer}.linear2")
            h = norm(h + feed, f"{layer}.norm2")
        return h.view(count, batch, tokens, D_MODEL)

    return run, list(params.values())


# -- an 8-member small ResNet ----------------------------------------------------------------------


class BasicBlock(nn.Module):
    def __init__(self, channels: int) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(channels, channels, 3, padding=1, bias=False)
        self.bn1 = nn.BatchNorm2d(channels)
        self.conv2 = nn.Conv2d(channels, channels, 3, padding=1, bias=False)
        self.bn2 = nn.BatchNorm2d(channels)

    def forward(self, x: Tensor) -> Tensor:
        out = torch.relu(self.bn1(self.conv1(x)))
        return torch.relu(x + self.bn2(self.conv2(out)))


class SmallResNet(nn.Module):
    """A stem (3x3 convolution, BatchNorm2d, ReLU), two basic blocks, global pooling, a head."""

    def __init__(self, channels: int = 16, classes: int = 10) -> None:
        super().__init__()
        self.stem = nn.Sequential(
            nn.Conv2d(3, channels, 3, padding=1, bias=False), nn.BatchNorm2d(channels), nn.ReLU()
        )
        self.blocks = nn.Sequential(BasicBlock(channels), BasicBlock(channels))
        self.head = nn.Linear(channels, classes)

    def forward(self, x: Tensor) -> Tensor:
        return self.head(self.blocks(self.stem(x)).mean(dim=(-2, -1)))


def hand_batched_resnet(
    models: list[nn.Module],
) -> tuple[Callable[[Tensor], Tensor], list[Tensor]]:
    """The small ResNet's math on the stacked weights, in training mode (batch statistics, the
    stacked running statistics updated), for a shared input ``(batch, 3, h, w)``: the members'
    channels side by side, grouped convolutions, one ``batch_norm`` over them."""
    params, buffers = stack_module_state(models)
    count = len(models)

    def batch_norm(x: Tensor, name: str) -> Tensor:
        return F.batch_norm(
            x,
            buffers[f"{name}.running_mean"].view(-1),
            buffers[f"{name}.running_var"].view(-1),
            params[f"{name}.weight"].flatten(),
            params[f"{name}.bias"].flatten(),
            True,
            0.1,
            1e-5,
        )

    def conv(x: Tensor, name: str, groups: int) -> Tensor:
        return F.conv2d(x, params[f"{name}.weight"].flatten(0, 1), padding=1, groups=groups)

    def run(x: Tensor) -> Tensor:
        h = torch.relu(batch_norm(conv(x, "stem.0", 1), "stem.1"))  # filters side by side
        for i in range(2):
            block = f"blocks.{i}"
            out = torch.relu(batch_norm(conv(h, f"{block}.conv1", count), f"{block}.bn1"))
            h = torch.relu(h + batch_norm(conv(out, f"{block}.conv2", count), f"{block}.bn2"))
        pooled = h.mean(dim=(-2, -1)).view(x.shape[0], count, -1).transpose(0, 1)
        return torch.baddbmm(params["head.bias"].unsqueeze(1), pooled, params["head.weight"].mT)

    return run, list(params.values())


# -- the zoo ---------------------------------------------------------------------------------------


def zoo() -> ModuleType:
    """``tests/ecosystem/models.py``, after the test-only stand-in for torchvision's missing
    C++ operator schemas (see ``tests/ecosystem/conftest.py``) where that extension cannot load."""
    if "_ensemble_zoo_models" in sys.modules:
        return sys.modules["_ensemble_zoo_models"]
    stand_in = _load("_ensemble_zoo_stand_in", ECOSYSTEM / "conftest.py")
    del stand_in  # defining the schemas is all it does
    return _load("_ensemble_zoo_models", ECOSYSTEM / "models.py")


def _load(name: str, path: Path) -> ModuleType:
    spec = importlib.util.spec_from_file_location(name, path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    spec.loader.exec_module(module)
    return module
