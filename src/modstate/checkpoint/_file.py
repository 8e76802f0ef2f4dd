"""The single-file checkpoint format: a safetensors file plus a JSON record of the tree.

A flat tree (dotted paths, module order) is written as one safetensors file. The header's
metadata holds, under the key ``"modstate"``, a JSON object::

    {"version": 1,
     "order": ["0.weight", "0.bias", ...],      # every path, in the tree's order
     "ties": {"head.weight": "embed.weight"},  # path -> the path whose tensor it shares
     "values": {"norm._extra_state": {...}},   # non-tensor leaves, as JSON
     "tuples": {"optimizer.param_groups": [[0, "betas"]]},  # where those hold tuples
     "crc32": {"0.weight": 123456, ...}}       # checksum of each stored tensor's bytes

Tensors stored once per tie; ``"format": "pt"`` is also set, as Hugging Face files do. A
safetensors file without the ``"modstate"`` record (written by any other tool) loads too: its
tensors, in the file's order, with no ties.

JSON has no tuple, so ``"tuples"`` lists, for each non-tensor leaf that holds one, the place of
every tuple inside it (the dict keys and list indices leading there, ``[]`` for the leaf itself):
an optimizer's ``betas`` come back as the tuple ``torch.optim`` keeps. A record without it (no
tuples, or an older file) reads as before.
"""

from __future__ import annotations

import errno
import json
import os
import re
import zlib
from collections.abc import Mapping
from typing import Any

import safetensors
import safetensors.torch
import torch

from modstate.checkpoint._leaves import check_file_tensor, check_json_value, path_conflict

RECORD_KEY = "modstate"
FORMAT_VERSION = 1


def pack(flat: Mapping[str, Any]) -> tuple[dict[str, torch.Tensor], dict[str, str]]:
    """Validate every leaf of ``flat``, then return the tensors to write and the header metadata.

    Leaves that are the same view of the same memory (tied weights) are stored once; a tensor
    that shares memory with another in any other way is copied, so each loads independently.
    Non-contiguous tensors are made contiguous. Nothing is copied before all leaves pass.
    """
    for path, leaf in flat.items():
        if isinstance(leaf, torch.Tensor):
            check_file_tensor(path, leaf)
        else:
            check_json_value(path, leaf)

    stored: dict[str, torch.Tensor] = {}
    ties: dict[str, str] = {}
    values: dict[str, Any] = {}
    tuples: dict[str, list[list[str | int]]] = {}
    first_path_of_view: dict[tuple, str] = {}
    storages_in_use: set[tuple] = set()
    for path, leaf in flat.items():
        if not isinstance(leaf, torch.Tensor):
            values[path] = leaf
            places = _tuple_places(leaf, [])
            if places:
                tuples[path] = places
            continue
        tensor = leaf.detach()
        view = _view_key(tensor)
        if view is not None and view in first_path_of_view:
            ties[path] = first_path_of_view[view]
            continue
        storage = _storage_key(tensor)
        if view is not None and storage is not None:  # (a view key implies a storage key)
            first_path_of_view[view] = path
            if storage in storages_in_use:
                tensor = tensor.clone(memory_format=torch.contiguous_format)
            storages_in_use.add(storage)
        # One copy to the CPU serves both the checksum and the write.
        stored[path] = tensor.to("cpu").contiguous()
    record = {
        "version": FORMAT_VERSION,
        "order": list(flat),
        "ties": ties,
        "values": values,
        **({"tuples": tuples} if tuples else {}),
        "crc32": {path: _crc32(tensor) for path, tensor in stored.items()},
    }
    return stored, {"format": "pt", RECORD_KEY: json.dumps(record, allow_nan=False)}


def write(path: str, tensors: dict[str, torch.Tensor], metadata: dict[str, str]) -> None:
    """Write a safetensors file; a failed write raises ``OSError`` with the errno of the cause."""
    try:
        safetensors.torch.save_file(tensors, path, metadata=metadata)
    except safetensors.SafetensorError as error:
        # safetensors reports I/O failures as SafetensorError("... (os error 28)"), which an
        # ``except OSError`` would not catch: give them back their errno.
        found = re.search(r"os error (\d+)", str(error))
        if found is None and "I/O error" not in str(error):
            raise
        number = int(found.group(1)) if found else errno.EIO
        raise OSError(number, os.strerror(number)) from error


