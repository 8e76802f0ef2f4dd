"""Errors read "<function>: '<path>': <what>; <fix>", and the fix they name works where the user is."""

import pickle

import pytest
import torch
from torch import nn

import modstate as ms
from modstate._core.errors import MissingPaths

from zoo import assert_unchanged, snapshot


def model(hidden: int = 4, out: int = 1) -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(
        nn.Linear(3, hidden), nn.ReLU(), nn.BatchNorm1d(hidden), nn.Linear(hidden, out)
    ).eval()


def test_calls_shape_error_says_the_tree_is_another_models_and_that_model_takes_it():
    net, x = model(), torch.randn(5, 3)
    tree = ms.extract(model(out=2), copy=True)  # issue 22: a head of another shape
    before = snapshot(net)
    with pytest.raises(
        ValueError,
        match=r"^call: '3\.weight': shape \(2, 4\) in the tree, \(1, 4\) in the module, and 1 "
        r"more of the tree's tensors have other shapes than the module's: the tree is another "
        r"model's \(another architecture or configuration\); build the model the tree was taken "
        r"from",
    ):
        ms.call(net, tree, x)
    assert_unchanged(net, before)

    # issue 42: call_partial or strict=False would run this model with a wider head (another
    # architecture, without a word); the fix is the model the tree belongs to.
    owner = model(out=2)
    out = ms.call(owner, tree, x)
    assert torch.equal(out, owner(x)) and out.shape == (5, 2)


@pytest.mark.parametrize("function", ["call", "inject", "apply", "load"])
def test_no_function_suggests_running_another_architecture(function):
    net, x = model(), torch.randn(5, 3)
    tree = ms.extract(model(hidden=8), copy=True)  # a wider hidden layer: 7 tensors differ
    before = snapshot(net)
    with pytest.raises(ValueError, match=rf"^{function}: '0\.weight': .* and 6 more") as info:
        if function == "call":
            ms.call(net, tree, x)
        elif function == "inject":
            with ms.inject(net, tree):
                pass
        elif function == "apply":
            ms.apply(net, *ms.split(model(hidden=8)), x)
        else:
            ms.load(net, tree, strict=False)  # even lenient, load never takes other shapes
    message = str(info.value)
    assert "another model's" in message
    assert "strict=False" not in message and "call_partial" not in message
    assert "ms.swap" not in message
    assert_unchanged(net, before)
    wide = model(hidden=8)
    ms.load(wide, tree)  # the fix: the model the tree was taken from takes it
    assert torch.equal(ms.call(wide, tree, x), wide(x))


def test_a_stacked_tree_is_named_a_stack_and_vmap_call_or_unstack_runs_it():
    net, x = model(), torch.randn(5, 3)
    members = [ms.extract(model(), copy=True) for _ in range(3)]
    for i, member in enumerate(members):
        member["3"]["bias"] += i  # three members that differ
    stacked = ms.stack(members)
    with pytest.raises(
        ValueError,
        match=r"^call: '0\.weight': shape \(3, 4, 3\) in the tree, \(4, 3\) in the module: a "
        r"stack of 3 trees .*ms\.vmap_call\(module, stacked, x\).*ms\.unstack\(stacked\)\[i\]",
    ):
        ms.call(net, stacked, x)
    outs = ms.vmap_call(net, stacked, x)  # fix 1: every member at once
    one = ms.call(net, ms.unstack(stacked)[2], x)  # fix 2: one member
    for i, member in enumerate(members):
        torch.testing.assert_close(outs[i], ms.call(net, member, x))
    assert torch.equal(one, ms.call(net, members[2], x))


def test_injects_dtype_error_names_strict_false_and_gradcheck_runs_with_it():
    net = model()
    tree = ms.tree.to(ms.extract(net, copy=True), torch.float64)  # gradcheck wants float64
    with pytest.raises(
        TypeError,
        match=r"^inject: '0\.weight': dtype torch\.float64 in the tree, torch\.float32 in the "
        r"module; strict=False accepts other dtypes",
    ):
        with ms.inject(net, tree):
            pass

    def forward(x: torch.Tensor) -> torch.Tensor:
        with ms.inject(net, tree, strict=False):  # the fix
            return net(x)

    x = torch.randn(5, 3, dtype=torch.float64, requires_grad=True)
    assert forward(x).dtype == torch.float64
    assert torch.autograd.gradcheck(forward, (x,))


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


def floated_counter_tree(net: nn.Module) -> dict:
    """What an op on every leaf gives: BatchNorm's counter made floating-point, and fractional."""
    tree = ms.extract(net, copy=True)
    tree["2"]["num_batches_tracked"] = tree["2"]["num_batches_tracked"].double() + 2.5
    return tree


@pytest.mark.parametrize("function", ["load", "call", "inject"])
def test_a_floated_counter_is_not_offered_strict_false_and_the_named_fix_keeps_the_counter(
    function,
):
    # issue 41: strict=False would turn 2.5 into 2 (load) or give the module a float counter.
    net, x = model(), torch.randn(5, 3)
    net[2].num_batches_tracked.fill_(7)
    tree, before = floated_counter_tree(net), snapshot(net)
    runs = {
        "load": lambda t: ms.load(net, t),
        "call": lambda t: ms.call(net, t, x),
        "inject": lambda t: ms.inject(net, t).__enter__(),
    }
    with pytest.raises(TypeError) as info:
        runs[function](tree)
    text = str(info.value)
    assert text.startswith(
        f"{function}: '2.num_batches_tracked': dtype torch.float64 in the tree, torch.int64 in "
        "the module; an integer counter"
    ), text
    assert "strict=False would round it" in text and "strict=False casts" not in text
    assert "strict=False accepts" not in text and "strict=False assigns" not in text
    assert_unchanged(net, before)

    model_ = net  # the fix's words, where the user's model is called model
    fixed = ms.tree.combine(ms.tree.partition(ms.extract(model_), ms.tree.is_float)[1], tree)
    if function == "inject":
        with ms.inject(net, fixed):
            assert torch.equal(net(x), ms.call(net, fixed, x))
    else:
        runs[function](fixed)
    assert net[2].num_batches_tracked.dtype == torch.int64
    assert int(net[2].num_batches_tracked) == 7
    assert torch.equal(ms.call(net, fixed, x), ms.call(net, ms.extract(net), x))


def test_other_dtypes_still_name_strict_false():
    net = model()
    tree = ms.tree.to(ms.extract(net, copy=True), torch.float64)
    with pytest.raises(TypeError, match=r"strict=False casts the values to the module's dtypes"):
        ms.load(net, tree)
