"""BatchNorm in an Ensemble runs as one BatchNorm over the members' channels side by side: the
same outputs, statistics and gradients as the members run one by one."""

import copy

import pytest
import torch
from torch import nn

import modstate as ms


def members(factory, count=3):
    out = []
    for seed in range(count):
        torch.manual_seed(seed)
        model = factory()
        for parameter in model.parameters():  # BatchNorm starts at weight 1, bias 0: vary them
            parameter.data.normal_()
        out.append(model)
    return out


CASES = {
    "BatchNorm1d on (batch, features)": (
        lambda: nn.Sequential(nn.Linear(5, 4), nn.BatchNorm1d(4)),
        (8, 5),
    ),
    "BatchNorm1d, then ReLU in place, then Linear": (
        lambda: nn.Sequential(nn.Linear(5, 4), nn.BatchNorm1d(4), nn.ReLU(), nn.Linear(4, 3)),
        (8, 5),
    ),
    "BatchNorm1d on (batch, channels, length)": (
        lambda: nn.Sequential(nn.BatchNorm1d(3)),
        (6, 3, 4),
    ),
    "BatchNorm2d after a convolution": (
        lambda: nn.Sequential(nn.Conv2d(2, 4, 3, bias=False), nn.BatchNorm2d(4), nn.ReLU()),
        (5, 2, 6, 6),
    ),
    "BatchNorm3d": (lambda: nn.Sequential(nn.BatchNorm3d(2)), (4, 2, 3, 3, 3)),
    "no affine, other momentum": (
        lambda: nn.Sequential(nn.BatchNorm1d(4, affine=False, momentum=0.3)),
        (8, 4),
    ),
    "no running statistics": (
        lambda: nn.Sequential(nn.BatchNorm1d(4, track_running_stats=False)),
        (8, 4),
    ),
}


@pytest.mark.parametrize("case", CASES)
@pytest.mark.parametrize("in_dims", [None, 0])
def test_batched_batch_norm_equals_the_members_one_by_one(case, in_dims):
    factory, shape = CASES[case]
    models = members(factory)
    ensemble = ms.Ensemble(models, in_dims=in_dims)
    assert "path=batched kernels\n" in repr(ensemble)
    references = [copy.deepcopy(m) for m in models]
    torch.manual_seed(1)
    x = torch.randn(*shape) if in_dims is None else torch.randn(3, *shape)
    for training in (True, True, False):  # two steps of statistics, then eval reads them
        ensemble.train(training)
        for reference in references:
            reference.train(training)
        out = ensemble(x)
        expected = torch.stack(
            [r(x if in_dims is None else x[i]) for i, r in enumerate(references)]
        )
        torch.testing.assert_close(out, expected, atol=1e-5, rtol=1e-5)
    flat = ms.flatten(ms.extract(ensemble))
    for path, leaf in ms.flatten(ms.stack([ms.extract(r) for r in references])).items():
        torch.testing.assert_close(flat[f"stacked.{path}"], leaf, atol=1e-6, rtol=1e-5, msg=path)

    ensemble.train()
    for reference in references:
        reference.train()
    weights = torch.randn_like(out)
    if any(p.requires_grad for p in ensemble.parameters()):
        (ensemble(x) * weights).sum().backward()
        for i, reference in enumerate(references):
            (reference(x if in_dims is None else x[i]) * weights[i]).sum().backward()
        for name, parameter in ensemble.named_parameters():
            path = name.removeprefix("stacked.")
            expected = torch.stack([r.get_parameter(path).grad for r in references])
            torch.testing.assert_close(parameter.grad, expected, atol=1e-4, rtol=1e-4, msg=name)


def test_state_dict_round_trips_after_training():
    models = members(lambda: nn.Sequential(nn.Linear(3, 4), nn.BatchNorm1d(4)))
    ensemble = ms.Ensemble(models)
    ensemble(torch.randn(8, 3))
    fresh = ms.Ensemble(members(lambda: nn.Sequential(nn.Linear(3, 4), nn.BatchNorm1d(4))))
    fresh.load_state_dict(ensemble.state_dict())
    x = torch.randn(8, 3)
    torch.testing.assert_close(fresh.eval()(x), ensemble.eval()(x))
    assert int(fresh.state_dict()["stacked.1.num_batches_tracked"][0]) == 1
