"""Pytree vs container: ``modstate.tree`` against ``torch.utils._pytree.tree_map`` and TensorDict.

The cases and test names follow tensordict's own ``benchmarks/common/pytree_benchmarks_test.py``
(reshape to one batch dim, view, unbind(0), split(sections, 0), add 1), on two trees:

- ``small``: ``{"a": {"b": randn(3,4,1), "c": {"d": rand(3,4,5,6)}}, "c": rand(3,4,1)}``, batch
  ``[3, 4]``;
- ``large``: four ``nn.Transformer(d_model=64, nhead=4, num_encoder_layers=2,
  num_decoder_layers=2, dim_feedforward=64)`` parameter trees stacked leaf by leaf and reshaped
  to batch ``[2, 2]`` (64 leaves, 2.2 MB).

Each test is one case, ``"<op> (<tree>)"``, timed with the ``compare`` fixture (every
implementation warmed up, then timed in interleaved rounds) after checking that each
implementation gives the same answer. TensorDict is left out (and listed by the report) when
tensordict is not installed.

The suite runs torch on one thread. Every implementation runs the same tensor ops, so this does
not change what is compared; but on a shared machine an op that splits a large leaf across
OpenMP threads waits for a busy core, and those millisecond stalls swamp microsecond figures.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest
import torch
from torch import nn
from torch.utils._pytree import tree_map

import modstate as ms
import modstate.tree
from _timing import optional

TREES = ["small", "large"]
# (batch size after merging the two batch dims, split sections along dim 0) per tree
MERGED = {"small": 12, "large": 4}
SECTIONS = {"small": [1, 2], "large": [1, 1]}
# a leaf the tests check their outputs at
PROBE = {"small": ("c",), "large": ("encoder", "norm", "weight")}

tensordict = optional("tensordict")
MISSING = () if tensordict else ("tensordict",)


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


def _td(name: str, tree: dict) -> Any:
    return tensordict.TensorDict(tree, batch_size=[2, 2] if name == "large" else [3, 4])


def _count(out: Any, name: str) -> int:
    """How many pieces: a list of trees (modstate, tensordict) or a tree of tuples (tree_map)."""
    return len(out) if isinstance(out, (list, tuple)) else len(_at(out, name))


def _run(compare, op: str, name: str, impls: dict[str, Callable[[], Any]], check) -> None:
    """Check every implementation's answer with ``check(out)``, then time them together."""
    for impl, fn in impls.items():
        assert check(fn()), f"{op} ({name}): {impl} gave a wrong answer"
    compare(f"{op} ({name})", impls, missing=MISSING)


def test_reshape(compare, case):
    name, tree = case
    size = MERGED[name]
    impls: dict[str, Callable[[], Any]] = {
        "modstate": lambda: ms.tree.reshape(tree, size, batch_ndim=2),
        "torch.utils._pytree": lambda: tree_map(lambda x: x.reshape(size, *x.shape[2:]), tree),
    }
    if tensordict:
        td = _td(name, tree)
        impls["tensordict"] = lambda: td.reshape(size)
    _run(compare, "reshape", name, impls, lambda out: _at(out, name).shape[0] == size)


def test_view(compare, case):
    name, tree = case
    size = MERGED[name]
    impls: dict[str, Callable[[], Any]] = {
        "modstate": lambda: ms.tree.view(tree, size, batch_ndim=2),
        "torch.utils._pytree": lambda: tree_map(lambda x: x.view(size, *x.shape[2:]), tree),
    }
    if tensordict:
        td = _td(name, tree)
        impls["tensordict"] = lambda: td.view(size)
    probe = _at(tree, name).data_ptr()
    _run(compare, "view", name, impls, lambda out: _at(out, name).data_ptr() == probe)


def test_unbind(compare, case):
    name, tree = case
    count = _at(tree, name).shape[0]
    impls: dict[str, Callable[[], Any]] = {
        "modstate": lambda: ms.tree.unbind(tree, 0),
        "torch.utils._pytree": lambda: tree_map(lambda x: x.unbind(0), tree),
    }
    if tensordict:
        td = _td(name, tree)
        impls["tensordict"] = lambda: td.unbind(0)
    # a list of trees (modstate, tensordict) or a tree of tuples (tree_map)
    _run(compare, "unbind", name, impls, lambda out: _count(out, name) == count)


def test_split(compare, case):
    name, tree = case
    sections = SECTIONS[name]
    impls: dict[str, Callable[[], Any]] = {
        "modstate": lambda: ms.tree.split(tree, sections, 0),
        "torch.utils._pytree": lambda: tree_map(lambda x: x.split(sections, 0), tree),
    }
    if tensordict:
        td = _td(name, tree)
        impls["tensordict"] = lambda: td.split(sections, 0)
    _run(compare, "split", name, impls, lambda out: _count(out, name) == len(sections))


def test_add(compare, case):
    name, tree = case
    expected = _at(tree, name) + 1
    impls: dict[str, Callable[[], Any]] = {
        "modstate": lambda: ms.tree.add(tree, 1),
        "torch.utils._pytree": lambda: tree_map(lambda x: x + 1, tree),
    }
    if tensordict:
        td = _td(name, tree)
        impls["tensordict"] = lambda: td.apply(lambda x: x + 1)
    _run(compare, "add", name, impls, lambda out: torch.equal(_at(out, name), expected))
