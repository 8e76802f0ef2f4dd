"""The checks of `prepare`, for a tree handed to a module while ``torch.compile`` traces.

A trace cannot build or read the module's anatomy (its slot tables are installed into the module,
which Dynamo does not trace), so this reads what Dynamo can: ``named_parameters`` and
``named_buffers`` (duplicates kept: a tie stands at each of its paths), and each submodule's
non-persistent buffers. The checks are the anatomy's: no unknown path; with ``strict`` every
path given (a tie once, a non-persistent buffer never required) and the module's shapes and
dtypes. They run at trace time, on structure, shapes and dtypes only, so they cost the compiled
graph nothing. Under ``fullgraph=True`` Dynamo reports the error as an "Observed exception"
whose message is this one; without it, the call falls back to eager, which raises it as is.
"""

from __future__ import annotations

from collections.abc import Mapping
from types import SimpleNamespace
from typing import Any

import torch
from torch import Tensor, nn

from modstate._core.errors import (
    MissingPaths,
    PathError,
    dtype_mismatch,
    shape_mismatch,
)
from modstate._core.swap.unknown import unknown_path
from modstate._core.trees.ties import tie_pairs

# (kind, path, found, expected): what `problem_while_tracing` found, in constants only (strings,
# shapes as tuples, dtypes), so that `error_text` can run outside the trace on them.
Problem = tuple[str, str, Any, Any]

# The builtin class a traced step raises for each kind: Dynamo cannot build modstate's error
# classes inside a trace (their __init__ calls super().__init__), so the trace raises the
# builtin their class derives from, with their message; eager raises the class itself.
BUILTIN = {"unknown": KeyError, "missing": KeyError, "shape": ValueError, "dtype": TypeError}


def problem_while_tracing(
    module: nn.Module, given: Mapping[str, Any], strict: bool
) -> Problem | None:
    """The first path of the flat ``given`` that does not fit ``module``, as a `Problem`."""
    own: dict[str, Tensor] = dict(module.named_parameters(remove_duplicate=False))
    own.update(module.named_buffers(remove_duplicate=False))
    for path, leaf in given.items():
        current = own.get(path)
        if current is None:
            # the module's paths go along, for the same hints as eager (a submodule's path, a
            # wrapper's prefix): unknown_path reads no more of the anatomy than these
            modules = tuple(prefix for prefix, _ in module.named_modules(remove_duplicate=False))
            return ("unknown", path, modules, tuple(own))
        if strict and isinstance(leaf, Tensor):
            if leaf.shape != current.shape:
                return ("shape", path, tuple(leaf.shape), tuple(current.shape))
            if leaf.dtype != current.dtype:
                return ("dtype", path, leaf.dtype, current.dtype)
    if strict:
        missing = _missing(module, own, given)
        if missing:
            return ("missing", missing[0], tuple(missing), None)
    return None


def engine_error(problem: Problem) -> PathError:
    """The error `prepare` raises for ``problem`` (the engine's, named by no function yet)."""
    kind, path, found, expected = problem
    if kind == "unknown":
        seen = SimpleNamespace(module_paths=set(found), by_path=set(expected))
        return unknown_path(seen, path)  # type: ignore[arg-type]  # the two sets it reads
    if kind == "missing":
        return MissingPaths(list(found), "pass strict=False to keep the module's own tensors there")
    # Stand-ins on the meta device carry the shapes and dtypes into the errors' own wording.
    if kind == "shape":
        leaf, current = torch.empty(found, device="meta"), torch.empty(expected, device="meta")
        return shape_mismatch(path, leaf, current)
    leaf, current = (
        torch.empty((), dtype=found, device="meta"),
        torch.empty((), dtype=expected, device="meta"),
    )
    return dtype_mismatch(path, leaf, current)


def _missing(module: nn.Module, own: dict[str, Tensor], given: Mapping[str, Any]) -> list[str]:
    """The module's paths that ``given`` leaves out, a tie counted given when one of its paths is,
    non-persistent buffers never missing (the module keeps its own, as in eager)."""
    paths = list(own)
    kept = {
        f"{prefix}.{name}" if prefix else name
        for prefix, sub in module.named_modules(remove_duplicate=False)
        for name in sub._non_persistent_buffers_set
    }
    first = list(range(len(paths)))  # each path's tie group, named by its first place
    for index, seen in tie_pairs(list(own.values())):
        first[index] = seen
    covered = {first[i] for i, path in enumerate(paths) if path in given}
    return [
        path
        for i, path in enumerate(paths)
        if path not in given and first[i] not in covered and path not in kept
    ]
