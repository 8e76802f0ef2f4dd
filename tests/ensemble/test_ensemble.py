"""Ensembles: stack / unstack trees, run them under vmap (vmap_call), and the Ensemble module."""

from __future__ import annotations

import copy
import io

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch import nn

import modstate as ms

from zoo import CASE_IDS, CASES, WithExtraState, assert_unchanged, module_trees, snapshot

ATOL = 1e-5


def seeded(factory, n, seed=0):
    torch.manual_seed(seed)
    return [factory() for _ in range(n)]


def loop(models, x, in_dims=None):
    return torch.stack([m(x if in_dims is None else x[i]) for i, m in enumerate(models)])


# -- stack / unstack -------------------------------------------------------------------------------


def test_stacked_leaves_are_new_leaves_and_keep_requires_grad():
    models = seeded(lambda: nn.Sequential(nn.Linear(3, 4), nn.BatchNorm1d(4)), 3)
    for m in models:
        m[0].bias.requires_grad_(False)
    stacked = ms.stack_modules(models)
    weight = stacked["0"]["weight"]
    assert weight.shape == (3, 4, 3) and weight.is_leaf and weight.requires_grad
    assert not isinstance(weight, nn.Parameter)
    assert not stacked["0"]["bias"].requires_grad
    assert not stacked["1"]["running_mean"].requires_grad
    assert stacked["1"]["num_batches_tracked"].shape == (3,)
    for i, m in enumerate(models):
        assert torch.equal(weight[i], m[0].weight)
    weight.sum().backward()  # no graph back to the models
    assert models[0][0].weight.grad is None


def test_stack_keeps_ties_and_unstack_gives_the_trees_back():
    shared = [torch.randn(2, 3) for _ in range(4)]
    trees = [
        {"a": {"w": w}, "b": {"w": w, "b": torch.full((2,), float(i))}}
        for i, w in enumerate(shared)
    ]
    stacked = ms.stack(trees)
    assert stacked["a"]["w"] is stacked["b"]["w"]
    members = ms.unstack(stacked)
    assert len(members) == 4
    for tree, member in zip(trees, members):
        assert member["a"]["w"] is member["b"]["w"]
        assert torch.equal(member["a"]["w"], tree["a"]["w"])
        assert torch.equal(member["b"]["b"], tree["b"]["b"])


@settings(max_examples=25, deadline=None)
@given(
    count=st.integers(1, 4),
    shapes=st.dictionaries(
        st.sampled_from(["w", "b", "layer.w", "layer.v", "deep.er.x"]),
        st.lists(st.integers(0, 3), max_size=3),
        min_size=1,
    ),
)
def test_unstack_inverts_stack(count, shapes):
    flats = [
        {path: torch.randn(tuple(shape)) for path, shape in shapes.items()} for _ in range(count)
    ]
    trees = [ms.unflatten(flat) for flat in flats]
    stacked = ms.stack(trees)
    assert all(leaf.shape[0] == count for leaf in ms.flatten(stacked).values())
    back = ms.unstack(stacked)
    assert [ms.flatten(t).keys() for t in back] == [f.keys() for f in flats]
    for flat, member in zip(flats, back):
        for path, leaf in ms.flatten(member).items():
            assert torch.equal(leaf, flat[path])


@pytest.mark.parametrize(
    ("second", "message"),
    [
        ({"a": {"w": torch.zeros(2)}, "c": torch.zeros(1)}, "tree 1 has 'c' where tree 0 has 'b'"),
        ({"a": {"w": torch.zeros(3)}, "b": torch.zeros(1)}, "'a.w': shape (3,) in tree 1, (2,)"),
        ({"a": {"w": torch.zeros(2, dtype=torch.float64)}, "b": torch.zeros(1)}, "'a.w': dtype"),
        ({"a": {"w": torch.zeros(2)}}, "only tree 0 has 'b'"),
    ],
)
def test_stack_names_the_first_path_that_differs(second, message):
    first = {"a": {"w": torch.zeros(2)}, "b": torch.zeros(1)}
    with pytest.raises(
        (ValueError, TypeError), match=message.replace("(", r"\(").replace(")", r"\)")
    ):
        ms.stack([first, second])


