"""save_distributed commits atomically: a killed save is refused on load, never loaded as if
complete, and the previous checkpoint still loads (see modstate/checkpoint/_commit.py).

Savers are killed for real (SIGKILL) in processes forked by ``_crash.py``: one process without a
process group, and ranks of a real gloo group on 127.0.0.1.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from _savers import crash, number_of, tree_number

from modstate import checkpoint

pytestmark = pytest.mark.skipif(not hasattr(os, "fork"), reason="kills forked savers")
LIKE = tree_number(0, size=1 << 15)  # the layout of _crash.distributed_tree, as full tensors


def check_killed_trial(place: Path, completed: list[int]) -> None:
    """What a round of saves killed at a random moment must leave in ``place``."""
    last = max(completed)  # every rank returns from a save only once it is committed
    assert last >= 1
    # `latest` was saved over again and again: it is one of the saved trees, whole.
    latest = number_of(checkpoint.load_distributed(place / "latest", LIKE))
    assert latest in (last, last + 1)
    # Every step saved to completion loads, as itself.
    for step in range(1, last + 1):
        assert number_of(checkpoint.load_distributed(place / f"step-{step}", LIKE)) == step
    # The step in progress at the kill either completed, or is refused, naming the interruption.
    interrupted = place / f"step-{last + 1}"
    if interrupted.exists():
        assert number_of(checkpoint.load_distributed(interrupted, LIKE)) == last + 1
    else:
        with pytest.raises(
            FileNotFoundError,
            match=rf"^\[Errno 2\] checkpoint\.load_distributed: '{interrupted}': no distributed checkpoint there",
        ) as info:
            checkpoint.load_distributed(interrupted, LIKE)
        if (place / f".step-{last + 1}.modstate-partial").exists():
            assert "a save into it was interrupted" in str(info.value)
    assert not (place / f"step-{last + 2}").exists()


def test_a_save_killed_half_way_is_refused_and_the_previous_checkpoint_still_loads(killed):
    places, reports = killed
    previous, fresh = places["previous"], places["fresh"]
    assert [r["killed"] for r in reports["die-in-distributed-save"]] == [True, True]

    # Killed while writing: what it wrote is in the staging directory, .metadata never came.
    for target in (previous, fresh):
        staging = target.parent / f".{target.name}.modstate-partial"
        assert staging.is_dir() and not (staging / ".metadata").exists()

    assert number_of(checkpoint.load_distributed(previous, tree_number(0))) == 0  # untouched
    with pytest.raises(
        FileNotFoundError,
        match=r"'.*fresh': no distributed checkpoint there .*a save into it was interrupted before it completed",
    ):
        checkpoint.load_distributed(fresh, tree_number(0))

    # The next save into either place commits, and clears what the killed one left.
    checkpoint.save_distributed(tree_number(5), fresh)
    checkpoint.save_distributed(tree_number(6), previous)
    assert sorted(os.listdir(previous.parent)) == ["ckpt", "fresh"]
    assert number_of(checkpoint.load_distributed(fresh, tree_number(0))) == 5
    assert number_of(checkpoint.load_distributed(previous, tree_number(0))) == 6


def test_saves_killed_at_random_moments_in_one_process(killed):
    _, reports = killed
    trials = reports["kill-distributed-saves"]
    assert len(trials) == 4
    for trial in trials:
        check_killed_trial(Path(trial["directory"]), trial["completed"])


@pytest.mark.distributed
@pytest.mark.skipif(not (dist.is_available() and dist.is_gloo_available()), reason="no gloo")
def test_saves_killed_at_random_moments_on_two_gloo_ranks(tmp_path):
    reports = crash(
        ("kill-distributed-saves", tmp_path, 2, 1, 2), ("refused-on-every-rank", tmp_path, 2)
    )
    assert len(reports["kill-distributed-saves"]) == 2
    for trial in reports["kill-distributed-saves"]:
        check_killed_trial(Path(trial["directory"]), trial["completed"])
    # A refusal on the first rank reaches every rank (none waits forever in a collective).
    (refused,) = reports["refused-on-every-rank"]
    assert len(refused["outcomes"]) == 2
    for outcome in refused["outcomes"]:
        assert outcome.startswith("NotADirectoryError: checkpoint.save_distributed: '"), outcome


# --- the commit protocol without a crash ---------------------------------------------------


def test_saving_over_a_checkpoint_replaces_it_as_a_whole(tmp_path):
    target = tmp_path / "ckpt"
    checkpoint.save_distributed({**tree_number(1), "extra": torch.ones(3)}, target)
    checkpoint.save_distributed(tree_number(2), target)
    assert sorted(os.listdir(tmp_path)) == ["ckpt"]  # no staging or replaced directory left
    with pytest.raises(ValueError, match=r"'extra'"):  # not there any more
        checkpoint.load_distributed(target, {**tree_number(0), "extra": torch.zeros(3)})
    assert number_of(checkpoint.load_distributed(target, tree_number(0))) == 2


def test_a_directory_holding_other_files_is_refused_before_anything_is_written(tmp_path):
    target = tmp_path / "outputs"
    target.mkdir()
    (target / "notes.txt").write_text("mine")
    with pytest.raises(
        FileExistsError, match=r"'.*outputs': holds \['notes\.txt'\].*save into a new directory"
    ):
        checkpoint.save_distributed(tree_number(1), target)
    assert sorted(os.listdir(target)) == ["notes.txt"]
    assert sorted(os.listdir(tmp_path)) == ["outputs"]
    checkpoint.save_distributed(tree_number(1), target / "step-1")  # the fix: a new directory
    assert number_of(checkpoint.load_distributed(target / "step-1", tree_number(0))) == 1


def test_a_file_is_refused_and_parents_are_created(tmp_path):
    (tmp_path / "a-file").write_text("x")
    with pytest.raises(NotADirectoryError, match=r"'.*a-file': a file is there"):
        checkpoint.save_distributed(tree_number(1), tmp_path / "a-file")
    checkpoint.save_distributed(tree_number(1), tmp_path / "runs" / "7" / "step-1")
    assert number_of(checkpoint.load_distributed(tmp_path / "runs/7/step-1", tree_number(0))) == 1


def test_a_relative_directory_commits_where_it_says(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    checkpoint.save_distributed(tree_number(3), "ckpt")
    assert sorted(os.listdir(tmp_path)) == ["ckpt"]
    assert number_of(checkpoint.load_distributed("ckpt", tree_number(0))) == 3


def test_an_interrupted_replacement_names_where_the_previous_checkpoint_is(tmp_path):
    """The one moment without a checkpoint at the name: between the two renames of a commit."""
    target = tmp_path / "ckpt"
    checkpoint.save_distributed(tree_number(1), target)
    os.rename(target, tmp_path / ".ckpt.modstate-replaced")  # as if killed right there
    with pytest.raises(
        FileNotFoundError,
        match=r"the previous checkpoint is in '.*\.ckpt\.modstate-replaced' \(rename it back\)",
    ):
        checkpoint.load_distributed(target, tree_number(0))
    os.rename(tmp_path / ".ckpt.modstate-replaced", target)  # the fix it names
    assert number_of(checkpoint.load_distributed(target, tree_number(0))) == 1
