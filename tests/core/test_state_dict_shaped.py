"""Trees shaped like state_dict() and like the files other libraries write load strictly: no
non-persistent buffers, and each tie group given once."""

from __future__ import annotations

import pytest
import safetensors.torch
import torch
from torch import nn

import modstate as ms


class TiedLM(nn.Module):
    """An embedding tied to its head, and a non-persistent buffer (a rotary cache, say)."""

    def __init__(self):
        super().__init__()
        self.embed = nn.Embedding(10, 4)
        self.head = nn.Linear(4, 10, bias=False)
        self.head.weight = self.embed.weight
        self.register_buffer("inv_freq", torch.arange(4.0), persistent=False)

    def forward(self, ids):
        return self.head(self.embed(ids) * self.inv_freq)


def lm():
    torch.manual_seed(0)
    return TiedLM()


IDS = torch.tensor([[1, 2, 3]])
ROUTES = [False, True]


def test_extract_has_the_non_persistent_buffers_that_state_dict_leaves_out():
    model = lm()
    assert set(ms.flatten(ms.extract(model))) == {*model.state_dict(), "inv_freq"}
    assert list(ms.flatten(ms.extract(model, use_state_dict=True))) == list(model.state_dict())


@pytest.mark.parametrize("use_state_dict", ROUTES)
def test_a_state_dict_loads_strictly(use_state_dict):
    model, other = lm(), TiedLM()
    ms.load(other, model.state_dict(), use_state_dict=use_state_dict)
    torch.testing.assert_close(other(IDS), model(IDS))
    assert other.head.weight is other.embed.weight


@pytest.mark.parametrize("use_state_dict", ROUTES)
def test_a_tie_group_given_once_fills_the_group_on_both_routes(use_state_dict):
    model = lm()
    tree = {"embed": {"weight": torch.randn(10, 4)}}  # no head.weight, no inv_freq
    with ms.inject(model, tree, use_state_dict=use_state_dict):
        assert model.head.weight is model.embed.weight
        assert model.embed.weight is tree["embed"]["weight"]
        out = model(IDS)
    expected = nn.functional.linear(
        tree["embed"]["weight"][IDS] * model.inv_freq, tree["embed"]["weight"]
    )
    torch.testing.assert_close(out, expected)
    assert model.head.weight is model.embed.weight and isinstance(model.head.weight, nn.Parameter)


@pytest.mark.parametrize("use_state_dict", ROUTES)
def test_a_safetensors_file_without_tied_copies_loads_strictly(tmp_path, use_state_dict):
    model = lm()
    path = tmp_path / "model.safetensors"
    safetensors.torch.save_model(model, str(path))  # keeps one key of each tie group
    saved = safetensors.torch.load_file(str(path))
    assert len(saved) == 1
    fresh = TiedLM()
    weight = fresh.embed.weight
    ms.load(fresh, saved, use_state_dict=use_state_dict)
    assert fresh.embed.weight is weight and fresh.head.weight is weight
    torch.testing.assert_close(fresh(IDS), model(IDS))


def test_missing_persistent_paths_are_still_refused():
    model = nn.Sequential(nn.Linear(2, 2), nn.BatchNorm1d(2))
    tree = ms.flatten(ms.extract(model))
    del tree["1.running_mean"]
    for use_state_dict in ROUTES:
        with pytest.raises(KeyError, match="running_mean"):
            ms.load(model, tree, use_state_dict=use_state_dict)
