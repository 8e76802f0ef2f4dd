"""A plain ``Sequential`` of layers with kernels runs them in sequence without vmap
(``ensemble/_chain.py``): the same outputs, gradients and statistics as the loop and as the whole
model under vmap (``fast=False``)."""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

import modstate as ms

from loop_reference import assert_like_the_loop
from members import ATOL, cnn, loop, seeded
from zoo import assert_unchanged, snapshot

LAYERS = {
    "linear": (lambda: nn.Linear(5, 3), (4, 5)),
    "linear_no_bias_3d_input": (lambda: nn.Linear(5, 3, bias=False), (2, 4, 5)),
    "linear_unbatched_input": (lambda: nn.Linear(5, 3), (5,)),
    "conv1d": (lambda: nn.Conv1d(2, 4, 3, padding="same"), (2, 2, 9)),
    "conv2d_grouped_strided": (lambda: nn.Conv2d(4, 6, 3, stride=2, groups=2), (2, 4, 9, 9)),
    "conv2d_no_bias": (lambda: nn.Conv2d(3, 2, 2, bias=False, dilation=2), (1, 3, 7, 7)),
    "conv2d_unbatched_input": (lambda: nn.Conv2d(3, 2, 3), (3, 6, 6)),
    "conv3d": (lambda: nn.Conv3d(2, 2, 2), (1, 2, 4, 4, 4)),
    "conv2d_reflect_padding": (
        lambda: nn.Conv2d(2, 2, 3, padding=1, padding_mode="reflect"),
        (1, 2, 5, 5),
    ),
    "layer_norm": (lambda: nn.LayerNorm(6), (3, 6)),
    "layer_norm_2d_no_bias": (lambda: nn.LayerNorm((2, 6), bias=False), (3, 2, 6)),
    "layer_norm_no_affine": (
        lambda: nn.Sequential(nn.Linear(6, 6), nn.LayerNorm(6, elementwise_affine=False)),
        (3, 6),
    ),
    "activations": (
        lambda: nn.Sequential(
            nn.Linear(4, 8),
            nn.ReLU(),
            nn.Linear(8, 8),
            nn.GELU(),
            nn.Tanh(),
            nn.Sigmoid(),
            nn.SiLU(),
            nn.LeakyReLU(0.3),
            nn.ELU(),
            nn.Softplus(),
            nn.Identity(),
            nn.Dropout(0.5),
            nn.Linear(8, 2),
        ),
        (3, 4),
    ),
    "activations_in_place_after_linear": (
        lambda: nn.Sequential(
            nn.Linear(4, 8),
            nn.Tanh(),
            nn.Linear(8, 8),
            nn.Sigmoid(),
            nn.ReLU(),
            nn.Linear(8, 8),
            nn.ReLU(),
            nn.Tanh(),
            nn.Linear(8, 2),
        ),
        (3, 4),
    ),
    "convolutions_with_activations": (
        lambda: nn.Sequential(nn.Conv2d(2, 3, 3), nn.ReLU(), nn.Conv2d(3, 2, 3), nn.Sigmoid()),
        (2, 2, 7, 7),
    ),
    "flatten_then_linear": (lambda: nn.Sequential(nn.Flatten(), nn.Linear(6, 2)), (4, 2, 3)),
    "nested_sequential_with_fallback": (
        lambda: nn.Sequential(
            nn.Linear(4, 6), nn.Sequential(nn.BatchNorm1d(6), nn.ReLU()), nn.Linear(6, 1)
        ),
        (5, 4),
    ),
    "stateless_unknown_layer": (lambda: nn.Sequential(nn.Linear(4, 6), nn.Softmax(dim=-1)), (5, 4)),
    "cnn_with_batchnorm": (cnn, (2, 3, 8, 8)),
}
TRAINING = {"cnn_with_batchnorm"}
NOT_CHAINED = {"stateless_unknown_layer"}  # Softmax has no step: the model runs under vmap


def grads_of(ensemble):
    return {name: p.grad.clone() for name, p in ensemble.named_parameters()}


