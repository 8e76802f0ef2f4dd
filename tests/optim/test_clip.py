"""clip_grad_norm: torch.nn.utils.clip_grad_norm_'s numbers, on a tree, without mutation."""

from __future__ import annotations

import math

import pytest
import torch

import modstate as ms
from modstate import optim


def make_grads(scale: float, dtype: torch.dtype = torch.float32) -> dict:
    generator = torch.Generator().manual_seed(0)
    return {
        "a": {"w": scale * torch.randn(5, 4, generator=generator, dtype=dtype)},
        "b": scale * torch.randn(7, generator=generator, dtype=dtype),
    }


@pytest.mark.parametrize("norm_type", [2.0, 1.0, math.inf, 3.0])
@pytest.mark.parametrize("scale", [0.01, 10.0], ids=["below", "above"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_equal_to_clip_grad_norm_(norm_type, scale, dtype):
    grads = make_grads(scale, dtype)
    before = ms.tree.clone(grads)
    params = [torch.nn.Parameter(torch.zeros_like(g)) for g in ms.flatten(grads).values()]
    for param, grad in zip(params, ms.flatten(grads).values(), strict=True):
        param.grad = grad.clone()
    expected_norm = torch.nn.utils.clip_grad_norm_(params, max_norm=1.0, norm_type=norm_type)
    clipped, norm = optim.clip_grad_norm(grads, max_norm=1.0, norm_type=norm_type)
    assert torch.equal(norm, expected_norm)
    for ours, param in zip(ms.flatten(clipped).values(), params, strict=True):
        assert torch.equal(ours, param.grad)
    assert all(
        torch.equal(a, b)
        for a, b in zip(ms.flatten(grads).values(), ms.flatten(before).values(), strict=True)
    )


def test_none_leaves_stay_none_and_pure_under_grad():
    grads = {"w": torch.tensor([3.0, 4.0], requires_grad=True), "frozen": None}
    clipped, norm = optim.clip_grad_norm(grads, max_norm=1.0)
    assert clipped["frozen"] is None
    clipped["w"].sum().backward()
    assert torch.isfinite(grads["w"].grad).all()
    torch.testing.assert_close(norm, torch.tensor(5.0))


def test_under_vmap_each_member_is_clipped_by_its_own_norm():
    grads = {"w": torch.tensor([[3.0, 4.0], [0.3, 0.4]])}
    clipped, norms = torch.vmap(lambda g: optim.clip_grad_norm(g, max_norm=1.0))(grads)
    torch.testing.assert_close(norms, torch.tensor([5.0, 0.5]))
    torch.testing.assert_close(
        clipped["w"], torch.tensor([[0.6, 0.8], [0.3, 0.4]]), atol=1e-6, rtol=0
    )


def test_a_non_float_leaf_is_refused_by_path():
    with pytest.raises(TypeError, match=r"^clip_grad_norm: 'a\.n': a torch\.int64 tensor"):
        optim.clip_grad_norm({"a": {"n": torch.tensor(1)}}, max_norm=1.0)
    # The fix the message names: None where a leaf has no gradient.
    _, norm = optim.clip_grad_norm({"a": {"n": None, "w": torch.ones(1)}}, max_norm=1.0)
    assert norm == 1


def test_leaves_are_taken_in_module_order_as_torch_sums_their_norms():
    """Torch sums the norms in parameter order; a dict's insertion order, not sorted keys."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(1, 64), torch.nn.Tanh(), torch.nn.Linear(64, 1))
    for trial in range(50):
        grads = {
            name: torch.randn(p.shape) * (100.0 if name == "2.weight" else 1.0)
            for name, p in model.named_parameters()
        }
        for name, p in model.named_parameters():
            p.grad = grads[name].clone()
        expected = torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm=1.0)
        clipped, norm = optim.clip_grad_norm(ms.unflatten(grads), max_norm=1.0)
        assert torch.equal(norm, expected), trial
        for name, p in model.named_parameters():
            assert torch.equal(ms.flatten(clipped)[name], p.grad), (trial, name)


def test_a_tied_gradient_counts_once_as_model_parameters_lists_it():
    from zoo import TiedLM

    torch.manual_seed(0)
    lm = TiedLM()
    lm(torch.tensor([[1, 2, 3]])).square().sum().backward()
    grads = ms.tree.map(lambda p: p.grad, ms.extract(lm))  # the tie's gradient at both paths
    assert grads["embed"]["weight"] is grads["head"]["weight"]
    clipped, norm = optim.clip_grad_norm(grads, max_norm=0.5)
    expected = torch.nn.utils.clip_grad_norm_(lm.parameters(), max_norm=0.5)
    torch.testing.assert_close(norm, expected)
    torch.testing.assert_close(clipped["embed"]["weight"], lm.embed.weight.grad)
    assert clipped["embed"]["weight"] is clipped["head"]["weight"]


def test_dp_sgd_per_sample_gradients_clipped_under_vmap_equal_a_loop_over_samples():
    """The README's DP-SGD recipe: torch.vmap(ms.grad(loss), in_dims=(None, 0, 0)) gives each
    sample's gradient (as torch.func's vmap(grad(functional_call)) does), and clip_grad_norm
    under the same vmap clips each by its own norm, as clip_grad_norm_ on that sample alone."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(3, 8), torch.nn.Tanh(), torch.nn.Linear(8, 2))
    params = ms.extract(model, detach=True)
    x, y = torch.randn(6, 3), torch.randn(6, 2)

    def sample_loss(params, xi, yi):
        return (ms.call(model, params, xi[None]) - yi[None]).square().sum()

    def clipped_grad(params, xi, yi):
        return optim.clip_grad_norm(ms.grad(sample_loss)(params, xi, yi), 0.5)[0]

    per_sample = torch.vmap(ms.grad(sample_loss), in_dims=(None, 0, 0))(params, x, y)
    clipped = torch.vmap(clipped_grad, in_dims=(None, 0, 0))(params, x, y)

    def func_loss(flat, xi, yi):
        return (torch.func.functional_call(model, flat, xi[None]) - yi[None]).square().sum()

    by_torch_func = torch.vmap(torch.func.grad(func_loss), in_dims=(None, 0, 0))(
        ms.flatten(params), x, y
    )
    norms = torch.stack([g.flatten(1).norm(dim=1) for g in ms.flatten(per_sample).values()])
    assert (norms.norm(dim=0) > 0.5).sum() >= 2  # so the clipping is exercised
    for i in range(len(x)):
        model.zero_grad()  # the loop: one plain backward per sample
        (model(x[i][None]) - y[i][None]).square().sum().backward()
        grads = [p.grad.clone() for p in model.parameters()]
        for path, grad in zip(ms.flatten(params), grads, strict=True):
            torch.testing.assert_close(ms.flatten(per_sample)[path][i], grad)
            torch.testing.assert_close(by_torch_func[path][i], grad)
        torch.nn.utils.clip_grad_norm_(model.parameters(), 0.5)
        for path, param in zip(ms.flatten(params), model.parameters(), strict=True):
            torch.testing.assert_close(ms.flatten(clipped)[path][i], param.grad)
