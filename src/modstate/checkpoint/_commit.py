"""How ``save_distributed`` commits a checkpoint, so that a directory name only ever holds a
complete one.

The protocol (the single-file ``save`` does the same with a file):

1. The first rank of the group removes what an earlier, interrupted save left (the staging
   directory ``.<name>.modstate-partial`` beside the target) and refuses a target that holds
   anything but a distributed checkpoint (replacing it would delete those files).
2. Every rank writes into the staging directory (``torch.distributed.checkpoint.save``; its
   ``.metadata`` is written last, by the coordinator, once every rank's data is on disk).
3. The first rank renames the staging directory to the target (an atomic rename). A target that
   already held a checkpoint is first renamed aside to ``.<name>.modstate-replaced``, and removed
   once the new one is in place. Then every rank returns.

A save killed at any point before step 3 leaves the target as it was (absent, or the previous
checkpoint, which still loads) and the staging directory, which the next save to the same target
removes; ``load_distributed`` names it when the target is absent. All ranks must see one file
system, as DCP's file system writer requires anyway.
"""

from __future__ import annotations

import os
import shutil
from collections.abc import Callable
from typing import Any

import torch.distributed as dist

from modstate.checkpoint._atomic import fsync_directory

STAGING = ".modstate-partial"
REPLACED = ".modstate-replaced"
_CHECKPOINT_FILES = (".distcp", ".metadata", ".metadata.tmp")


def staging_path(final: str) -> str:
    directory, name = os.path.split(final)
    return os.path.join(directory, f".{name}{STAGING}")


def replaced_path(final: str) -> str:
    directory, name = os.path.split(final)
    return os.path.join(directory, f".{name}{REPLACED}")


def begin(final: str) -> None:
    """Step 1, on the first rank: check the target, clear the staging place."""
    if os.path.exists(final) and not os.path.isdir(final):
        raise NotADirectoryError(
            f"checkpoint.save_distributed: {final!r}: a file is there; a distributed checkpoint "
            "is a directory: give another name"
        )
    if os.path.isdir(final):
        foreign = sorted(
            entry
            for entry in os.listdir(final)
            if not (
                entry.endswith(_CHECKPOINT_FILES) and os.path.isfile(os.path.join(final, entry))
            )
        )
        if foreign:
            raise FileExistsError(
                f"checkpoint.save_distributed: {final!r}: holds {foreign[:3]!r}, which are not "
                "part of a distributed checkpoint, and a save replaces the whole directory; "
                "save into a new directory (or move those files away)"
            )
    os.makedirs(os.path.dirname(final), exist_ok=True)
    _remove(staging_path(final))


def commit(final: str) -> None:
    """Step 3, on the first rank: put the complete staging directory in place of the target."""
    staging, replaced = staging_path(final), replaced_path(final)
    if os.path.isdir(final):
        _remove(replaced)
        os.rename(final, replaced)
        os.rename(staging, final)
        fsync_directory(os.path.dirname(final))  # the new one is in place before the old goes
        _remove(replaced)
    else:
        os.rename(staging, final)
        fsync_directory(os.path.dirname(final))


def abandon(final: str) -> None:
    """After a failed save in one process: remove the staging directory."""
    _remove(staging_path(final))


def why_absent(final: str) -> str:
    """What a missing target's neighbours say about it (for load's error)."""
    staging, replaced = staging_path(final), replaced_path(final)
    if os.path.isdir(replaced):
        return (
            f"a save that was replacing it was interrupted; the previous checkpoint is in "
            f"{replaced!r} (rename it back)"
        )
    if os.path.isdir(staging):
        return (
            f"a save into it was interrupted before it completed (what it wrote is in "
            f"{staging!r}, never loaded); load an earlier checkpoint, or save again"
        )
    return "no directory there; check the path"


def on_first_rank(step: Callable[[], None], process_group: Any, no_dist: bool) -> None:
    """Run ``step`` on the first rank of the group while the others wait; if it raises, every
    rank raises that error (so that no rank is left waiting in a collective)."""
    if no_dist:
        step()
        return
    failure: list[Any] = [None]
    if dist.get_rank(process_group) == 0:
        try:
            step()
        except Exception as error:  # handed to every rank below
            failure[0] = error
    first = dist.get_global_rank(process_group, 0) if process_group is not None else 0
    dist.broadcast_object_list(failure, src=first, group=process_group)
    if failure[0] is not None:
        raise failure[0]


def _remove(path: str) -> None:
    if os.path.isdir(path):
        shutil.rmtree(path)