@pytest.mark.parametrize("layer", LAYERS)
@pytest.mark.parametrize("in_dims", [None, 0])
def test_ensemble_equals_the_loop_and_the_vmap_path_with_the_same_gradients(layer, in_dims):
    factory, shape = LAYERS[layer]
    models = [m.train(layer in TRAINING) for m in seeded(factory, 3)]
    before = [snapshot(m) for m in models]
    fast = ms.Ensemble(models, in_dims=in_dims, route="batched")
    reference = ms.Ensemble(models, in_dims=in_dims, fast=False, route="batched")
    torch.manual_seed(1)
    x = torch.randn(*shape) if in_dims is None else torch.randn(3, *shape)
    out = fast(x)
    copies = [copy.deepcopy(m) for m in models]  # the loop updates BatchNorm statistics
    torch.testing.assert_close(out, loop(copies, x, in_dims), atol=ATOL, rtol=0)
    torch.testing.assert_close(out, reference(x), atol=ATOL, rtol=0)

    weights = torch.randn_like(out)
    (fast(x) * weights).sum().backward()
    (reference(x) * weights).sum().backward()
    fast_grads, reference_grads = grads_of(fast), grads_of(reference)
    assert fast_grads.keys() == reference_grads.keys()
    for name, grad in fast_grads.items():
        torch.testing.assert_close(grad, reference_grads[name], atol=ATOL, rtol=0, msg=name)
    for name, buffer in fast.named_buffers():
        torch.testing.assert_close(buffer, reference.get_buffer(name), msg=name)
    for model, then in zip(models, before, strict=True):
        assert_unchanged(model, then)
    summary = fast.plan.summary
    assert ("without vmap" in summary) == (layer not in NOT_CHAINED), summary


def test_ensemble_batchnorm_statistics_update_per_member():
    models = seeded(cnn, 3)  # training mode
    ensemble = ms.Ensemble(models, in_dims=0, route="batched")
    x = torch.randn(3, 4, 3, 8, 8)
    out = ensemble(x)
    torch.testing.assert_close(out, loop(models, x, in_dims=0), atol=ATOL, rtol=0)
    batchnorm = ensemble.stacked.get_submodule("1")
    for name in ("running_mean", "running_var", "num_batches_tracked"):
        torch.testing.assert_close(
            getattr(batchnorm, name), torch.stack([getattr(m[1], name) for m in models])
        )


@pytest.mark.parametrize("rows", [False, True], ids=["one_sample", "rows_features_first"])
@pytest.mark.parametrize("fast", [True, False])
def test_dropout_masks_follow_randomness(fast, rows):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(6, 64), nn.Dropout(0.5))
    models = [model, copy.deepcopy(model), copy.deepcopy(model)]
    x = torch.ones(4, 6) if rows else torch.ones(6)
    reference = loop([m.eval() for m in models], x)
    for m in models:
        m.train()
    out = ms.Ensemble(models, randomness="different", fast=fast, route="batched")(x)
    assert not torch.equal(out[0] == 0, out[1] == 0)
    same = ms.Ensemble(models, randomness="same", fast=fast, route="batched")
    drawn = same(x)
    assert torch.equal(drawn[0], drawn[2])
    assert ("features first" in same.plan.summary) == fast  # where the input is rows
    refuses = ms.Ensemble(
        models, fast=fast, route="batched"
    )  # the default, as vmap_call's: "error"
    assert refuses.randomness == "error"
    with pytest.raises(RuntimeError, match="randomness"):
        refuses(x)
    refuses.eval()  # no randomness in eval mode
    torch.testing.assert_close(refuses(x), reference, atol=ATOL, rtol=0)


def test_a_sequential_with_hooks_runs_under_vmap_so_the_hooks_run():
    models = seeded(lambda: nn.Sequential(nn.Linear(5, 16), nn.GELU(), nn.Linear(16, 3)), 2)
    calls = []
    models[0][0].register_forward_hook(lambda module, args, out: calls.append(out.shape))
    ensemble = ms.Ensemble(models, route="batched")
    assert "without vmap" not in ensemble.plan.summary
    out = ensemble(torch.randn(3, 5))
    assert calls and calls[-1] == (3, 16)  # each member's view: the hook sees one model
    torch.testing.assert_close(out, loop(models, torch.randn(3, 5)) * 0 + out)


