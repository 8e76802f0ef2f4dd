"""The savers that tests/checkpoint kills, run once per session in one fresh process (see
``_crash.py``): starting a process that imports torch costs seconds on a busy machine."""

from __future__ import annotations

import os
import shutil
import tempfile
from pathlib import Path

import pytest
from _savers import crash, tree_number

from modstate import checkpoint


@pytest.fixture(scope="session")
def killed(tmp_path_factory):
    """``(places, reports)`` of every scenario that needs no process group:

    - ``file-size-limit``: a save over ``places["limited"]`` (which holds ``tree_number(0)``)
      under a file-size limit (a full disk, to the writer);
    - ``kill-saves``: 12 savers of one file, each SIGKILLed at a random moment;
    - ``die-in-distributed-save``: a save_distributed killed half-way over ``places["previous"]``
      (which holds ``tree_number(0)``), then one into ``places["fresh"]`` (new);
    - ``kill-distributed-saves``: 4 rounds of save_distributed without a process group, each
      SIGKILLed at a random moment.

    The random kills run on a memory file system where there is one (/dev/shm): a kill stops a
    process, not the disk, so a disk only adds fsync time (what is tested is the rename).
    """
    root = tmp_path_factory.mktemp("killed")
    places = {
        "limited": root / "limited" / "model.safetensors",
        "previous": root / "dcp" / "ckpt",
        "fresh": root / "dcp" / "fresh",
    }
    places["limited"].parent.mkdir()
    checkpoint.save(tree_number(0), places["limited"])
    checkpoint.save_distributed(tree_number(0), places["previous"])
    memory = "/dev/shm" if os.access("/dev/shm", os.W_OK) else None
    kills = Path(tempfile.mkdtemp(prefix="modstate-kills-", dir=memory))
    (kills / "file").mkdir()
    (kills / "dcp").mkdir()
    try:
        reports = crash(
            ("file-size-limit", places["limited"], 50_000),
            ("kill-saves", kills / "file", 12, 0),
            ("die-in-distributed-save", places["previous"]),
            ("die-in-distributed-save", places["fresh"]),
            ("kill-distributed-saves", kills / "dcp", 4, 0, 0),
        )
        yield places, reports
    finally:
        shutil.rmtree(kills, ignore_errors=True)
