"""apply's fast route (``_core/apply_plan.py``): ``(params, state)`` of a structure met before are
read by a plan, and every result equals the general route's; trees that do not fit take the
general route, with its errors."""

from __future__ import annotations

import importlib

import pytest
import torch
from torch import nn

import modstate as ms
from modstate._core.module.anatomy import anatomy_of
from modstate._core.swap import apply_plan

from zoo import Counter


def general_route(monkeypatch) -> None:
    # modstate._core.apply is also the name of the function that _core re-exports
    apply_module = importlib.import_module("modstate._core.apply")
    monkeypatch.setattr(apply_module, "_apply_in_plan_order", lambda *args: None)


def model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(3, 4), nn.BatchNorm1d(4), nn.Linear(4, 2))


def assert_same_trees(got, want):
    assert ms.flatten(got).keys() == ms.flatten(want).keys()
    for path, leaf in ms.flatten(want).items():
        assert torch.equal(ms.flatten(got)[path], leaf), path


@pytest.mark.parametrize("training", [True, False], ids=["train", "eval"])
def test_the_fast_route_returns_what_the_general_route_does(monkeypatch, training):
    net = model().train(training)
    params, state = ms.split(net, detach=True)
    x = torch.randn(6, 3)
    fast = [ms.apply(net, params, state, x) for _ in range(2)]  # the plan made, then read
    (plan,) = apply_plan._plans[anatomy_of(net)]
    assert plan.fits
    general_route(monkeypatch)
    out, new_state = ms.apply(net, params, state, x)
    for fast_out, fast_state in fast:
        assert torch.equal(fast_out, out)
        assert_same_trees(fast_state, new_state)
        # the same leaves come back as the same objects, on both routes
        for path, leaf in ms.flatten(new_state).items():
            kept = leaf is ms.flatten(state)[path]
            assert (ms.flatten(fast_state)[path] is ms.flatten(state)[path]) == kept, path
    assert int(state["1"]["num_batches_tracked"]) == 0  # nothing given was written to


def test_a_reassigned_buffer_comes_back_and_the_given_one_is_untouched():
    counter = Counter()
    params, state = ms.split(counter, detach=True)
    for _ in range(2):
        _, new_state = ms.apply(counter, params, state, torch.randn(1, 3))
        assert new_state["count"].item() == 1 and state["count"].item() == 0
    assert counter.count.item() == 0


def test_a_hole_filled_or_a_leaf_left_out_is_read_by_another_plan():
    net = model().eval()
    params, state = ms.split(net, detach=True)
    x = torch.randn(6, 3)
    want = ms.apply(net, params, state, x)[0]
    trainable, frozen = ms.tree.partition(ms.extract(net, detach=True), ms.tree.is_trainable)
    assert torch.equal(ms.apply(net, trainable, frozen, x)[0], want)  # holes
    moved = ms.tree.combine(trainable, ms.tree.select(frozen, "1.running_*"))
    rest = ms.tree.exclude(frozen, "1.running_*")
    with pytest.raises(ValueError, match=r"'1\.running_mean' is a buffer, given in params"):
        ms.apply(net, moved, rest, x)
    missing = {**state, "1": {k: v for k, v in state["1"].items() if k != "running_var"}}
    with pytest.raises(KeyError, match=r"'1\.running_var'"):
        ms.apply(net, params, missing, x)


def test_other_shapes_are_refused_with_the_path():
    net = model().eval()
    params, state = ms.split(net, detach=True)
    ms.apply(net, params, state, torch.randn(6, 3))
    wrong = {**params, "0": {**params["0"], "bias": torch.zeros(5)}}
    with pytest.raises(ValueError, match=r"apply: '0\.bias'"):
        ms.apply(net, wrong, state, torch.randn(6, 3))


def test_the_plans_kept_per_module_stay_few():
    net = nn.BatchNorm1d(3)
    params, state = ms.split(net, detach=True)
    x = torch.randn(4, 3)
    for i in range(3 * apply_plan._MOST_PLANS):
        extra = {f"x{j}": {} for j in range(i)}  # a new structure of state each time
        ms.apply(net, params, {**state, **extra}, x)
    assert len(apply_plan._plans[anatomy_of(net)]) <= apply_plan._MOST_PLANS
