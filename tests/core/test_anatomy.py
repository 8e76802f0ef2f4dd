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
from modstate._core.anatomy import anatomy_of


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
