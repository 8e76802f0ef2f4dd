"""Flat trees through ``torch.distributed.checkpoint`` (DCP): checks and load targets."""

from __future__ import annotations

import contextlib
import errno
import os
import warnings
from collections.abc import Iterator, Mapping
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.metadata import Metadata, TensorStorageMetadata

from modstate._core.torch_facts import differentiable_dtype, is_dtensor
from modstate.checkpoint._commit import why_absent
from modstate.checkpoint._dcp_reader import check_value


@contextlib.contextmanager
def single_process_quietly(process_group: Any) -> Iterator[bool]:
    """Yield DCP's ``no_dist``: true when there is no process group to coordinate.

    Then DCP reads and writes as one process, which is what modstate documents, so DCP's
    warning that it is "assuming the intent" is silenced for that call only.
    """
    grouped = process_group is not None or (dist.is_available() and dist.is_initialized())
    if grouped:
        yield False
        return
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="torch.distributed is disabled")
        yield True


def to_state_dict(flat: Mapping[str, Any]) -> dict[str, Any]:
    """The flat tree as DCP wants it: tensors detached (DTensors stay DTensors).

    Refused, naming the path, before anything is written: meta tensors (they hold no data), and
    non-tensor values that ``load_distributed`` could not read back (see ``check_value``).
    """
    for path, leaf in flat.items():
        if not isinstance(leaf, torch.Tensor):
            check_value(path, leaf)
        elif leaf.device.type == "meta":
            raise ValueError(
                f"checkpoint.save_distributed: {path!r}: it is a meta tensor and holds no data; "
                "materialize the model first (ms.load(model, tree, assign=True))"
            )
    return {
        path: leaf.detach() if isinstance(leaf, torch.Tensor) else leaf
        for path, leaf in flat.items()
    }


def read_metadata(directory: str | os.PathLike, reader: dcp.FileSystemReader) -> Metadata:
    """The checkpoint's metadata, read by ``reader``; refuses a directory that holds no complete
    checkpoint."""
    name = os.fspath(directory)
    if not os.path.isdir(name):
        raise FileNotFoundError(
            errno.ENOENT,
            f"checkpoint.load_distributed: {name!r}: no distributed checkpoint there (not a "
            f"directory): {why_absent(os.path.abspath(name))}",
        )
    if not os.path.exists(os.path.join(name, ".metadata")):
        raise FileNotFoundError(
            errno.ENOENT,
            f"checkpoint.load_distributed: {name!r}: no complete distributed checkpoint: its "
            ".metadata file, written last, is missing (a save by another tool was interrupted, "
            "or the directory is not a checkpoint); load an earlier checkpoint",
        )
    return reader.read_metadata()


def under(path: str, prefixes: tuple[str, ...]) -> bool:
    """Whether ``path`` is one of ``prefixes`` or lies under one of them."""
    return any(path == p or path.startswith(p + ".") for p in prefixes)


def as_saved_targets(name: str, metadata: Metadata, prefixes: tuple[str, ...]) -> dict[str, Any]:
    """Targets for every leaf the checkpoint holds under ``prefixes``, shaped as saved: tensors
    as plain tensors of their saved (global) shape and dtype, on the CPU; non-tensor leaves as
    ``non_tensor_target`` rebuilds them. Refuses a prefix under which nothing was saved."""
    origins = dict.fromkeys(_origin(metadata, fqn) for fqn in metadata.state_dict_metadata)
    targets: dict[str, Any] = {}
    for prefix in prefixes:
        found = [origin for origin in origins if under(origin, (prefix,))]
        if not found:
            raise ValueError(
                f"checkpoint.load_distributed: {name!r}: as_saved names {prefix!r}, but the "
                "checkpoint holds nothing there; name a path it holds (or leave as_saved out)"
            )
        for origin in found:
            entry = metadata.state_dict_metadata.get(origin)
            if isinstance(entry, TensorStorageMetadata):
                targets[origin] = _placeholder(entry)
            else:
                targets[origin] = non_tensor_target(origin, None, metadata)
    return targets


def _fix_for(path: str, flat_like: Mapping[str, Any]) -> str:
    """The shortest prefix of ``path`` under which ``like`` holds nothing: what as_saved needs."""
    parts = path.split(".")
    for n in range(1, len(parts) + 1):
        prefix = ".".join(parts[:n])
        if not any(under(key, (prefix,)) for key in flat_like):
            return prefix
    return path


