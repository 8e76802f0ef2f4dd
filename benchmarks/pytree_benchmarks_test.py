"""Pytree vs container: ``modstate.tree`` against ``torch.utils._pytree.tree_map`` and TensorDict.

The cases and test names follow tensordict's own ``benchmarks/common/pytree_benchmarks_test.py``
(reshape to one batch dim, view, unbind(0), split(sections, 0), add 1), on two trees:

- ``small``: ``{"a": {"b": randn(3,4,1), "c": {"d": rand(3,4,5,6)}}, "c": rand(3,4,1)}``, batch
  ``[3, 4]``;
- ``large``: four ``nn.Transformer(d_model=64, nhead=4, num_encoder_layers=2,
  num_decoder_layers=2, dim_feedforward=64)`` parameter trees stacked leaf by leaf and reshaped
  to batch ``[2, 2]`` (64 leaves, 2.2 MB).

Each test's group is ``"<op> (<tree>)"``; ``extra_info["impl"]`` names the implementation.

The suite runs torch on one thread. Every implementation runs the same tensor ops, so this does
not change what is compared; but on a shared machine an op that splits a large leaf across
OpenMP threads waits for a busy core, and those millisecond stalls swamp microsecond figures.
"""

from __future__ import annotations

import pytest
import torch
from torch import nn
from torch.utils._pytree import tree_map

import modstate as ms
import modstate.tree

TREES = ["small", "large"]
# (batch size after merging the two batch dims, split sections along dim 0) per tree
MERGED = {"small": 12, "large": 4}
SECTIONS = {"small": [1, 2], "large": [1, 1]}
# a leaf the tests check their outputs at
PROBE = {"small": ("c",), "large": ("encoder", "norm", "weight")}


def _small_tree() -> dict:
    torch.manual_seed(0)
    return {
        "a": {"b": torch.randn(3, 4, 1), "c": {"d": torch.rand(3, 4, 5, 6)}},
        "c": torch.rand(3, 4, 1),
    }


def _large_tree() -> dict:
    torch.manual_seed(0)
    members = [
        ms.extract(
            nn.Transformer(
                d_model=64,
                nhead=4,
                num_encoder_layers=2,
                num_decoder_layers=2,
                dim_feedforward=64,
            ),
            detach=True,
        )
        for _ in range(4)
    ]
    return tree_map(lambda *leaves: torch.stack(leaves).reshape(2, 2, *leaves[0].shape), *members)


@pytest.fixture(scope="module", autouse=True)
def one_thread():
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture(scope="module", params=TREES)
def case(request: pytest.FixtureRequest) -> tuple[str, dict]:
    name = request.param
    return name, _small_tree() if name == "small" else _large_tree()


def _at(tree, name):
    """The probe leaf of a tree or TensorDict."""
    for key in PROBE[name]:
        tree = tree[key]
    return tree


def _tag(benchmark, op: str, tree_name: str, impl: str) -> None:
    benchmark.group = f"{op} ({tree_name})"
    benchmark.extra_info["impl"] = impl


@pytest.fixture
def nested_td(case):
    tensordict = pytest.importorskip("tensordict")
    name, tree = case
    return name, tensordict.TensorDict(tree, batch_size=[2, 2] if name == "large" else [3, 4])


# reshape


def test_reshape_pytree(benchmark, case):
    name, tree = case
    size = MERGED[name]
    _tag(benchmark, "reshape", name, "torch.utils._pytree")
    out = benchmark(tree_map, lambda x: x.reshape(size, *x.shape[2:]), tree)
    assert _at(out, name).shape[0] == size


def test_reshape_td(benchmark, nested_td):
    name, td = nested_td
    _tag(benchmark, "reshape", name, "tensordict")
    out = benchmark(td.reshape, MERGED[name])
    assert out.batch_size == torch.Size([MERGED[name]])


def test_reshape_modstate(benchmark, case):
    name, tree = case
    _tag(benchmark, "reshape", name, "modstate")
    out = benchmark(ms.tree.reshape, tree, MERGED[name], batch_ndim=2)
    assert _at(out, name).shape[0] == MERGED[name]


# view


def test_view_pytree(benchmark, case):
    name, tree = case
    size = MERGED[name]
    _tag(benchmark, "view", name, "torch.utils._pytree")
    out = benchmark(tree_map, lambda x: x.view(size, *x.shape[2:]), tree)
    assert _at(out, name).shape[0] == size


def test_view_td(benchmark, nested_td):
    name, td = nested_td
    _tag(benchmark, "view", name, "tensordict")
    out = benchmark(td.view, MERGED[name])
    assert out.batch_size == torch.Size([MERGED[name]])


def test_view_modstate(benchmark, case):
    name, tree = case
    _tag(benchmark, "view", name, "modstate")
    out = benchmark(ms.tree.view, tree, MERGED[name], batch_ndim=2)
    assert _at(out, name).data_ptr() == _at(tree, name).data_ptr()


# unbind


def test_unbind_pytree(benchmark, case):
    name, tree = case
    _tag(benchmark, "unbind", name, "torch.utils._pytree")
    out = benchmark(tree_map, lambda x: x.unbind(0), tree)
    assert len(_at(out, name)) == _at(tree, name).shape[0]


def test_unbind_td(benchmark, nested_td):
    name, td = nested_td
    _tag(benchmark, "unbind", name, "tensordict")
    out = benchmark(td.unbind, 0)
    assert len(out) == td.batch_size[0]


def test_unbind_modstate(benchmark, case):
    name, tree = case
    _tag(benchmark, "unbind", name, "modstate")
    out = benchmark(ms.tree.unbind, tree, 0)
    assert len(out) == _at(tree, name).shape[0]


# split


def test_split_pytree(benchmark, case):
    name, tree = case
    sections = SECTIONS[name]
    _tag(benchmark, "split", name, "torch.utils._pytree")
    out = benchmark(tree_map, lambda x: x.split(sections, 0), tree)
    assert len(_at(out, name)) == len(sections)


def test_split_td(benchmark, nested_td):
    name, td = nested_td
    sections = SECTIONS[name]
    _tag(benchmark, "split", name, "tensordict")
    out = benchmark(td.split, sections, 0)
    assert len(out) == len(sections)


def test_split_modstate(benchmark, case):
    name, tree = case
    sections = SECTIONS[name]
    _tag(benchmark, "split", name, "modstate")
    out = benchmark(ms.tree.split, tree, sections, 0)
    assert len(out) == len(sections)


# add


def test_add_pytree(benchmark, case):
    name, tree = case
    _tag(benchmark, "add", name, "torch.utils._pytree")
    out = benchmark(tree_map, lambda x: x + 1, tree)
    assert torch.equal(_at(out, name), _at(tree, name) + 1)


def test_add_td(benchmark, nested_td):
    name, td = nested_td
    _tag(benchmark, "add", name, "tensordict")
    out = benchmark(td.apply, lambda x: x + 1)
    assert torch.equal(_at(out, name), _at(td, name) + 1)


def test_add_modstate(benchmark, case):
    name, tree = case
    _tag(benchmark, "add", name, "modstate")
    out = benchmark(ms.tree.add, tree, 1)
    assert torch.equal(_at(out, name), _at(tree, name) + 1)
