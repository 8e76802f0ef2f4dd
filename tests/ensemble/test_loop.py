"""The loop route (``_loop.py``): each member a plain call of this thread's copy of the template,
whose slots hold views of the stacked tensors. It computes what the members compute one by one
(outputs, gradients, BatchNorm statistics), follows every change of the stacked tensors, and
keeps no state a later call or another thread could see."""

from __future__ import annotations

import copy
import threading

import torch
from torch import nn

import modstate as ms

from members import ATOL, cnn, from_threads, loop, mlp, seeded
from together import run_together


def test_without_grad_it_equals_the_members_in_eval_and_in_training():
    models = seeded(cnn, 3)  # BatchNorm: training mode updates the stacked statistics
    ensemble = ms.Ensemble([copy.deepcopy(m) for m in models], route="loop")
    x = torch.randn(5, 3, 8, 8)
    for training in (False, True, True):
        ensemble.train(training)
        for model in models:
            model.train(training)
        with torch.no_grad():
            torch.testing.assert_close(ensemble(x), loop(models, x), atol=ATOL, rtol=0)
    for i, model in enumerate(models):  # two updates of the statistics, as the members made
        for path, buffer in model.named_buffers():
            torch.testing.assert_close(ensemble.stacked.get_buffer(path)[i], buffer, msg=path)


def test_it_follows_an_optimizer_step_a_load_and_a_cast():
    ensemble = ms.Ensemble(seeded(mlp, 3), route="loop").eval()
    x = torch.randn(4, 5)
    with torch.no_grad():
        ensemble(x)  # the copies' views are made
    ensemble(x).sum().backward()  # with autograd: views made afresh
    torch.optim.SGD(ensemble.parameters(), lr=0.5).step()  # in place
    with torch.no_grad():
        torch.testing.assert_close(ensemble(x), loop(ensemble.members(), x), atol=ATOL, rtol=0)
    other = ms.Ensemble(seeded(mlp, 3, seed=1))
    ensemble.load_state_dict(other.state_dict())
    with torch.no_grad():
        torch.testing.assert_close(ensemble(x), loop(other.members(), x), atol=ATOL, rtol=0)
    ensemble.double()  # new storage under the same parameter objects
    with torch.no_grad():
        out = ensemble(x.double())
    assert out.dtype == torch.float64
    torch.testing.assert_close(out, loop(ensemble.members(), x.double()), atol=ATOL, rtol=0)


def test_a_stateless_call_sees_its_tree_and_the_next_call_the_ensembles_own():
    ensemble = ms.Ensemble(seeded(mlp, 2), route="loop").eval()
    other = ms.Ensemble(seeded(mlp, 2, seed=7)).eval()
    x = torch.randn(3, 5)
    with torch.no_grad():
        own = ensemble(x)
        swapped = ms.call(ensemble, ms.extract(other), x)
        again = ensemble(x)
    torch.testing.assert_close(swapped, loop(other.members(), x), atol=ATOL, rtol=0)
    assert torch.equal(again, own)


def test_a_forward_that_reassigns_a_buffer_changes_nothing_the_next_call_sees():
    class Counting(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.linear = nn.Linear(4, 4)
            self.register_buffer("offset", torch.zeros(4))

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            out = self.linear(x) + self.offset
            self.offset = self.offset + 1  # reassigned: the member's tree, not the ensemble's
            return out

    ensemble = ms.Ensemble(seeded(Counting, 2), route="loop")
    x = torch.randn(2, 4)
    with torch.no_grad():
        first, second = ensemble(x), ensemble(x)
    assert torch.equal(first, second)
    assert torch.equal(ensemble.stacked.offset, torch.zeros(2, 4))


def test_threads_with_and_without_a_tree_of_their_own_get_exact_results():
    ensemble = ms.Ensemble(seeded(mlp, 3), route="loop").eval()
    other = ms.extract(ms.Ensemble(seeded(mlp, 3, seed=3)))
    inputs = [torch.randn(8, 5, generator=torch.Generator().manual_seed(i)) for i in range(200)]
    plain = from_threads(ensemble, inputs)
    swapped: dict[int, torch.Tensor] = {}

    def stateless(k: int) -> None:
        for i in range(k, len(inputs), 4):
            with torch.no_grad():
                swapped[i] = ms.call(ensemble, other, inputs[i])

    threads = [threading.Thread(target=stateless, args=(k,)) for k in range(4)]
    for thread in threads:
        thread.start()
    mixed = from_threads(ensemble, inputs)  # while the stateless calls run
    for thread in threads:
        thread.join()
    with torch.no_grad():
        for i, x in enumerate(inputs):
            want = ensemble(x)
            assert torch.equal(plain[i], want) and torch.equal(mixed[i], want), i
            assert torch.equal(swapped[i], ms.call(ensemble, other, x)), i


def test_with_autograd_it_trains_as_the_members_do_step_after_step():
    models = seeded(cnn, 3)  # BatchNorm in training mode
    ensemble = ms.Ensemble([copy.deepcopy(m) for m in models], route="loop")
    ours = torch.optim.SGD(ensemble.parameters(), lr=0.1, momentum=0.9)
    theirs = [torch.optim.SGD(m.parameters(), lr=0.1, momentum=0.9) for m in models]
    for step in range(3):  # each step writes the stacked weights in place: fresh views next call
        x = torch.randn(5, 3, 8, 8, generator=torch.Generator().manual_seed(step))
        ensemble(x).square().sum().backward()
        ours.step()
        ours.zero_grad()
        for model, optimizer in zip(models, theirs, strict=True):
            model(x).square().sum().backward()
            optimizer.step()
            optimizer.zero_grad()
    for i, model in enumerate(models):
        for path, weight in model.named_parameters():
            stacked = ensemble.stacked.get_parameter(path)
            torch.testing.assert_close(stacked[i], weight, atol=1e-5, rtol=0, msg=path)
        for path, buffer in model.named_buffers():
            torch.testing.assert_close(ensemble.stacked.get_buffer(path)[i], buffer, msg=path)


def test_threads_taking_gradients_get_exact_results():
    ensemble = ms.Ensemble(seeded(mlp, 3), route="loop")
    weights = list(ensemble.parameters())
    inputs = [torch.randn(8, 5, generator=torch.Generator().manual_seed(i)) for i in range(200)]
    grads: dict[int, tuple[torch.Tensor, ...]] = {}

    def work(first: int) -> int:
        for i in range(first, len(inputs), 8):
            grads[i] = torch.autograd.grad(ensemble(inputs[i]).square().sum(), weights)
        return 0

    run_together(work, 8)
    for i, x in enumerate(inputs):  # each thread's copies, each call's views: the same numbers
        want = torch.autograd.grad(ensemble(x).square().sum(), weights)
        assert all(torch.equal(a, b) for a, b in zip(grads[i], want, strict=True)), i