def test_stack_refuses_trees_tied_differently():
    w = torch.zeros(2)
    with pytest.raises(ValueError, match="'b': .*tied differently"):
        ms.stack([{"a": w, "b": w}, {"a": torch.zeros(2), "b": torch.zeros(2)}])


def test_unstack_refuses_leaves_with_different_member_counts():
    with pytest.raises(ValueError, match="'b' has 2 members along dim 0, 'a' has 3"):
        ms.unstack({"a": torch.zeros(3, 1), "b": torch.zeros(2)})


class Mismatch(nn.Module):
    def __init__(self, width=4, kind=nn.ReLU, dtype=torch.float32, extra=False):
        super().__init__()
        self.body = nn.Sequential(nn.Linear(3, width, dtype=dtype), kind())
        self.register_buffer("scale", torch.ones(1), persistent=False)
        if extra:
            self.register_buffer("extra", torch.zeros(1))


@pytest.mark.parametrize(
    ("other", "message"),
    [
        (lambda: Mismatch(kind=nn.Tanh), "'body.1': module 1 is a Tanh there, module 0 a ReLU"),
        (lambda: Mismatch(width=5), r"'body.0.weight': shape \(5, 3\) in module 1"),
        (lambda: Mismatch(dtype=torch.float64), "'body.0.weight': dtype torch.float64 in module 1"),
        (lambda: Mismatch(extra=True), "module 1 has 'extra' where module 0 has 'body.0.weight'"),
        (lambda: Mismatch().train(False), "the root: module 1 is in eval mode there"),
        (lambda: nn.Linear(3, 4), "the root: module 1 is a Linear there, module 0 a Mismatch"),
    ],
)
def test_stack_modules_refuses_models_that_differ(other, message):
    with pytest.raises((ValueError, TypeError), match=message):
        ms.stack_modules([Mismatch(), other()])
    with pytest.raises((ValueError, TypeError), match=message):
        ms.Ensemble([Mismatch(), other()])


def test_stack_modules_through_state_dict_keeps_equal_extra_state_once():
    models = [WithExtraState() for _ in range(2)]
    stacked = ms.flatten(ms.stack_modules(models, use_state_dict=True))
    assert stacked["_extra_state"] == {"calls": 0, "note": "opaque"}
    assert stacked["linear.weight"].shape == (2, 3, 3)
    assert "scratch" not in stacked  # non-persistent: state_dict does not show it
    models[1].calls = 5
    with pytest.raises(
        ValueError, match="'_extra_state': the non-tensor value differs in module 1"
    ):
        ms.stack_modules(models, use_state_dict=True)


def test_stack_modules_keeps_non_persistent_buffers():
    stacked = ms.stack_modules([Mismatch(), Mismatch()])
    assert stacked["scale"].shape == (2, 1)


# -- vmap_call -------------------------------------------------------------------------------------


def mlp():
    return nn.Sequential(nn.Linear(5, 16), nn.GELU(), nn.Linear(16, 3))


def cnn():
    return nn.Sequential(
        nn.Conv2d(3, 4, 3, padding=1),
        nn.BatchNorm2d(4),
        nn.ReLU(),
        nn.Conv2d(4, 4, 3, stride=2, groups=2),
        nn.Flatten(),
        nn.Linear(4 * 3 * 3, 2),
    )


def encoder_layer():
    return nn.TransformerEncoderLayer(8, nhead=2, dim_feedforward=16, dropout=0.0, batch_first=True)


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
    ensemble = ms.Ensemble(models)
    ensemble(torch.randn(2))
    ensemble(torch.randn(2))
    assert ensemble.stacked.count.tolist() == [2.0, 2.0, 2.0]
    assert ensemble.state_dict()["stacked.count"].tolist() == [2.0, 2.0, 2.0]
    assert ensemble.member(0).count.item() == 2.0
    assert models[0].count.item() == 0.0


