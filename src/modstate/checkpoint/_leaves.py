"""Which leaves and paths a checkpoint can hold: checked before anything is written, and what
is read checked before it is nested."""

from __future__ import annotations

import math
import os
from collections.abc import Iterable
from typing import Any

import torch

from modstate._core.errors import PathError
from modstate._core.torch_facts import is_dtensor
from modstate._core.trees.flat import flatten, is_subtree

# Every dtype that both torch and safetensors know (safetensors' own table, by torch name).
_SAFETENSORS_DTYPE_NAMES = (
    "float64",
    "float32",
    "float16",
    "bfloat16",
    "complex64",
    "int64",
    "int32",
    "int16",
    "int8",
    "uint64",
    "uint32",
    "uint16",
    "uint8",
    "bool",
    "float8_e4m3fn",
    "float8_e4m3fnuz",
    "float8_e5m2",
    "float8_e5m2fnuz",
)
SAFETENSORS_DTYPES: frozenset[torch.dtype] = frozenset(
    getattr(torch, name) for name in _SAFETENSORS_DTYPE_NAMES if hasattr(torch, name)
)


def check_file_tensor(path: str, tensor: torch.Tensor) -> None:
    """Refuse, naming ``path``, a tensor that a safetensors file cannot hold faithfully."""
    if is_dtensor(tensor):
        raise TypeError(
            f"checkpoint.save: {path!r}: a DTensor (a shard of a distributed tensor) cannot go "
            "in one file; use modstate.checkpoint.save_distributed, or save leaf.full_tensor()"
        )
    if tensor.is_nested:
        raise TypeError(
            f"checkpoint.save: {path!r}: a nested tensor, which safetensors cannot hold; "
            "save its components (leaf.unbind()) instead"
        )
    if tensor.layout != torch.strided:
        raise TypeError(
            f"checkpoint.save: {path!r}: layout {tensor.layout} is not dense; "
            "convert it with .to_dense() first"
        )
    if tensor.is_quantized:
        raise TypeError(
            f"checkpoint.save: {path!r}: quantized tensors ({tensor.dtype}) are not supported; "
            "save extract(module, use_state_dict=True) of an unquantized model, or dequantize"
        )
    if tensor.device.type == "meta":
        raise ValueError(
            f"checkpoint.save: {path!r}: it is a meta tensor and holds no data; materialize "
            "the model first (ms.load(model, tree, assign=True))"
        )
    if tensor.dtype not in SAFETENSORS_DTYPES:
        supported = ", ".join(sorted(str(d).removeprefix("torch.") for d in SAFETENSORS_DTYPES))
        raise TypeError(
            f"checkpoint.save: {path!r}: dtype {tensor.dtype} is not supported by safetensors; "
            f"convert it to one that is ({supported})"
        )


def check_json_value(path: str, value: Any) -> None:
    """Refuse, naming ``path``, a non-tensor leaf that JSON would not give back unchanged.

    Allowed: ``None``, ``bool``, ``int``, finite ``float``, ``str``, and ``list`` / ``tuple`` /
    ``dict`` (string keys) of those (the record notes where the tuples are, so they come back as
    tuples). Sets, namedtuples, non-string keys, NaN and other objects are refused because
    ``json`` would change them (or cannot write them) and a checkpoint never pickles.
    """
    problem = _json_problem(value, "")
    if problem is not None:
        where, what = problem
        inside = f" (at {where})" if where else ""
        raise TypeError(
            f"checkpoint.save: {path!r}: {what}{inside}; non-tensor leaves (such as "
            "_extra_state) are stored as JSON, so they must be None, bool, int, finite float, "
            "str, or lists / tuples / str-keyed dicts of those (checkpoints never pickle)"
        )


def _json_problem(value: Any, where: str) -> tuple[str, str] | None:
    kind = type(value)
    if value is None or kind in (bool, int, str):
        return None
    if kind is float:
        return None if math.isfinite(value) else (where, f"float {value!r} is not finite")
    if kind is list or kind is tuple:
        for index, item in enumerate(value):
            problem = _json_problem(item, f"{where}[{index}]")
            if problem is not None:
                return problem
        return None
    if kind is dict:
        for key, item in value.items():
            if type(key) is not str:
                return (where, f"dict key {key!r} is a {type(key).__name__}, not a str")
            problem = _json_problem(item, f"{where}[{key!r}]")
            if problem is not None:
                return problem
        return None
    if isinstance(value, torch.Tensor):
        return (where, "a tensor inside a non-tensor leaf cannot be stored")
    return (where, f"a {kind.__name__} value is not JSON")


def refuse_swapped_arguments(function: str, tree: Any, path: Any) -> None:
    """Refuse ``save(path, tree)``, naming the order that works."""
    if isinstance(tree, (str, os.PathLike)) and isinstance(path, dict):
        raise TypeError(
            f"checkpoint.{function}: {os.fspath(tree)!r}: a path where the tree goes; the tree "
            f"comes first, as in torch.save(obj, f): modstate.checkpoint.{function}(tree, "
            f"{os.fspath(tree)!r})"
        )


def flat_tree(function: str, tree: Any) -> dict[str, Any]:
    """``tree`` flattened to its dotted paths, refusing what a checkpoint cannot store faithfully:
    a tree that is not a dict, and keys that are empty or hold dots (paths are keys joined by
    dots, so such a key would load as a different tree)."""
    if not isinstance(tree, dict):
        raise TypeError(
            f"checkpoint.{function}: a checkpoint holds a tree (a dict), got "
            f"{type(tree).__name__}; give a dict such as ms.extract(model)"
        )
    _check_keys(function, tree, "")
    try:
        return flatten(tree)
    except PathError as error:
        raise error.within(f"checkpoint.{function}") from None


def _check_keys(function: str, tree: dict[str, Any], prefix: str) -> None:
    for key, value in tree.items():
        if isinstance(key, str) and ("." in key or not key):
            raise ValueError(
                f"checkpoint.{function}: {prefix + key!r}: the key {key!r} under "
                f"{prefix.rstrip('.') or 'the root'!r} is empty or contains a dot; checkpoints "
                "store dotted paths, so keys must be non-empty and dot-free (ms.unflatten "
                "nests a flat state_dict)"
            )
        if isinstance(key, str) and is_subtree(key, value):
            _check_keys(function, value, f"{prefix}{key}.")


def path_conflict(paths: Iterable[str]) -> str | None:
    """Two paths that ``unflatten`` cannot both place (a leaf and a path under it), or ``None``:
    what a checkpoint read from disk is checked for before it is nested."""
    paths = list(paths)
    seen = set(paths)
    for path in paths:
        parts = path.split(".")
        for end in range(1, len(parts)):
            prefix = ".".join(parts[:end])
            if prefix in seen:
                return f"{prefix!r} is a leaf and {path!r} continues it"
    return None
