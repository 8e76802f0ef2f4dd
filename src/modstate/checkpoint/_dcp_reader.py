"""Reading a DCP checkpoint without running code from it.

A DCP directory holds two kinds of pickle: ``.metadata`` (DCP's own dataclasses) and, inside
the ``.distcp`` files, one ``torch.save`` archive per non-tensor value (tensors DCP itself reads
with ``weights_only=True``). ``Reader`` is the ``FileSystemReader`` that ``dcp.load`` is
given: it reads ``.metadata`` once, with an unpickler that resolves only DCP's metadata classes
and torch's value types, and checks the result's fields. ``RestrictedPlanner`` reads the
values with ``torch.load(weights_only=True)``. ``check_value`` refuses at save time a value
that the planner would refuse at load time.
"""

from __future__ import annotations

import functools
import io
import os
import pathlib
import pickle
import re
from typing import IO, Any, cast

import torch
from torch.distributed.checkpoint import filesystem
from torch.distributed.checkpoint import metadata as dcp_metadata
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner
from torch.distributed.checkpoint.metadata import Metadata, StorageMeta
from torch.distributed.checkpoint.planner import ReadItem

TRUSTED_FIX = (
    "if you trust whoever wrote the checkpoint, load it with "
    "modstate.checkpoint.load_distributed(directory, like, weights_only=False), which runs "
    "what its pickles hold"
)


class _Refused(Exception):
    """A global that ``.metadata`` names and the allowlist lacks (never resolved, never called)."""


@functools.cache
def _allowed_globals() -> dict[tuple[str, str], Any]:
    # Keyed as pickle writes a global: the object's module and qualified name.
    allowed: list[Any] = [
        dcp_metadata.Metadata,
        dcp_metadata.MetadataIndex,
        dcp_metadata.StorageMeta,
        dcp_metadata.TensorStorageMetadata,
        dcp_metadata.ChunkStorageMetadata,
        dcp_metadata.TensorProperties,
        dcp_metadata.BytesStorageMetadata,
        dcp_metadata._MEM_FORMAT_ENCODING,
        filesystem._StorageInfo,  # what FileSystemWriter records for each item
        torch.Size,
        torch.device,
        # StorageMeta.checkpoint_id: FileSystemWriter records its path as a pathlib.Path.
        pathlib.PurePosixPath,
        pathlib.PosixPath,
        pathlib.PureWindowsPath,
        pathlib.WindowsPath,
        torch.serialization._get_layout,  # how torch pickles a layout: a lookup by name
    ]
    table = {(value.__module__, value.__qualname__): value for value in allowed}
    # dtypes and memory formats pickle as the torch attribute of their name.
    for name, value in vars(torch).items():
        if isinstance(value, (torch.dtype, torch.layout, torch.memory_format)):
            table[("torch", name)] = value
    return table


class _MetadataUnpickler(pickle.Unpickler):
    def find_class(self, module: str, name: str) -> Any:
        found = _allowed_globals().get((module, name))
        if found is None:
            raise _Refused(f"{module}.{name}")
        return found

    def persistent_load(self, pid: Any) -> Any:
        raise pickle.UnpicklingError("a persistent id, which DCP's .metadata never holds")


def read_metadata_file(stream: IO[bytes], directory: str) -> Metadata:
    """Unpickle a ``.metadata`` stream with the allowlist, and check its fields.

    Raises ``ValueError`` naming ``directory``: for a global outside the allowlist (refused
    before it is resolved, so before it could be called), a stream that is not a pickle, or a
    pickle that is not DCP metadata (another object, or DCP's classes with wrong fields).
    """
    where = f"checkpoint.load_distributed: {directory!r}: its .metadata"
    try:
        metadata = _MetadataUnpickler(stream).load()
    except _Refused as refused:
        raise ValueError(
            f"{where} names {refused}, which is not one of DCP's metadata classes, so it was "
            f"refused without being called (the checkpoint may be crafted to run code); "
            f"{TRUSTED_FIX}"
        ) from None
    except Exception as error:  # anything a malformed pickle raises
        raise ValueError(
            f"{where} is not a readable DCP metadata pickle ({type(error).__name__}: {error}); "
            "the checkpoint is corrupted or was not written by torch.distributed.checkpoint: "
            "load another checkpoint"
        ) from None
    problem = _metadata_problem(metadata)
    if problem is not None:
        raise ValueError(
            f"{where} is not DCP metadata: {problem}; the checkpoint is corrupted or crafted: "
            "load another checkpoint"
        )
    return metadata


