"""The swap objects: every slot write goes through ``Swap.put``, private (this thread) or shared.

``begin`` then ``put`` per part is how a subclass fills the slots in parts (one FSDP unit at a
time, say); ``undo`` takes back whatever was put.
"""

from __future__ import annotations

import threading

import pytest
import torch
from torch import nn

import modstate as ms
from modstate._core.swap.prepare import prepare

from zoo import forward_with

X = torch.randn(4, 3, generator=torch.Generator().manual_seed(0))


def model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(3, 4), nn.Tanh(), nn.Linear(4, 2))


def seen_from_another_thread(m: nn.Module) -> torch.Tensor:
    out: dict[str, torch.Tensor] = {}
    thread = threading.Thread(target=lambda: out.setdefault("y", m(X)))
    thread.start()
    thread.join()
    return out["y"]


@pytest.mark.parametrize("private", [True, False], ids=["private", "shared"])
def test_put_in_parts_then_undo(private):
    m = model()
    own = ms.flatten(ms.extract(m))
    before = m(X)
    tree = ms.tree.map(lambda t: t + 1, ms.extract(m, detach=True))
    swap = prepare(m, tree, True, compute=True, private=private)
    assert swap.private is private
    with pytest.raises(RuntimeError, match="begin"):
        swap.put(swap.tables, swap.names, swap.values)
    swap.begin()
    half = len(swap.tables) // 2
    for part in (slice(0, half), slice(half, None)):
        swap.put(swap.tables[part], swap.names[part], swap.values[part])
    assert torch.equal(m(X), forward_with(model(), tree, X))
    # A private swap is this thread's only; a shared one, every thread's.
    assert torch.equal(seen_from_another_thread(m), before if private else m(X))
    swap.undo()
    assert torch.equal(m(X), before)
    after = ms.flatten(ms.extract(m))
    assert after.keys() == own.keys() and all(v is own[k] for k, v in after.items())
