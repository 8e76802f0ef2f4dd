"""Linear layers as one batched matmul (``_kernels/linear.py``): ``nn.Linear`` alone, inside
residual blocks, read directly by the model's own code, and Hugging Face's ``Conv1D``."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import modstate as ms
from modstate.ensemble._kernels.linear import LAYOUT_KERNEL_ELEMENTS

from loop_reference import assert_like_the_loop


class Residual(nn.Module):
    def __init__(self, width: int = 6) -> None:
        super().__init__()
        self.inner = nn.Linear(width, 2 * width)
        self.outer = nn.Linear(2 * width, width, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.outer(torch.relu(self.inner(x)))


class ReadsItsWeight(nn.Module):
    """Code that reads a layer's weight itself, beside calling the layer (as tied heads do)."""

    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(4, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc(x) + F.linear(x, self.fc.weight.t())


@pytest.mark.parametrize(
    ("factory", "shape"),
    [
        (lambda: nn.Linear(5, 3), (4, 5)),
        (lambda: nn.Linear(5, 3, bias=False), (2, 4, 5)),
        (lambda: nn.Linear(5, 3), (5,)),
        (lambda: nn.Linear(5, 3), (2, 3, 4, 5)),
        (Residual, (3, 6)),
        (lambda: nn.Sequential(Residual(), Residual()), (2, 3, 6)),
        (ReadsItsWeight, (3, 4)),
    ],
    ids=["linear", "no_bias_3d", "unbatched", "4d", "residual", "residual_stack", "reads_weight"],
)
@pytest.mark.parametrize("in_dims", [None, 0])
def test_linear_layers_equal_the_members_one_by_one(factory, shape, in_dims):
    lead = () if in_dims is None else (3,)
    ensemble = assert_like_the_loop(factory, lambda: (torch.randn(*lead, *shape),), in_dims=in_dims)
    linears = [r for r in ensemble.plan.routes if r.layer.startswith("Linear")]
    assert linears and all(r.how == "batched matmul" for r in linears)


def test_hugging_face_conv1d_is_a_batched_matmul():
    pytorch_utils = pytest.importorskip("transformers.pytorch_utils")

    class Projection(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.proj = pytorch_utils.Conv1D(8, 5)  # 5 -> 8, weight stored (5, 8)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return torch.tanh(self.proj(x))

    ensemble = assert_like_the_loop(Projection, lambda: (torch.randn(2, 3, 5),))
    assert ensemble.plan.routes[0].how == "batched matmul"


def mlp() -> nn.Module:
    """Its middle layer, over 3 members, has `LAYOUT_KERNEL_ELEMENTS` weights or more; the
    outer ones have fewer (plain ``bmm``, whose transposed gradient is cheap to copy). The tests
    below give it tokens, ``(batch, tokens, features)``: on one batch of rows a chain of
    linear layers runs features first instead (``_chain.py``), without `stacked_affine`."""
    return nn.Sequential(
        nn.Linear(5, 128), nn.Tanh(), nn.Linear(128, 96), nn.Tanh(), nn.Linear(96, 3)
    )


def test_weight_gradients_come_back_in_the_weights_layout_with_the_loops_values():
    # bmm's own backward gives the transpose of a contiguous tensor, which .grad (torch's
    # layout contract) and modstate's fused optimizers would copy at every step.
    torch.manual_seed(0)
    members = [mlp() for _ in range(3)]
    ensemble, x = ms.Ensemble(members, route="batched"), torch.randn(4, 2, 5)
    params, _ = ms.split(ensemble, detach=True)

    def loss(p):
        return ms.call(ensemble, p, x).square().sum()

    grads = ms.flatten(ms.grad(loss)(params))
    large = [path for path in grads if params_numel(params, path) >= LAYOUT_KERNEL_ELEMENTS]
    assert large == ["stacked.2.weight"]
    for path in large:
        assert grads[path].stride() == ms.flatten(params)[path].stride(), path
    ensemble(x).square().sum().backward()
    for path, grad in grads.items():
        assert torch.equal(grad, dict(ensemble.named_parameters())[path].grad), path
    for i, member in enumerate(members):
        member(x).square().sum().backward()
        for index in (0, 2, 4):
            want = member[index].weight.grad
            got = grads[f"stacked.{index}.weight"][i]
            torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5, msg=str(index))


def params_numel(params: dict, path: str) -> int:
    return ms.flatten(params)[path].numel()


def test_second_order_gradients_through_the_ensemble_equal_the_loops():
    torch.manual_seed(0)
    members = [mlp() for _ in range(3)]
    ensemble, x = ms.Ensemble(members, route="batched"), torch.randn(4, 2, 5)

    def gradient_norm(out: torch.Tensor, weights: list[torch.Tensor]) -> torch.Tensor:
        grads = torch.autograd.grad(out.square().sum(), weights, create_graph=True)
        return sum(g.square().sum() for g in grads)

    stacked = [p for name, p in ensemble.named_parameters() if name.endswith("weight")]
    got = torch.autograd.grad(gradient_norm(ensemble(x), stacked), stacked)
    for i, member in enumerate(members):
        weights = [member[0].weight, member[2].weight, member[4].weight]
        want = torch.autograd.grad(gradient_norm(member(x), weights), weights)
        for g, w in zip(got, want, strict=True):
            torch.testing.assert_close(g[i], w, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("where", ["torch.func.grad", "autocast", "no weight grad"])
def test_the_plain_batched_matmul_runs_where_the_layout_kernel_does_not(where):
    torch.manual_seed(0)
    members = [mlp() for _ in range(3)]
    ensemble, x = ms.Ensemble(members, route="batched"), torch.randn(4, 2, 5)
    params, _ = ms.split(ensemble, detach=True)
    if where == "torch.func.grad":
        grads = torch.func.grad(lambda p: ms.call(ensemble, p, x).square().sum())(params)
        want = ms.grad(lambda p: ms.call(ensemble, p, x).square().sum())(params)
        for path, grad in ms.flatten(grads).items():
            torch.testing.assert_close(grad, ms.flatten(want)[path], atol=1e-6, rtol=1e-5)
    elif where == "autocast":
        with torch.autocast("cpu", dtype=torch.bfloat16):
            out = ensemble(x)
        out.float().square().sum().backward()
        assert out.dtype == torch.bfloat16
        assert all(p.grad is not None for p in ensemble.parameters())
    else:
        for p in ensemble.parameters():
            p.requires_grad_(False)
        xg = x.clone().requires_grad_()
        (grad,) = torch.autograd.grad(ensemble(xg).square().sum(), [xg])
        want = sum(torch.autograd.grad(m(xg).square().sum(), [xg])[0] for m in members)
        torch.testing.assert_close(grad, want, atol=1e-5, rtol=1e-5)
