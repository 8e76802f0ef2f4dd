"""The module anatomy (``_core/anatomy.py``) is cached per module and goes with it: nothing in it
refers to itself, so a member built, extracted and called is freed by reference counting alone,
without waiting for the cycle collector (which ``Ensemble.from_factory`` relies on to keep its
peak memory at the stacked size)."""

from __future__ import annotations

import gc
import weakref

import pytest
import torch
from torch import nn

import modstate as ms
from modstate._core.module.anatomy import anatomy_of


def sequential() -> nn.Module:
    return nn.Sequential(nn.Linear(3, 4), nn.BatchNorm1d(4), nn.Linear(4, 3))


@pytest.mark.parametrize("make", [sequential, lambda: nn.BatchNorm1d(3)], ids=["nested", "root"])
def test_a_module_and_its_anatomy_go_together_without_the_cycle_collector(make):
    # "root": the module itself owns the buffers that apply copies (apply's plans must not hold it)
    gc.collect()
    gc.disable()  # from the start: a collection could break a cycle that the build made
    try:
        model = make()
        x = torch.randn(5, 3)
        tree = ms.extract(model, detach=True)
        ms.call(model, tree, x)
        params, state = ms.split(model, detach=True)
        ms.apply(model, params, state, x)
        with ms.inject(model, tree):
            model(x)
        anatomy = weakref.ref(anatomy_of(model))
        module = weakref.ref(model)
        del tree, params, state, model
        assert anatomy() is None
        assert module() is None
    finally:
        gc.enable()


def _assign_anew(model: nn.Module) -> None:
    model.load_state_dict({k: v.clone() for k, v in model.state_dict().items()}, assign=True)


def _new_parameter(model: nn.Module) -> None:
    model[0].weight = nn.Parameter(torch.zeros(4, 3))


def _new_buffer(model: nn.Module) -> None:
    model[1].register_buffer("running_mean", torch.ones(4))


def _new_submodule(model: nn.Module) -> None:
    model[0] = nn.Linear(3, 4)


@pytest.mark.parametrize(
    ("replace", "freed"),
    [
        (_assign_anew, [True, True]),
        (_new_parameter, [True, False]),
        (_new_buffer, [False, True]),
        (_new_submodule, [True, False]),
    ],
    ids=["assign", "parameter", "buffer", "submodule"],
)
def test_a_tensor_the_module_lets_go_is_freed_at_once_and_the_next_call_sees_its_successor(
    replace, freed
):
    # The anatomy cached by the first call leaves the cache as soon as the module lets go of a
    # tensor (its slot table says so) or a submodule (held by weak reference): replacing them
    # (load_state_dict(assign=True), a new Parameter or submodule, fully_shard) frees the old
    # ones at once, not at the next modstate call on the module.
    model = sequential()
    x = torch.randn(5, 3)
    params, state = ms.split(model, detach=True)
    ms.apply(model, params, state, x)
    del params, state
    gc.collect()
    gc.disable()
    try:
        olds = [weakref.ref(t) for t in (model[0].weight, model[1].running_mean)]
        replace(model)
        assert [old() is None for old in olds] == freed  # what was replaced is gone already
    finally:
        gc.enable()
    tree = ms.extract(model)
    assert tree["0"]["weight"] is model[0].weight
    assert tree["1"]["running_mean"] is model[1].running_mean
    new = ms.tree.map(lambda t: t.detach() + 1, tree)
    with torch.no_grad():
        expected = torch.func.functional_call(model, ms.flatten(new), x)
        assert torch.equal(ms.call(model, new, x), expected)


def test_a_deleted_tensor_is_freed_at_once():
    model = sequential()
    ms.extract(model)
    gc.collect()
    gc.disable()
    try:
        old = weakref.ref(model[2].bias)
        del model[2].bias
        assert old() is None
    finally:
        gc.enable()
    assert "bias" not in ms.extract(model)["2"]
