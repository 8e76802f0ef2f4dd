"""torch_facts.scalar_gradients: ``torch.autograd.grad(loss, inputs, allow_unused=True)`` for a
real scalar loss, entering the engine directly for plain tensors (what ``ms.grad`` runs outside
torch.func), and ``torch.autograd.grad`` itself wherever ``__torch_function__`` could see it."""

from __future__ import annotations

from typing import ClassVar

import pytest
import torch
from torch.overrides import TorchFunctionMode

from modstate._core.torch_facts import scalar_gradients


def leaves() -> list[torch.Tensor]:
    generator = torch.Generator().manual_seed(0)
    return [torch.randn(3, 4, generator=generator).requires_grad_() for _ in range(3)]


def loss_of(inputs: list[torch.Tensor]) -> torch.Tensor:
    w, b, _unused = inputs
    return (torch.tanh(w) @ b.T).square().sum()


def test_plain_tensors_get_torch_autograd_grads_bit_for_bit_and_none_where_unused():
    inputs = leaves()
    got = scalar_gradients(loss_of(inputs), inputs)
    want = torch.autograd.grad(loss_of(inputs), inputs, allow_unused=True)
    assert len(got) == 3 and got[2] is None and want[2] is None
    for g, w in zip(got[:2], want[:2], strict=True):
        assert torch.equal(g, w)
    assert all(leaf.grad is None for leaf in inputs)  # nothing accumulated


def test_the_graph_is_freed_as_torch_autograd_grad_frees_it():
    inputs = leaves()
    loss = loss_of(inputs)
    scalar_gradients(loss, inputs)
    with pytest.raises(RuntimeError, match="second time"):
        torch.autograd.grad(loss, inputs[:2])


class Recorder(TorchFunctionMode):
    def __init__(self) -> None:
        super().__init__()
        self.seen: list[str] = []

    def __torch_function__(self, func, types, args=(), kwargs=None):
        self.seen.append(getattr(func, "__name__", str(func)))
        return func(*args, **(kwargs or {}))


def test_under_a_torch_function_mode_the_mode_sees_torch_autograd_grad():
    inputs = leaves()
    loss = loss_of(inputs)
    with Recorder() as mode:
        got = scalar_gradients(loss, inputs)
    assert "grad" in mode.seen
    want = torch.autograd.grad(loss_of(inputs), inputs, allow_unused=True)
    assert torch.equal(got[0], want[0]) and got[2] is None


class Traced(torch.Tensor):
    calls: ClassVar[list[str]] = []

    @classmethod
    def __torch_function__(cls, func, types, args=(), kwargs=None):
        cls.calls.append(getattr(func, "__name__", str(func)))
        return super().__torch_function__(func, types, args, kwargs or {})


def test_a_tensor_subclass_input_goes_through_torch_autograd_grad():
    inputs = leaves()
    traced = [leaf.detach().as_subclass(Traced).requires_grad_() for leaf in inputs]
    loss = loss_of(traced)
    Traced.calls.clear()
    got = scalar_gradients(loss, traced)
    assert "grad" in Traced.calls
    want = torch.autograd.grad(loss_of(inputs), inputs, allow_unused=True)
    assert torch.equal(got[0].as_subclass(torch.Tensor), want[0])


def test_a_complex_output_gets_torch_autograd_grads_own_error():
    z = torch.randn(3, dtype=torch.complex64, requires_grad=True)
    with pytest.raises(RuntimeError) as ours:
        scalar_gradients(z.sum(), [z])
    with pytest.raises(RuntimeError) as torchs:
        torch.autograd.grad(z.sum(), [z], allow_unused=True)
    assert str(ours.value) == str(torchs.value)
