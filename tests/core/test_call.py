import pytest
import torch
from torch import nn
from torch.func import grad, jacrev, vmap

import modstate as ms

from zoo import Counter, TiedLM, assert_unchanged, snapshot


def mlp() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(3, 8), nn.Tanh(), nn.Linear(8, 1))


def test_call_equals_forward_and_leaves_the_module_alone():
    model = mlp()
    tree = ms.extract(model, detach=True)
    x = torch.randn(4, 3)
    before = snapshot(model)
    assert torch.equal(ms.call(model, tree, x), model(x))
    assert_unchanged(model, before)


def test_keyword_arguments_go_to_forward():
    attention = nn.MultiheadAttention(4, 2, batch_first=True)
    q = torch.randn(1, 3, 4)
    out, weights = ms.call(attention, ms.extract(attention), q, q, q, need_weights=True)
    assert out.shape == (1, 3, 4) and weights.shape == (1, 3, 3)


def test_grad_matches_autograd_on_the_module():
    model = mlp()
    x = torch.randn(4, 3)
    grads = grad(lambda t: ms.call(model, t, x).square().mean())(ms.extract(model, detach=True))
    model(x).square().mean().backward()
    for (path, g), p in zip(ms.flatten(grads).items(), model.parameters(), strict=True):
        assert torch.allclose(g, p.grad), path


def test_vmap_over_a_stack_of_trees_keeps_identity_and_requires_grad():
    model = mlp()
    model[2].bias.requires_grad_(False)
    before = snapshot(model)
    trees = [ms.extract(mlp(), detach=True) for _ in range(3)]
    stacked = {k: torch.stack([ms.flatten(t)[k] for t in trees]) for k in ms.flatten(trees[0])}
    x = torch.randn(4, 3)
    out = vmap(lambda t: ms.call(model, t, x))(ms.unflatten(stacked))
    for i, tree in enumerate(trees):
        assert torch.allclose(out[i], ms.call(model, tree, x), atol=1e-6)
    assert_unchanged(model, before)  # tensordict 0.15.3 loses both after a vmapped to_module
    assert isinstance(model[0].weight, nn.Parameter) and not model[2].bias.requires_grad


def test_per_sample_gradients_with_vmap_of_grad():
    model = mlp()
    tree = ms.extract(model, detach=True)
    xs, ys = torch.randn(5, 3), torch.randn(5, 1)

    def loss(t, x, y):
        return (ms.call(model, t, x[None]) - y).square().sum()

    per_sample = vmap(grad(loss), in_dims=(None, 0, 0))(tree, xs, ys)
    for i in range(5):
        single = grad(loss)(tree, xs[i], ys[i])
        assert torch.allclose(per_sample["0"]["weight"][i], single["0"]["weight"], atol=1e-6)


def test_jacrev_with_respect_to_the_tree():
    layer = nn.Linear(3, 2)
    x = torch.randn(3)
    jac = jacrev(lambda t: ms.call(layer, t, x))(ms.extract(layer, detach=True))
    assert jac["weight"].shape == (2, 2, 3)
    assert torch.allclose(jac["bias"], torch.eye(2))


def test_a_tuple_of_trees_splits_parameters_from_buffers():
    model = nn.Sequential(nn.Linear(3, 4), nn.BatchNorm1d(4), nn.Linear(4, 1)).eval()
    params = ms.extract(model, buffers=False, detach=True)
    buffers = ms.unflatten(
        {k: v for k, v in ms.flatten(ms.extract(model)).items() if "running" in k or "batches" in k}
    )
    x = torch.randn(5, 3)
    grads = grad(lambda p: ms.call(model, (p, buffers), x).sum())(
        params
    )  # integer buffers stay out
    assert set(ms.flatten(grads)) == set(ms.flatten(params))
    assert torch.allclose(ms.call(model, (params, buffers), x), model(x))
    with pytest.raises(ValueError, match=r"call: '1\.running_mean': given by two of the trees"):
        ms.call(model, (ms.extract(model), buffers), x)
    with pytest.raises(KeyError, match="'1.running_mean'"):
        ms.call(model, (params,), x)


