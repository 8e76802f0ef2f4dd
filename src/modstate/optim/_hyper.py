"""A step's hyperparameters: which fields they are, and their values at this step.

A hyperparameter is a number, a 0-dim tensor, a 1-D tensor of one value per member of stacked
trees, or (``lr``) a schedule of the step count. `resolve` gives its value for one step: a
schedule evaluated at the count, a tensor that is free to read as a number (so the numbers are
`torch.optim`'s), and, while ``torch.compile`` traces, nothing read (`read_number` refuses then),
so every step-dependent value stays a graph input.
"""

from __future__ import annotations

from dataclasses import fields
from typing import Any

from torch import Tensor

from modstate.optim._tree import StepLeaves, read_number

_NUMBERS = (float, int, bool)


def is_number(value: Any) -> bool:
    if isinstance(value, tuple):
        return all(is_number(item) for item in value)
    return type(value) in _NUMBERS


def resolve(value: Any, count_before: float | Tensor) -> Any:
    """A hyperparameter for this step: a schedule evaluated, a free-to-read tensor as a number."""
    if type(value) in _NUMBERS:
        return value  # the common case
    if isinstance(value, tuple):
        return tuple(resolve(item, count_before) for item in value)
    if callable(value) and not isinstance(value, Tensor):
        value = value(count_before)
    if isinstance(value, Tensor):
        number = read_number(value)
        if number is not None:
            return number
    return value


def check_members(owner: str, hyper: dict[str, Any], leaves: StepLeaves) -> None:
    """A per-member hyperparameter (1-D: one value per member) needs stacked leaves with that
    many members on their first dim: refuse the first leaf that has another count."""
    for name, value in hyper.items():
        for item in value if isinstance(value, tuple) else (value,):
            if not (isinstance(item, Tensor) and item.dim() == 1):
                continue
            count = item.shape[0]
            for position, leaf in enumerate(leaves.active_params()):
                if leaf.dim() == 0 or leaf.shape[0] != count:
                    found = "0-dim" if leaf.dim() == 0 else f"{leaf.shape[0]} on its first dim"
                    raise ValueError(
                        f"{owner}.step: '{leaves.active_path(position)}': {name} holds {count} "
                        f"values, one per member, but this leaf is {found}; step trees stacked "
                        f"from {count} members (ms.stack_modules, an Ensemble's), or give "
                        f"{name} one value for all"
                    )


_KERNEL_FLAGS = ("foreach", "fused")

_HYPERPARAMETER_NAMES: dict[type, tuple[str, ...]] = {}


def hyperparameter_names(cls: type) -> tuple[str, ...]:
    """The dataclass fields of `cls` that are hyperparameters (not the kernel flags), cached."""
    names = _HYPERPARAMETER_NAMES.get(cls)
    if names is None:
        names = tuple(f.name for f in fields(cls) if f.name not in _KERNEL_FLAGS)
        _HYPERPARAMETER_NAMES[cls] = names
    return names


def scalars_of(hyper: dict[str, Any]) -> list[Any]:
    found: list[Any] = []
    for value in hyper.values():
        if isinstance(value, (tuple, list)):
            found.extend(value)
        else:
            found.append(value)
    return found
