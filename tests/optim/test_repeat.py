"""A loop of steps, donated or pure, reuses the last step's analysis (optim/_repeat.py) only when
the trees are the ones that step returned: anything else takes the full path, with its checks
and its numbers."""

from __future__ import annotations

import copy
import dataclasses
import gc
import pickle
import time
import weakref

import pytest
import torch

import modstate as ms
from modstate import optim

from together import run_together


def make():
    generator = torch.Generator().manual_seed(0)
    params = {
        "a": {"w": torch.randn(5, 3, generator=generator)},
        "b": torch.randn(4, generator=generator),
    }
    grads = ms.tree.map(lambda p: torch.randn(p.shape, generator=generator), params)
    return params, grads


def reference(opt, params, grads, steps):
    """The same steps, pure, each by a fresh copy of `opt`: the full path every time."""
    state = opt.init(params)
    for _ in range(steps):
        params, state = dataclasses.replace(opt).step(params, grads, state)
    return params


def same(a, b):
    return all(
        torch.equal(x, y)
        for x, y in zip(ms.flatten(a).values(), ms.flatten(b).values(), strict=True)
    )


OPTIMIZERS = [optim.sgd(lr=0.1, momentum=0.9, fused=True), optim.adam(lr=0.1), optim.nadam(lr=0.1)]
IDS = ["sgd-fused", "adam", "nadam"]


@pytest.fixture
def reused(monkeypatch):
    """Whether each call of `again` (the reuse) found the trees it remembered, in order."""
    from modstate.optim import _base

    found: list[bool] = []
    again = _base.again

    def counting_again(*args):
        run = again(*args)
        found.append(run is not None)
        return run

    monkeypatch.setattr(_base, "again", counting_again)
    return found


@pytest.mark.parametrize("opt", OPTIMIZERS, ids=IDS)
def test_a_donated_loop_reuses_the_analysis_and_keeps_the_numbers(opt, reused):
    params, grads = make()
    want = reference(opt, ms.tree.clone(params), grads, 5)
    reused.clear()
    state = opt.init(params)
    for _ in range(5):
        params, state = opt.step(params, grads, state, donate=True)
        assert opt.__dict__.get("_repeat") is not None  # remembered for the next step
    assert reused == [True] * 4  # every step after the first reused the analysis
    assert same(params, want)
    assert int(state["step"]) == 5


@pytest.mark.parametrize("opt", OPTIMIZERS, ids=IDS)
def test_a_pure_loop_reuses_the_analysis_writes_no_input_and_keeps_the_numbers(opt, reused):
    params, grads = make()
    want = reference(opt, params, grads, 5)
    reused.clear()
    state = opt.init(params)
    seen = []  # every step's inputs, and a copy of them as they were
    for _ in range(5):
        inputs = {"params": params, "state": state}
        seen.append((inputs, ms.tree.clone(inputs)))
        params, state = opt.step(params, grads, state)
    assert reused == [True] * 4
    assert same(params, want)
    assert int(state["step"]) == 5
    for inputs, as_they_were in seen:
        assert same(inputs, as_they_were)  # no step wrote what it was given


def test_a_pure_step_on_older_trees_takes_the_full_path_and_gives_the_same_numbers(reused):
    opt = optim.adam(lr=0.1)
    params, grads = make()
    state = opt.init(params)
    first, first_state = opt.step(params, grads, state)
    second, _ = opt.step(first, grads, first_state)
    again, _ = opt.step(first, grads, first_state)  # not the last outputs
    assert reused == [True, False]
    assert same(again, second)


@pytest.mark.parametrize("donate", [True, False])
def test_trees_that_are_not_the_last_outputs_take_the_full_path(donate):
    opt = optim.sgd(lr=0.1, momentum=0.9, fused=True)
    params, grads = make()
    state = opt.init(params)
    params, state = opt.step(params, grads, state, donate=donate)
    # Another tensor at a path: the full path checks it, and names the path.
    wrong = {"a": {"w": torch.zeros(3, 5)}, "b": params["b"]}
    with pytest.raises(ValueError, match=r"'a\.w': grads has shape \(5, 3\)"):
        opt.step(wrong, grads, state, donate=donate)
    # A tensor whose shape changed in place (`.data =`) is not taken for the one remembered,
    # a param's or a buffer's.
    params, grads = make()
    state = opt.init(params)
    params, state = opt.step(params, grads, state, donate=donate)
    params["b"].data = torch.zeros(6)
    with pytest.raises(ValueError, match=r"'b': grads has shape \(4,\)"):
        opt.step(params, grads, state, donate=donate)
    params, grads = make()
    state = opt.init(params)
    params, state = opt.step(params, grads, state, donate=donate)
    state["momentum_buffer"]["b"].data = torch.zeros(6)
    with pytest.raises(ValueError, match=r"'b': state\['momentum_buffer'\] has shape \(6,\)"):
        opt.step(params, grads, state, donate=donate)


