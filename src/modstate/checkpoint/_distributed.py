"""``save_distributed`` and ``load_distributed``: trees through ``torch.distributed.checkpoint``."""

from __future__ import annotations

import os
from collections.abc import Sequence
from typing import Any

from modstate._core.trees.flat import unflatten
from modstate.checkpoint._leaves import flat_tree, path_conflict, refuse_swapped_arguments

# torch.distributed.checkpoint is imported when first used: ``import modstate`` stays light.


def save_distributed(
    tree: dict[str, Any], directory: str | os.PathLike, *, process_group: Any = None
) -> None:
    """Write ``tree`` with ``torch.distributed.checkpoint.save`` into ``directory``, atomically.

    Call it on every rank of the process group (collective). DTensor leaves, such as those of a
    model sharded by ``fully_shard`` or ``parallelize_module``, are written as their shards, each
    by the rank that holds it; plain tensor leaves count as replicated and are written once (they
    must be equal on all ranks); non-tensor leaves are pickled, as DCP keeps them. Without a
    process group it writes from this one process. Keys are the ``flatten`` paths, so the
    directory is an ordinary DCP checkpoint of a state_dict-style dict:
    ``torch.distributed.checkpoint`` tools read it, and checkpoints that torch wrote from
    ``model.state_dict()`` load with ``load_distributed``.

    Non-tensor leaves must be values that ``load_distributed`` reads back without running code,
    what ``torch.load(weights_only=True)`` reads: ``None``, bool, int, float, str,
    ``torch.Size``, dtypes, tensors, and tuples, lists and dicts of those. Each is pickled and
    read back that way before anything is written; one that fails is refused, naming its path,
    so a save never writes a checkpoint that its own load would refuse.

    Commit protocol: the ranks write into a staging directory beside ``directory``
    (``.<name>.modstate-partial``), and the first rank renames it to ``directory`` once every
    rank's data and DCP's ``.metadata`` are on disk. So ``directory`` only ever holds a complete
    checkpoint: a save killed half-way leaves the previous checkpoint there (it still loads), or
    nothing, which ``load_distributed`` refuses, saying that a save was interrupted. Saving over
    an existing checkpoint replaces it as a whole; a directory holding other files is refused.
    All ranks must see one file system (as DCP's file system writer requires).

    Args:
        tree: A nested dict of tensors, DTensors and non-tensor values (see above), such as
            ``{"model": ms.extract(model), "optimizer": ms.optim.optimizer_state(opt, model)}``.
            Keys must be non-empty and dot-free.
        directory: The checkpoint directory (created, with its parents, if missing).
        process_group: The group whose ranks write (default: the default group, or this one
            process when ``torch.distributed`` is not initialized).

    Returns:
        None.

    Raises:
        TypeError: ``tree`` is not a dict, the arguments are swapped, or a non-tensor leaf is a
            value ``load_distributed`` could not read back (the message names its path and
            what its pickle calls); nothing is written then.
        ValueError: A key is empty or holds a dot, or a leaf is a meta tensor.
        NotADirectoryError: ``directory`` is a file.
        FileExistsError: ``directory`` holds files that are not part of a checkpoint.

    Example:
        >>> import tempfile, torch, modstate as ms
        >>> directory = tempfile.mkdtemp() + "/step-100"
        >>> ms.checkpoint.save_distributed({"model": ms.extract(torch.nn.Linear(3, 2))}, directory)
        >>> like = {"model": ms.extract(torch.nn.Linear(3, 2))}
        >>> ms.checkpoint.load_distributed(directory, like)["model"]["weight"].shape
        torch.Size([2, 3])
    """
    from torch.distributed import checkpoint as dcp

    from modstate.checkpoint import _commit, _dcp

    refuse_swapped_arguments("save_distributed", tree, directory)
    state = _dcp.to_state_dict(flat_tree("save_distributed", tree))
    final = os.path.abspath(os.fspath(directory))
    with _dcp.single_process_quietly(process_group) as no_dist:
        _commit.on_first_rank(lambda: _commit.begin(final), process_group, no_dist)
        try:
            dcp.save(
                state,
                checkpoint_id=_commit.staging_path(final),
                process_group=process_group,
                no_dist=no_dist,
            )
        except BaseException:
            if no_dist:  # with ranks, the next save cleans up: no collective on a failure path
                _commit.abandon(final)
            raise
        _commit.on_first_rank(lambda: _commit.commit(final), process_group, no_dist)


