"""nn.Dropout in an ensemble: the masks depend only on the random state and the member, not on
the route (a chain features first, grouped convolutions, the runner, fast=False, vmap_call,
vmap over ms.apply). On the CPU member i's mask is row i of ``F.dropout`` of ones laid out
``(members, *member's shape)``; with ``randomness="same"``, one mask of a member's shape."""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import modstate as ms

P = 0.4


class Block(nn.Module):
    """Not a Sequential: it runs through the runner, the model's own forward under vmap."""

    def __init__(self) -> None:
        super().__init__()
        self.conv = nn.Conv2d(3, 4, 3)
        self.drop = nn.Dropout(P)

    def forward(self, x):
        return self.drop(torch.relu(self.conv(x)) + 1)


MODELS = {
    # Linear then Dropout on rows: the chain runs it features first.
    "mlp": (lambda: nn.Sequential(nn.Linear(3, 6), nn.Dropout(P)), (5, 3)),
    "bn-mlp": (lambda: nn.Sequential(nn.Linear(3, 6), nn.BatchNorm1d(6), nn.Dropout(P)), (5, 3)),
    # A grouped convolution lays the members out inside the channels.
    "cnn": (lambda: nn.Sequential(nn.Conv2d(3, 4, 3), nn.ReLU(), nn.Dropout(P)), (2, 3, 6, 6)),
    "runner": (Block, (2, 3, 6, 6)),
}
MEMBERS = 3


def members(name):
    factory, shape = MODELS[name]
    models = ms.Ensemble.from_factory(factory, MEMBERS, seeds=[0, 1, 2], route="batched").members()
    return models, torch.randn(*shape, generator=torch.Generator().manual_seed(5))


def without_dropout(models, x):
    """Every member's activations before the mask: copies of the models in train mode (batch
    statistics) with p = 0, one by one."""
    outs = []
    for model in models:
        copied = copy.deepcopy(model).train()
        for layer in copied.modules():
            if isinstance(layer, nn.Dropout):
                layer.p = 0.0
        with torch.no_grad():
            outs.append(copied(x))
    return torch.stack(outs)


def keep(randomness, before):
    """The mask of the module docstring, drawn from seed 1."""
    torch.manual_seed(1)
    shape = before.shape if randomness == "different" else before.shape[1:]
    return F.dropout(torch.ones(shape), P, True)


@pytest.mark.parametrize("randomness", ["different", "same"])
@pytest.mark.parametrize("name", list(MODELS))
def test_the_masks_are_the_same_on_every_route(name, randomness):
    models, x = members(name)
    before = without_dropout(models, x)
    expected = before * keep(randomness, before)
    outputs = {}
    for fast in (True, False):
        ensemble = ms.Ensemble(models, randomness=randomness, fast=fast, route="batched").train()
        torch.manual_seed(1)
        with torch.no_grad():
            outputs[f"fast={fast}"] = ensemble(x)
    stacked = ms.stack_modules([m.train() for m in models])
    torch.manual_seed(1)
    with torch.no_grad():
        outputs["vmap_call"] = ms.vmap_call(models[0], stacked, x, randomness=randomness)
    params, state = (
        ms.stack([ms.split(m)[0] for m in models]),
        ms.stack([ms.split(m)[1] for m in models]),
    )
    torch.manual_seed(1)
    with torch.no_grad():
        outputs["vmap(apply)"] = torch.vmap(
            lambda p, s: ms.apply(models[0], p, s, x)[0], randomness=randomness
        )(params, state)
    for route, out in outputs.items():
        assert torch.equal(out == 0, expected == 0), route  # the same elements dropped
        torch.testing.assert_close(out, expected, rtol=1e-5, atol=1e-6, msg=route)


def test_members_get_masks_of_their_own_and_same_shares_one():
    models, _ = members("mlp")
    for randomness in ("different", "same"):
        torch.manual_seed(1)
        out = ms.Ensemble(models, randomness=randomness, route="batched").train()(torch.ones(5, 3))
        assert torch.equal(out[0] == 0, out[1] == 0) == (randomness == "same")


def test_per_member_inputs_get_the_same_masks_as_a_shared_input():
    models, x = members("cnn")
    ensemble = ms.Ensemble(models, randomness="different", in_dims=0, route="batched").train()
    before = without_dropout(models, x)
    torch.manual_seed(1)
    with torch.no_grad():
        out = ensemble(x.expand(MEMBERS, *x.shape))
    assert torch.equal(out == 0, (before * keep("different", before)) == 0)


def test_the_gradient_is_the_masks():
    models, x = members("mlp")
    ensemble = ms.Ensemble(models, randomness="different", route="batched").train()
    x = x.clone().requires_grad_()
    torch.manual_seed(1)
    ensemble(x).sum().backward()
    before = without_dropout(models, x.detach())
    mask = keep("different", before)
    weights = torch.stack([m[0].weight.detach() for m in models])  # (members, 6, 3)
    torch.testing.assert_close(x.grad, torch.einsum("mbo,moi->bi", mask, weights))


def test_eval_mode_and_p_zero_draw_nothing():
    models, x = members("runner")
    evaluating = ms.Ensemble(models, randomness="different", route="batched").eval()
    for model in models:
        model.drop.p = 0.0
    without = ms.Ensemble(models, randomness="different", route="batched").train()
    for ensemble in (evaluating, without):
        state = torch.get_rng_state()
        ensemble(x)
        assert torch.equal(torch.get_rng_state(), state)