@pytest.mark.parametrize("donate", [True, False])
def test_a_buffer_laid_out_anew_in_place_is_not_taken_for_the_one_remembered(donate):
    """A fused kernel walks a param and its buffers in step; a buffer transposed in place (same
    shape, other strides) takes the full path, which lays it out as its param."""
    opt = optim.sgd(lr=0.1, momentum=0.9, fused=True)
    generator = torch.Generator().manual_seed(0)
    params = {"w": torch.randn(4, 4, generator=generator)}
    grads = {"w": torch.randn(4, 4, generator=generator)}
    state = opt.init(params)
    params, state = opt.step(params, grads, state, donate=donate)
    buffer = state["momentum_buffer"]["w"]
    buffer.data = buffer.data.t().contiguous().t()  # the same values, column-major
    want, _ = dataclasses.replace(opt).step(
        ms.tree.clone(params), grads, {**state, "momentum_buffer": {"w": buffer.contiguous()}}
    )
    got, _ = opt.step(params, grads, state, donate=donate)
    assert torch.equal(got["w"], want["w"])


def test_a_frozen_leaf_or_a_leaf_that_requires_grad_takes_the_full_path():
    opt = optim.adam(lr=0.1)
    params, grads = make()
    state = opt.init(params)
    params, state = opt.step(params, grads, state, donate=True)
    frozen = {"a": {"w": None}, "b": grads["b"]}
    before = params["a"]["w"].clone()
    params, state = opt.step(params, frozen, state, donate=True)
    assert torch.equal(params["a"]["w"], before)  # its gradient was None: left as it was
    params["b"].requires_grad_()
    new, _ = opt.step(params, grads, state, donate=True)
    assert new["b"].grad_fn is not None  # the differentiable path ran
    assert opt.__dict__.get("_repeat") is None  # and nothing was remembered


@pytest.mark.parametrize("donate", [True, False])
def test_the_analysis_keeps_no_tensor_alive(donate):
    opt = optim.sgd(lr=0.1, momentum=0.9, fused=True)
    params, grads = make()
    state = opt.init(params)
    params, state = opt.step(params, grads, state, donate=donate)
    assert opt.__dict__.get("_repeat") is not None
    watched = weakref.ref(params["a"]["w"])
    del params, state
    gc.collect()
    assert watched() is None


@pytest.mark.parametrize("donate", [True, False])
def test_threads_stepping_with_one_optimizer_each_get_their_own_numbers(donate, reused):
    """Each thread runs its own loop with one shared optimizer object: whatever the other
    threads' steps left remembered, every thread's trees equal a loop run alone, bit for bit."""
    opt = optim.adam(lr=0.1, fused=True)
    steps = 150

    def loop(seed: int, optimizer, *, take_turns: bool = False) -> dict:
        generator = torch.Generator().manual_seed(seed)
        params = {
            "w": torch.randn(6, 5, generator=generator),
            "b": torch.randn(5, generator=generator),
        }
        grads = ms.tree.map(lambda p: torch.randn(p.shape, generator=generator), params)
        state = optimizer.init(params)
        for _ in range(steps):
            params, state = optimizer.step(params, grads, state, donate=donate)
            if take_turns:
                time.sleep(0)  # lets another thread step in between
        return params

    alone = [loop(seed, dataclasses.replace(opt)) for seed in range(4)]

    def work(i: int) -> int:
        return 0 if same(loop(i, opt, take_turns=True), alone[i]) else 1

    reused.clear()
    assert run_together(work) == [0, 0, 0, 0]
    assert True in reused and False in reused  # steps were interleaved: some lost the reuse


@pytest.mark.parametrize(
    "copier", [copy.copy, copy.deepcopy, lambda o: pickle.loads(pickle.dumps(o))]
)
def test_a_copied_or_pickled_optimizer_leaves_the_analysis_behind(copier):
    opt = optim.adam(lr=0.1, fused=True)
    params, grads = make()
    params, state = opt.step(params, grads, opt.init(params))
    assert opt.__dict__.get("_repeat") is not None
    copied = copier(opt)
    assert copied == opt and "_repeat" not in copied.__dict__
    assert same(copied.step(params, grads, state)[0], opt.step(params, grads, state)[0])