def read(path: str | os.PathLike, device: torch.device, *, mmap: bool = False) -> dict[str, Any]:
    """Read a checkpoint file into a flat dict (paths in tree order), never unpickling.

    ``mmap=False``: the tensors are read into memory of their own and checked against their
    checksums. ``mmap=True``: the tensors map the file (copy-on-write: writing to them never
    changes the file), so they cost no memory until they are read; the checksums are not
    verified, since that would read every byte.

    Raises ``ValueError`` naming the file when it is not a safetensors file (a pickle or a
    ``torch.save`` archive is recognised and named as such), is truncated, or its contents do
    not match their checksums.
    """
    name = os.fspath(path)
    _refuse_foreign_file(name)
    try:
        header, tensors = _open(name, mmap)
    except safetensors.SafetensorError as error:
        raise ValueError(
            f"checkpoint.load: {name!r}: not a readable safetensors file ({error}); it may be "
            "truncated or corrupted: load another checkpoint"
        ) from error
    record_text = header.get(RECORD_KEY)
    if record_text is None:
        flat: dict[str, Any] = dict(tensors)
        conflict = path_conflict(flat)
        if conflict is not None:
            raise ValueError(
                f"checkpoint.load: {name!r}: its tensor names do not form a tree: {conflict}; "
                "load it with safetensors.torch.load_file, which gives the flat names"
            )
    else:
        flat = _assemble(name, tensors, _parse_record(name, record_text, tensors), verify=not mmap)
    return _to_device(flat, device)


def _open(name: str, mmap: bool) -> tuple[dict[str, str], dict[str, torch.Tensor]]:
    """The header metadata and the tensors, mapping the file or read into memory of their own."""
    if not mmap:
        try:  # safetensors >= 0.7 reads straight into memory with pread(2)
            return _tensors(safetensors.safe_open(name, framework="pt", backend="pread"))
        except TypeError:
            pass
    header, tensors = _tensors(safetensors.safe_open(name, framework="pt"))
    if not mmap:  # an older safetensors maps the file: copy out of it
        tensors = {key: tensor.clone() for key, tensor in tensors.items()}
    return header, tensors


def _tensors(opened: Any) -> tuple[dict[str, str], dict[str, torch.Tensor]]:
    with opened as handle:
        names = handle.keys()  # a safe_open handle is not iterable
        return handle.metadata() or {}, {key: handle.get_tensor(key) for key in names}


def _assemble(
    name: str, tensors: dict[str, torch.Tensor], record: dict, *, verify: bool
) -> dict[str, Any]:
    for path, expected in record["crc32"].items() if verify else ():
        if _crc32(tensors[path]) != expected:
            raise ValueError(
                f"checkpoint.load: {name!r}: corrupted: the bytes of tensor {path!r} do not "
                "match their checksum; load another checkpoint"
            )
    flat: dict[str, Any] = {}
    for path in record["order"]:
        if path in record["values"]:
            places = record.get("tuples", {}).get(path, [])
            value = record["values"][path]
            flat[path] = _with_tuples(name, path, value, places) if places else value
        elif path in record["ties"]:
            flat[path] = tensors[record["ties"][path]]
        else:
            flat[path] = tensors[path]
    return flat


def _parse_record(name: str, text: str, tensors: Mapping[str, torch.Tensor]) -> dict:
    def corrupted(why: str) -> ValueError:
        return ValueError(
            f"checkpoint.load: {name!r}: a corrupted modstate record in its header ({why}); "
            "load another checkpoint"
        )

    try:
        record = json.loads(text)
    except ValueError as error:  # JSONDecodeError, or an int past Python's 4300-digit limit
        raise corrupted(f"invalid JSON ({error})") from error
    except RecursionError:  # the decoder recurses once per level of nesting
        raise corrupted("JSON nested deeper than Python's recursion limit") from None
    if not isinstance(record, dict):
        raise corrupted("not a JSON object")
    version = record.get("version")
    if version != FORMAT_VERSION:
        raise ValueError(
            f"checkpoint.load: {name!r}: written in modstate checkpoint format {version!r}; "
            f"this version of modstate reads format {FORMAT_VERSION}: load it with the modstate "
            "that wrote it"
        )
    order, ties, values, checksums = (record.get(k) for k in ("order", "ties", "values", "crc32"))
    if not (
        isinstance(order, list)
        and isinstance(ties, dict)
        and isinstance(values, dict)
        and isinstance(checksums, dict)
    ):
        raise corrupted("missing or malformed 'order', 'ties', 'values' or 'crc32'")
    if not all(isinstance(p, str) for p in [*order, *ties.values()]):
        raise corrupted("a recorded path is not a string")
    stored = [p for p in order if p not in ties and p not in values]
    if (
        len(set(order)) != len(order)
        or set(stored) != set(tensors)
        or not set(ties).union(values) <= set(order)
    ):
        raise corrupted("the recorded paths do not match the tensors in the file")
    if any(target not in tensors for target in ties.values()) or set(checksums) != set(tensors):
        raise corrupted("ties or checksums refer to tensors that are not in the file")
    tuples = record.get("tuples", {})
    if not (
        isinstance(tuples, dict)
        and set(tuples) <= set(values)
        and all(
            isinstance(places, list)
            and all(isinstance(place, list) for place in places)
            and all(type(key) in (str, int) for place in places for key in place)
            for places in tuples.values()
        )
    ):
        raise corrupted("malformed 'tuples'")
    conflict = path_conflict(order)
    if conflict is not None:
        raise corrupted(conflict)
    return record


