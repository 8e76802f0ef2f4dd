"""The model's own forward under vmap with the kernels in place (``ensemble/_runner.py``): glue
of every kind, hooks, transforms inside a model, buffers reassigned by forward; the runner is a
private copy, so the models, the template and ``member(i)`` never see a kernel."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import modstate as ms

from loop_reference import assert_like_the_loop, backward_nodes, seeded_members
from together import run_together


class Glue(nn.Module):
    """Reshapes, concatenation, pooling, residual adds, indexing, and a loop: the model's own
    tensor code between layers."""

    def __init__(self) -> None:
        super().__init__()
        self.conv = nn.Conv2d(3, 4, 3, padding=1)
        self.norm = nn.BatchNorm2d(4)
        self.head = nn.Linear(8 + 4, 5)
        self.gate = nn.Parameter(torch.ones(4))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.relu(self.norm(self.conv(x)))
        for _ in range(2):
            h = h + F.max_pool2d(h, 3, stride=1, padding=1) * self.gate.view(1, 4, 1, 1)
        pooled = torch.cat([h.mean(dim=(2, 3)), h.amax(dim=(2, 3))], dim=1)
        features = torch.cat([pooled, h[:, :, 0, 0]], dim=1)
        return self.head(features).softmax(dim=-1)


@pytest.mark.parametrize("in_dims", [None, 0])
def test_the_models_own_code_between_layers_is_batched_too(in_dims):
    lead = () if in_dims is None else (3,)
    ensemble = assert_like_the_loop(
        Glue, lambda: (torch.randn(*lead, 2, 3, 6, 6),), in_dims=in_dims
    )
    assert [r.path for r in ensemble.plan.fallbacks] == [""]  # its gate, read by its own code


class InnerTransform(nn.Module):
    """A model that runs a torch.func transform of its own inside forward."""

    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(4, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        per_row = torch.func.vmap(self.fc)(x)  # the layer runs inside another vmap level
        return per_row + self.fc(x)


def test_a_layer_called_inside_the_models_own_transform_runs_its_own_forward():
    assert_like_the_loop(InnerTransform, lambda: (torch.randn(3, 4),))


class Counter(nn.Module):
    """Reassigns a buffer in forward."""

    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(3, 3)
        self.register_buffer("count", torch.zeros(()))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.count = self.count + 1
        return torch.relu(self.fc(x)) * self.count


def test_a_buffer_that_forward_reassigns_lands_in_the_stacked_state():
    models = seeded_members(Counter)
    ensemble = ms.Ensemble(models, route="batched")
    for _ in range(2):
        ensemble(torch.randn(2, 3))
    assert ensemble.stacked.count.tolist() == [2.0, 2.0, 2.0]
    assert ensemble.member(1).count.item() == 2.0
    assert all(m.count.item() == 0.0 for m in models)


class Hooked(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(4, 6)
        self.out = nn.Linear(6, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.out(torch.tanh(self.fc(x)))


def test_hooks_on_a_batched_layer_run_and_see_one_members_view():
    models = seeded_members(Hooked, 2)
    seen = []
    models[0].fc.register_forward_hook(lambda module, args, out: seen.append(tuple(out.shape)))
    for model in models:  # a pre-hook that changes the input: the kernel gets the new input
        model.out.register_forward_pre_hook(lambda module, args: (args[0] * 2,))
    ensemble = ms.Ensemble(models, route="batched")
    x = torch.randn(5, 4)
    out = ensemble(x)
    assert seen[-1] == (5, 6)  # the hook ran, on one member's shape
    with torch.no_grad():
        expected = torch.stack([m(x) for m in models])
    torch.testing.assert_close(out, expected, atol=1e-5, rtol=1e-5)  # the pre-hook's change too
    routes = {r.path: r for r in ensemble.plan.routes}
    assert routes["fc"].fallback is None


def test_the_models_and_members_never_see_a_kernel():
    models = seeded_members(Glue)
    ensemble = ms.Ensemble(models, route="batched")
    ensemble(torch.randn(2, 3, 6, 6))
    for module in [*models, ensemble.member(0), ensemble._template]:
        assert all("forward" not in vars(m) for m in module.modules())


class Attending(nn.Module):
    """Glue tensors (injected per call) and attention in the model's own code (folded)."""

    def __init__(self) -> None:
        super().__init__()
        self.qkv = nn.Linear(8, 24)
        self.scale = nn.Parameter(torch.ones(8))
        self.norm = nn.LayerNorm(8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        q, k, v = self.qkv(x).view(x.shape[0], x.shape[1], 3, 2, 4).permute(2, 0, 3, 1, 4)
        out = F.scaled_dot_product_attention(q, k, v).transpose(1, 2).flatten(2)
        return self.norm(out * self.scale)


@pytest.mark.parametrize("factory", [Glue, Attending], ids=["glue", "attention"])
def test_one_ensemble_called_from_several_threads_at_once(factory):
    ensemble = ms.Ensemble(seeded_members(factory), route="batched").eval()
    shape = (2, 3, 6, 6) if factory is Glue else (2, 5, 8)
    inputs = [torch.randn(*shape, generator=torch.Generator().manual_seed(i)) for i in range(4)]
    with torch.no_grad():
        expected = [ensemble(x) for x in inputs]  # one thread, first

    def work(index: int) -> int:
        with torch.no_grad():
            return sum(
                not torch.equal(ensemble(inputs[index]), expected[index]) for _ in range(100)
            )

    assert run_together(work) == [0] * 4  # wrong results per thread
    for model in [ensemble._template, ensemble.member(0)]:  # no forward left a kernel or a view
        assert all("forward" not in vars(m) for m in model.modules())


class InPlaceBlock(nn.Module):
    """torchvision's BasicBlock habits: ``ReLU(inplace=True)`` after a BatchNorm, and
    ``out += identity`` on another BatchNorm's output."""

    def __init__(self) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(3, 3, 3, padding=1, bias=False)
        self.bn1 = nn.BatchNorm2d(3)
        self.relu = nn.ReLU(inplace=True)
        self.conv2 = nn.Conv2d(3, 3, 3, padding=1, bias=False)
        self.bn2 = nn.BatchNorm2d(3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = self.relu(self.bn1(self.conv1(x)))
        out = self.bn2(self.conv2(out))
        out += x
        return self.relu(out)


@pytest.mark.parametrize("in_dims", [None, 0])
def test_in_place_writes_into_kernel_outputs_are_learned_then_cost_no_view_rewrite(in_dims):
    lead = () if in_dims is None else (3,)
    shape = (*lead, 2, 3, 5, 5)
    ensemble = ms.Ensemble(seeded_members(InPlaceBlock), in_dims=in_dims, route="batched")
    with torch.no_grad():
        ensemble(torch.randn(shape))  # without autograd there is nothing to learn
    first = ensemble(torch.randn(shape))
    # The first call with autograd notes which outputs forward wrote in place: both norms'.
    assert "CopySlices" in backward_nodes(first)
    runner = ensemble._runners.mine()
    assert runner.written_in_place == {runner.module.bn1, runner.module.bn2}
    assert "CopySlices" not in backward_nodes(ensemble(torch.randn(shape)))
    # Every call, the first one included, equals the members one by one.
    assert_like_the_loop(InPlaceBlock, lambda: (torch.randn(shape),), in_dims=in_dims)


def test_in_place_writes_are_learned_by_each_threads_runner_with_exact_results():
    ensemble = ms.Ensemble(seeded_members(InPlaceBlock), route="batched").train()
    inputs = [torch.randn(2, 3, 5, 5, generator=torch.Generator().manual_seed(i)) for i in range(4)]

    def output_and_input_gradient(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        x = x.clone().requires_grad_()
        out = ensemble(x)
        return out.detach(), torch.autograd.grad(out.square().sum(), x)[0]

    # Train mode normalizes with batch statistics: the running ones moving meanwhile change
    # nothing that is compared.
    expected = [output_and_input_gradient(x) for x in inputs]  # one thread, first

    def work(index: int) -> int:
        wrong = 0
        for _ in range(50):
            out, grad = output_and_input_gradient(inputs[index])
            wrong += not (
                torch.equal(out, expected[index][0]) and torch.equal(grad, expected[index][1])
            )
        return wrong

    assert run_together(work) == [0] * 4  # wrong results per thread
