"""``save`` and ``load``: a whole tree as one safetensors file, on one machine."""

from __future__ import annotations

import errno
import os
from typing import Any

import torch

from modstate._core.trees.flat import unflatten
from modstate.checkpoint import _atomic, _file
from modstate.checkpoint._leaves import flat_tree, refuse_swapped_arguments


def save(tree: dict[str, Any], path: str | os.PathLike) -> None:
    """Write ``tree`` to the safetensors file ``path``, atomically.

    Every leaf is checked first (a refused tree writes nothing): tensors of any dtype safetensors
    knows (float64/32/16, bfloat16, float8, complex64, signed and unsigned ints, bool), any shape
    including 0-d, on any device; non-tensor leaves such as ``_extra_state`` if they are JSON
    (``None``, bool, int, finite float, str, lists, tuples and str-keyed dicts of those; tuples
    come back as tuples, so an optimizer's ``param_groups`` with Adam's ``betas`` round-trip).

    Tied tensors (the same view of the same memory at several paths, like an embedding tied to
    a head) are stored once and ``load`` gives back one tensor at all those paths. Tensors that
    overlap in memory in any other way are stored as independent copies; non-contiguous tensors
    are stored contiguous. Each tensor's bytes carry a CRC-32 checksum that ``load`` verifies.

    The file is written to a temporary name in the same directory, flushed to disk, and renamed
    over ``path`` only once complete, so ``path`` never holds a partial checkpoint: after a
    failure or a crash it holds the previous file (or nothing). A failed write leaves no
    temporary file; one left by a killed process is removed by the next save to ``path``.

    Args:
        tree: A nested dict of tensors (and JSON leaves), such as ``ms.extract(model)``. Keys
            must be non-empty and dot-free: the file stores ``ms.flatten`` paths.
        path: The file to write. Its directory must exist.

    Returns:
        None.

    Raises:
        TypeError: ``tree`` is not a dict, the arguments are swapped, or a leaf cannot be stored
            (a DTensor, a sparse, nested or quantized tensor, a dtype safetensors lacks, a
            non-JSON value); the message names the path.
        ValueError: A key is empty or holds a dot, or a leaf is a meta tensor.
        FileNotFoundError: The directory of ``path`` does not exist.
        OSError: The write failed, with its errno (``ENOSPC`` for a full disk, ``EFBIG`` past
            the file-size limit) and a message naming ``path``; the previous file is untouched.

    Example:
        >>> import tempfile, torch, modstate as ms
        >>> path = tempfile.mkdtemp() + "/linear.safetensors"
        >>> ms.checkpoint.save(ms.extract(torch.nn.Linear(3, 2)), path)
        >>> ms.checkpoint.load(path)["weight"].shape
        torch.Size([2, 3])
    """
    refuse_swapped_arguments("save", tree, path)
    flat = flat_tree("save", tree)
    tensors, metadata = _file.pack(flat)
    _atomic.write_atomically(path, lambda temporary: _file.write(temporary, tensors, metadata))


def load(
    path: str | os.PathLike,
    *,
    device: torch.device | str | None = None,
    mmap: bool = False,
) -> dict[str, Any]:
    """Read the tree that ``save`` wrote to ``path``.

    The tree has the saved paths in the saved order; leaves are plain tensors
    (``requires_grad=False``), tied paths share one tensor, non-tensor leaves are their JSON
    values. Any safetensors file loads (a Hugging Face ``model.safetensors`` gives its dotted
    keys as a nested tree). Nothing is ever unpickled: a pickle or ``torch.save`` file is refused
    without being run.

    ``mmap=True`` is ``torch.load(mmap=True)``: the tensors are backed by the file (a private,
    copy-on-write mapping: writing to them never changes the file), so loading costs almost no
    memory until the values are read. With ``ms.load(model, tree, assign=True)`` that puts a big
    checkpoint into a model built on the meta device without a second copy of the weights. The
    checksums are not verified then (that would read every byte); the file must not be changed
    in place while the tensors are in use (``save`` replaces a file, which is safe).

    Args:
        path: A safetensors file.
        device: Where the tensors go (default: the CPU). Another device copies them there.
        mmap: Map the file instead of reading it into memory (CPU tensors).

    Returns:
        A new nested dict, ``unflatten`` of the saved paths.

    Raises:
        FileNotFoundError: No file at ``path``.
        ValueError: The file is not a safetensors file (a pickle or a zip archive is named as
            such), is truncated, or (``mmap=False``) a tensor's bytes fail their checksum.

    Example:
        >>> import tempfile, torch, modstate as ms
        >>> path = tempfile.mkdtemp() + "/model.safetensors"
        >>> ms.checkpoint.save(ms.extract(torch.nn.Linear(3, 2)), path)
        >>> with torch.device("meta"):
        ...     model = torch.nn.Linear(3, 2)                  # built without memory
        >>> ms.load(model, ms.checkpoint.load(path, mmap=True), assign=True)
        >>> model.weight.device, model.weight.requires_grad
        (device(type='cpu'), True)
    """
    target = torch.device("cpu") if device is None else torch.device(device)
    if not os.path.isfile(path):
        raise FileNotFoundError(
            errno.ENOENT,
            f"checkpoint.load: {os.fspath(path)!r}: no checkpoint file there; check the path",
        )
    return unflatten(_file.read(path, target, mmap=mmap))