def _tuple_places(value: Any, where: list[str | int]) -> list[list[str | int]]:
    """The place of every tuple inside the JSON value ``value`` (see the module docstring)."""
    places: list[list[str | int]] = []
    if isinstance(value, (list, tuple)):
        if isinstance(value, tuple):
            places.append(where)
        for index, item in enumerate(value):
            places += _tuple_places(item, [*where, index])
    elif isinstance(value, dict):
        for key, item in value.items():
            places += _tuple_places(item, [*where, key])
    return places


def _with_tuples(name: str, path: str, value: Any, places: list[list[str | int]]) -> Any:
    """``value`` read from JSON with the lists at ``places`` turned back into tuples."""
    wanted: set[tuple[str | int, ...]] = {tuple(place) for place in places}
    found: set[tuple[str | int, ...]] = set()

    def rebuilt(node: Any, where: tuple[str | int, ...]) -> Any:
        if isinstance(node, list):
            items = [rebuilt(item, (*where, index)) for index, item in enumerate(node)]
            if where in wanted:
                found.add(where)
                return tuple(items)
            return items
        if isinstance(node, dict):
            return {key: rebuilt(item, (*where, key)) for key, item in node.items()}
        return node

    result = rebuilt(value, ())
    if found != wanted:
        raise ValueError(
            f"checkpoint.load: {name!r}: a corrupted modstate record in its header ({path!r}: "
            f"the record places a tuple at {list(next(iter(wanted - found)))}, where the "
            "value holds no list); load another checkpoint"
        )
    return result


def _refuse_foreign_file(name: str) -> None:
    # A safetensors file is an 8-byte little-endian header length, then a JSON header that
    # the format requires to start with "{".
    with open(name, "rb") as handle:
        head = handle.read(9)
        size = os.fstat(handle.fileno()).st_size
    header_length = int.from_bytes(head[:8], "little")
    if len(head) == 9 and head[8:] == b"{" and header_length <= size - 8:
        return
    if head.startswith(b"PK\x03\x04"):
        raise ValueError(
            f"checkpoint.load: {name!r}: a zip archive (as torch.save writes), not a safetensors "
            "file, and modstate.checkpoint.load never unpickles; if you trust the file, load it "
            "with torch.load(path, weights_only=True) and save it again with "
            "modstate.checkpoint.save"
        )
    if head[:1] == b"\x80" and head[1:2] in (b"\x02", b"\x03", b"\x04", b"\x05"):
        raise ValueError(
            f"checkpoint.load: {name!r}: a pickle, not a safetensors file (it was not opened: "
            "modstate.checkpoint.load never unpickles); if you trust the file, load it with "
            "torch.load(path, weights_only=True) (a torch.save file) and save it again with "
            "modstate.checkpoint.save"
        )
    if len(head) == 9 and head[8:] == b"{":
        raise ValueError(
            f"checkpoint.load: {name!r}: truncated: its safetensors header claims "
            f"{header_length} bytes but the file has {size} bytes; load another checkpoint"
        )
    raise ValueError(
        f"checkpoint.load: {name!r}: not a safetensors file (or empty, or truncated); give a "
        "file that modstate.checkpoint.save or safetensors wrote"
    )


def _to_device(flat: dict[str, Any], device: torch.device) -> dict[str, Any]:
    if device == torch.device("cpu"):
        return flat
    moved: dict[int, torch.Tensor] = {}
    out: dict[str, Any] = {}
    for path, leaf in flat.items():
        if isinstance(leaf, torch.Tensor):
            if id(leaf) not in moved:  # a tie moves once and stays one tensor
                moved[id(leaf)] = leaf.to(device)
            leaf = moved[id(leaf)]
        out[path] = leaf
    return out


def _view_key(tensor: torch.Tensor) -> tuple | None:
    """Equal keys mean the tensors are the same view of the same memory (always equal)."""
    storage = _storage_key(tensor)
    if storage is None:
        return None
    return (*storage, tensor.storage_offset(), tuple(tensor.shape), tensor.stride(), tensor.dtype)


def _storage_key(tensor: torch.Tensor) -> tuple | None:
    if tensor.numel() == 0:
        return None
    pointer = tensor.untyped_storage().data_ptr()
    return None if pointer == 0 else (tensor.device, pointer)


def _crc32(tensor: torch.Tensor) -> int:
    flat_bytes = tensor.detach().contiguous().reshape(-1)
    if flat_bytes.numel() == 0:
        return 0
    data: Any = flat_bytes.view(torch.uint8).numpy()  # a buffer, read in place
    return zlib.crc32(data)