@pytest.mark.parametrize("case", CASES, ids=CASE_IDS)
def test_every_zoo_model_runs_as_an_ensemble(case):
    models = [case.make(seed) for seed in range(3)]
    x = case.input()
    expected = loop(models, x)
    base = models[0]
    before = snapshot(base)
    torch.testing.assert_close(
        ms.vmap_call(base, ms.stack_modules(models), x), expected, atol=ATOL, rtol=0
    )
    assert_unchanged(base, before)
    ensemble = ms.Ensemble(models)
    torch.testing.assert_close(ensemble(x), expected, atol=ATOL, rtol=0)
    torch.testing.assert_close(ensemble.member(1)(x), models[1](x), atol=ATOL, rtol=0)
    assert_unchanged(base, before)


@settings(max_examples=15, deadline=None)
@given(tree=module_trees())
def test_random_module_trees_run_as_ensembles(tree):
    build, width = tree
    models = [build(seed) for seed in range(2)]
    x = torch.randn(3, width)
    expected = loop(models, x)
    stacked = ms.stack_modules(models)
    for path, leaf in ms.flatten(ms.extract(models[0])).items():  # ties stay ties
        tied = [p for p, other in ms.flatten(ms.extract(models[0])).items() if other is leaf]
        assert all(ms.flatten(stacked)[p] is ms.flatten(stacked)[path] for p in tied)
    if stacked:
        out = ms.vmap_call(models[0], stacked, x)
        torch.testing.assert_close(out, expected, atol=ATOL, rtol=0)
    else:  # no state and a shared input: vmap_call cannot tell how many members there are
        with pytest.raises(ValueError, match="how many members"):
            ms.vmap_call(models[0], stacked, x)
    torch.testing.assert_close(ms.Ensemble(models)(x), expected, atol=ATOL, rtol=0)


# -- Ensemble: the batched kernels -----------------------------------------------------------------

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
    "transformer_encoder_layer": (encoder_layer, (2, 5, 8)),
    "cnn_with_batchnorm": (cnn, (2, 3, 8, 8)),
}
# In eval mode, TransformerEncoderLayer under vmap takes torch's fused inference kernel, which has
# no derivative: compare it in training mode (its dropout is 0).
TRAINING = {"transformer_encoder_layer", "cnn_with_batchnorm"}


def grads_of(ensemble):
    return {name: p.grad.clone() for name, p in ensemble.named_parameters()}


@pytest.mark.parametrize("layer", LAYERS)
@pytest.mark.parametrize("in_dims", [None, 0])
def test_ensemble_equals_the_loop_and_the_vmap_path_with_the_same_gradients(layer, in_dims):
    factory, shape = LAYERS[layer]
    models = [m.train(layer in TRAINING) for m in seeded(factory, 3)]
    before = [snapshot(m) for m in models]
    fast = ms.Ensemble(models, in_dims=in_dims)
    reference = ms.Ensemble(models, in_dims=in_dims, fast=False)
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
    for model, then in zip(models, before):
        assert_unchanged(model, then)


def test_known_layers_run_as_batched_kernels_and_the_rest_under_vmap():
    text = repr(ms.Ensemble(seeded(cnn, 2)))
    assert "members=2" in text and "path=batched kernels\n" in text  # BatchNorm2d included
    assert "Conv2d(3, 4" in text
    cumulative = ms.Ensemble(seeded(lambda: nn.Sequential(nn.BatchNorm1d(3, momentum=None)), 2))
    assert "batched kernels, vmap for BatchNorm1d" in repr(cumulative)
    assert "path=batched kernels\n" in repr(ms.Ensemble(seeded(mlp, 2)))
    assert "vmap over the whole model" in repr(ms.Ensemble(seeded(encoder_layer, 2)))


