"""A tuple of trees that together give every path once (``_core/parts.py``) takes the compiled
route: ``(params, state)`` from ``split``, the halves of ``tree.partition`` with their None holes,
any split of the paths; what does not fit goes the path-by-path route, with its errors."""

from __future__ import annotations

import pytest
import torch
from torch import nn

import modstate as ms
from modstate._core.module.anatomy import anatomy_of
from modstate._core.swap import parts

from zoo import Counter, TiedLM


def spy_on_plans(monkeypatch) -> list[bool]:
    """Record, for each new structure of parts, whether it fits the compiled route."""
    seen: list[bool] = []

    class Recorded(parts._Plan):
        def __init__(self, anatomy, trees):
            super().__init__(anatomy, trees)
            seen.append(self.fits)

    monkeypatch.setattr(parts, "_Plan", Recorded)
    return seen


def test_split_halves_take_the_compiled_route_and_compute_what_one_tree_does(monkeypatch):
    seen = spy_on_plans(monkeypatch)
    model = nn.Sequential(nn.Linear(3, 4), nn.BatchNorm1d(4), nn.Linear(4, 2)).eval()
    params, state = ms.split(model, detach=True)
    x = torch.randn(5, 3)
    for _ in range(3):  # the plan is made once, then read
        out = ms.call(model, (params, state), x)
    assert seen == [True]
    assert torch.equal(out, ms.call(model, ms.extract(model, detach=True), x))
    floats, ints = ms.tree.partition(ms.extract(model, detach=True), ms.tree.is_float)
    assert torch.equal(ms.call(model, (floats, ints), x), out)  # None holes: empty subtrees
    assert seen == [True, True]


def test_a_reassigned_buffer_lands_in_the_part_that_gave_it():
    counter = Counter()
    params, state = ms.split(counter, detach=True)
    ms.call(counter, (params, state), torch.randn(1, 3))
    assert state["count"].item() == 1 and counter.count.item() == 0
    assert "count" not in params


def test_a_tie_given_in_one_part_is_one_tensor():
    lm = TiedLM()
    tree = ms.extract(lm, detach=True)
    embed, rest = ms.tree.select(tree, "embed.*"), ms.tree.exclude(tree, "embed.*")
    tokens = torch.randint(0, 10, (2, 5))
    assert torch.equal(ms.call(lm, (embed, rest), tokens), ms.call(lm, tree, tokens))


def test_parts_that_do_not_fit_take_the_path_by_path_route_and_its_errors(monkeypatch):
    seen = spy_on_plans(monkeypatch)
    model = nn.Sequential(nn.Linear(3, 4), nn.BatchNorm1d(4))
    params, state = ms.split(model, detach=True)
    x = torch.randn(5, 3)
    with pytest.raises(ValueError, match=r"'1\.running_mean': given by two of the trees"):
        ms.call(model, (ms.extract(model), state), x)
    with pytest.raises(KeyError, match=r"'1\.running_mean'"):
        ms.call(model, (params,), x)
    with pytest.raises(KeyError, match="'nope'"):
        ms.call(model, (params, {**state, "nope": torch.ones(1)}), x)
    assert seen == [False, False, False]
    # A partial pair is fine for call_partial, which keeps the module's own tensors elsewhere.
    out = ms.call_partial(model, (params,), x)
    assert out.shape == (5, 4)


def test_a_path_given_twice_in_one_part_as_a_dotted_key_and_nested_is_refused():
    # One reader path for two entries: the compiled route would read one and drop the other.
    model = nn.Sequential(nn.Linear(2, 1))
    weight = {"0.weight": torch.ones(1, 2), "0": {"weight": torch.full((1, 2), 5.0)}}
    with pytest.raises(ValueError, match=r"'0\.weight': given twice in one tree"):
        ms.call(model, (weight, {"0": {"bias": torch.zeros(1)}}), torch.ones(1, 2))


def test_a_tensor_where_the_plan_had_a_hole_is_not_ignored(monkeypatch):
    seen = spy_on_plans(monkeypatch)
    model = nn.Sequential(nn.Linear(3, 4), nn.BatchNorm1d(4))
    tree = ms.extract(model, detach=True)
    floats, ints = ms.tree.partition(tree, ms.tree.is_float)
    x = torch.randn(5, 3)
    ms.call(model, (floats, ints), x)
    floats["1"]["num_batches_tracked"] = ints["1"]["num_batches_tracked"]  # given twice now
    with pytest.raises(ValueError, match="given by two of the trees"):
        ms.call(model, (floats, ints), x)
    assert seen == [True, False]


def test_flat_keys_in_a_part_and_a_reassigned_buffer_written_back_there():
    counter = Counter()
    params, state = ms.split(counter, detach=True)
    flat_params = ms.flatten(params)  # state_dict-style keys: "linear.weight"
    ms.call(counter, (flat_params, state), torch.randn(1, 3))
    ms.call(counter, (flat_params, state), torch.randn(1, 3))
    assert state["count"].item() == 2


def test_the_plans_kept_per_module_stay_few(monkeypatch):
    model = nn.Linear(3, 2)
    weight = {"weight": model.weight.detach()}
    bias = {"bias": model.bias.detach()}
    x = torch.randn(1, 3)
    for i in range(3 * parts._MOST_PLANS):
        extra = [{} for _ in range(i % (parts._MOST_PLANS + 3))]  # a new structure each time
        ms.call(model, (weight, bias, *extra), x)
    assert len(parts._plans[anatomy_of(model)]) <= parts._MOST_PLANS
