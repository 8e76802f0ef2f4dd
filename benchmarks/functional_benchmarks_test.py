"""The functional-call layer beside its peers, on the networks tensordict benchmarks them with
(``benchmarks/nn/functional_benchmarks_test.py`` there): test names follow theirs.

Groups pair one ``modstate`` entry with each peer; an entry whose impl starts with ``baseline``
is the plain forward, which the report subtracts to compare overheads.
"""

from __future__ import annotations

import warnings

import pytest
import torch
from torch import nn
from torch.func import functional_call
from torch.nn.utils.stateless import _reparametrize_module

import modstate as ms

warnings.filterwarnings("ignore", message="enable_nested_tensor is True")


def tag(benchmark, group: str, impl: str) -> None:
    benchmark.group = group
    benchmark.extra_info["impl"] = impl


def make_net() -> nn.Module:
    return nn.Sequential(
        nn.Linear(2, 2),
        nn.Linear(2, 2),
        nn.Linear(2, 2),
        nn.Sequential(nn.Linear(2, 2), nn.Linear(2, 2), nn.Linear(2, 2)),
    )


EXEC = "call overhead: Sequential(Linear(2,2)x3, Sequential(Linear(2,2)x3))"
INJECT_OWN = "empty inject: nn.Transformer(), its own tensors (184 leaves)"
INJECT_COPIES = "empty inject: nn.Transformer(), detached copies (184 leaves)"
EXTRACT = "extract: nn.Transformer()"
EXTRACT_SD = "extract(use_state_dict=True): nn.Transformer()"


@pytest.fixture(scope="module")
def transformer() -> nn.Module:
    return nn.Transformer()


# -- a call on a small network ---------------------------------------------------------------------


def test_exec_forward(benchmark):
    net, x = make_net(), torch.randn(2, 2)
    tag(benchmark, EXEC, "baseline: plain forward")
    benchmark(net, x)


def test_exec_modstate(benchmark):
    net, x = make_net(), torch.randn(2, 2)
    tree = ms.extract(net, detach=True)
    tag(benchmark, EXEC, "modstate")
    benchmark(ms.call, net, tree, x)


def test_exec_functional_call(benchmark):
    net, x = make_net(), torch.randn(2, 2)
    params = {k: v.detach() for k, v in net.state_dict().items()}
    tag(benchmark, EXEC, "torch.func.functional_call")
    benchmark(functional_call, net, params, (x,))


def test_exec_td_decorator(benchmark):
    tensordict = pytest.importorskip("tensordict")
    net, x = make_net(), torch.randn(2, 2)
    params = tensordict.TensorDict.from_module(net).detach()

    def run():
        with params.to_module(net):
            return net(x)

    tag(benchmark, EXEC, "tensordict")
    benchmark(run)


# -- entering and leaving an injection -------------------------------------------------------------


def _own(module):
    return {**dict(module.named_parameters()), **dict(module.named_buffers())}


def _copies(module):
    return {k: v.detach().clone() for k, v in _own(module).items()}


@pytest.mark.parametrize("tensors", ["own", "copies"])
def test_inject_speed(benchmark, transformer, tensors):
    tree = ms.extract(transformer) if tensors == "own" else ms.unflatten(_copies(transformer))

    def run():
        with ms.inject(transformer, tree):
            pass

    tag(benchmark, INJECT_OWN if tensors == "own" else INJECT_COPIES, "modstate")
    benchmark(run)


@pytest.mark.parametrize("tensors", ["own", "copies"])
def test_reparametrize_module_speed(benchmark, transformer, tensors):
    flat = _own(transformer) if tensors == "own" else _copies(transformer)

    def run():
        with _reparametrize_module(transformer, flat):
            pass

    tag(benchmark, INJECT_OWN if tensors == "own" else INJECT_COPIES, "torch _reparametrize_module")
    benchmark(run)


def test_to_module_speed(benchmark, transformer):
    tensordict = pytest.importorskip("tensordict")
    params = tensordict.TensorDict.from_module(transformer)

    def run():
        with params.to_module(transformer):
            pass

    tag(benchmark, INJECT_OWN, "tensordict")
    benchmark(run)


def test_to_module_plain_tensor_speed(benchmark, transformer):
    tensordict = pytest.importorskip("tensordict")
    params = tensordict.TensorDict.from_module(transformer).data.detach().clone()
    warnings.filterwarnings("ignore", category=FutureWarning)

    def run():
        with params.to_module(transformer):
            pass

    tag(benchmark, INJECT_COPIES, "tensordict")
    benchmark(run)


# -- extraction ------------------------------------------------------------------------------------


def test_extract_modstate(benchmark, transformer):
    tag(benchmark, EXTRACT, "modstate")
    benchmark(ms.extract, transformer)


def test_from_module_eager(benchmark, transformer):
    tensordict = pytest.importorskip("tensordict")
    tag(benchmark, EXTRACT, "tensordict")
    benchmark(tensordict.TensorDict.from_module, transformer)


def test_extract_state_dict_modstate(benchmark, transformer):
    tag(benchmark, EXTRACT_SD, "modstate")
    benchmark(ms.extract, transformer, use_state_dict=True)


def test_state_dict_keep_vars(benchmark, transformer):
    tag(benchmark, EXTRACT_SD, "torch state_dict(keep_vars=True)")
    benchmark(transformer.state_dict, keep_vars=True)
