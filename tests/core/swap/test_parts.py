"""A tuple of trees that together give every path once (``_core/swap/parts.py``) takes the
compiled route: ``(params, state)`` from ``split``, the halves of ``tree.partition`` with their
None holes, any split of the paths; what does not fit goes the path-by-path route, with its errors.
``apply``'s ``(params, state)`` is read by the same readers, from the same cache, and every result
of its fast route equals the general route's."""

from __future__ import annotations

import importlib

import pytest
import torch
from torch import nn

import modstate as ms
from modstate._core.module.anatomy import anatomy_of
from modstate._core.swap import parts

from zoo import Counter, TiedLM


def spy_on_readers(monkeypatch) -> list[bool]:
    """Record, for each new structure of parts, whether it fits the compiled route."""
    seen: list[bool] = []

    class Recorded(parts.PartsReader):
        def __init__(self, anatomy, module, trees):
            super().__init__(anatomy, module, trees)
            seen.append(self.fits)

    monkeypatch.setattr(parts, "PartsReader", Recorded)
    return seen


def test_split_halves_take_the_compiled_route_and_compute_what_one_tree_does(monkeypatch):
    seen = spy_on_readers(monkeypatch)
    model = nn.Sequential(nn.Linear(3, 4), nn.BatchNorm1d(4), nn.Linear(4, 2)).eval()
    params, state = ms.split(model, detach=True)
    x = torch.randn(5, 3)
    for _ in range(3):  # the reader is made once, then reads
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
    seen = spy_on_readers(monkeypatch)
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
    seen = spy_on_readers(monkeypatch)
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


def test_the_readers_kept_per_module_stay_few():
    model = nn.Linear(3, 2)
    weight = {"weight": model.weight.detach()}
    bias = {"bias": model.bias.detach()}
    x = torch.randn(1, 3)
    for i in range(3 * parts._MOST_READERS):
        extra = [{} for _ in range(i % (parts._MOST_READERS + 3))]  # a new structure each time
        ms.call(model, (weight, bias, *extra), x)
    assert len(parts._readers[anatomy_of(model)]) <= parts._MOST_READERS
    net = nn.BatchNorm1d(3)
    params, state = ms.split(net, detach=True)
    for i in range(3 * parts._MOST_READERS):
        extra = {f"x{j}": {} for j in range(i)}  # a new structure of state each time
        ms.apply(net, params, {**state, **extra}, torch.randn(4, 3))
    assert len(parts._readers[anatomy_of(net)]) <= parts._MOST_READERS


def test_call_and_apply_share_one_reader_per_structure(monkeypatch):
    seen = spy_on_readers(monkeypatch)
    net = bn_model().train()
    params, state = ms.split(net, detach=True)
    x = torch.randn(6, 3)
    ms.call(net, (params, state), x)
    ms.apply(net, params, state, x)
    ms.call(net, (params, state), x)
    assert seen == [True]
    assert len(parts._readers[anatomy_of(net)]) == 1


# apply's fast route


def general_route(monkeypatch) -> None:
    # modstate._core.apply is also the name of the function that _core re-exports
    apply_module = importlib.import_module("modstate._core.apply")
    monkeypatch.setattr(apply_module, "_apply_in_plan_order", lambda *args: None)


def bn_model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(3, 4), nn.BatchNorm1d(4), nn.Linear(4, 2))


def assert_same_trees(got, want):
    assert ms.flatten(got).keys() == ms.flatten(want).keys()
    for path, leaf in ms.flatten(want).items():
        assert torch.equal(ms.flatten(got)[path], leaf), path


@pytest.mark.parametrize("training", [True, False], ids=["train", "eval"])
def test_the_fast_route_returns_what_the_general_route_does(monkeypatch, training):
    net = bn_model().train(training)
    params, state = ms.split(net, detach=True)
    x = torch.randn(6, 3)
    fast = [ms.apply(net, params, state, x) for _ in range(2)]  # the reader made, then reads
    (reader,) = parts._readers[anatomy_of(net)]
    assert reader.fits and reader.buffers_in_last
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
    net = bn_model().eval()
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
    net = bn_model().eval()
    params, state = ms.split(net, detach=True)
    ms.apply(net, params, state, torch.randn(6, 3))
    wrong = {**params, "0": {**params["0"], "bias": torch.zeros(5)}}
    with pytest.raises(ValueError, match=r"apply: '0\.bias'"):
        ms.apply(net, wrong, state, torch.randn(6, 3))
