"""The functional-call layer beside its peers, on the networks tensordict benchmarks them with
(``benchmarks/nn/functional_benchmarks_test.py`` there): test names follow theirs.

Each test is one case timed with the ``compare`` fixture: every implementation warmed up, then
timed in interleaved rounds. An impl starting with ``baseline`` is the plain forward, which the
report subtracts to compare overheads. tensordict entries are left out (and listed by the report)
when tensordict is not installed.

Before timing, every case checks each implementation: a call's output equals the plain forward's
bit for bit; inside an injection the module holds the very tensors given (the same memory), and
its own again after; an extraction gives the module's own tensors at the same paths.
"""

from __future__ import annotations

import functools
import warnings
from collections.abc import Callable
from typing import Any

import pytest
import torch
from torch import nn
from torch.func import functional_call
from torch.nn.utils.stateless import _reparametrize_module

import modstate as ms
from _timing import assert_same_trees, optional

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
    for impl, fn in impls.items():  # the same Linear ops on the same tensors: bit for bit
        assert_same_trees(expected, fn(), what=f"{EXEC}: {impl}")
    compare(EXEC, impls, missing=MISSING)


def _own(module):
    return {**dict(module.named_parameters()), **dict(module.named_buffers())}


def _copies(module):
    return {k: v.detach().clone() for k, v in _own(module).items()}


def _check_injections(case: str, module: nn.Module, injections: dict[str, tuple]) -> None:
    """Inside each injection the module holds the tensors it was given (the same memory), and
    after it its own again. ``injections``: impl -> (context factory, the flat tensors given)."""
    own = _own(module)
    for impl, (enter, given) in injections.items():
        with enter():
            assert_same_trees(
                given, _own(module), what=f"{case}: {impl}, inside", same_storage=True
            )
        assert_same_trees(own, _own(module), what=f"{case}: {impl}, after", same_storage=True)


@pytest.mark.parametrize("tensors", ["own", "copies"])
def test_inject_speed(compare, transformer, tensors):
    """Entering and leaving an injection, with nothing computed inside.

    ``own``: the tensors injected are the module's own, the case of an injection that changes
    nothing. modstate sees that and swaps nothing (a fast path: what is timed is that check),
    while the peers swap every tensor out and back; ``copies`` is the like-for-like case, where
    every implementation swaps all 184 tensors."""
    flat = _own(transformer) if tensors == "own" else _copies(transformer)
    tree = ms.unflatten(flat)
    injections: dict[str, tuple[Callable[[], Any], dict]] = {
        "modstate": (lambda: ms.inject(transformer, tree), flat),
        "torch _reparametrize_module": (lambda: _reparametrize_module(transformer, flat), flat),
    }
    if tensordict:
        if tensors == "own":
            td_params = tensordict.TensorDict.from_module(transformer)
        else:
            td_params = tensordict.TensorDict.from_module(transformer).data.detach().clone()
            warnings.filterwarnings("ignore", category=FutureWarning)
        given = dict(td_params.flatten_keys(".").items())
        injections["tensordict"] = (lambda: td_params.to_module(transformer), given)
    case = INJECT_OWN if tensors == "own" else INJECT_COPIES
    _check_injections(case, transformer, injections)
    impls = {
        impl: functools.partial(_enter_and_leave, enter) for impl, (enter, _) in injections.items()
    }
    compare(case, impls, missing=MISSING)


def _enter_and_leave(enter: Callable[[], Any]) -> None:
    with enter():
        pass


def test_extract(compare, transformer):
    """Both give the module's own tensors: the same paths, the same memory."""
    impls: dict[str, Callable[[], Any]] = {"modstate": lambda: ms.extract(transformer)}
    if tensordict:
        impls["tensordict"] = lambda: tensordict.TensorDict.from_module(transformer)
    for impl, fn in impls.items():
        assert_same_trees(_own(transformer), fn(), what=f"{EXTRACT}: {impl}", same_storage=True)
    compare(EXTRACT, impls, missing=MISSING)


def test_extract_state_dict(compare, transformer):
    """Both give the module's own tensors at state_dict's keys: the same paths, the same memory."""
    impls: dict[str, Callable[[], Any]] = {
        "modstate": lambda: ms.extract(transformer, use_state_dict=True),
        "torch state_dict(keep_vars=True)": lambda: transformer.state_dict(keep_vars=True),
    }
    expected = impls["torch state_dict(keep_vars=True)"]()
    for impl, fn in impls.items():
        assert_same_trees(expected, fn(), what=f"{EXTRACT_SD}: {impl}", same_storage=True)
    compare(EXTRACT_SD, impls)
