"""The functional-call layer beside its peers, on the networks tensordict benchmarks them with
(``benchmarks/nn/functional_benchmarks_test.py`` there): test names follow theirs.

Each test is one case timed with the ``compare`` fixture: every implementation warmed up, then
timed in interleaved rounds. An impl starting with ``baseline`` is the plain forward, which the
report subtracts to compare overheads. tensordict entries are left out (and listed by the report)
when tensordict is not installed.
"""

from __future__ import annotations

import warnings
from collections.abc import Callable
from typing import Any

import pytest
import torch
from torch import nn
from torch.func import functional_call
from torch.nn.utils.stateless import _reparametrize_module

import modstate as ms
from _timing import optional

warnings.filterwarnings("ignore", message="enable_nested_tensor is True")

EXEC = "call overhead: Sequential(Linear(2,2)x3, Sequential(Linear(2,2)x3))"
INJECT_OWN = "empty inject: nn.Transformer(), its own tensors (184 leaves)"
INJECT_COPIES = "empty inject: nn.Transformer(), detached copies (184 leaves)"
EXTRACT = "extract: nn.Transformer()"
EXTRACT_SD = "extract(use_state_dict=True): nn.Transformer()"

tensordict = optional("tensordict")
MISSING = () if tensordict else ("tensordict",)


def make_net() -> nn.Module:
    return nn.Sequential(
        nn.Linear(2, 2),
        nn.Linear(2, 2),
        nn.Linear(2, 2),
        nn.Sequential(nn.Linear(2, 2), nn.Linear(2, 2), nn.Linear(2, 2)),
    )


@pytest.fixture(scope="module")
def transformer() -> nn.Module:
    return nn.Transformer()


def test_exec(compare):
    """A stateless call on a small network: the overhead each library adds to the forward."""
    net, x = make_net(), torch.randn(2, 2)
    tree = ms.extract(net, detach=True)
    params = {k: v.detach() for k, v in net.state_dict().items()}
    impls: dict[str, Callable[[], Any]] = {
        "baseline: plain forward": lambda: net(x),
        "modstate": lambda: ms.call(net, tree, x),
        "torch.func.functional_call": lambda: functional_call(net, params, (x,)),
    }
    if tensordict:
        td_params = tensordict.TensorDict.from_module(net).detach()

        def td_call():
            with td_params.to_module(net):
                return net(x)

        impls["tensordict"] = td_call
    expected = net(x)
    for fn in impls.values():
        torch.testing.assert_close(fn(), expected)
    compare(EXEC, impls, missing=MISSING)


def _own(module):
    return {**dict(module.named_parameters()), **dict(module.named_buffers())}


def _copies(module):
    return {k: v.detach().clone() for k, v in _own(module).items()}


@pytest.mark.parametrize("tensors", ["own", "copies"])
def test_inject_speed(compare, transformer, tensors):
    """Entering and leaving an injection, with nothing computed inside."""
    flat = _own(transformer) if tensors == "own" else _copies(transformer)
    tree = ms.unflatten(flat)

    def modstate_inject():
        with ms.inject(transformer, tree):
            pass

    def torch_reparametrize():
        with _reparametrize_module(transformer, flat):
            pass

    impls: dict[str, Callable[[], Any]] = {
        "modstate": modstate_inject,
        "torch _reparametrize_module": torch_reparametrize,
    }
    if tensordict:
        if tensors == "own":
            td_params = tensordict.TensorDict.from_module(transformer)
        else:
            td_params = tensordict.TensorDict.from_module(transformer).data.detach().clone()
            warnings.filterwarnings("ignore", category=FutureWarning)

        def td_inject():
            with td_params.to_module(transformer):
                pass

        impls["tensordict"] = td_inject
    compare(INJECT_OWN if tensors == "own" else INJECT_COPIES, impls, missing=MISSING)


def test_extract(compare, transformer):
    impls: dict[str, Callable[[], Any]] = {"modstate": lambda: ms.extract(transformer)}
    if tensordict:
        impls["tensordict"] = lambda: tensordict.TensorDict.from_module(transformer)
    compare(EXTRACT, impls, missing=MISSING)


def test_extract_state_dict(compare, transformer):
    assert ms.flatten(ms.extract(transformer, use_state_dict=True)).keys() == (
        transformer.state_dict().keys()
    )
    compare(
        EXTRACT_SD,
        {
            "modstate": lambda: ms.extract(transformer, use_state_dict=True),
            "torch state_dict(keep_vars=True)": lambda: transformer.state_dict(keep_vars=True),
        },
    )
