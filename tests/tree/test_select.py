"""tree.select and tree.exclude: glob patterns over dotted paths."""

from __future__ import annotations

import re

import pytest
import torch
from torch import nn

import modstate as ms
import modstate.tree


def _model_tree():
    model = nn.Transformer(
        d_model=8, nhead=2, num_encoder_layers=1, num_decoder_layers=1, dim_feedforward=8
    )
    return ms.extract(model, detach=True)


def test_select_star_crosses_dots_and_keeps_the_input_leaves():
    tree = _model_tree()
    encoder = ms.tree.select(tree, "encoder.*")
    assert list(encoder) == ["encoder"]
    assert (
        ms.flatten(encoder).keys()
        == {k: v for k, v in ms.flatten(tree).items() if k.startswith("encoder.")}.keys()
    )
    assert encoder["encoder"]["norm"]["weight"] is tree["encoder"]["norm"]["weight"]
    biases = ms.flatten(ms.tree.select(tree, "*.bias", "*bias_*"))
    assert biases and all(k.endswith("bias") or "bias_" in k for k in biases)


def test_select_a_subtree_by_its_own_path_and_exclude_is_the_complement():
    tree = _model_tree()
    assert (
        ms.flatten(ms.tree.select(tree, "decoder")).keys()
        == ms.flatten(ms.tree.select(tree, "decoder.*")).keys()
    )
    kept = ms.flatten(ms.tree.exclude(tree, "*.norm?.*", "decoder"))
    assert kept and not any(re.search(r"\.norm\d\.", k) or k.startswith("decoder") for k in kept)
    everything = set(ms.flatten(tree))
    chosen = set(ms.flatten(ms.tree.select(tree, "*weight")))
    assert set(ms.flatten(ms.tree.exclude(tree, "*weight"))) == everything - chosen


def test_select_pruning_on_lists_tuples_and_none():
    tree = {"a": [torch.ones(1), {"w": torch.ones(1)}], "b": (torch.ones(1),), "n": None, "e": {}}
    assert ms.tree.select(tree, "a.1.*") == {
        "a": [None, {"w": tree["a"][1]["w"]}],
        "n": None,
        "e": {},
    }
    out = ms.tree.exclude(tree, "a.0", "b.*")
    assert list(out) == ["a", "n", "e"] and out["a"][0] is None
    assert ms.tree.select(tree) == {"n": None, "e": {}}
    assert ms.tree.exclude(tree) == tree and ms.tree.exclude(tree) is not tree
    with pytest.raises(TypeError, match="strings"):
        ms.tree.select(tree, 1)