def _metadata_problem(metadata: Any) -> str | None:
    """What is wrong with an unpickled ``.metadata``, or ``None``: every field DCP reads."""
    try:
        return _fields_problem(metadata)
    except AttributeError as error:  # a field missing from an object of an allowed class
        return f"a field is missing ({error})"


def _fields_problem(metadata: Any) -> str | None:
    meta = dcp_metadata
    if type(metadata) is not meta.Metadata:
        return f"it holds a {type(metadata).__name__}, not a Metadata"
    entries, storage = metadata.state_dict_metadata, metadata.storage_data
    if type(entries) is not dict:
        return "state_dict_metadata is not a dict"
    if type(storage) is not dict:
        return "storage_data is not a dict"
    # (fqn, offsets) of each record: what DCP's reads look a piece up by (MetadataIndex's hash).
    stored: set[tuple[str, torch.Size | None]] = set()
    for index, info in storage.items():
        if type(index) is not meta.MetadataIndex or type(index.fqn) is not str:
            return f"storage_data has a key {index!r} that is not a MetadataIndex"
        problem = _storage_info_problem(info)
        if problem is not None:
            return f"the storage of {index.fqn!r} {problem}"
        stored.add((index.fqn, index.offset))
    for fqn, entry in entries.items():
        problem = _entry_problem(fqn, entry)
        if problem is not None:
            return problem
        # Every piece DCP will read needs its record (a missing one is a KeyError inside DCP).
        pieces: list[tuple[str, torch.Size | None]]
        if isinstance(entry, meta.TensorStorageMetadata):
            pieces = [(fqn, chunk.offsets) for chunk in entry.chunks]
        else:
            pieces = [(fqn, None)]
        if any(piece not in stored for piece in pieces):
            return f"{fqn!r} has no storage record of its data"
    planner_data = metadata.planner_data
    if planner_data is not None:
        if type(planner_data) is not dict:
            return "planner_data is not a dict"
        for fqn, keys in planner_data.items():
            if type(keys) is not tuple or not all(type(key) in (str, int) for key in keys):
                return f"planner_data of {fqn!r} is not a tuple of keys"
    storage_meta = metadata.storage_meta
    if storage_meta is not None and type(storage_meta) is not meta.StorageMeta:
        return "storage_meta is not a StorageMeta"
    if metadata.version is not None and type(metadata.version) is not str:
        return "version is not a str"
    return None


def _entry_problem(fqn: Any, entry: Any) -> str | None:
    meta = dcp_metadata
    if type(fqn) is not str:
        return f"the key {fqn!r} of state_dict_metadata is not a str"
    if type(entry) is meta.BytesStorageMetadata:
        return None
    if type(entry) is not meta.TensorStorageMetadata:
        return f"{fqn!r} is a {type(entry).__name__}, not a tensor or bytes entry"
    if type(entry.properties) is not meta.TensorProperties or not isinstance(
        entry.properties.dtype, torch.dtype
    ):
        return f"{fqn!r} has no valid tensor properties"
    if type(entry.size) is not torch.Size or type(entry.chunks) is not list:
        return f"{fqn!r} has no valid size or chunk list"
    for chunk in entry.chunks:
        if not (
            type(chunk) is meta.ChunkStorageMetadata
            and type(chunk.offsets) is torch.Size
            and type(chunk.sizes) is torch.Size
            and len(chunk.offsets) == len(chunk.sizes) == len(entry.size)
        ):
            return f"{fqn!r} has a chunk that is not {len(entry.size)}-d offsets and sizes"
    return None


def _storage_info_problem(info: Any) -> str | None:
    if type(info) is not filesystem._StorageInfo:
        return f"is a {type(info).__name__}, not a storage record"
    if not (type(info.offset) is int and type(info.length) is int and info.offset >= 0):
        return "has no valid offset and length"
    relative = info.relative_path
    # DCP writes its data files into the directory itself: a path leaving it is crafted.
    if type(relative) is not str or os.path.isabs(relative) or ".." in relative.split(os.sep):
        return f"names the file {relative!r}, which is not inside the checkpoint"
    descriptors = getattr(info, "transform_descriptors", None)
    if descriptors is not None and not all(type(d) is str for d in descriptors):
        return "has transform descriptors that are not str"
    return None


