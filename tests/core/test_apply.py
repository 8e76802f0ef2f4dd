"""ms.apply: the pure stateful call, checked against the stateful forward of a copy."""

import copy

import pytest
import torch
from torch import nn
from torch.func import grad, grad_and_value, vjp, vmap

import modstate as ms

from zoo import Counter, assert_unchanged, snapshot


def bn_model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(3, 4), nn.ReLU(), nn.BatchNorm1d(4), nn.Linear(4, 2))


def snapshot_tree(tree):
    return {
        path: (id(leaf), leaf.clone())
        for path, leaf in ms.flatten(tree).items()
        if leaf is not None
    }


def assert_tree_unchanged(tree, before):
    for path, leaf in ms.flatten(tree).items():
        if leaf is None:
            continue
        assert id(leaf) == before[path][0], path
        assert torch.equal(leaf, before[path][1]), f"{path} was mutated"


def assert_equal_trees(tree, reference):
    flat, ref = ms.flatten(tree), ms.flatten(reference)
    assert flat.keys() == ref.keys()
    for path in flat:
        assert torch.equal(flat[path], ref[path]), path


def test_train_mode_equals_the_stateful_forward_bit_for_bit_and_mutates_nothing():
    model = bn_model()
    reference = copy.deepcopy(model)
    params, state = ms.split(model, detach=True)
    before_params, before_state, before_module = (
        snapshot_tree(params),
        snapshot_tree(state),
        snapshot(model),
    )
    x = torch.randn(8, 3)
    out, new_state = ms.apply(model, params, state, x)
    assert torch.equal(out, reference(x))
    assert_equal_trees(new_state, ms.split(reference)[1])
    assert int(new_state["2"]["num_batches_tracked"]) == 1
    assert_tree_unchanged(params, before_params)
    assert_tree_unchanged(state, before_state)
    assert_unchanged(model, before_module)


def test_unchanged_leaves_come_back_as_the_same_objects():
    model = bn_model().eval()  # eval: BatchNorm reads its statistics, writes nothing
    params, state = ms.split(model, detach=True)
    _, new_state = ms.apply(model, params, state, torch.randn(8, 3))
    assert all(
        new is old
        for new, old in zip(ms.flatten(new_state).values(), ms.flatten(state).values(), strict=True)
    )


def test_buffers_of_training_modules_come_back_as_copies_frozen_parameters_as_they_are():
    model = nn.ModuleDict({"bn": nn.BatchNorm1d(4), "frozen": nn.Linear(4, 4)})
    model["frozen"].requires_grad_(False)
    model["frozen"].register_buffer("cache", torch.ones(4))
    params, state = ms.split(model, detach=True)

    def forward(x):
        return model["frozen"](model["bn"](x)) * model["frozen"].cache

    model.forward = forward
    _, new_state = ms.apply(model, params, state, torch.randn(8, 4))
    assert new_state["frozen"]["weight"] is state["frozen"]["weight"]  # a frozen parameter
    assert new_state["bn"]["running_mean"] is not state["bn"]["running_mean"]
    assert new_state["bn"]["num_batches_tracked"] is not state["bn"]["num_batches_tracked"]
    # In training mode a buffer comes back as its copy even if nothing wrote to it (a kernel can
    # write without a trace): a new tensor with the same value.
    assert new_state["frozen"]["cache"] is not state["frozen"]["cache"]
    assert torch.equal(new_state["frozen"]["cache"], state["frozen"]["cache"])
    model["frozen"].eval()
    _, new_state = ms.apply(model, params, state, torch.randn(8, 4))
    assert new_state["frozen"]["cache"] is state["frozen"]["cache"]


def test_statistics_a_kernel_writes_without_a_trace_come_back():
    # An Ensemble's batched BatchNorm updates views of the stacked statistics inside the kernel:
    # no version counter moves, and the owner is not a BatchNorm module.
    ensemble = ms.Ensemble([bn_model() for _ in range(2)])
    reference = copy.deepcopy(ensemble)
    params, state = ms.split(ensemble, detach=True)
    x = torch.randn(8, 3)
    out, new_state = ms.apply(ensemble, params, state, x)
    assert torch.equal(out, reference(x))
    assert_equal_trees(new_state, ms.split(reference)[1])
    assert int(state["stacked"]["2"]["num_batches_tracked"].sum()) == 0


