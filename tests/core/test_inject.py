import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch import nn

import modstate as ms

from zoo import (
    CASE_IDS,
    CASES,
    Counter,
    GuardedAttributes,
    SharedBlock,
    TiedLM,
    assert_unchanged,
    forward_with,
    module_trees,
    snapshot,
)


def mlp() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(3, 4), nn.ReLU(), nn.BatchNorm1d(4), nn.Linear(4, 2))


def perturbed(tree, scale=0.1):
    return ms.unflatten(
        {
            k: (v.detach() + scale * torch.randn_like(v.float()).to(v.dtype)).requires_grad_(
                v.requires_grad
            )
            if v.is_floating_point()
            else v.clone()
            for k, v in ms.flatten(tree).items()
        }
    )


# -- inject ----------------------------------------------------------------------------------------


def test_inside_the_block_the_module_is_the_tree():
    model = mlp()
    tree = perturbed(ms.extract(model))
    with ms.inject(model, tree) as inside:
        assert inside is model
        assert model[0].weight is tree["0"]["weight"]
        assert [id(p) for p in model.parameters()] == [
            id(v) for k, v in ms.flatten(tree).items() if "running" not in k and "batches" not in k
        ]


def test_gradients_reach_the_tree_and_not_the_module():
    model = mlp().eval()
    tree = perturbed(ms.extract(model))
    with ms.inject(model, tree):
        model(torch.randn(5, 3)).sum().backward()
    assert tree["0"]["weight"].grad is not None
    assert model[0].weight.grad is None


def test_module_is_restored_exactly_also_when_the_body_raises():
    model = mlp()
    model[3].bias.requires_grad_(False)
    before = snapshot(model)
    with pytest.raises(ZeroDivisionError), ms.inject(model, perturbed(ms.extract(model))):
        model(torch.randn(5, 3))
        raise ZeroDivisionError
    assert_unchanged(model, before)
    assert isinstance(model[0].weight, nn.Parameter)
    assert not model[3].bias.requires_grad


def test_batchnorm_statistics_update_the_trees_buffers():
    model = mlp().train()
    tree = perturbed(ms.extract(model))
    before = snapshot(model)
    mean = tree["2"]["running_mean"].clone()
    with ms.inject(model, tree):
        model(torch.randn(8, 3))
    assert not torch.equal(tree["2"]["running_mean"], mean)
    assert tree["2"]["num_batches_tracked"].item() == 1
    assert_unchanged(model, before)


def test_a_reassigned_buffer_is_written_back_into_the_tree():
    counter = Counter()
    tree = ms.extract(counter, detach=True)
    tree["count"] = torch.tensor(5)
    own = counter.count
    with ms.inject(counter, tree):
        counter(torch.randn(2, 3))
        counter(torch.randn(2, 3))
    assert tree["count"].item() == 7
    assert counter.count is own and own.item() == 0


def test_tied_weights_one_path_sets_the_whole_tie():
    lm = TiedLM()
    new = torch.randn(10, 4)
    tree = ms.extract(lm)
    partial = {"embed": {"weight": new}}
    with ms.inject(lm, partial, strict=False):
        assert lm.head.weight is new and lm.embed.weight is new
    full = {**tree, "embed": {"weight": new}, "head": {"weight": new}}
    with ms.inject(lm, full):
        assert lm.head.weight is new
    strict_one_path = {k: v for k, v in tree.items() if k != "head"}
    with ms.inject(lm, {**strict_one_path, "embed": {"weight": new}}):
        assert lm.head.weight is new
    assert lm.head.weight is lm.embed.weight is tree["embed"]["weight"]


def test_tied_weights_given_different_tensors_are_refused():
    lm = TiedLM()
    before = snapshot(lm)
    tree = {**ms.extract(lm), "embed": {"weight": torch.randn(10, 4)}}
    with pytest.raises(ValueError, match=r"'embed.weight' and 'head.weight' are tied"):
        with ms.inject(lm, tree):
            pass
    assert_unchanged(lm, before)


def test_shared_submodule_and_setattr_override():
    for module in (SharedBlock(), GuardedAttributes()):
        tree = perturbed(ms.extract(module))
        before = snapshot(module)
        x = torch.randn(2, 3)
        with ms.inject(module, tree):
            inside = module(x)
        expected = forward_with(module, tree, x)
        assert torch.equal(inside, expected) and torch.equal(ms.call(module, tree, x), expected)
        assert not torch.allclose(inside, module(x))
        assert_unchanged(module, before)


