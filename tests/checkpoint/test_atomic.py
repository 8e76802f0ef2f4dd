"""checkpoint.save's atomic writes: a failed or killed write loses nothing and says what happened.

Faults are real where they can be: a full disk is the file-size limit (``RLIMIT_FSIZE``, which a
writer sees as ``EFBIG``, exactly as it sees ``ENOSPC`` on a full disk) in a forked process, and
crashes are ``SIGKILL`` sent to a saving process at random moments.
"""

from __future__ import annotations

import errno
import os
import subprocess
import sys
from pathlib import Path

import pytest
import safetensors
import torch
from _savers import number_of, tree_number

import modstate as ms
from modstate import checkpoint

pytestmark = pytest.mark.skipif(not hasattr(os, "fork"), reason="kills forked savers")


def files_in(directory):
    return sorted(os.listdir(directory))


# --- a full disk ----------------------------------------------------------------------------


def test_a_full_disk_raises_an_oserror_with_errno_naming_the_path(killed):
    places, reports = killed
    path = places["limited"]
    (report,) = reports["file-size-limit"]  # a tree of ~330 kB over a 50 kB limit

    assert report["is_oserror"] and report["errno"] == errno.EFBIG, report  # except OSError
    assert report["message"].startswith(
        f"[Errno {errno.EFBIG}] checkpoint.save: '{path}': the write failed (File too large)"
    )
    assert "free disk space" in report["message"]
    assert files_in(path.parent) == ["model.safetensors"]  # no temporary file left
    assert number_of(checkpoint.load(path)) == 0  # the previous checkpoint is intact


def test_safetensors_io_errors_become_oserrors_with_their_errno(tmp_path, monkeypatch):
    """safetensors reports a full disk as SafetensorError("... (os error 28)")."""

    def out_of_space(tensors, path, metadata=None):
        with open(path, "wb") as handle:
            handle.write(b"\x00" * 100)
        raise safetensors.SafetensorError(
            "Error while serializing: I/O error: No space left on device (os error 28)"
        )

    monkeypatch.setattr(safetensors.torch, "save_file", out_of_space)
    path = tmp_path / "t.safetensors"
    with pytest.raises(
        OSError, match=r"checkpoint\.save: '.*t\.safetensors': .*No space left"
    ) as info:
        checkpoint.save({"w": torch.ones(3)}, path)
    assert info.value.errno == errno.ENOSPC
    assert files_in(tmp_path) == []


def test_a_failure_mid_write_leaves_no_file_and_no_temporary_litter(tmp_path, monkeypatch):
    def write_half_then_fail(path, tensors, metadata):
        with open(path, "wb") as handle:
            handle.write(b"\x00" * 100)
        raise OSError("disk full")

    monkeypatch.setattr(checkpoint._file, "write", write_half_then_fail)
    with pytest.raises(OSError, match="disk full"):
        checkpoint.save({"w": torch.ones(3)}, tmp_path / "t.safetensors")

    assert files_in(tmp_path) == []


def test_an_interrupted_save_keeps_the_previous_checkpoint(tmp_path, monkeypatch):
    path = tmp_path / "t.safetensors"
    checkpoint.save({"w": torch.zeros(3)}, path)

    def interrupted(path, tensors, metadata):
        with open(path, "wb") as handle:
            handle.write(b"\x00" * 10)
        raise KeyboardInterrupt

    monkeypatch.setattr(checkpoint._file, "write", interrupted)
    with pytest.raises(KeyboardInterrupt):
        checkpoint.save({"w": torch.ones(3)}, path)

    assert files_in(tmp_path) == ["t.safetensors"]
    assert torch.equal(checkpoint.load(path)["w"], torch.zeros(3))


def test_saving_over_an_existing_checkpoint_replaces_it(tmp_path):
    path = tmp_path / "t.safetensors"
    checkpoint.save({"w": torch.zeros(3)}, path)
    checkpoint.save({"v": torch.ones(2)}, path)
    assert files_in(tmp_path) == ["t.safetensors"]
    assert list(checkpoint.load(path)) == ["v"]


def test_saving_into_a_missing_directory_is_refused(tmp_path):
    with pytest.raises(
        FileNotFoundError, match=r"checkpoint\.save: '.*t\.safetensors'.*does not exist"
    ):
        checkpoint.save({"w": torch.ones(1)}, tmp_path / "no" / "t.safetensors")
    os.mkdir(tmp_path / "no")  # the fix it names
    checkpoint.save({"w": torch.ones(1)}, tmp_path / "no" / "t.safetensors")


# --- a killed process -----------------------------------------------------------------------


def test_a_save_killed_at_random_moments_leaves_one_of_the_saved_trees(killed):
    _, reports = killed
    trials = reports["kill-saves"]
    assert len(trials) == 12
    for trial in trials:
        path = Path(trial["path"])
        assert trial["completed"] >= 1  # killed after at least one complete save
        loaded = number_of(checkpoint.load(path))  # it always loads, and is never a mix
        # The last save the saver reported complete, or the next one, renamed into place just
        # before the kill could stop the report.
        assert loaded in (trial["completed"], trial["completed"] + 1), (trial, loaded)
        # A killed saver may leave its temporary directory (it could not remove it) ...
        assert all(n == path.name or n.endswith(".tmp") for n in files_in(path.parent))
        checkpoint.save(tree_number(-1), path)  # ... which the next save removes
        assert files_in(path.parent) == [path.name]
        assert number_of(checkpoint.load(path)) == -1


def test_only_the_leftovers_of_writers_that_are_gone_are_removed(tmp_path):
    import socket

    finished = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"],
                              capture_output=True, text=True, check=True)  # fmt: skip
    gone = int(finished.stdout)  # the pid of a process that has exited
    host = socket.gethostname()
    abandoned = f".m.safetensors.{host}.{gone}.0123456789ab.tmp"
    live = f".m.safetensors.{host}.1.0123456789ab.tmp"  # pid 1 is alive
    other_host = f".m.safetensors.elsewhere.{gone}.0123456789ab.tmp"
    for name in (abandoned, live, other_host):  # what a killed save leaves: its workspace
        (tmp_path / name).mkdir()
        (tmp_path / name / "m.safetensors").write_bytes(b"partial")
    checkpoint.save({"w": torch.ones(1)}, tmp_path / "m.safetensors")
    assert files_in(tmp_path) == sorted([live, other_host, "m.safetensors"])


def test_the_file_gets_the_mode_open_would_give_it(tmp_path):
    path = tmp_path / "m.safetensors"
    checkpoint.save({"w": torch.ones(1)}, path)
    with open(tmp_path / "plain", "w"):
        pass
    assert os.stat(path).st_mode & 0o777 == os.stat(tmp_path / "plain").st_mode & 0o777


def test_tree_number_tells_two_saves_apart():
    """The check the kill test relies on can fail: a tree mixing two saves is caught."""
    mixed = tree_number(3)
    mixed["layer"]["bias"] = tree_number(4)["layer"]["bias"]
    with pytest.raises(AssertionError):
        number_of(mixed)
    assert number_of(ms.tree.clone(tree_number(5))) == 5
