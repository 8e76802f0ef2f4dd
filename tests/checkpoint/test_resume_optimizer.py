"""Resuming a torch.optim optimizer from a distributed checkpoint without a warm-up step: the
error names a fix that keeps the optimizer's state, and the fix works."""

from __future__ import annotations

import pytest
import torch
from torch import nn

import modstate as ms
from modstate import checkpoint


def model_and_adam(seed: int):
    torch.manual_seed(seed)
    model = nn.Sequential(nn.Linear(3, 4), nn.Tanh(), nn.Linear(4, 2))
    return model, torch.optim.Adam(model.parameters(), lr=1e-2)


def step(model, optimizer, seed):
    x = torch.randn(8, 3, generator=torch.Generator().manual_seed(seed))
    model(x).square().mean().backward()
    optimizer.step()
    optimizer.zero_grad()


@pytest.fixture
def saved(tmp_path):
    model, adam = model_and_adam(0)
    for seed in range(3):
        step(model, adam, seed)
    training = {"model": ms.extract(model), "optimizer": ms.optim.optimizer_state(adam, model)}
    checkpoint.save_distributed(training, tmp_path / "step-3")
    step(model, adam, 3)  # what resuming must reproduce
    return tmp_path / "step-3", ms.extract(model, detach=True)


def assert_resumes(fresh, fresh_adam, expected):
    step(fresh, fresh_adam, 3)
    for path, value in ms.flatten(ms.extract(fresh)).items():
        assert torch.equal(value, ms.flatten(expected)[path]), path


def test_a_like_without_the_optimizer_names_as_saved_and_the_fix_resumes_exactly(saved):
    directory, expected = saved
    fresh, fresh_adam = model_and_adam(1)
    like = {"model": ms.extract(fresh)}
    with pytest.raises(ValueError, match=r"as_saved=\['optimizer'\] reads what is there as saved"):
        checkpoint.load_distributed(directory, like)

    tree = checkpoint.load_distributed(directory, like, as_saved=["optimizer"])
    ms.load(fresh, tree["model"])
    ms.optim.load_optimizer_state(fresh_adam, fresh, tree["optimizer"])
    assert_resumes(fresh, fresh_adam, expected)


def test_a_like_from_a_fresh_optimizer_names_its_missing_state_and_the_fix_resumes(saved):
    directory, expected = saved
    fresh, fresh_adam = model_and_adam(1)
    like = {"model": ms.extract(fresh), "optimizer": ms.optim.optimizer_state(fresh_adam, fresh)}
    assert like["optimizer"]["state"] == {}  # torch.optim creates state on the first step
    with pytest.raises(ValueError, match=r"as_saved=\['optimizer\.state'\]"):
        checkpoint.load_distributed(directory, like)

    tree = checkpoint.load_distributed(directory, like, as_saved=["optimizer.state"])
    ms.load(fresh, tree["model"])
    ms.optim.load_optimizer_state(fresh_adam, fresh, tree["optimizer"])
    assert_resumes(fresh, fresh_adam, expected)


def test_strict_false_leaves_the_state_out_as_the_message_says(saved):
    directory, _ = saved
    fresh, _ = model_and_adam(1)
    tree = checkpoint.load_distributed(directory, {"model": ms.extract(fresh)}, strict=False)
    assert list(tree) == ["model"]


def test_as_saved_refuses_a_path_with_nothing_saved_under_it(saved):
    directory, _ = saved
    with pytest.raises(ValueError, match="as_saved names 'optimiser', but the checkpoint holds"):
        checkpoint.load_distributed(directory, {}, as_saved=["optimiser"])


def test_a_floated_counter_in_the_checkpoint_names_as_saved_not_a_rounding_cast(tmp_path):
    # issue 41: a counter saved as a float (an average of counters) into like's int64 counter;
    # a cast would round 2.5 to 2, so the error names as_saved, and as_saved reads 2.5.
    bn = nn.BatchNorm1d(3)
    tree = ms.extract(bn, copy=True)
    saved = {**tree, "num_batches_tracked": torch.tensor(2.5, dtype=torch.float64)}
    checkpoint.save_distributed(saved, tmp_path / "soup")
    with pytest.raises(ValueError) as info:
        checkpoint.load_distributed(tmp_path / "soup", ms.extract(bn))
    text = str(info.value)
    assert (
        "'num_batches_tracked' has dtype torch.float64 in the checkpoint, torch.int64 in " in text
    )
    assert "as_saved=['num_batches_tracked'] reads it as saved, a cast would round it" in text
    assert "strict=False casts" not in text
    loaded = checkpoint.load_distributed(
        tmp_path / "soup", ms.extract(bn), as_saved=["num_batches_tracked"]
    )
    assert loaded["num_batches_tracked"].item() == 2.5
    assert torch.equal(loaded["weight"], tree["weight"])
