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

Modules: ``_one_file`` (save, load), ``_file`` (the file format), ``_atomic`` (atomic writes),
``_leaves`` (what a checkpoint can hold), ``_distributed`` (save_distributed, load_distributed),
``_commit`` (the commit protocol of a distributed checkpoint), ``_dcp`` (DCP checks and targets).
"""

from __future__ import annotations

from modstate.checkpoint._distributed import load_distributed, save_distributed
from modstate.checkpoint._one_file import load, save

__all__ = ["load", "load_distributed", "save", "save_distributed"]