class Reader(filesystem.FileSystemReader):
    """DCP's file system reader, reading ``.metadata`` once: with the restricted unpickler, or
    with ``pickle.load`` (as DCP does) when ``weights_only`` is false.

    ``load_distributed`` reads the metadata first, to check ``like`` against it; ``dcp.load``
    then asks this same reader again and gets that same object: the file is read one time.
    """

    def __init__(self, path: str | os.PathLike, *, weights_only: bool) -> None:
        super().__init__(path)
        self._name = os.fspath(path)
        self._weights_only = weights_only
        self._metadata: Metadata | None = None

    def read_metadata(self, *args: Any, **kwargs: Any) -> Metadata:
        rank = kwargs.get("rank")  # DCP's fallback to a rank's own __<rank>.metadata
        if rank is not None or self._metadata is None:
            with self.fs.create_stream(self._get_metadata_path(rank), "rb") as stream:
                if self._weights_only:
                    metadata = read_metadata_file(cast(IO[bytes], stream), self._name)
                else:
                    metadata = pickle.load(stream)  # trusted: runs what the pickle holds
            if rank is not None:
                return self._with_load_id(metadata)
            self._metadata = metadata
        return self._with_load_id(self._metadata)

    def _with_load_id(self, metadata: Metadata) -> Metadata:
        # As FileSystemReader.read_metadata does: this load's id goes into the metadata.
        storage_meta = getattr(metadata, "storage_meta", None)
        if storage_meta is None:
            storage_meta = metadata.storage_meta = StorageMeta()
        storage_meta.load_id = self.load_id
        return metadata


def load_value(stream: IO[bytes]) -> Any:
    """A DCP byte item, read as ``torch.load(weights_only=True)`` reads it."""
    return torch.load(stream, weights_only=True)


def why_refused(error: Exception) -> str:
    """What ``torch.load(weights_only=True)`` refused, from its error: the global, if it names one."""
    found = re.search(r"GLOBAL ([\w.]+)", str(error))
    if found is not None:
        return f"it calls {found.group(1)}, which torch.load(weights_only=True) does not allow"
    return f"torch.load(weights_only=True) cannot read it ({type(error).__name__})"


class RestrictedPlanner(DefaultLoadPlanner):
    """DCP's default load planner with non-tensor values read by ``load_value``.

    A refused value is recorded, not raised: under a process group DCP would wrap the error of
    one rank into a ``CheckpointException``; ``load_distributed`` raises them all once the load
    returns, on every rank alike (every rank reads every value).
    """

    def __init__(self) -> None:
        super().__init__()
        self.refused: list[str] = []

    def load_bytes(self, read_item: ReadItem, value: io.BytesIO) -> None:
        fqn = read_item.dest_index.fqn
        try:
            loaded = load_value(value)
        except Exception as error:  # whatever the unpickler refuses
            self.refused.append(f"{fqn!r}: {why_refused(error)}")
            return
        if not self.flatten_state_dict:
            self.state_dict[fqn] = loaded
            return
        # As DefaultLoadPlanner.load_bytes does: the value goes where DCP's flattening found it
        # (the targets hold every container on the way: see _dcp.non_tensor_target).
        *keys, last = self.mappings[fqn]
        node: Any = self.original_state_dict
        for key in keys:
            node = node[key]
        node[last] = loaded


def check_value(path: str, value: Any) -> None:
    """Refuse, naming ``path``, a non-tensor leaf that ``RestrictedPlanner`` could not read back.

    The check is the round trip itself (``torch.save``, then ``load_value``), so it refuses
    exactly what a load would refuse.
    """
    buffer = io.BytesIO()
    try:
        torch.save(value, buffer)
    except Exception as error:  # whatever pickling the value raises
        why = f"it cannot be pickled ({type(error).__name__}: {error})"
    else:
        buffer.seek(0)
        try:
            load_value(buffer)
            return
        except Exception as error:  # whatever the unpickler refuses
            why = why_refused(error)
    raise TypeError(
        f"checkpoint.save_distributed: {path!r}: a {type(value).__name__} value that "
        f"load_distributed could not read back: {why}; non-tensor leaves must be None, bool, "
        "int, float, str, torch.Size, dtypes, tensors, or tuples, lists and dicts of those "
        "(store an object's fields, not the object)"
    )
