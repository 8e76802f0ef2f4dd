"""ms.update_bn: BatchNorm statistics recomputed over batches, purely, as
``torch.optim.swa_utils.update_bn`` recomputes them in place on a copy of the model; on a model,
on an Ensemble (each member its own statistics) and under torch.vmap over stacked trees."""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn
from torch.optim import swa_utils

import modstate as ms


def bn_cnn() -> nn.Module:
    return nn.Sequential(
        nn.Conv2d(3, 4, 3), nn.BatchNorm2d(4), nn.ReLU(),
        nn.Conv2d(4, 4, 3), nn.BatchNorm2d(4, momentum=None), nn.ReLU(),
        nn.Flatten(), nn.Linear(4 * 4 * 4, 5), nn.BatchNorm1d(5),
    )  # fmt: skip


def trained(seed: int) -> nn.Module:
    """A BN CNN whose statistics have moved away from the fresh ones, left in eval mode."""
    torch.manual_seed(seed)
    model = bn_cnn()
    for _ in range(3):
        model(torch.randn(6, 3, 8, 8) * 2 + 1)
    return model.eval()


def loader(n=4):
    generator = torch.Generator().manual_seed(0)
    return [(torch.randn(8, 3, 8, 8, generator=generator), torch.zeros(8)) for _ in range(n)]


def statistics(tree):
    return {
        path: leaf
        for path, leaf in ms.flatten(tree).items()
        if path.rsplit(".", 1)[-1] in ("running_mean", "running_var", "num_batches_tracked")
    }


def test_the_statistics_equal_swa_utils_on_a_copy_bit_for_bit_and_nothing_is_changed():
    model, batches = trained(0), loader()
    params, state = ms.split(model, detach=True)
    before = {k: v.clone() for k, v in model.state_dict().items()}

    new_state = ms.update_bn(model, params, state, batches, progress=False)

    reference = copy.deepcopy(model)
    swa_utils.update_bn(batches, reference)
    expected = statistics(ms.extract(reference))
    assert statistics(new_state).keys() == expected.keys() and expected
    for path, leaf in statistics(new_state).items():
        assert leaf.dtype == expected[path].dtype and torch.equal(leaf, expected[path]), path
    # the module, its momenta and mode, and the trees given are as they were
    assert not model.training and model[1].momentum == 0.1 and model[4].momentum is None
    given = {**ms.flatten(params), **ms.flatten(state)}
    for path, value in model.state_dict().items():
        assert torch.equal(value, before[path]) and torch.equal(given[path], before[path]), path


def test_the_new_statistics_serve_the_averaged_weights():
    models, batches = [trained(seed) for seed in range(3)], loader()
    trees = [ms.split(m, detach=True) for m in models]
    soup = ms.tree.mean([params for params, _ in trees])
    state = ms.update_bn(models[0], soup, trees[0][1], batches, progress=False)

    reference = copy.deepcopy(models[0])
    ms.load(reference, soup, strict=False)  # the weights; update_bn resets the statistics
    swa_utils.update_bn(batches, reference)
    x = torch.randn(5, 3, 8, 8)
    with torch.no_grad():
        assert torch.equal(ms.call(models[0].eval(), (soup, state), x), reference.eval()(x))


def test_an_ensemble_gets_each_members_own_statistics():
    models, batches = [trained(seed) for seed in range(3)], loader()
    ensemble = ms.Ensemble(models, route="batched")
    params, state = ms.split(ensemble, detach=True)
    before = {k: v.clone() for k, v in ensemble.state_dict().items()}

    new_state = ms.update_bn(ensemble, params, state, batches, progress=False)

    for i, model in enumerate(models):
        reference = copy.deepcopy(model)
        swa_utils.update_bn(batches, reference)
        for path, expected in statistics(ms.extract(reference)).items():
            got = ms.flatten(new_state)[f"stacked.{path}"][i]
            # the ensemble's batched kernels agree with a loop over the members to the last bits
            assert torch.allclose(got, expected, rtol=1e-5, atol=1e-6), (i, path)
    for path, value in ensemble.state_dict().items():
        assert torch.equal(value, before[path]), path
    assert not ensemble.training


def test_under_vmap_over_stacked_trees_each_member_gets_its_statistics():
    models, batches = [trained(seed) for seed in range(3)], loader()
    halves = [ms.split(m, detach=True) for m in models]
    params, state = ms.stack([p for p, _ in halves]), ms.stack([s for _, s in halves])

    def update(p, s):
        return ms.update_bn(models[0], p, s, batches, progress=False)

    new_state = torch.vmap(update)(params, state)
    for i, model in enumerate(models):
        reference = copy.deepcopy(model)
        swa_utils.update_bn(batches, reference)
        for path, expected in statistics(ms.extract(reference)).items():
            got = ms.flatten(new_state)[path][i]
            assert torch.allclose(got, expected, rtol=1e-5, atol=1e-6), (i, path)


def test_a_model_without_batch_norm_gives_the_state_back_and_reads_no_batch():
    model = nn.Sequential(nn.Linear(3, 2))
    params, state = ms.split(model, detach=True)

    def batches():
        raise AssertionError("no batch should be read")
        yield

    assert ms.update_bn(model, params, state, batches()) is state


def test_a_progress_bar_shows_where_the_batches_have_a_length(capsys):
    model = trained(0)
    params, state = ms.split(model, detach=True)
    ms.update_bn(model, params, state, loader(3))
    assert "update_bn" in capsys.readouterr().err
    ms.update_bn(model, params, state, iter(loader(3)))  # no length: no bar
    ms.update_bn(model, params, state, loader(3), progress=False)
    assert capsys.readouterr().err == ""


def test_a_state_without_the_statistics_names_the_path_and_the_fix_works():
    model = trained(0)
    params, _ = ms.split(model, detach=True)
    with pytest.raises(ValueError, match=r"^update_bn: '1\.running_mean': a BatchNorm statistic"):
        ms.update_bn(model, params, {}, loader())
    params, state = ms.split(model)  # the fix the message names
    new_state = ms.update_bn(model, params, state, loader(), progress=False)
    assert int(new_state["1"]["num_batches_tracked"]) == 4


class Uncopyable(nn.Sequential):
    """Refuses deep copies, as FSDP2's fully_shard modules do; fails on a batch of 3 rows."""

    def __deepcopy__(self, memo):
        raise AssertionError("no deepcopy")

    def forward(self, x):
        if len(x) == 3:
            raise RuntimeError("a bad batch")
        return super().forward(x)


def test_a_module_that_cannot_be_copied_runs_the_passes_itself_and_is_put_back():
    torch.manual_seed(0)
    model = Uncopyable(nn.Linear(3, 4), nn.BatchNorm1d(4)).eval()
    reference = nn.Sequential(nn.Linear(3, 4), nn.BatchNorm1d(4))
    reference.load_state_dict(model.state_dict())
    batches = [torch.randn(8, 3) for _ in range(3)]
    params, state = ms.split(model, detach=True)
    new_state = ms.update_bn(model, params, state, batches, progress=False)
    swa_utils.update_bn(batches, reference)
    for path, leaf in statistics(new_state).items():
        assert torch.equal(leaf, reference.state_dict()[path]), path
    assert not model.training and model[1].momentum == 0.1
    with pytest.raises(RuntimeError, match="a bad batch"):  # put back after an error too
        ms.update_bn(model, params, state, [torch.randn(8, 3), torch.randn(3, 3)])
    assert not model.training and not model[1].training and model[1].momentum == 0.1