def test_tied_weights_like_functional_call():
    lm = TiedLM()
    tree = ms.extract(lm, detach=True)
    tokens = torch.randint(0, 10, (2, 5))
    grads = grad(lambda t: ms.call(lm, t, tokens).sum())(tree)
    lm(tokens).sum().backward()
    # One tensor at two paths: its gradient sums both uses, as autograd on the module does.
    assert torch.allclose(grads["embed"]["weight"], lm.embed.weight.grad, atol=1e-6)


def test_a_reassigned_buffer_lands_in_the_tree_dict():
    counter = Counter()
    tree = ms.extract(counter, detach=True)
    ms.call(counter, tree, torch.randn(1, 3))
    assert tree["count"].item() == 1 and counter.count.item() == 0


def test_the_module_is_restored_when_forward_raises():
    model = mlp()
    before = snapshot(model)
    # the forward's own error (5 features into Linear(3, 8)), raised with the tree swapped in
    with pytest.raises(RuntimeError, match="mat1 and mat2 shapes cannot be multiplied"):
        ms.call(model, ms.extract(model, detach=True), torch.randn(4, 5))
    assert_unchanged(model, before)


@pytest.mark.slow
def test_compile_fullgraph():
    model = mlp()
    tree = ms.extract(model, detach=True)
    x = torch.randn(4, 3)
    compiled = torch.compile(
        lambda t, x: ms.call(model, t, x),
        fullgraph=True,
    )
    assert torch.allclose(compiled(tree, x), model(x))
    other = ms.extract(mlp(), detach=True)
    other["0"]["weight"] = other["0"]["weight"] * 2
    assert torch.allclose(compiled(other, x), ms.call(model, other, x))
    assert isinstance(model[0].weight, nn.Parameter)


def bn_model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(3, 4), nn.ReLU(), nn.BatchNorm1d(4)).eval()


def test_a_partial_tree_is_refused_with_fixes_that_work_with_call():
    model = bn_model()
    x = torch.randn(5, 3)
    partial = ms.unflatten(dict(model.named_parameters()))  # the functional_call habit
    before = snapshot(model)
    with pytest.raises(KeyError, match=r"'2\.running_mean'.*ms\.split.*ms\.call_partial") as info:
        ms.call(model, partial, x)
    assert "strict=False" not in str(info.value)  # call takes no such option
    assert_unchanged(model, before)
    # Fix 1: the lenient form.
    assert torch.equal(ms.call_partial(model, partial, x), model(x))
    # Fix 2: the tuple split gives.
    assert torch.equal(ms.call(model, ms.split(model), x), model(x))


