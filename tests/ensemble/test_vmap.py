"""vmap_call: one module run with every member of a stacked tree (``ensemble/_vmap.py``)."""

from __future__ import annotations

import pytest
import torch
from torch import nn

import modstate as ms

from members import ATOL, cnn, encoder_layer, loop, mlp, seeded
from zoo import assert_unchanged, snapshot

FAMILIES = {
    "mlp": (mlp, lambda: torch.randn(7, 5)),
    "cnn": (cnn, lambda: torch.randn(2, 3, 8, 8)),
    "transformer_encoder_layer": (encoder_layer, lambda: torch.randn(2, 5, 8)),
}


@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("in_dims", [None, 0])
def test_vmap_call_equals_the_loop_and_leaves_the_module_alone(family, in_dims):
    factory, make_input = FAMILIES[family]
    models = [m.eval() for m in seeded(factory, 3)]
    stacked = ms.stack_modules(models)
    x = make_input() if in_dims is None else torch.stack([make_input() for _ in models])
    base = models[0]
    before = snapshot(base)
    out = ms.vmap_call(base, stacked, x, in_dims=in_dims)
    torch.testing.assert_close(out, loop(models, x, in_dims), atol=ATOL, rtol=0)
    assert_unchanged(base, before)


def test_vmap_call_takes_per_argument_in_dims_and_shared_kwargs():
    class Affine(nn.Module):
        def __init__(self):
            super().__init__()
            self.lin = nn.Linear(3, 3)

        def forward(self, x, y, *, scale):
            return self.lin(x) * scale + y

    models = seeded(Affine, 4)
    x, y = torch.randn(4, 2, 3), torch.randn(2, 3)
    out = ms.vmap_call(models[0], ms.stack_modules(models), x, y, in_dims=(0, None), scale=2.0)
    expected = torch.stack([m(x[i], y, scale=2.0) for i, m in enumerate(models)])
    torch.testing.assert_close(out, expected, atol=ATOL, rtol=0)
    with pytest.raises(ValueError, match="in_dims has 1 entries for 2 positional inputs"):
        ms.vmap_call(models[0], ms.stack_modules(models), x, y, in_dims=(0,), scale=2.0)


def test_vmap_call_gradients_equal_the_loop():
    models = seeded(mlp, 3)
    stacked = ms.stack_modules(models)
    x = torch.randn(4, 5)
    ms.vmap_call(models[0], stacked, x).square().sum().backward()
    loop(models, x).square().sum().backward()
    for path, leaf in ms.flatten(stacked).items():
        expected = torch.stack([ms.flatten(ms.extract(m))[path].grad for m in models])
        torch.testing.assert_close(leaf.grad, expected, atol=ATOL, rtol=0)


def test_vmap_call_with_tied_weights():
    class Tied(nn.Module):
        def __init__(self):
            super().__init__()
            self.embed = nn.Embedding(6, 4)
            self.head = nn.Linear(4, 6, bias=False)
            self.head.weight = self.embed.weight

        def forward(self, tokens):
            return self.head(self.embed(tokens))

    models = seeded(Tied, 3)
    stacked = ms.stack_modules(models)
    assert stacked["embed"]["weight"] is stacked["head"]["weight"]
    tokens = torch.tensor([1, 4, 2])
    torch.testing.assert_close(
        ms.vmap_call(models[0], stacked, tokens), loop(models, tokens), atol=ATOL, rtol=0
    )


def test_vmap_call_batchnorm_updates_each_members_statistics():
    models = seeded(lambda: nn.Sequential(nn.Linear(3, 4), nn.BatchNorm1d(4)), 3)
    stacked = ms.stack_modules(models)
    base = models[0]
    x = torch.randn(3, 8, 3)
    before = snapshot(base)
    out = ms.vmap_call(base, stacked, x, in_dims=0)
    assert_unchanged(base, before)
    expected = loop(models, x, in_dims=0)  # updates the models' own statistics
    torch.testing.assert_close(out, expected, atol=ATOL, rtol=0)
    for name in ("running_mean", "running_var", "num_batches_tracked"):
        assert stacked["1"][name] is not None
        torch.testing.assert_close(
            stacked["1"][name], torch.stack([getattr(m[1], name) for m in models])
        )
    assert stacked["1"]["num_batches_tracked"].tolist() == [1, 1, 1]


def test_vmap_call_dropout_randomness():
    models = seeded(lambda: nn.Sequential(nn.Linear(6, 64), nn.Dropout(0.5)), 2)
    models[1].load_state_dict(models[0].state_dict())  # identical members: masks tell them apart
    stacked = ms.stack_modules(models)
    x = torch.ones(1, 6)
    different = ms.vmap_call(models[0], stacked, x, randomness="different")
    assert not torch.equal(different[0] == 0, different[1] == 0)
    same = ms.vmap_call(models[0], stacked, x, randomness="same")
    assert torch.equal(same[0], same[1])
    with pytest.raises(RuntimeError, match="randomness"):
        ms.vmap_call(models[0], stacked, x)


def test_vmap_call_writes_reassigned_buffers_back():
    class Counter(nn.Module):
        def __init__(self):
            super().__init__()
            self.lin = nn.Linear(2, 2)
            self.register_buffer("count", torch.zeros(()))

        def forward(self, x):
            self.count = self.count + 1
            return self.lin(x)

    models = seeded(Counter, 3)
    stacked = ms.stack_modules(models)
    ms.vmap_call(models[0], stacked, torch.randn(2))
    assert stacked["count"].tolist() == [1.0, 1.0, 1.0]
    assert models[0].count.item() == 0.0
    ensemble = ms.Ensemble(models, route="batched")
    ensemble(torch.randn(2))
    ensemble(torch.randn(2))
    assert ensemble.stacked.count.tolist() == [2.0, 2.0, 2.0]
    assert ensemble.state_dict()["stacked.count"].tolist() == [2.0, 2.0, 2.0]
    assert ensemble.member(0).count.item() == 2.0
    assert models[0].count.item() == 0.0