def test_strict_false_accepts_partial_trees_and_other_dtypes():
    model = mlp().eval()
    x = torch.randn(4, 3)
    expected = model(x)
    head = {"3": {"weight": torch.zeros(2, 4), "bias": torch.ones(2)}}
    with ms.inject(model, head, strict=False):
        assert torch.equal(model(x), torch.ones(4, 2))
    assert torch.equal(model(x), expected)
    doubled = ms.unflatten(
        {k: v.double() for k, v in ms.flatten(ms.extract(model, detach=True)).items()}
    )
    with ms.inject(model, doubled, strict=False):
        assert model(x.double()).dtype == torch.float64


def test_nested_inject_restores_each_level():
    model = mlp()
    first, second = perturbed(ms.extract(model)), perturbed(ms.extract(model))
    own = model[0].weight
    with ms.inject(model, first):
        with ms.inject(model, second):
            assert model[0].weight is second["0"]["weight"]
        assert model[0].weight is first["0"]["weight"]
    assert model[0].weight is own


def test_legacy_spectral_norm_attribute_is_restored():
    layer = nn.utils.spectral_norm(nn.Linear(3, 3)).eval()
    layer(torch.randn(1, 3))
    before = snapshot(layer)
    with ms.inject(layer, perturbed(ms.extract(layer))):
        layer(torch.randn(1, 3))
    assert_unchanged(layer, before)


def test_lazy_module_computes_with_the_tree_and_stays_lazy():
    lazy = nn.LazyLinear(2)
    tree = {"weight": torch.randn(2, 3), "bias": torch.randn(2)}
    x = torch.randn(4, 3)
    with ms.inject(lazy, tree):
        out = lazy(x)
    assert torch.allclose(out, x @ tree["weight"].T + tree["bias"])
    assert isinstance(lazy, nn.LazyLinear)
    assert nn.parameter.is_lazy(lazy.weight)
    assert lazy(x).shape == (4, 2)  # still initializes itself on its first real call


# -- bad input: refused before anything changes ----------------------------------------------------


def _bad_trees(model):
    good = ms.extract(model, detach=True)
    yield "unknown path", r"'9.weight'", {**good, "9": {"weight": torch.ones(1)}}
    yield "unknown leaf", r"'0.gain'", {**good, "0": {**good["0"], "gain": torch.ones(1)}}
    yield "non-tensor", r"'3.bias'", {**good, "3": {**good["3"], "bias": [0.0, 0.0]}}
    yield "wrong shape", r"'3.bias'", {**good, "3": {**good["3"], "bias": torch.ones(3)}}
    yield (
        "wrong dtype",
        r"'0.weight'",
        {**good, "0": {**good["0"], "weight": good["0"]["weight"].double()}},
    )
    yield "missing", r"'3.bias'", {**good, "3": {"weight": good["3"]["weight"]}}
    yield "module as leaf", r"'3'", {**good, "3": torch.ones(2)}


OPERATIONS = {
    "inject": lambda m, t: ms.inject(m, t).__enter__(),
    "swap": lambda m, t: ms.swap(m, t),
    "load": lambda m, t: ms.load(m, t),
    "call": lambda m, t: ms.call(m, t, torch.randn(2, 3)),
    "inject-state_dict": lambda m, t: ms.inject(m, t, use_state_dict=True).__enter__(),
    "swap-state_dict": lambda m, t: ms.swap(m, t, use_state_dict=True),
    "load-state_dict": lambda m, t: ms.load(m, t, use_state_dict=True),
}


@pytest.mark.parametrize("name", OPERATIONS)
def test_bad_trees_are_refused_naming_the_path_and_change_nothing(name):
    model = mlp()
    for kind, path, tree in _bad_trees(model):
        if kind == "wrong dtype" and name == "load-state_dict":
            continue  # load_state_dict semantics: copying casts
        before = snapshot(model)
        with pytest.raises((KeyError, TypeError, ValueError), match=path):
            OPERATIONS[name](model, tree)
        assert_unchanged(model, before)


def test_non_tree_is_refused():
    with pytest.raises(TypeError, match="expected a tree"):
        ms.call(nn.Linear(1, 1), [torch.ones(1)], torch.ones(1))


# -- swap and load ---------------------------------------------------------------------------------


def test_swap_returns_what_it_replaced_and_swapping_back_undoes_it():
    model = mlp()
    before = snapshot(model)
    new = perturbed(ms.extract(model))
    old = ms.swap(model, new)
    own = ms.flatten(old)
    assert model[0].weight is new["0"]["weight"]
    assert {k: id(v) for k, v in own.items()} == {k: before[k][0] for k in own}
    back = ms.swap(model, old)
    assert back["0"]["weight"] is new["0"]["weight"]
    assert_unchanged(model, before)