def test_call_partial_passes_every_other_argument_to_forward():
    class TakesStrict(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.lin = nn.Linear(2, 2)
            self.register_buffer("shift", torch.ones(2))

        def forward(self, x, strict=False):
            return self.lin(x) + (self.shift if strict else 0)

    module = TakesStrict()
    x = torch.randn(1, 2)
    weights = {"lin": {"weight": torch.zeros(2, 2)}}
    assert torch.equal(
        ms.call_partial(module, weights, x, strict=True), (module.lin.bias + 1).expand(1, 2)
    )
    assert torch.equal(ms.call_partial(module, weights, x), module.lin.bias.expand(1, 2))


def test_call_partial_refuses_unknown_paths_and_changes_nothing():
    model = bn_model()
    before = snapshot(model)
    with pytest.raises(KeyError, match=r"call_partial: '3\.weight': unknown path"):
        ms.call_partial(model, {"3": {"weight": torch.zeros(1)}}, torch.randn(2, 3))
    assert_unchanged(model, before)


def test_call_partial_under_grad():
    model = bn_model()
    head = {"0": {"weight": model[0].weight.detach()}}
    x = torch.randn(5, 3)
    grads = grad(lambda t: ms.call_partial(model, t, x).sum())(head)
    assert list(ms.flatten(grads)) == ["0.weight"]


def test_none_leaves_in_a_tuple_of_trees_are_holes():
    model, source = bn_model(), bn_model()
    with torch.no_grad():
        for tensor in source.state_dict().values():
            tensor.add_(1)  # other values than the model's, buffers included
    trained, carried = ms.tree.partition(ms.extract(source), ms.tree.is_trainable)
    x = torch.randn(5, 3)
    expected = source(x)  # the module's own forward with those values
    assert not torch.equal(expected, model(x))
    assert torch.equal(ms.call(model, (trained, carried), x), expected)
    with ms.inject(model, (trained, carried)):
        assert torch.equal(model(x), expected)
    with pytest.raises(KeyError, match=r"'2\.running_var'"):
        carried["2"]["running_var"] = None  # now no tree gives it
        ms.call(model, (trained, carried), x)


def test_call_under_grad_on_a_train_mode_batchnorm_points_to_apply_and_apply_works():
    model = nn.Sequential(nn.Linear(3, 4), nn.BatchNorm1d(4))  # train mode
    params, state = ms.split(model, detach=True)
    x = torch.randn(8, 3)
    with pytest.raises(RuntimeError, match="mutate a captured Tensor") as info:
        grad(lambda p: ms.call(model, (p, state), x).sum())(params)
    assert "ms.apply(module, params, state" in "".join(info.value.__notes__)
    grads, new_state = grad(
        lambda p: (lambda out, new: (out.sum(), new))(*ms.apply(model, p, state, x)),
        has_aux=True,
    )(params)  # the fix the note names
    assert int(new_state["1"]["num_batches_tracked"]) == 1
    assert ms.flatten(grads).keys() == ms.flatten(params).keys()


def test_a_meta_tree_is_refused_naming_the_path_the_device_and_the_fixes_that_work(tmp_path):
    model, x = mlp(), torch.randn(4, 3)
    with torch.device("meta"):
        meta_model = mlp()  # no memory, no data: shapes only
    tree = ms.extract(meta_model)
    before = snapshot(model)
    with pytest.raises(
        ValueError,
        match=r"^call: '0\.weight': the tree's tensor is on the meta device \(shapes only, no "
        r"data\), the module's on cpu; materialize the tree first",
    ) as info:
        ms.call(model, tree, x)
    message = str(info.value)
    assert "ms.checkpoint.load(path)" in message
    assert "meta_model.to_empty(device='cpu') then ms.load(meta_model, weights)" in message
    assert "ms.load(meta_model, weights, assign=True)" in message
    assert_unchanged(model, before)
    with pytest.raises(ValueError, match=r"^apply: '0\.weight': the tree's tensor is on the meta"):
        ms.apply(model, *ms.split(meta_model), x)
    with pytest.raises(ValueError, match=r"^inject: '0\.weight': the tree's tensor is on the meta"):
        with ms.inject(model, tree):
            pass
    assert_unchanged(model, before)

    weights = ms.extract(mlp(), copy=True)  # the real values the meta tree stands for
    expected = ms.call(mlp(), weights, x)
    ms.checkpoint.save(weights, tmp_path / "model")
    assert torch.equal(ms.call(model, ms.checkpoint.load(tmp_path / "model"), x), expected)

    meta_model.to_empty(device="cpu")  # fix 2: real memory, then the values
    ms.load(meta_model, weights)
    assert torch.equal(ms.call(model, ms.extract(meta_model), x), expected)

    with torch.device("meta"):
        meta_model = mlp()
    ms.load(meta_model, weights, assign=True)  # fix 3: the values' tensors become the model's
    assert torch.equal(ms.call(model, ms.extract(meta_model), x), expected)


def test_a_meta_tree_in_a_meta_model_traces_shapes():
    with torch.device("meta"):
        model = mlp()
    out = ms.call(model, ms.extract(model, detach=True), torch.randn(4, 3, device="meta"))
    assert out.shape == (4, 1) and out.is_meta