def load_distributed(
    directory: str | os.PathLike,
    like: dict[str, Any],
    *,
    strict: bool = True,
    process_group: Any = None,
    as_saved: Sequence[str] = (),
    weights_only: bool = True,
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
    that ``like`` lacks. A checkpoint whose save was interrupted is refused (see
    [`save_distributed`][modstate.checkpoint.save_distributed]).

    Loading runs no code from the checkpoint. DCP stores its ``.metadata`` and each non-tensor
    value as pickles; ``load_distributed`` reads ``.metadata`` once, with an unpickler that
    resolves only DCP's metadata classes and torch's value types (``torch.Size``, dtypes,
    layouts, devices, paths), checks its fields, and gives that same reader to DCP for the load;
    the values it reads with ``torch.load(weights_only=True)``, as DCP reads tensors. Any other
    global a pickle names is refused before it is called, with a ``ValueError`` naming the
    directory (and the value's path) and the global, on every rank. (Calling
    ``torch.distributed.checkpoint.load`` yourself on the same directory does not get this.)

    ``as_saved`` lists dotted paths (``"optimizer"``) under which ``like`` is not needed: every
    leaf the checkpoint holds there comes back as saved, tensors as plain tensors of their saved
    (global) shape and dtype on the CPU, whatever ``like`` holds there. That is how to resume a
    ``torch.optim`` optimizer without a warm-up step to create its state first::

        tree = load_distributed(dir, {"model": modstate.extract(model)}, as_saved=["optimizer"])
        modstate.load(model, tree["model"])
        modstate.optim.load_optimizer_state(optimizer, model, tree["optimizer"])

    (``load_optimizer_state`` lays full tensors out like their parameter when that is a DTensor.)

    Args:
        directory: A checkpoint directory written by ``save_distributed`` (or by
            ``torch.distributed.checkpoint.save`` from a state_dict-style dict).
        like: The template tree: shapes, dtypes, devices and DTensor layouts of the result.
        strict: Also require the same dtypes, and no saved tensor that ``like`` lacks.
            ``False`` loads a subset and casts dtypes.
        process_group: The group whose ranks read (as for [`save_distributed`][modstate.checkpoint.save_distributed]).
        as_saved: Dotted paths under which the checkpoint's leaves come back as saved.
        weights_only: ``False`` reads the checkpoint as ``torch.distributed.checkpoint.load``
            does: ``.metadata`` with ``pickle.load`` and values with
            ``torch.load(weights_only=False)``, which run whatever code the pickles name (any
            function of any installed module). Only for a checkpoint you trust, such as one
            holding a value of your own class, which the default refuses.

    Returns:
        A new nested dict laid out like ``like`` (plus the ``as_saved`` subtrees).

    Raises:
        FileNotFoundError: No complete checkpoint in ``directory`` (none there, a save into it
            was interrupted, or its ``.metadata`` is missing); the message says which.
        ValueError: ``like`` does not fit the checkpoint (a missing path, another shape; with
            ``strict`` another dtype or a saved tensor ``like`` lacks), or ``as_saved`` names a
            path under which nothing was saved; the message names the paths. Also (with
            ``weights_only``) a ``.metadata`` that names a global outside DCP's metadata
            classes, is not a pickle, or is not DCP metadata, and a non-tensor value that
            ``torch.load(weights_only=True)`` refuses; the message names what was refused.

    Example:
        >>> import tempfile, torch, modstate as ms
        >>> directory = tempfile.mkdtemp() + "/step-1"
        >>> ms.checkpoint.save_distributed({"w": torch.ones(2), "step": 1}, directory)
        >>> ms.checkpoint.load_distributed(directory, {"w": torch.zeros(2), "step": None})
        {'w': tensor([1., 1.]), 'step': 1}
    """
    from torch.distributed import checkpoint as dcp

    from modstate.checkpoint import _dcp, _dcp_reader

    name = os.fspath(directory)
    if isinstance(as_saved, str):
        as_saved = [as_saved]
    prefixes = tuple(as_saved)
    flat_like = flat_tree("load_distributed", like)
    flat_like = {p: leaf for p, leaf in flat_like.items() if not _dcp.under(p, prefixes)}
    reader = _dcp_reader.Reader(name, weights_only=weights_only)
    metadata = _dcp.read_metadata(name, reader)
    saved_as_is = _dcp.as_saved_targets(name, metadata, prefixes)
    _dcp.check_compatible(name, flat_like, metadata, strict=strict, as_saved=prefixes)
    state = _dcp.empty_targets(flat_like, metadata)
    state.update(saved_as_is)
    conflict = path_conflict(state)  # like is a tree: only the checkpoint's paths can conflict
    if conflict is not None:
        raise ValueError(
            f"checkpoint.load_distributed: {name!r}: the paths it holds do not form a tree: "
            f"{conflict}; a tree holds only one of the two: name one of them at a time in like "
            "or as_saved (with strict=False)"
        )
    planner = _dcp_reader.RestrictedPlanner() if weights_only else None
    with _dcp.single_process_quietly(process_group) as no_dist:
        dcp.load(
            state,
            storage_reader=reader,
            planner=planner,
            process_group=process_group,
            no_dist=no_dist,
        )
    if planner is not None and planner.refused:
        raise ValueError(
            f"checkpoint.load_distributed: {name!r}: non-tensor values refused without being "
            f"called (the checkpoint may be crafted to run code): {'; '.join(planner.refused)}; "
            f"{_dcp_reader.TRUSTED_FIX}"
        )
    return unflatten(dict(state))
