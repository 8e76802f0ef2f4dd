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
implementation gives modstate's answer: every piece, every leaf, bit for bit (the same tensor op
runs on each leaf), and for ``view`` the same memory. TensorDict is left out (and listed by the report) when
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
from _timing import assert_same_trees, flat, optional

TREES = ["small", "large"]
# (batch size after merging the two batch dims, split sections along dim 0) per tree
MERGED = {"small": 12, "large": 4}
SECTIONS = {"small": [1, 2], "large": [1, 1]}

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


def _td(name: str, tree: dict) -> Any:
    return tensordict.TensorDict(tree, batch_size=[2, 2] if name == "large" else [3, 4])


def _pieces(out: Any) -> list[dict[str, Any]]:
    """A list of trees (modstate, tensordict) or a tree of tuples (tree_map), as a list of flat
    trees: every piece, every leaf."""
    if isinstance(out, (list, tuple)):
        return [flat(piece) for piece in out]
    pieces: dict[int, dict[str, Any]] = {}
    for path, leaf in flat(out).items():
        prefix, _, index = path.rpartition(".")
        pieces.setdefault(int(index), {})[prefix] = leaf
    return [pieces[index] for index in sorted(pieces)]


def _run(
    compare,
    op: str,
    name: str,
    impls: dict[str, Callable[[], Any]],
    normalize: Callable[[Any], Any] = flat,
    same_storage: bool = False,
) -> None:
    """Check every implementation's answer against modstate's, every leaf bit for bit (they run
    the same tensor op on each leaf), then time them together."""
    expected = normalize(impls["modstate"]())
    for impl, fn in impls.items():
        what = f"{op} ({name}): {impl} vs modstate"
        assert_same_trees(expected, normalize(fn()), what=what, same_storage=same_storage)
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
    _run(compare, "reshape", name, impls)


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
    # a view: the leaves are the input's memory, so every peer's leaf is modstate's memory too
    _run(compare, "view", name, impls, same_storage=True)


def test_unbind(compare, case):
    name, tree = case
    impls: dict[str, Callable[[], Any]] = {
        "modstate": lambda: ms.tree.unbind(tree, 0),
        "torch.utils._pytree": lambda: tree_map(lambda x: x.unbind(0), tree),
    }
    if tensordict:
        td = _td(name, tree)
        impls["tensordict"] = lambda: td.unbind(0)
    # a list of trees (modstate, tensordict) or a tree of tuples (tree_map)
    _run(compare, "unbind", name, impls, _pieces)


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
    _run(compare, "split", name, impls, _pieces)


def test_add(compare, case):
    name, tree = case
    impls: dict[str, Callable[[], Any]] = {
        "modstate": lambda: ms.tree.add(tree, 1),
        "torch.utils._pytree": lambda: tree_map(lambda x: x + 1, tree),
    }
    if tensordict:
        td = _td(name, tree)
        impls["tensordict"] = lambda: td.apply(lambda x: x + 1)
    _run(compare, "add", name, impls)
