"""What the thread tests of this folder share: the module's own objects, a model and random trees
for it, and one intra-op thread per calling thread (threads started together: ``together.py``)."""

from __future__ import annotations

import pytest
import torch
from torch import nn

import modstate as ms

THREADS = 4
CALLS = 200


@pytest.fixture(autouse=True, scope="module")
def one_intra_op_thread_per_calling_thread():
    """As a server would run (and fast on a machine with few cores): calling threads are the
    parallelism, torch's intra-op pool is one thread."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


def leaves(tree: dict) -> list[torch.Tensor]:
    return list(ms.flatten(tree).values())


def own_objects(module: nn.Module) -> dict[str, torch.Tensor]:
    return ms.flatten(ms.extract(module))


def assert_holds(module: nn.Module, objects: dict[str, torch.Tensor]) -> None:
    now = own_objects(module)
    assert now.keys() == objects.keys()
    assert all(now[path] is tensor for path, tensor in objects.items())


def mlp() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(
        nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 16), nn.Tanh(), nn.Linear(16, 3)
    )


def random_tree(module: nn.Module, seed: int) -> dict:
    generator = torch.Generator().manual_seed(seed)
    return ms.tree.map(
        lambda t: (
            torch.randn(t.shape, generator=generator, dtype=t.dtype)
            if t.is_floating_point()
            else t.clone()
        ),
        ms.extract(module, detach=True),
    )


X = torch.randn(5, 8, generator=torch.Generator().manual_seed(1))
