"""The helper that runs test code on real gloo process groups (tests/distributed/_ranks.py)."""

from __future__ import annotations

import multiprocessing
import os
import time

import pytest
import torch.distributed as dist
from _ranks import RankFailed, run_ranks

pytestmark = pytest.mark.distributed


def rank_one_fails_while_the_others_wait(rank: int, world_size: int) -> None:
    if rank == 1:
        raise ValueError("rank one gives up")
    dist.barrier()  # never completes: rank 1 is gone


def rank_one_dies_silently(rank: int, world_size: int) -> None:
    if rank == 1:
        os._exit(3)  # no exception, no report: as if killed
    dist.barrier()


def rank_one_never_finishes(rank: int, world_size: int) -> int:
    if rank == 1:
        time.sleep(3600)
    return rank


def test_a_failing_rank_is_reported_and_the_blocked_ranks_are_stopped():
    # The report opens with the failing rank, the cause (the others may follow, their barrier
    # broken), ...
    with pytest.raises(RankFailed, match=r"^rank 1 of 3 failed:(.|\n)*rank one gives up") as info:
        run_ranks(rank_one_fails_while_the_others_wait, 3, timeout=60)
    # ... and no timeout appears, run_ranks' own or gloo's in a blocked rank: the failure ended it.
    assert "timed out" not in str(info.value).lower()
    assert multiprocessing.active_children() == []  # rank 0 and 2 were stopped


def test_a_rank_that_dies_without_reporting_is_named():
    with pytest.raises(RankFailed, match="rank 1 of 2 died with exit code 3 without reporting"):
        run_ranks(rank_one_dies_silently, 2, timeout=60)
    assert multiprocessing.active_children() == []


def test_a_rank_that_never_finishes_times_out():
    with pytest.raises(RankFailed, match=r"timed out after 6s waiting for rank\(s\) \[(0, )?1\]"):
        run_ranks(rank_one_never_finishes, 2, timeout=6)
    assert multiprocessing.active_children() == []
