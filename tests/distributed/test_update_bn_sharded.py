"""ms.update_bn on a model sharded with FSDP2 (fully_shard per layer and at the root), on a real
2-rank gloo group: its trees are DTensors, and the statistics equal swa_utils.update_bn on the
unsharded model; the module (which cannot be deep-copied) is put back as it was."""

from __future__ import annotations

import pytest
import torch
from _ranks import stage
from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor import DTensor
from torch.optim import swa_utils

import modstate as ms

pytestmark = pytest.mark.distributed


def bn_mlp() -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(
        nn.Linear(4, 8), nn.BatchNorm1d(8), nn.ReLU(), nn.Linear(8, 6), nn.BatchNorm1d(6)
    )


@stage(2)
def update_bn_on_fsdp2(rank: int, world_size: int, directory: str) -> int:
    mesh = init_device_mesh("cpu", (world_size,))
    sharded = bn_mlp()
    for index in (0, 3):
        fully_shard(sharded[index], mesh=mesh)
    fully_shard(sharded, mesh=mesh)
    sharded.eval()
    batches = [torch.randn(6, 4, generator=torch.Generator().manual_seed(i)) for i in range(3)]
    params, state = ms.split(sharded, detach=True)
    assert all(isinstance(leaf, DTensor) for leaf in ms.flatten(params).values())
    before = {path: leaf.clone() for path, leaf in ms.flatten(state).items()}

    new_state = ms.update_bn(sharded, params, state, batches, progress=False)

    reference = bn_mlp()
    swa_utils.update_bn(batches, reference)
    expected = reference.state_dict()
    for path, leaf in ms.flatten(new_state).items():
        assert torch.equal(leaf, expected[path]), path
    # put back as it was: modes, momenta, statistics
    assert not any(m.training for m in sharded.modules())
    assert sharded[1].momentum == 0.1 and sharded[4].momentum == 0.1
    for path, leaf in ms.flatten(ms.split(sharded)[1]).items():
        assert torch.equal(leaf, before[path]), path
    return len(ms.flatten(new_state))


def test_update_bn_on_an_fsdp2_model_equals_swa_utils_on_the_unsharded_model(two_rank_stages):
    # update_bn_on_fsdp2 ran in the shared launch of every 2-rank stage (conftest.py).
    assert two_rank_stages["update_bn_on_fsdp2"] == [6, 6]
