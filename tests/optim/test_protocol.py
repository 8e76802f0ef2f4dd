"""The Optimizer protocol: every optimizer of modstate.optim and every masked one satisfies it,
so code written against it takes any of them."""

from __future__ import annotations

import pytest
import torch

from modstate import optim

FACTORIES = [
    optim.sgd, optim.adam, optim.adamw, optim.rmsprop, optim.adagrad, optim.adamax,
    optim.nadam, optim.radam, optim.adadelta,
]  # fmt: skip


def train(opt: optim.Optimizer, params: dict, steps: int = 3) -> dict:
    """Typed against the protocol only."""
    state: optim.OptimizerState = opt.init(params)
    for _ in range(steps):
        params, state = opt.step(params, {"w": torch.ones(2), "b": None}, state, donate=True)
    return params


@pytest.mark.parametrize("factory", FACTORIES, ids=lambda f: f.__name__)
def test_every_optimizer_and_its_masked_form_is_an_optimizer(factory):
    opt = factory(lr=0.1)
    assert isinstance(opt, optim.Optimizer)
    assert isinstance(optim.masked(opt, "w"), optim.Optimizer)
    for candidate in (opt, optim.masked(opt, "w")):
        params = {"w": torch.zeros(2), "b": torch.zeros(1)}
        new = train(candidate, params)
        assert not torch.equal(new["w"], torch.zeros(2)) and new["b"] is params["b"]


def test_other_objects_are_not_optimizers():
    assert not isinstance(torch.optim.SGD([torch.zeros(1, requires_grad=True)]), optim.Optimizer)
    assert not isinstance(object(), optim.Optimizer)
