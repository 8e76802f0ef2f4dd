"""A donated loop reuses the last step's analysis (optim/_repeat.py) only when the trees are the
ones that step wrote: anything else takes the full path, with its checks and its numbers."""

from __future__ import annotations

import gc
import weakref

import pytest
import torch

import modstate as ms
from modstate import optim


def make():
    generator = torch.Generator().manual_seed(0)
    params = {
        "a": {"w": torch.randn(5, 3, generator=generator)},
        "b": torch.randn(4, generator=generator),
    }
    grads = ms.tree.map(lambda p: torch.randn(p.shape, generator=generator), params)
    return params, grads


def reference(opt, params, grads, steps):
    """The same steps, pure: the full path every time."""
    state = opt.init(params)
    for _ in range(steps):
        params, state = opt.step(params, grads, state)
    return params


@pytest.mark.parametrize(
    "opt", [optim.sgd(lr=0.1, momentum=0.9, fused=True), optim.adam(lr=0.1), optim.nadam(lr=0.1)],
    ids=["sgd-fused", "adam", "nadam"],
)  # fmt: skip
def test_a_donated_loop_reuses_the_analysis_and_keeps_the_numbers(opt, monkeypatch):
    from modstate.optim import _base

    reused = []

    def counting_again(*args):
        run = again(*args)
        reused.append(run is not None)
        return run

    again = _base.again
    monkeypatch.setattr(_base, "again", counting_again)
    params, grads = make()
    want = reference(opt, ms.tree.clone(params), grads, 5)
    state = opt.init(params)
    for _ in range(5):
        params, state = opt.step(params, grads, state, donate=True)
        assert opt.__dict__.get("_repeat") is not None  # remembered for the next step
    assert reused == [True] * 4  # every step after the first reused the analysis
    assert all(
        torch.equal(a, b)
        for a, b in zip(ms.flatten(params).values(), ms.flatten(want).values(), strict=True)
    )
    assert int(state["step"]) == 5


def test_trees_that_are_not_the_last_outputs_take_the_full_path():
    opt = optim.sgd(lr=0.1, momentum=0.9, fused=True)
    params, grads = make()
    state = opt.init(params)
    params, state = opt.step(params, grads, state, donate=True)
    # Another tensor at a path: the full path checks it, and names the path.
    wrong = {"a": {"w": torch.zeros(3, 5)}, "b": params["b"]}
    with pytest.raises(ValueError, match=r"'a\.w': grads has shape \(5, 3\)"):
        opt.step(wrong, grads, state, donate=True)
    # A tensor whose shape changed in place (`.data =`) is not taken for the one remembered.
    params, grads = make()
    state = opt.init(params)
    params, state = opt.step(params, grads, state, donate=True)
    params["b"].data = torch.zeros(6)
    with pytest.raises(ValueError, match=r"'b': grads has shape \(4,\)"):
        opt.step(params, grads, state, donate=True)


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


def test_the_analysis_keeps_no_tensor_alive():
    opt = optim.sgd(lr=0.1, momentum=0.9, fused=True)
    params, grads = make()
    state = opt.init(params)
    params, state = opt.step(params, grads, state, donate=True)
    watched = weakref.ref(params["a"]["w"])
    del params, state
    gc.collect()
    assert watched() is None
