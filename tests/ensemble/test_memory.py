"""The peak of the tensor memory a run makes, as the route choice counts it.

A storage counts from the op that makes it until it is freed, also where only autograd's saved
tensors hold it; views and in-place ops make nothing.
"""

from __future__ import annotations

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from modstate.ensemble._memory import PeakBytes, held_bytes, peak_bytes

MIB = 2**20


def test_a_made_tensor_counts_until_it_is_freed_and_views_count_nothing():
    x = torch.ones(MIB // 4)  # 1 MiB, made before: not counted
    with PeakBytes() as counter:
        y = x * 2  # 1 MiB made
        view = y[: MIB // 8].view(-1, 2)  # a view: nothing made
        y.mul_(3)  # in place: nothing made
        assert counter.now == MIB
        z = y + view.sum()  # another MiB (and a 4-byte sum)
        assert counter.peak == 2 * MIB + 4
        del y, z  # the view keeps y's storage alive
        assert counter.now == MIB
        del view
        assert counter.now == 0
    assert counter.peak == 2 * MIB + 4


def test_what_autograd_saves_for_the_backward_counts_until_the_backward_frees_it():
    weight = torch.randn(256, 256, requires_grad=True)
    x = torch.randn(1024, 256)
    with PeakBytes() as counter:
        hidden = torch.tanh(x @ weight)  # tanh saves its output for the backward
        out = hidden.sum()
        del hidden  # only the graph holds it now
        assert counter.now >= 1024 * 256 * 4
        (grad,) = torch.autograd.grad(out, [weight])
        del out
    assert counter.now == 256 * 256 * 4  # the gradient alone is left
    assert counter.peak >= 2 * 1024 * 256 * 4  # the product and tanh's output at once
    assert grad.shape == weight.shape


def test_peak_bytes_runs_the_function_and_gives_none_under_another_dispatch_mode():
    def run():
        return torch.empty(MIB // 4).fill_(1.0)

    assert peak_bytes(run) == MIB

    class Passing(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            return func(*args, **(kwargs or {}))

    with Passing():
        assert peak_bytes(run) is None  # the other mode would see the counter's tensors


def test_held_bytes_counts_a_shared_storage_once():
    stacked = torch.zeros(4, 1024)
    assert held_bytes([stacked, stacked[0], stacked.view(-1)]) == 4 * 1024 * 4
