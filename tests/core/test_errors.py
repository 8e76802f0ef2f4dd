"""Errors read "<function>: '<path>': <what>; <fix>", and the fix they name works where the user is."""

import pickle

import pytest
import torch
from torch import nn

import modstate as ms
from modstate._core.errors import MissingPaths

from zoo import assert_unchanged, snapshot


def model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(3, 4), nn.ReLU(), nn.BatchNorm1d(4), nn.Linear(4, 1)).eval()


def test_calls_shape_error_names_fixes_that_work_with_call():
    net, x = model(), torch.randn(5, 3)
    tree = ms.extract(net, copy=True)
    tree["3"]["weight"] = torch.randn(2, 4)  # issue 22: a head of another shape
    before = snapshot(net)
    with pytest.raises(
        ValueError,
        match=r"^call: '3\.weight': shape \(2, 4\) in the tree, \(1, 4\) in the module; ",
    ) as info:
        ms.call(net, tree, x)
    message = str(info.value)
    assert "ms.call_partial(module, tree, ...)" in message
    assert "ms.inject(module, tree, strict=False)" in message
    assert "strict=False accepts" not in message  # call has no strict option to pass
    assert_unchanged(net, before)

    out = ms.call_partial(net, tree, x)  # fix 1
    with ms.inject(net, tree, strict=False):  # fix 2
        assert torch.equal(net(x), out)
    assert out.shape == (5, 2)
    assert_unchanged(net, before)


def test_calls_dtype_error_names_the_same_fixes_and_they_work():
    net, x = model(), torch.randn(5, 3, dtype=torch.float64)
    tree = ms.tree.to(ms.extract(net, copy=True), torch.float64)
    with pytest.raises(
        TypeError, match=r"^call: '0\.weight': dtype torch\.float64.*ms\.call_partial"
    ):
        ms.call(net, tree, x)
    out = ms.call_partial(net, tree, x)
    assert out.dtype == torch.float64
    with ms.inject(net, tree, strict=False):
        assert torch.equal(net(x), out)


def test_injects_shape_error_names_strict_false_and_it_works():
    net, x = model(), torch.randn(5, 3)
    tree = ms.extract(net, copy=True)
    tree["3"]["weight"] = torch.randn(2, 4)
    with pytest.raises(
        ValueError, match=r"^inject: '3\.weight': shape .*; strict=False accepts other shapes"
    ):
        with ms.inject(net, tree):
            pass
    with ms.inject(net, tree, strict=False):
        assert net(x).shape == (5, 2)


def test_applys_errors_name_apply_and_its_fix():
    net = model().train()
    params, state = ms.split(net, detach=True)
    params = ms.tree.to(params, torch.float64)
    with pytest.raises(TypeError, match=r"^apply: '0\.weight': dtype torch\.float64.*ms\.split"):
        ms.apply(net, params, state, torch.randn(5, 3))
    out, _ = ms.apply(net, *ms.split(net, detach=True), torch.randn(5, 3))  # the fix
    assert out.shape == (5, 1)


@pytest.mark.parametrize(
    "function",
    [
        lambda m, t: ms.call(m, t, torch.randn(2, 3)),
        lambda m, t: ms.call_partial(m, t, torch.randn(2, 3)),
        lambda m, t: ms.inject(m, t).__enter__(),
        lambda m, t: ms.swap(m, t),
        lambda m, t: ms.load(m, t),
    ],
    ids=["call", "call_partial", "inject", "swap", "load"],
)
def test_every_function_names_itself_and_the_path(function, request):
    name = request.node.callspec.id
    net = model()
    tree = ms.flatten(ms.extract(net))
    tree["9.weight"] = torch.zeros(1)
    before = snapshot(net)
    with pytest.raises(KeyError, match=rf"^{name}: '9\.weight': unknown path: .*; "):
        function(net, ms.unflatten(tree))
    assert_unchanged(net, before)


def test_missing_paths_lists_every_path_and_survives_pickling():
    net = model()
    partial = ms.unflatten(dict(net.named_parameters()))
    with pytest.raises(MissingPaths) as info:
        ms.load(net, partial)
    error = info.value
    assert error.paths == ["2.running_mean", "2.running_var", "2.num_batches_tracked"]
    assert str(error).startswith(
        "load: '2.running_mean': the tree has no tensor there, nor at '2.running_var', "
        "'2.num_batches_tracked' (3 paths missing); pass strict=False"
    )
    ms.load(net, partial, strict=False)  # the fix it names
    again = pickle.loads(pickle.dumps(error))  # errors travel between processes
    assert type(again) is MissingPaths and str(again) == str(error) and again.paths == error.paths


def test_flatten_and_unflatten_errors_name_the_function_and_path():
    with pytest.raises(
        TypeError, match=r"^flatten: 'a\.3': the key 3 is of type int; tree keys are strings"
    ):
        ms.flatten({"a": {3: torch.ones(1)}})
    with pytest.raises(
        ValueError, match=r"^unflatten: 'a\.b': lies under 'a', which is already a leaf"
    ):
        ms.unflatten({"a": torch.ones(1), "a.b": torch.ones(1)})
