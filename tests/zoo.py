"""The module zoo shared by the tests: every kind of module anatomy modstate must handle.

Each entry builds a fresh, seeded module and an input for it. ``module_trees`` is a hypothesis
strategy for random module trees (depth, widths, buffers, ties).
"""

from __future__ import annotations

import copy
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from hypothesis import strategies as st
from torch import nn
from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper
from torch.nn.utils import parametrize

import modstate as ms


@dataclass(frozen=True)
class Case:
    name: str
    build: Callable[[], nn.Module]
    input: Callable[[], Any]

    def make(self, seed: int = 0) -> nn.Module:
        torch.manual_seed(seed)
        return self.build().eval()


class Symmetric(nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x.triu() + x.triu(1).transpose(-1, -2)


class GuardedAttributes(nn.Module):
    """Overrides ``__setattr__`` (and refuses plain tensors there), as some libraries do."""

    def __init__(self) -> None:
        super().__init__()
        self.linear = nn.Linear(3, 3)
        self.scale = nn.Parameter(torch.ones(3))

    def __setattr__(self, name: str, value: Any) -> None:
        if isinstance(value, torch.Tensor) and not isinstance(value, nn.Parameter):
            raise AttributeError(f"{name}: only parameters may be set on this module")
        super().__setattr__(name, value)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.linear(x) * self.scale


class WithExtraState(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.linear = nn.Linear(3, 3)
        self.calls = 0
        self.register_buffer("offset", torch.zeros(3))
        self.register_buffer("scratch", torch.zeros(3), persistent=False)

    def get_extra_state(self) -> dict:
        return {"calls": self.calls, "note": "opaque"}

    def set_extra_state(self, state: dict) -> None:
        self.calls = state["calls"]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.linear(x) + self.offset


class TiedLM(nn.Module):
    """An embedding tied to the output head, the classic tie."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(10, 4)
        self.body = nn.Linear(4, 4)
        self.head = nn.Linear(4, 10, bias=False)
        self.head.weight = self.embed.weight

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        return self.head(torch.tanh(self.body(self.embed(tokens))))


class SharedBlock(nn.Module):
    """One submodule reachable at two paths."""

    def __init__(self) -> None:
        super().__init__()
        self.block = nn.Linear(3, 3)
        self.again = self.block
        self.out = nn.Linear(3, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.out(self.again(self.block(x)))


class Counter(nn.Module):
    """Reassigns a buffer in forward, instead of updating it in place."""

    def __init__(self) -> None:
        super().__init__()
        self.linear = nn.Linear(3, 3)
        self.register_buffer("count", torch.zeros((), dtype=torch.long))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.count = self.count + 1
        return self.linear(x)


def _parametrized() -> nn.Module:
    layer = nn.Linear(3, 3)
    parametrize.register_parametrization(layer, "weight", Symmetric())
    return nn.Sequential(layer, nn.Tanh(), nn.Linear(3, 2))


def _small_transformer() -> nn.Module:
    return nn.Transformer(
        d_model=8,
        nhead=2,
        num_encoder_layers=1,
        num_decoder_layers=1,
        dim_feedforward=16,
        dropout=0.0,
        batch_first=True,
    )


class TransformerCall(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.model = _small_transformer()

    def forward(self, src: torch.Tensor) -> torch.Tensor:
        return self.model(src, src[:, :3])


def _x3() -> torch.Tensor:
    return torch.randn(5, 3)


CASES = [
    Case(
        "mlp_batchnorm",
        lambda: nn.Sequential(nn.Linear(3, 4), nn.ReLU(), nn.BatchNorm1d(4), nn.Linear(4, 2)),
        _x3,
    ),
    Case("setattr_override", GuardedAttributes, _x3),
    Case("parametrize", _parametrized, _x3),
    Case(
        "weight_norm",
        lambda: nn.Sequential(nn.utils.parametrizations.weight_norm(nn.Linear(3, 4)), nn.ReLU()),
        _x3,
    ),
    Case("spectral_norm_legacy", lambda: nn.utils.spectral_norm(nn.Linear(3, 4)), _x3),
    Case(
        "checkpoint_wrapper",
        lambda: nn.Sequential(checkpoint_wrapper(nn.Linear(3, 4)), nn.ReLU(), nn.Linear(4, 2)),
        _x3,
    ),
    Case("extra_state", WithExtraState, _x3),
    Case("transformer", TransformerCall, lambda: torch.randn(2, 5, 8)),
    Case("tied_embedding", TiedLM, lambda: torch.randint(0, 10, (2, 6))),
    Case("shared_submodule", SharedBlock, _x3),
    Case(
        "conv_batchnorm",
        lambda: nn.Sequential(nn.Conv2d(2, 3, 3), nn.BatchNorm2d(3), nn.ReLU(), nn.Flatten()),
        lambda: torch.randn(2, 2, 5, 5),
    ),
]
CASE_IDS = [case.name for case in CASES]


# -- random module trees ---------------------------------------------------------------------------


class Node(nn.Module):
    """A random module: a few linear layers, optional buffers, children, and ties to earlier
    layers."""

    def __init__(self, width: int, spec: dict, pool: list[nn.Linear]) -> None:
        super().__init__()
        self.layers = nn.ModuleList()
        for i in range(spec["layers"]):
            if spec["tie"] and pool and i == 0:
                layer = nn.Linear(width, width, bias=spec["bias"])
                layer.weight = pool[0].weight
            else:
                layer = nn.Linear(width, width, bias=spec["bias"])
            pool.append(layer)
            self.layers.append(layer)
        if spec["buffer"]:
            self.register_buffer("shift", torch.randn(width))
        if spec["stateless_child"]:
            self.act = nn.Tanh()
        self.children_ = nn.ModuleList(Node(width, child, pool) for child in spec["children"])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            x = torch.tanh(layer(x))
        if hasattr(self, "shift"):
            x = x + self.shift
        for child in self.children_:
            x = child(x)
        return x


def _node_specs(depth: int) -> st.SearchStrategy[dict]:
    children = st.just([]) if depth == 0 else st.lists(_node_specs(depth - 1), max_size=2)
    return st.fixed_dictionaries(
        {
            "layers": st.integers(0, 2),
            "bias": st.booleans(),
            "buffer": st.booleans(),
            "tie": st.booleans(),
            "stateless_child": st.booleans(),
            "children": children,
        }
    )


@st.composite
def module_trees(draw: st.DrawFn) -> tuple[Callable[[], nn.Module], int]:
    """A factory for a random module tree (seeded: each call builds the same weights) and its width."""
    width = draw(st.integers(1, 4))
    spec = draw(_node_specs(2))

    def build(seed: int = 0) -> nn.Module:
        torch.manual_seed(seed)
        return Node(width, spec, [])

    return build, width


# -- a reference that shares no code with modstate's swaps -----------------------------------------


def forward_with(module: nn.Module, tree: Any, *args: Any) -> Any:
    """``module``'s own forward on ``args`` with ``tree``'s values, loaded by ``load_state_dict``
    into a deep copy: the reference for ``inject`` and ``call``, which share their swap code, so
    that comparing them with each other could not catch a bug in it. ``tree`` gives every path
    but the second path of a tie (a shared submodule), as ``extract`` does."""
    reference = copy.deepcopy(module)
    flat = ms.flatten(tree)
    result = reference.load_state_dict(flat, strict=False)
    slots = reference.state_dict(keep_vars=True)
    loaded = {id(slots[path]) for path in flat}
    assert not result.unexpected_keys, result.unexpected_keys
    assert all(id(slots[path]) in loaded for path in result.missing_keys), result.missing_keys
    return reference(*args)


# -- checking that a module was left exactly as it was ---------------------------------------------


def snapshot(module: nn.Module) -> dict[str, tuple]:
    """Every slot of ``module``: which object, its ``requires_grad``, a copy of its value; and the
    class and tensor attributes of every submodule."""
    state: dict[str, tuple] = {}
    for prefix, owner in module.named_modules(remove_duplicate=False):
        state[f"{prefix}#class"] = (type(owner),)
        for kind in ("_parameters", "_buffers"):
            for name, tensor in getattr(owner, kind).items():
                value = None
                if tensor is not None and not torch.nn.parameter.is_lazy(tensor):
                    value = tensor.detach().clone()
                state[f"{prefix}.{name}"] = (
                    id(tensor),
                    getattr(tensor, "requires_grad", None),
                    value,
                )
        for name, attr in vars(owner).items():
            if isinstance(attr, torch.Tensor):
                state[f"{prefix}@{name}"] = (id(attr),)
    return state


def assert_unchanged(module: nn.Module, before: dict[str, tuple]) -> None:
    after = snapshot(module)
    assert after.keys() == before.keys()
    for key, (first, *rest) in before.items():
        now_first, *now_rest = after[key]
        assert now_first == first, f"{key}: another object"
        if rest:
            assert now_rest[0] == rest[0], f"{key}: requires_grad changed"
            if rest[1] is not None:
                assert torch.equal(now_rest[1], rest[1]), f"{key}: value changed"