ROWS = {
    "batch_norm_mlp": lambda: nn.Sequential(
        nn.Linear(5, 8), nn.BatchNorm1d(8), nn.ReLU(), nn.Linear(8, 8),
        nn.BatchNorm1d(8, affine=False, momentum=0.3), nn.Tanh(), nn.Linear(8, 2, bias=False),
    ),
    "no_running_statistics": lambda: nn.Sequential(
        nn.Linear(5, 6), nn.BatchNorm1d(6, track_running_stats=False), nn.SiLU(), nn.Linear(6, 2)
    ),
    # A cumulative average (momentum=None) runs batch-major from its BatchNorm on.
    "cumulative_average_midway": lambda: nn.Sequential(
        nn.Linear(5, 6), nn.ReLU(), nn.Linear(6, 6), nn.BatchNorm1d(6, momentum=None),
        nn.ReLU(), nn.Linear(6, 2),
    ),
}  # fmt: skip


@pytest.mark.parametrize("case", ROWS)
@pytest.mark.parametrize("in_dims", [None, 0])
def test_rows_run_features_first_and_equal_the_loop(case, in_dims):
    lead = () if in_dims is None else (3,)
    # Two training calls (the statistics move), then eval (which reads them).
    ensemble = assert_like_the_loop(
        ROWS[case], lambda: (torch.randn(*lead, 7, 5),), in_dims=in_dims
    )
    assert "features first" in ensemble.plan.summary
    ensemble.train()
    ensemble(torch.randn(*lead, 7, 5)).square().sum().backward()
    for name, parameter in ensemble.named_parameters():  # in its own layout, as nn.Linear's
        assert parameter.grad.stride() == parameter.stride(), name


def test_features_first_second_order_gradients_equal_the_loops():
    torch.manual_seed(0)
    members = [ROWS["batch_norm_mlp"]().double() for _ in range(3)]
    ensemble, x = (
        ms.Ensemble(copy.deepcopy(members), route="batched"),
        torch.randn(7, 5, dtype=torch.float64),
    )

    def gradient_norm(out: torch.Tensor, weights: list[torch.Tensor]) -> torch.Tensor:
        grads = torch.autograd.grad(out.square().sum(), weights, create_graph=True)
        return sum(g.square().sum() for g in grads)

    names = ["0.weight", "1.weight", "3.weight", "6.weight"]
    stacked = [ensemble.stacked.get_parameter(name) for name in names]
    got = torch.autograd.grad(gradient_norm(ensemble(x), stacked), stacked)
    for i, member in enumerate(members):
        weights = [member.get_parameter(name) for name in names]
        want = torch.autograd.grad(gradient_norm(member(x), weights), weights)
        for g, w, name in zip(got, want, names, strict=True):
            torch.testing.assert_close(g[i], w, atol=1e-10, rtol=1e-10, msg=name)


@pytest.mark.parametrize(
    "factory",
    [
        lambda: nn.Sequential(nn.Linear(5, 4), nn.Flatten(), nn.Linear(4, 2)),
        lambda: nn.Sequential(nn.ReLU(), nn.Linear(5, 2)),
        lambda: nn.Sequential(nn.Linear(5, 4), nn.LayerNorm(4)),
    ],
    ids=["flatten", "activation_first", "layer_norm"],
)
def test_other_chains_run_batch_major(factory):
    ensemble = assert_like_the_loop(factory, lambda: (torch.randn(7, 5),))
    summary = ensemble.plan.summary
    assert "without vmap" in summary and "features first" not in summary


def test_features_first_under_torch_func_grad_equals_plain_autograd():
    ensemble = ms.Ensemble(seeded(ROWS["batch_norm_mlp"], 3), route="batched")
    params, state = ms.split(ensemble, detach=True)
    x = torch.randn(7, 5)

    def loss(p: dict) -> torch.Tensor:
        return ms.apply(ensemble, p, state, x)[0].square().sum()

    want = ms.flatten(ms.grad(loss)(params))
    for path, grad in ms.flatten(torch.func.grad(loss)(params)).items():
        torch.testing.assert_close(grad, want[path], atol=1e-5, rtol=1e-5, msg=path)