def test_layers_with_hooks_run_under_vmap_so_the_hooks_run():
    models = seeded(mlp, 2)
    calls = []
    models[0][0].register_forward_hook(lambda module, args, out: calls.append(out.shape))
    ensemble = ms.Ensemble(models)
    assert "vmap for Linear" in repr(ensemble)
    ensemble(torch.randn(3, 5))
    assert calls  # traced once under vmap, per member shape
    assert calls[-1] == (3, 16)


def test_ensemble_batchnorm_statistics_update_per_member():
    models = seeded(cnn, 3)  # training mode
    ensemble = ms.Ensemble(models, in_dims=0)
    x = torch.randn(3, 4, 3, 8, 8)
    out = ensemble(x)
    torch.testing.assert_close(out, loop(models, x, in_dims=0), atol=ATOL, rtol=0)
    batchnorm = ensemble.stacked.get_submodule("1")
    for name in ("running_mean", "running_var", "num_batches_tracked"):
        torch.testing.assert_close(
            getattr(batchnorm, name), torch.stack([getattr(m[1], name) for m in models])
        )


@pytest.mark.parametrize("fast", [True, False])
def test_ensemble_dropout_masks(fast):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(6, 64), nn.Dropout(0.5))
    models = [model, copy.deepcopy(model), copy.deepcopy(model)]
    x = torch.ones(6)
    reference = loop([m.eval() for m in models], x)
    for m in models:
        m.train()
    out = ms.Ensemble(models, randomness="different", fast=fast)(x)
    assert not torch.equal(out[0] == 0, out[1] == 0)
    same = ms.Ensemble(models, randomness="same", fast=fast)(x)
    assert torch.equal(same[0], same[2])
    refuses = ms.Ensemble(models, fast=fast)  # the default, as vmap_call's: "error"
    assert refuses.randomness == "error"
    with pytest.raises(RuntimeError, match="randomness"):
        refuses(x)
    refuses.eval()  # no randomness in eval mode
    torch.testing.assert_close(refuses(x), reference, atol=ATOL, rtol=0)


# -- Ensemble: the module ---------------------------------------------------------------------------


def test_ensemble_trains_with_torch_optim():
    torch.manual_seed(0)
    ensemble = ms.Ensemble.from_factory(mlp, 4)
    models_before = [copy.deepcopy(m) for m in ensemble.members()]
    optimizer = torch.optim.Adam(ensemble.parameters(), lr=1e-2)
    x, y = torch.randn(32, 5), torch.randn(32, 3)
    losses = []
    for _ in range(30):
        optimizer.zero_grad()
        loss = (ensemble(x) - y).square().mean()
        loss.backward()
        optimizer.step()
        losses.append(loss.item())
    assert losses[-1] < 0.7 * losses[0]
    trained = ensemble.members()
    assert not torch.equal(trained[0][0].weight, models_before[0][0].weight)
    torch.testing.assert_close(torch.stack([m(x) for m in trained]), ensemble(x), atol=ATOL, rtol=0)


def test_from_factory_builds_independent_members():
    torch.manual_seed(0)
    ensemble = ms.Ensemble.from_factory(lambda: nn.Linear(3, 2), 4)
    weights = ensemble.stacked.weight
    assert weights.shape == (4, 2, 3) and len(ensemble) == 4
    assert not torch.equal(weights[0], weights[1])
    with pytest.raises(ValueError, match="positive int"):
        ms.Ensemble.from_factory(lambda: nn.Linear(3, 2), 0)


def test_state_dict_round_trips_and_uses_the_models_paths():
    models = seeded(cnn, 2)
    ensemble = ms.Ensemble(models)
    state = ensemble.state_dict()
    assert list(state) == [f"stacked.{key}" for key in models[0].state_dict()]
    assert state["stacked.0.weight"].shape == (2, 4, 3, 3, 3)
    buffer = io.BytesIO()
    torch.save(state, buffer)
    buffer.seek(0)
    other = ms.Ensemble(seeded(cnn, 2, seed=1)).eval()
    other.load_state_dict(torch.load(buffer))
    x = torch.randn(2, 3, 8, 8)
    torch.testing.assert_close(other(x), ensemble.eval()(x), atol=ATOL, rtol=0)
    assert ms.flatten(ensemble.tree()).keys() == ms.flatten(ms.extract(models[0])).keys()
    assert ensemble.tree()["0"]["weight"] is ensemble.stacked.get_submodule("0").weight


