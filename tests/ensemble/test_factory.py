"""``Ensemble.from_factory`` (``ensemble/_factory.py``): who seeds member ``i``, and each member
written into the stacked tensors as it is built (peak memory: see
benchmarks/ensemble_architectures_benchmarks_test.py)."""

from __future__ import annotations

import gc
import weakref

import pytest
import torch
from torch import nn

import modstate as ms


def factory() -> nn.Module:
    return nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 2))


def test_the_global_seed_decides_every_member():
    torch.manual_seed(7)
    first = ms.Ensemble.from_factory(factory, 4)
    torch.manual_seed(7)
    again = ms.Ensemble.from_factory(factory, 4)
    for a, b in zip(first.parameters(), again.parameters(), strict=True):
        assert torch.equal(a, b)


def test_two_ensembles_built_in_a_row_differ_and_so_do_members():
    torch.manual_seed(7)
    first = ms.Ensemble.from_factory(factory, 4)
    second = ms.Ensemble.from_factory(factory, 4)
    weight = first.stacked.get_submodule("0").weight
    assert not torch.equal(weight, second.stacked.get_submodule("0").weight)
    assert all(not torch.equal(weight[0], weight[i]) for i in range(1, 4))


def test_member_i_does_not_depend_on_how_many_members_are_built():
    # The rule that makes member i the same model on any number of ranks.
    torch.manual_seed(7)
    three = ms.Ensemble.from_factory(factory, 3)
    torch.manual_seed(7)
    five = ms.Ensemble.from_factory(factory, 5)
    assert (
        ms.flatten(three.tree()).keys()
        == ms.flatten(five.tree()).keys()
        == {"0.weight", "0.bias", "2.weight", "2.bias"}
    )
    for path, leaf in ms.flatten(three.tree()).items():
        assert torch.equal(leaf, ms.flatten(five.tree())[path][:3]), path


def test_members_are_dropped_as_soon_as_they_are_copied_in():
    alive: list[weakref.ref] = []
    most_alive = []

    def watched() -> nn.Module:
        gc.collect(1)
        most_alive.append(sum(ref() is not None for ref in alive))
        model = factory()
        alive.append(weakref.ref(model))
        return model

    ensemble = ms.Ensemble.from_factory(watched, 6)
    assert len(ensemble) == 6
    # While member k is built, only member 0 (kept as the template) is still alive.
    assert most_alive == [0, 1, 1, 1, 1, 1]


def test_the_first_member_is_the_template_and_members_stay_ordinary_modules():
    ensemble = ms.Ensemble.from_factory(factory, 3)
    member = ensemble.member(2)
    assert type(member) is nn.Sequential
    torch.testing.assert_close(
        member[0].weight, ensemble.stacked.get_submodule("0").weight[2], atol=0, rtol=0
    )
    x = torch.randn(5, 4)
    torch.testing.assert_close(ensemble(x), torch.stack([m(x) for m in ensemble.members()]))


def test_a_factory_that_builds_other_things_is_refused_with_the_path():
    with pytest.raises(
        TypeError, match="Ensemble.from_factory: model 0 is a int; give torch.nn.Module"
    ):
        ms.Ensemble.from_factory(lambda: 3, 2)
    widths = iter([8, 9])

    def varying() -> nn.Module:
        return nn.Linear(4, next(widths))

    with pytest.raises(
        ValueError, match=r"Ensemble.from_factory: 'weight': shape \(9, 4\) in model 1"
    ):
        ms.Ensemble.from_factory(varying, 2)