def check_compatible(
    name: str,
    flat_like: Mapping[str, Any],
    metadata: Metadata,
    *,
    strict: bool,
    as_saved: tuple[str, ...] = (),
) -> None:
    """Refuse, naming paths, a ``like`` tree whose tensors the checkpoint cannot fill.

    Every tensor path of ``like`` must be a tensor in the checkpoint with the same global shape
    (and, if ``strict``, the same dtype); with ``strict`` the checkpoint may hold no tensor that
    ``like`` lacks. Non-tensor leaves are checked by ``non_tensor_targets``.
    """
    saved = metadata.state_dict_metadata
    problems: list[str] = []
    for path, leaf in flat_like.items():
        if not isinstance(leaf, torch.Tensor) or under(path, as_saved):
            continue
        entry = saved.get(path)
        if entry is None:
            problems.append(f"{path!r} is not in the checkpoint")
        elif not isinstance(entry, TensorStorageMetadata):
            problems.append(f"{path!r} is a tensor in like but not in the checkpoint")
        elif tuple(entry.size) != tuple(leaf.shape):
            problems.append(
                f"{path!r} has shape {tuple(entry.size)} in the checkpoint, "
                f"{tuple(leaf.shape)} in like"
            )
        elif strict and entry.properties.dtype != leaf.dtype:
            saved_dtype = entry.properties.dtype
            # Casting a floating-point value into an integer counter rounds it: not a fix.
            rounds = differentiable_dtype(saved_dtype) and not differentiable_dtype(leaf.dtype)
            fix = (
                f"as_saved=[{path!r}] reads it as saved, a cast would round it"
                if rounds
                else "strict=False casts"
            )
            problems.append(
                f"{path!r} has dtype {saved_dtype} in the checkpoint, {leaf.dtype} in like ({fix})"
            )
    if strict:
        unlisted = [
            path
            for path, entry in saved.items()
            if isinstance(entry, TensorStorageMetadata)
            and _origin(metadata, path) not in flat_like
            and not under(_origin(metadata, path), as_saved)
        ]
        if unlisted:
            fixes = list(dict.fromkeys(_fix_for(_origin(metadata, p), flat_like) for p in unlisted))
            shown = ", ".join(repr(p) for p in unlisted[:3])
            more = f" and {len(unlisted) - 3} more" if len(unlisted) > 3 else ""
            problems.append(
                f"{shown}{more} {'is' if len(unlisted) == 1 else 'are'} in the checkpoint but not "
                f"in like (as_saved={fixes!r} reads what is there as saved; strict=False leaves "
                "it out of the result)"
            )
    if problems:
        shown = "; ".join(problems[:8])
        more = f"; and {len(problems) - 8} more" if len(problems) > 8 else ""
        raise ValueError(
            f"checkpoint.load_distributed: {name!r}: like does not fit it: {shown}{more}; "
            "give a like tree laid out as the checkpoint was saved"
        )


def empty_targets(flat_like: Mapping[str, Any], metadata: Metadata) -> dict[str, Any]:
    """Fresh tensors shaped, typed and placed like ``flat_like``'s (DTensors keep their layout).

    A tensor object that appears at several paths gets one target, so ties survive the load.
    Non-tensor leaves get placeholders shaped as saved (see ``non_tensor_target``).
    """
    made: dict[int, torch.Tensor] = {}
    targets: dict[str, Any] = {}
    for path, leaf in flat_like.items():
        if isinstance(leaf, torch.Tensor):
            if leaf.device.type == "meta" and not is_dtensor(leaf):
                raise ValueError(
                    f"checkpoint.load_distributed: {path!r}: like holds a meta tensor there, "
                    "which cannot receive data; give a like tree on a real device"
                )
            if id(leaf) not in made:
                made[id(leaf)] = torch.empty_like(leaf.detach())
            targets[path] = made[id(leaf)]
        else:
            targets[path] = non_tensor_target(path, leaf, metadata)
    return targets


def non_tensor_target(path: str, like_leaf: Any, metadata: Metadata) -> Any:
    """A placeholder that DCP fills with the non-tensor leaf saved at ``path``.

    DCP splits a saved dict (and a list holding dicts or tensors) into one entry per item, and
    loads only the entries its target names; so the target is rebuilt from the checkpoint's own
    record of those entries, and the leaf comes back as it was saved, whatever ``like`` holds
    there. An empty dict or list leaves no entry: it comes back as ``like``'s own empty value.
    """
    items = [
        (_object_path(metadata, fqn)[1:], entry)
        for fqn, entry in metadata.state_dict_metadata.items()
        if _origin(metadata, fqn) == path
    ]
    if not items:
        if isinstance(like_leaf, (dict, list)) and not like_leaf:
            return like_leaf
        raise ValueError(
            f"checkpoint.load_distributed: {path!r}: not in the checkpoint; leave it out of like"
        )
    if len(items) == 1 and items[0][0] == ():
        return _placeholder(items[0][1])
    root: dict = {}
    for keys, entry in items:
        node = root
        for key in keys[:-1]:
            node = node.setdefault(key, {})
        node[keys[-1]] = _placeholder(entry)
    return _with_lists(root)


def _placeholder(entry: Any) -> Any:
    if isinstance(entry, TensorStorageMetadata):
        return torch.empty(tuple(entry.size), dtype=entry.properties.dtype)
    return None


def _with_lists(node: Any) -> Any:
    # DCP records list items by integer index: turn those levels back into lists.
    if not isinstance(node, dict):
        return node
    node = {key: _with_lists(value) for key, value in node.items()}
    if node and all(type(key) is int for key in node) and sorted(node) == list(range(len(node))):
        return [node[index] for index in range(len(node))]
    return node


def _object_path(metadata: Metadata, fqn: str) -> tuple:
    """Where DCP found entry ``fqn``: (top-level key, then keys / indices inside its value)."""
    planner_data = metadata.planner_data
    if isinstance(planner_data, dict) and fqn in planner_data:
        return tuple(planner_data[fqn])
    return (fqn,)


def _origin(metadata: Metadata, fqn: str) -> str:
    return _object_path(metadata, fqn)[0]
