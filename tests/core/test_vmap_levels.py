"""The seam to torch.vmap: which vmap is running, members in and out."""

from __future__ import annotations

import torch

from modstate._core import vmap_levels
from modstate._core.vmap_levels import as_member_view, lone_vmap, members_of


def test_lone_vmap_reads_the_running_vmap_and_nothing_else(monkeypatch):
    seen = []

    def record(x):
        seen.append(lone_vmap())
        return x

    assert lone_vmap() is None
    torch.vmap(record, randomness="different")(torch.ones(3, 2))
    torch.vmap(torch.vmap(record))(torch.ones(2, 3, 2))  # two vmaps: not a lone one
    torch.func.grad(lambda x: torch.vmap(record)(x).sum())(torch.ones(3, 2))  # grad around it
    monkeypatch.setattr(vmap_levels, "_VmapPointer", None)  # torch's Python wrapper instead
    torch.vmap(record, randomness="same")(torch.ones(4, 2))
    assert seen[0] == (1, 3, "different")
    assert seen[1] is None and seen[2] is None
    assert seen[3] == (1, 4, "same")


def test_members_go_out_and_come_back_as_the_same_member_views():
    stacked = torch.arange(6.0).view(3, 2)

    def double(x):
        members, dim = members_of(x, 1)
        assert dim == 0 and torch.equal(members, stacked)
        assert members_of(2.0, 1) == (2.0, None)
        return as_member_view(members * 2, 0, 1)

    assert torch.equal(torch.vmap(double)(stacked), stacked * 2)
