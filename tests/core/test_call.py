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
    for (path, g), p in zip(ms.flatten(grads).items(), model.parameters()):
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
    with pytest.raises(ValueError, match="'1.running_mean' is given by two"):
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
    with pytest.raises(RuntimeError):
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