def test_in_eval_mode_an_untouched_buffer_comes_back_as_itself_on_the_general_route_too():
    # A Mapping that is not a dict takes the general route (the fast one reads dicts only).
    from collections import OrderedDict

    model = nn.Sequential(nn.Linear(3, 4), nn.BatchNorm1d(4)).eval()
    params, state = ms.split(model, detach=True)
    x = torch.randn(2, 3)
    out, new_state = ms.apply(model, OrderedDict(params), state, x)
    assert new_state["1"]["running_mean"] is state["1"]["running_mean"]
    assert torch.equal(out, model(x))


def test_a_reassigned_buffer_comes_back_and_the_input_tree_keeps_its_own():
    model = Counter()
    params, state = ms.split(model, detach=True)
    count = state["count"]
    _, new_state = ms.apply(model, params, state, torch.randn(2, 3))
    assert int(new_state["count"]) == 1
    assert state["count"] is count and int(count) == 0
    assert int(model.count) == 0


def test_grad_with_has_aux_equals_backward_on_a_copy():
    model = bn_model()
    reference = copy.deepcopy(model)
    params, state = ms.split(model, detach=True)
    x, y = torch.randn(8, 3), torch.randn(8, 2)

    def loss(params, state):
        out, new_state = ms.apply(model, params, state, x)
        return (out - y).square().mean(), new_state

    grads, new_state = grad(loss, has_aux=True)(params, state)
    (reference(x) - y).square().mean().backward()
    assert_equal_trees(grads, {k: v.grad for k, v in ms.flatten(ms.split(reference)[0]).items()})
    assert_equal_trees(new_state, ms.split(reference)[1])


def test_grad_and_value_and_vjp():
    model = bn_model()
    params, state = ms.split(model, detach=True)
    x = torch.randn(8, 3)

    def loss(params):
        out, new_state = ms.apply(model, params, state, x)
        return out.sum(), new_state

    grads, (value, new_state) = grad_and_value(loss, has_aux=True)(params)
    out, pullback, aux_state = vjp(lambda p: ms.apply(model, p, state, x), params, has_aux=True)
    (vjp_grads,) = pullback(torch.ones_like(out))
    assert torch.equal(value, out.sum())
    assert_equal_trees(vjp_grads, grads)
    assert_equal_trees(aux_state, new_state)
    assert int(state["2"]["num_batches_tracked"]) == 0


def test_vmap_keeps_per_member_statistics():
    members = [bn_model() for _ in range(3)]
    for i, member in enumerate(members):
        torch.manual_seed(i)
        for p in member.parameters():
            p.data.normal_()
    params = ms.stack([ms.split(m, detach=True)[0] for m in members])
    state = ms.stack([ms.split(m, detach=True)[1] for m in members])
    xs = torch.randn(3, 8, 3)
    outs, new_state = vmap(lambda p, s, x: ms.apply(members[0], p, s, x))(params, state, xs)
    for i, member in enumerate(members):
        reference = copy.deepcopy(member)
        assert torch.allclose(outs[i], reference(xs[i]), atol=1e-6)
        member_state = ms.unstack(new_state)[i]
        assert_close = [
            torch.allclose(a, b, atol=1e-6)
            for a, b in zip(
                ms.flatten(member_state).values(),
                ms.flatten(ms.split(reference)[1]).values(),
                strict=True,
            )
        ]
        assert all(assert_close)
    assert int(state["2"]["num_batches_tracked"].sum()) == 0  # the stacked input is untouched


def test_vmap_of_grad_trains_an_ensemble_one_step():
    model = bn_model()
    params, state = ms.split(model, detach=True)
    params, state = ms.stack([params, params]), ms.stack([state, state])
    xs = torch.randn(2, 8, 3)

    def loss(params, state, x):
        out, new_state = ms.apply(model, params, state, x)
        return out.square().mean(), new_state

    grads, new_state = vmap(grad(loss, has_aux=True))(params, state, xs)
    assert grads["0"]["weight"].shape == (2, 4, 3)
    assert new_state["2"]["running_mean"].shape == (2, 4)
    assert not torch.equal(new_state["2"]["running_mean"][0], new_state["2"]["running_mean"][1])


