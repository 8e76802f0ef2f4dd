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
    first = ms.Ensemble.from_factory(factory, 4, route="batched")
    torch.manual_seed(7)
    again = ms.Ensemble.from_factory(factory, 4, route="batched")
    for a, b in zip(first.parameters(), again.parameters(), strict=True):
        assert torch.equal(a, b)


def test_two_ensembles_built_in_a_row_differ_and_so_do_members():
    torch.manual_seed(7)
    first = ms.Ensemble.from_factory(factory, 4, route="batched")
    second = ms.Ensemble.from_factory(factory, 4, route="batched")
    weight = first.stacked.get_submodule("0").weight
    assert not torch.equal(weight, second.stacked.get_submodule("0").weight)
    assert all(not torch.equal(weight[0], weight[i]) for i in range(1, 4))


def test_member_i_does_not_depend_on_how_many_members_are_built():
    # The rule that makes member i the same model on any number of ranks.
    torch.manual_seed(7)
    three = ms.Ensemble.from_factory(factory, 3, route="batched")
    torch.manual_seed(7)
    five = ms.Ensemble.from_factory(factory, 5, route="batched")
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

    ensemble = ms.Ensemble.from_factory(watched, 6, route="batched")
    assert len(ensemble) == 6
    # While member k is built, only member 0 (kept as the template) is still alive.
    assert most_alive == [0, 1, 1, 1, 1, 1]


def test_the_first_member_is_the_template_and_members_stay_ordinary_modules():
    ensemble = ms.Ensemble.from_factory(factory, 3, route="batched")
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
        ms.Ensemble.from_factory(lambda: 3, 2, route="batched")
    widths = iter([8, 9])

    def varying() -> nn.Module:
        return nn.Linear(4, next(widths))

    with pytest.raises(
        ValueError, match=r"Ensemble.from_factory: 'weight': shape \(9, 4\) in model 1"
    ):
        ms.Ensemble.from_factory(varying, 2, route="batched")


# --- seeds given by the caller -------------------------------------------------------------


def bn_factory() -> nn.Module:
    model = nn.Sequential(nn.Conv2d(3, 4, 3), nn.BatchNorm2d(4), nn.Flatten(), nn.Linear(16, 2))
    with torch.no_grad():
        model[1].weight.uniform_()  # a draw after the layers' own initialization
    return model


def test_with_seeds_member_i_is_bit_for_bit_a_separate_run_with_seeds_i():
    seeds = [3, 1 << 40, 0, -5]
    ensemble = ms.Ensemble.from_factory(bn_factory, 4, seeds=seeds, route="batched")
    for i, seed in enumerate(seeds):
        torch.manual_seed(seed)
        alone = bn_factory()
        for path, leaf in ms.flatten(ms.extract(alone)).items():
            got = ms.flatten(ensemble.tree())[path][i]
            assert got.dtype == leaf.dtype and torch.equal(got, leaf), (i, path)


def test_with_seeds_the_global_random_state_is_left_as_it_was():
    torch.manual_seed(11)
    before = torch.get_rng_state()
    ms.Ensemble.from_factory(bn_factory, 3, seeds=[0, 1, 2], route="batched")
    assert torch.equal(torch.get_rng_state(), before)
    ms.Ensemble.from_factory(bn_factory, 3, route="batched")  # without seeds: one draw
    assert not torch.equal(torch.get_rng_state(), before)


def test_without_seeds_the_global_state_advances_by_exactly_one_draw():
    torch.manual_seed(11)
    ms.Ensemble.from_factory(factory, 3, route="batched")
    after_build = torch.rand(3)
    torch.manual_seed(11)
    torch.randint(0, (1 << 63) - 1, (1,), dtype=torch.int64)  # the one draw, by hand
    assert torch.equal(torch.rand(3), after_build)


@pytest.mark.parametrize(
    ("seeds", "error", "complaint"),
    [
        ([1, 2], ValueError, r"seeds has 2 entries for n=3 members"),
        ([1, 2.0, 3], TypeError, r"'seeds\[1\]': a float \(2\.0\)"),
        ([1, True, 3], TypeError, r"'seeds\[1\]': a bool"),
        ([1, 1 << 64, 3], ValueError, r"'seeds\[1\]': 18446744073709551616 is outside"),
        (7, TypeError, r"seeds is a int; give a list of 3 ints"),
    ],
    ids=["length", "float", "bool", "range", "not-a-list"],
)
def test_seeds_that_do_not_fit_are_refused_naming_the_entry(seeds, error, complaint):
    with pytest.raises(error, match=rf"^Ensemble\.from_factory: {complaint}"):
        ms.Ensemble.from_factory(factory, 3, seeds=seeds, route="batched")
    # the fix the messages name for the count
    assert len(ms.Ensemble.from_factory(factory, 3, seeds=list(range(3)), route="batched")) == 3
