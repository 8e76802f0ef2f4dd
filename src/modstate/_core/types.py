"""The type aliases of the public API: what a tree is."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, TypeAlias

Tree: TypeAlias = dict[str, Any]
"""A nested ``dict`` mirroring the module tree: keys are attribute names, leaves are tensors (or
the opaque values ``state_dict`` produces, such as ``_extra_state``)."""

TreeArg: TypeAlias = Mapping[str, Any] | tuple[Mapping[str, Any], ...] | list[Mapping[str, Any]]
"""A tree, or several trees that together give the module's paths (say parameters and buffers),
as ``torch.func.functional_call`` accepts a tuple of dicts. A None leaf in one of them is a hole:
that path is not given by this tree."""