def test_partition_halves_go_in_as_they_are():
    model = bn_model()
    reference = copy.deepcopy(model)
    trained, carried = ms.tree.partition(ms.extract(model), ms.tree.is_trainable)
    trained, carried = ms.tree.detach(trained), ms.tree.detach(carried)
    x = torch.randn(8, 3)
    out, new_carried = ms.apply(model, trained, carried, x)
    assert torch.equal(out, reference(x))
    assert torch.equal(new_carried["2"]["running_mean"], reference[2].running_mean)
    assert new_carried["0"]["weight"] is None  # the structure of the state half, holes included
    assert int(new_carried["2"]["num_batches_tracked"]) == 1


def test_a_buffer_in_params_is_refused_naming_it_and_the_fix_works():
    model = bn_model()
    floats, ints = ms.tree.partition(ms.extract(model, detach=True), ms.tree.is_float)
    before = snapshot_tree(floats)
    with pytest.raises(ValueError, match=r"'2\.running_mean' is a buffer.*is_trainable"):
        ms.apply(model, floats, ints, torch.randn(8, 3))
    assert_tree_unchanged(floats, before)
    trained, carried = ms.tree.partition(ms.extract(model), ms.tree.is_trainable)
    _, new_carried = ms.apply(model, trained, carried, torch.randn(8, 3))
    assert int(new_carried["2"]["num_batches_tracked"]) == 1


def test_a_missing_path_is_refused_naming_it_and_the_fix_works():
    model = bn_model()
    params, state = ms.split(model, detach=True)
    del state["2"]["running_var"]
    before = snapshot(model)
    with pytest.raises(KeyError, match=r"'2\.running_var'.*apply needs.*ms\.split\(module"):
        ms.apply(model, params, state, torch.randn(8, 3))
    assert_unchanged(model, before)
    params, state = ms.split(model, detach=True)  # the fix the message names
    ms.apply(model, params, state, torch.randn(8, 3))


def test_state_must_be_a_tree():
    model = bn_model()
    params, _ = ms.split(model)
    with pytest.raises(TypeError, match="state must be a tree"):
        ms.apply(model, params, [torch.zeros(1)], torch.randn(2, 3))


@pytest.mark.slow
def test_compile_fullgraph_in_train_mode():
    model = bn_model()
    reference = copy.deepcopy(model)
    params, state = ms.split(model, detach=True)
    x = torch.randn(8, 3)
    compiled = torch.compile(
        lambda p, s: ms.apply(model, p, s, x), fullgraph=True, backend="aot_eager"
    )
    out, new_state = compiled(params, state)
    assert torch.equal(out, reference(x))
    assert_equal_trees(new_state, ms.split(reference)[1])
    assert int(state["2"]["num_batches_tracked"]) == 0
    step = torch.compile(
        grad(
            lambda p, s: (lambda out, new: (out.sum(), new))(*ms.apply(model, p, s, x)),
            has_aux=True,
        ),
        fullgraph=True,
        backend="aot_eager",
    )
    grads, stepped = step(params, state)
    eager_grads, eager_stepped = grad(
        lambda p, s: (lambda out, new: (out.sum(), new))(*ms.apply(model, p, s, x)), has_aux=True
    )(params, state)
    assert_equal_trees(grads, eager_grads)
    assert_equal_trees(stepped, eager_stepped)


def test_vmap_with_unbatched_statistics_names_the_fix_and_the_fix_works():
    model = bn_model()
    params, state = ms.split(model, detach=True)
    stacked = ms.stack([params, params])
    x = torch.randn(8, 3)
    with pytest.raises(RuntimeError) as info:
        vmap(lambda p: ms.apply(model, p, state, x)[0])(stacked)
    assert "ms.stack" in "".join(info.value.__notes__)
    stacked_state = ms.stack([state, state])  # the fix the note names
    outs, new_state = vmap(lambda p, s: ms.apply(model, p, s, x))(stacked, stacked_state)
    assert outs.shape == (2, 8, 2)
    assert new_state["2"]["running_mean"].shape == (2, 4)