def test_partial_swap_returns_the_partial_old_tree():
    lm = TiedLM()
    own = lm.embed.weight
    old = ms.swap(lm, {"head": {"weight": torch.zeros(10, 4)}}, strict=False)
    assert old == {"head": {"weight": own}}
    assert lm.embed.weight is lm.head.weight and not lm.embed.weight.any()
    ms.swap(lm, old, strict=False)
    assert lm.embed.weight is own is lm.head.weight


def test_load_copies_in_place_keeping_identity():
    online, target = mlp(), mlp()
    with torch.no_grad():
        for p in online.parameters():
            p.add_(1.0)
    before = snapshot(target)
    ms.load(target, ms.extract(online))
    after = snapshot(target)
    assert {k: v[0] for k, v in after.items()} == {k: v[0] for k, v in before.items()}
    for a, b in zip(
        ms.flatten(ms.extract(target)).values(),
        ms.flatten(ms.extract(online)).values(),
        strict=True,
    ):
        assert torch.equal(a, b)


def test_load_ema_update_with_lerp():
    online, ema = mlp(), mlp()
    with torch.no_grad():
        ema_tree = {
            k: torch.lerp(v.float(), ms.flatten(ms.extract(online))[k].float(), 0.5).to(v.dtype)
            for k, v in ms.flatten(ms.extract(ema)).items()
        }
    ms.load(ema, ms.unflatten(ema_tree))
    assert torch.equal(ema[0].weight, ema_tree["0.weight"])


def test_load_casts_dtypes_with_strict_false_and_refuses_shape_changes():
    model = mlp()
    doubled = ms.unflatten(
        {k: v.double() for k, v in ms.flatten(perturbed(ms.extract(model))).items()}
    )
    ms.load(model, doubled, strict=False)
    assert model[0].weight.dtype == torch.float32
    assert torch.allclose(model[0].weight.double(), doubled["0"]["weight"])
    with pytest.raises(ValueError, match="'0.bias'"):
        ms.load(model, {"0": {"bias": torch.ones(7)}}, strict=False)


# -- properties over the zoo and over random module trees ------------------------------------------


@pytest.mark.parametrize("case", CASES, ids=CASE_IDS)
def test_zoo_call_on_own_detached_state_equals_forward(case):
    module = case.make()
    x = case.input()
    expected = module(x)
    before = snapshot(module)
    out = ms.call(module, ms.extract(module, detach=True), x)
    assert torch.allclose(out, expected, atol=1e-6)
    assert_unchanged(module, before)


@pytest.mark.parametrize("case", CASES, ids=CASE_IDS)
def test_zoo_load_through_state_dict_round_trips(case):
    source, target = case.make(seed=1), case.make(seed=2)
    source(case.input())
    ms.load(target, ms.extract(source, use_state_dict=True), use_state_dict=True)
    expected, got = source.state_dict(), target.state_dict()
    assert list(got) == list(expected)
    for key, value in expected.items():
        assert (
            torch.equal(got[key], value) if isinstance(value, torch.Tensor) else got[key] == value
        )


@settings(max_examples=30, deadline=None)
@given(module_trees(), st.integers(0, 2**16))
def test_random_trees_round_trip(factory, seed):
    build, width = factory
    source, target = build(seed), build(seed + 1)
    ms.load(target, ms.extract(source, use_state_dict=True), use_state_dict=True)
    assert all(
        torch.equal(a, b)
        for a, b in zip(source.state_dict().values(), target.state_dict().values(), strict=True)
    )
    x = torch.randn(2, width)
    before = snapshot(target)
    assert torch.allclose(ms.call(target, ms.extract(source, detach=True), x), source(x))
    assert_unchanged(target, before)


@settings(max_examples=30, deadline=None)
@given(module_trees(), st.data())
def test_random_trees_refuse_corrupted_trees_atomically(factory, data):
    build, _ = factory
    module = build()
    flat = ms.flatten(ms.extract(module, detach=True))
    if not flat:
        return
    path = data.draw(st.sampled_from(sorted(flat)))
    corruption = data.draw(st.sampled_from(["shape", "type", "unknown"]))
    bad = dict(flat)
    if corruption == "shape":
        bad[path] = torch.zeros(*bad[path].shape, 2)
    elif corruption == "type":
        bad[path] = 1.5
    else:
        bad[path + "_typo"] = bad[path]
        path = path + "_typo"
    before = snapshot(module)
    for name in ("inject", "swap", "load", "load-state_dict"):
        with pytest.raises((KeyError, TypeError, ValueError), match=repr(path).replace(".", r"\.")):
            OPERATIONS[name](module, ms.unflatten(bad))
        assert_unchanged(module, before)
