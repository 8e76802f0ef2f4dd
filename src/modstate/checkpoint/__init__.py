"""Checkpoints of trees: one safetensors file on one machine, ``torch.distributed.checkpoint`` on many.

``save`` / ``load`` write and read a whole tree as one safetensors file: no pickle, so loading
a file from anyone runs no code. ``save_distributed`` / ``load_distributed`` hand the tree to
``torch.distributed.checkpoint`` (DCP): every rank writes its own shards of DTensor leaves
(FSDP2, tensor parallel), and a checkpoint loads on any number of ranks, or in one process
without a process group.

Both store the tree under its ``modstate.flatten`` paths (``"encoder.0.weight"``), the same keys
``state_dict`` uses, so tree keys must not contain dots. Empty sub-dicts hold no state and are
not stored: a tree comes back as ``unflatten(flatten(tree))``.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from typing import Any

import torch

from modstate.checkpoint import _atomic, _file

__all__ = ["load", "load_distributed", "save", "save_distributed"]


def save(tree: dict[str, Any], path: str | os.PathLike) -> None:
    """Write ``tree`` to the safetensors file ``path``, atomically.

    Every leaf is checked first (a refused tree writes nothing): tensors of any dtype safetensors
    knows (float64/32/16, bfloat16, float8, complex64, signed and unsigned ints, bool), any shape
    including 0-d, on any device; non-tensor leaves such as ``_extra_state`` if they are JSON
    (``None``, bool, int, finite float, str, lists and str-keyed dicts of those). DTensors, sparse,
    quantized and meta tensors, and non-JSON objects are refused with an error naming the path.

    Tied tensors (the same view of the same memory at several paths, like an embedding tied to
    a head) are stored once and ``load`` gives back one tensor at all those paths. Tensors that
    overlap in memory in any other way are stored as independent copies; non-contiguous tensors
    are stored contiguous. Each tensor's bytes carry a CRC-32 checksum that ``load`` verifies.

    The file is written to a temporary name in the same directory and renamed over ``path``
    only once complete, so ``path`` never holds a partial checkpoint, even after a crash.

    >>> model = torch.nn.Linear(3, 2)
    >>> save(modstate.extract(model), "linear.safetensors")  # doctest: +SKIP
    >>> load("linear.safetensors")["weight"].shape  # doctest: +SKIP
    torch.Size([2, 3])
    """
    _refuse_swapped_arguments("save", tree, path)
    flat = _flatten(tree)
    tensors, metadata = _file.pack(flat)
    _atomic.write_atomically(path, lambda temporary: _file.write(temporary, tensors, metadata))


def load(path: str | os.PathLike, *, device: torch.device | str | None = None) -> dict[str, Any]:
    """Read the tree that ``save`` wrote to ``path`` (tensors on ``device``, default CPU).

    The tree has the saved paths in the saved order; leaves are new plain tensors
    (``requires_grad=False``), tied paths share one tensor, non-tensor leaves are their JSON
    values. Any safetensors file loads (a Hugging Face ``model.safetensors`` gives its dotted
    keys as a nested tree). Nothing is ever unpickled: a pickle or ``torch.save`` file is refused
    without being run, and a truncated or corrupted file (bad header, checksum mismatch) raises
    ``ValueError`` naming the file.

    >>> tree = load("linear.safetensors")  # doctest: +SKIP
    >>> modstate.load(model, tree)  # copy into the model's own tensors  # doctest: +SKIP
    """
    target = torch.device("cpu") if device is None else torch.device(device)
    if not os.path.isfile(path):
        raise FileNotFoundError(f"no checkpoint file at {os.fspath(path)!r}")
    return _unflatten(_file.read(path, target))


def save_distributed(
    tree: dict[str, Any], directory: str | os.PathLike, *, process_group: Any = None
) -> None:
    """Write ``tree`` with ``torch.distributed.checkpoint.save`` into ``directory``.

    Call it on every rank of the process group (collective). DTensor leaves, such as those of a
    model sharded by ``fully_shard`` or ``parallelize_module``, are written as their shards, each
    by the rank that holds it; plain tensor leaves count as replicated and are written once (they
    must be equal on all ranks); non-tensor leaves are kept as DCP keeps them. Without a process
    group it writes from this one process. Keys are the ``flatten`` paths, so the directory is an
    ordinary DCP checkpoint of a state_dict-style dict: ``torch.distributed.checkpoint`` tools
    read it, and checkpoints that torch wrote from ``model.state_dict()`` load with
    ``load_distributed``. DCP writes ``.metadata`` last, so an interrupted save into a new
    directory is detected; save each checkpoint to a new directory (``step-100``, ``step-200``):
    one interrupted while overwriting an older checkpoint in place damages it.

    >>> fully_shard(model)  # doctest: +SKIP
    >>> save_distributed(modstate.extract(model), "ckpt/step-100")  # every rank  # doctest: +SKIP
    """
    from torch.distributed import checkpoint as dcp

    from modstate.checkpoint import _dcp

    _refuse_swapped_arguments("save_distributed", tree, directory)
    flat = _flatten(tree)
    state = _dcp.to_state_dict(flat)
    with _dcp.single_process_quietly(process_group) as no_dist:
        dcp.save(
            state,
            checkpoint_id=os.fspath(directory),
            process_group=process_group,
            no_dist=no_dist,
        )


def load_distributed(
    directory: str | os.PathLike,
    like: dict[str, Any],
    *,
    strict: bool = True,
    process_group: Any = None,
    as_saved: Sequence[str] = (),
) -> dict[str, Any]:
    """Read a ``save_distributed`` checkpoint into a new tree laid out like ``like``.

    ``like`` is a template and is not changed: each tensor leaf gets a fresh tensor of its shape,
    dtype, device and, for a DTensor, its mesh and placements, which DCP fills from whatever
    layout the checkpoint was written with: a checkpoint written by 2 ranks loads on 3 ranks, or
    in a single process without a process group into plain (full) tensors. Call it on every rank
    of the group. A tensor object that ``like`` holds at several paths comes back as one tensor.
    Non-tensor leaves (``_extra_state``, an optimizer's ``param_groups``) come back as they were
    saved, whatever ``like`` holds at their paths (``None`` will do).

    Before reading any data, every tensor path of ``like`` must be in the checkpoint with the same
    shape; with ``strict`` (default) also the same dtype, and the checkpoint may hold no tensor
    that ``like`` lacks. ``strict=False`` loads a subset and casts dtypes. Errors name the paths.
    DCP's ``.metadata`` and non-tensor values are pickles: load distributed checkpoints you trust.

    ``as_saved`` lists dotted paths (``"optimizer"``) under which ``like`` is not needed: every
    leaf the checkpoint holds there comes back as saved, tensors as plain tensors of their saved
    (global) shape and dtype on the CPU, whatever ``like`` holds there. That is how to resume a
    ``torch.optim`` optimizer without a warm-up step to create its state first::

        tree = load_distributed(dir, {"model": modstate.extract(model)}, as_saved=["optimizer"])
        modstate.load(model, tree["model"])
        modstate.optim.load_optimizer_state(optimizer, model, tree["optimizer"])

    (``load_optimizer_state`` lays full tensors out like their parameter when that is a DTensor.)

    >>> like = modstate.extract(model)  # the sharded model, on every rank  # doctest: +SKIP
    >>> modstate.load(model, load_distributed("ckpt/step-100", like))  # doctest: +SKIP
    """
    from torch.distributed import checkpoint as dcp

    from modstate.checkpoint import _dcp

    name = os.fspath(directory)
    if isinstance(as_saved, str):
        as_saved = [as_saved]
    prefixes = tuple(as_saved)
    flat_like = _flatten(like)
    flat_like = {p: leaf for p, leaf in flat_like.items() if not _dcp.under(p, prefixes)}
    metadata = _dcp.read_metadata(name)
    saved_as_is = _dcp.as_saved_targets(name, metadata, prefixes)
    _dcp.check_compatible(name, flat_like, metadata, strict=strict, as_saved=prefixes)
    state = _dcp.empty_targets(flat_like, metadata)
    state.update(saved_as_is)
    with _dcp.single_process_quietly(process_group) as no_dist:
        dcp.load(state, checkpoint_id=name, process_group=process_group, no_dist=no_dist)
    return _unflatten(dict(state))


def _refuse_swapped_arguments(function: str, tree: Any, path: Any) -> None:
    if isinstance(tree, (str, os.PathLike)) and isinstance(path, dict):
        raise TypeError(
            f"{function}(tree, path): the tree comes first, as in torch.save(obj, f); "
            f"got a path first: modstate.checkpoint.{function}(tree, {str(tree)!r})"
        )


def _flatten(tree: Any) -> dict[str, Any]:
    from modstate._core.flat import flatten

    if not isinstance(tree, dict):
        raise TypeError(f"a checkpoint holds a tree (a dict), got {type(tree).__name__}")
    _check_keys(tree, "")
    return flatten(tree)


def _check_keys(tree: dict[str, Any], prefix: str) -> None:
    # Paths are keys joined by dots, so a key holding a dot would load as a different tree.
    from modstate._core.flat import is_subtree

    for key, value in tree.items():
        if isinstance(key, str) and ("." in key or not key):
            raise ValueError(
                f"tree key {key!r} under {prefix.rstrip('.') or 'the root'!r} is empty or "
                "contains a dot; checkpoints store dotted paths, so keys must be non-empty "
                "and dot-free"
            )
        if isinstance(key, str) and is_subtree(key, value):
            _check_keys(value, f"{prefix}{key}.")


def _unflatten(flat: dict[str, Any]) -> dict[str, Any]:
    from modstate._core.flat import unflatten

    return unflatten(flat)
