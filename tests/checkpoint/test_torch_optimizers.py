"""A model and its torch.optim optimizer in one checkpoint, a single file or a DCP directory:
``optim.optimizer_state`` saves as it is, and ``optim.load_optimizer_state`` after the load gives
the optimizer back exactly (its groups, tuples such as ``betas`` included; its state, bit for
bit; so its next steps are the saved optimizer's)."""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

import modstate as ms
from modstate import checkpoint

OPTIMIZERS = {
    "adam-betas": lambda groups: torch.optim.Adam(groups, lr=1e-2, betas=(0.8, 0.95)),
    "adamw-amsgrad": lambda groups: torch.optim.AdamW(groups, lr=1e-2, amsgrad=True),
    "sgd-nesterov": lambda groups: torch.optim.SGD(groups, lr=0.1, momentum=0.9, nesterov=True),
    "rmsprop-centered": lambda groups: torch.optim.RMSprop(
        groups, lr=1e-2, centered=True, momentum=0.5
    ),
    "adagrad": lambda groups: torch.optim.Adagrad(groups, lr=0.1, lr_decay=0.01),
}


def model_and_optimizer(kind: str, seed: int):
    torch.manual_seed(seed)
    model = nn.Sequential(nn.Linear(3, 4), nn.BatchNorm1d(4), nn.Tanh(), nn.Linear(4, 2))
    groups = [
        {"params": [model[0].weight, model[0].bias, model[1].weight]},
        {"params": [model[1].bias, model[3].weight, model[3].bias], "lr": 3e-3},
    ]
    return model, OPTIMIZERS[kind](groups)


def step(model, optimizer, seed):
    x = torch.randn(8, 3, generator=torch.Generator().manual_seed(seed))
    model(x).square().mean().backward()
    optimizer.step()
    optimizer.zero_grad()


def save_file(tree, tmp_path):
    checkpoint.save(tree, tmp_path / "step.safetensors")
    return checkpoint.load(tmp_path / "step.safetensors")


def save_directory(tree, tmp_path):
    checkpoint.save_distributed(tree, tmp_path / "step")
    like = {"model": tree["model"]}  # the optimizer's state is read as saved
    return checkpoint.load_distributed(tmp_path / "step", like, as_saved=["optimizer"])


@pytest.mark.parametrize("round_trip", [save_file, save_directory], ids=["file", "dcp"])
@pytest.mark.parametrize("kind", list(OPTIMIZERS))
def test_a_model_and_its_torch_optimizer_come_back_exactly(tmp_path, kind, round_trip):
    model, optimizer = model_and_optimizer(kind, seed=0)
    for seed in range(3):
        step(model, optimizer, seed)
    saved = copy.deepcopy(optimizer.state_dict())
    tree = {"model": ms.extract(model), "optimizer": ms.optim.optimizer_state(optimizer, model)}
    loaded = round_trip(tree, tmp_path)

    fresh, fresh_optimizer = model_and_optimizer(kind, seed=1)
    ms.load(fresh, loaded["model"])
    ms.optim.load_optimizer_state(fresh_optimizer, fresh, loaded["optimizer"])

    restored = fresh_optimizer.state_dict()
    assert restored["param_groups"] == saved["param_groups"]
    for group in restored["param_groups"]:
        for key, value in group.items():
            assert type(value) is type(saved["param_groups"][0][key]), key  # betas: a tuple
    assert restored["state"].keys() == saved["state"].keys()
    for index, entries in saved["state"].items():
        assert restored["state"][index].keys() == entries.keys()
        for key, value in entries.items():
            got = restored["state"][index][key]
            assert got.dtype == value.dtype and torch.equal(got, value), (index, key)

    for seed in range(3, 6):
        step(model, optimizer, seed)
        step(fresh, fresh_optimizer, seed)
    fresh_state = fresh.state_dict()
    for path, want in model.state_dict().items():
        assert torch.equal(fresh_state[path], want), path