def test_to_double_and_deepcopy():
    models = seeded(cnn, 2)
    ensemble = ms.Ensemble(models).eval()
    x = torch.randn(2, 3, 8, 8)
    expected = ensemble(x)
    assert ensemble.double() is ensemble
    assert all(p.dtype == torch.float64 for p in ensemble.parameters())
    torch.testing.assert_close(ensemble(x.double()), expected.double(), atol=ATOL, rtol=0)
    assert ensemble.member(0)[0].weight.dtype == torch.float64
    clone = copy.deepcopy(ensemble.float())
    with torch.no_grad():
        clone.stacked.get_submodule("5").bias.add_(1)
    torch.testing.assert_close(clone(x), expected + 1, atol=ATOL, rtol=0)
    torch.testing.assert_close(ensemble(x), expected, atol=ATOL, rtol=0)
    buffer = io.BytesIO()
    torch.save(ensemble, buffer)
    buffer.seek(0)
    loaded = torch.load(buffer, weights_only=False)
    torch.testing.assert_close(loaded(x), expected, atol=ATOL, rtol=0)
    with torch.no_grad():
        loaded.stacked.get_submodule("5").bias.sub_(1)
    torch.testing.assert_close(loaded(x), expected - 1, atol=ATOL, rtol=0)


def test_member_is_an_ordinary_independent_module():
    models = seeded(cnn, 3)
    for model in models:
        model[0].bias.requires_grad_(False)
    ensemble = ms.Ensemble(models)
    member = ensemble.member(1)
    assert type(member) is nn.Sequential and member.training
    assert isinstance(member[0].weight, nn.Parameter)
    assert not member[0].bias.requires_grad and member[0].weight.requires_grad
    for key, value in member.state_dict().items():
        torch.testing.assert_close(value, models[1].state_dict()[key], msg=key)
    with torch.no_grad():
        member[0].weight.zero_()
    assert ensemble.stacked.get_submodule("0").weight[1].abs().sum() > 0
    assert member is not ensemble.member(1)
    assert [m[0].weight.sum().item() for m in ensemble.members()] == pytest.approx(
        [m[0].weight.sum().item() for m in models]
    )
    with pytest.raises(IndexError, match="member index 3"):
        ensemble.member(3)


def test_ensemble_leaves_the_models_alone_and_train_eval_reach_every_layer():
    models = seeded(cnn, 2)
    before = [snapshot(m) for m in models]
    ensemble = ms.Ensemble(models)
    ensemble(torch.randn(2, 3, 8, 8)).sum().backward()
    for model, then in zip(models, before):
        assert_unchanged(model, then)
        assert all(p.grad is None for p in model.parameters())
    assert ensemble.eval().member(0)[1].training is False
    assert ensemble.train().member(0)[1].training is True


def test_ensemble_with_several_inputs_runs_under_vmap():
    class Pair(nn.Module):
        def __init__(self):
            super().__init__()
            self.lin = nn.Linear(3, 2)

        def forward(self, x, y):
            return self.lin(x) - y

    models = seeded(Pair, 3)
    x, y = torch.randn(4, 3), torch.randn(3, 4, 2)
    out = ms.Ensemble(models, in_dims=(None, 0))(x, y)
    torch.testing.assert_close(
        out, torch.stack([m(x, y[i]) for i, m in enumerate(models)]), atol=ATOL, rtol=0
    )


@pytest.mark.slow
def test_compiled_ensemble_equals_eager():
    models = seeded(mlp, 3)
    x = torch.randn(4, 5)
    compiled = ms.Ensemble(models, compile=True)
    assert "compiled" in repr(compiled)
    torch.testing.assert_close(compiled(x), ms.Ensemble(models)(x), atol=ATOL, rtol=0)
