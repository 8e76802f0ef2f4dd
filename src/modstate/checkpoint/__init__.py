"""Checkpoints of trees: one safetensors file on one machine, ``torch.distributed.checkpoint`` on many.

``save`` / ``load`` write and read a whole tree as one safetensors file: no pickle, so loading
a file from anyone runs no code; ``load(path, mmap=True)`` maps the file instead of reading it.
``save_distributed`` / ``load_distributed`` hand the tree to ``torch.distributed.checkpoint``
(DCP): every rank writes its own shards of DTensor leaves (FSDP2, tensor parallel), and a
checkpoint loads on any number of ranks, or in one process without a process group.

Both store the tree under its ``modstate.flatten`` paths (``"encoder.0.weight"``), the same keys
``state_dict`` uses, so tree keys must not contain dots. Empty sub-dicts hold no state and are
not stored: a tree comes back as ``unflatten(flatten(tree))``. Both commit atomically: a name
only ever holds a complete checkpoint (see ``save`` and ``save_distributed``).

Security:
    Loading a checkpoint runs no code from it. ``load`` never unpickles (a pickle or a
    ``torch.save`` archive is refused unopened, and every malformed file is a ``ValueError``
    naming it). DCP stores pickles: ``load_distributed`` reads ``.metadata`` with an unpickler
    that resolves only DCP's metadata classes, ``torch.Size``, dtypes, layouts, devices and
    paths (the reader DCP itself uses inside the load, reading the file once), and non-tensor
    values with ``torch.load(weights_only=True)``; any other global is refused before it is
    called, with a ``ValueError`` naming the directory or the value's path and the global.
    ``save_distributed`` refuses a value that such a load could not read back.
    ``load_distributed(..., weights_only=False)`` reads as DCP does, running whatever the
    pickles name: only for checkpoints you trust. ``torch.distributed.checkpoint.load`` called
    directly on a directory is not covered. tests/checkpoint/test_dcp_reader.py builds crafted
    checkpoints (``.metadata`` calling ``os.mkdir``, ``eval`` or ``subprocess.Popen``, not a
    pickle, wrong fields; values calling a function) and checks that each is refused, that the
    payload's marker directory never appears, and that ``like`` is unchanged.

Modules: ``_one_file`` (save, load), ``_file`` (the file format), ``_atomic`` (atomic writes),
``_leaves`` (what a checkpoint can hold), ``_distributed`` (save_distributed, load_distributed),
``_commit`` (the commit protocol of a distributed checkpoint), ``_dcp`` (DCP checks and targets),
``_dcp_reader`` (reading a DCP checkpoint without running code from it).
"""

from __future__ import annotations

from modstate.checkpoint._distributed import load_distributed, save_distributed
from modstate.checkpoint._one_file import load, save

__all__ = ["load", "load_distributed", "save", "save_distributed"]
