"""Kernels a user declares for layer classes of their own: ``Ensemble(..., kernels={MyNorm:
nn.LayerNorm})`` says "a ``MyNorm`` computes what ``nn.LayerNorm`` computes", and its layers run
``nn.LayerNorm``'s batched kernel (`_kernels.kernel_class`).

A declaration is the user's word on the computation, which cannot be checked without running
it; what is checked, before the ensemble is built, is that the layers fit the kernel: each
declared layer holds the settings the torch class is built from (the arguments of its
``__init__``, as attributes of the same names) and the tensors a torch layer built from those
settings holds (names and shapes). Nothing is registered anywhere: the mapping belongs to the
ensemble it is given to.
"""

from __future__ import annotations

import inspect
from collections.abc import Mapping
from typing import Any

from torch import Tensor, nn

from ._kernels import KERNEL_TYPES, kernel_class

DECLARABLE: frozenset[type[nn.Module]] = KERNEL_TYPES - {nn.MultiheadAttention}
"""The torch classes a user's class may be declared to compute as (``MultiheadAttention``'s
kernel reads more of the layer than its settings and tensors)."""

_EXAMPLE = "kernels={MyLinear: nn.Linear}"


def checked_kernels(kernels: Any, caller: str) -> dict[type, type[nn.Module]]:
    """``kernels`` as a dict of the user's classes to torch classes with a kernel, or a
    TypeError / ValueError naming the entry at fault."""
    if kernels is None:
        return {}
    if not isinstance(kernels, Mapping):
        raise TypeError(
            f"{caller}: kernels is a {type(kernels).__name__}; give a dict mapping a layer class "
            f"of yours to the torch layer class whose computation it has ({_EXAMPLE})"
        )
    names = ", ".join(sorted(f"nn.{kind.__name__}" for kind in DECLARABLE))
    for kind, target in kernels.items():
        if not (isinstance(kind, type) and issubclass(kind, nn.Module)):
            raise TypeError(
                f"{caller}: kernels has the key {kind!r}, which is not a layer class; the keys are "
                f"your nn.Module classes, the values torch's ({_EXAMPLE})"
            )
        if kind in KERNEL_TYPES:
            raise ValueError(
                f"{caller}: kernels={{nn.{kind.__name__}: ...}}: nn.{kind.__name__} is torch's "
                "own layer and takes its own kernel; leave it out of kernels"
            )
        if target not in DECLARABLE:
            shown = f"nn.{target.__name__}" if isinstance(target, type) else repr(target)
            raise ValueError(
                f"{caller}: kernels={{{kind.__name__}: {shown}}}: {shown} has no batched kernel "
                f"a class may be declared to compute as; give one of {names}, or leave "
                f"{kind.__name__} out of kernels (its layers then run their own forward under "
                "vmap)"
            )
    return dict(kernels)


def check_declared_layers(
    model: nn.Module, kernels: Mapping[type, type[nn.Module]], caller: str
) -> None:
    """A ValueError naming the first layer of ``model`` that a declaration sends to a kernel it
    does not fit (see the module docstring), with the fix; nothing otherwise."""
    if not kernels:
        return
    for path, layer in model.named_modules():
        found = kernel_class(type(layer), kernels)
        if found is None or found[1] not in kernels:
            continue
        target, base = found
        misfit = _misfit(layer, target)
        if misfit is not None:
            raise ValueError(
                f"{caller}: layer {path or '(the model)'!r} ({type(layer).__name__}) is declared "
                f"to compute what nn.{target.__name__} computes (kernels={{{base.__name__}: "
                f"nn.{target.__name__}}}), but {misfit}; declare the torch class it computes as, "
                f"or leave {base.__name__} out of kernels (its layers then run their own forward "
                "under vmap)"
            )


def _misfit(layer: nn.Module, target: type[nn.Module]) -> str | None:
    """Why ``layer`` does not fit ``target``'s kernel, or None."""
    settings: dict[str, Any] = {}
    missing = []
    for name, parameter in inspect.signature(target.__init__).parameters.items():
        if name in ("self", "device", "dtype") or name.startswith("_"):
            continue
        if parameter.kind in (parameter.VAR_POSITIONAL, parameter.VAR_KEYWORD):
            continue
        if not hasattr(layer, name):
            missing.append(name)
            continue
        value = getattr(layer, name)
        if isinstance(parameter.default, bool) and (value is None or isinstance(value, Tensor)):
            value = value is not None  # bias=True: the layer holds a bias
        settings[name] = value
    if missing:
        return (
            f"it has no {', '.join(missing)} (the settings nn.{target.__name__} is built from, "
            "which its kernel reads as attributes of those names)"
        )
    accepted = inspect.signature(target.__init__).parameters
    if "device" in accepted:
        settings["device"] = "meta"
    try:
        reference = target(**settings)
    except (TypeError, ValueError, RuntimeError) as error:
        return f"nn.{target.__name__} cannot be built from its settings ({error})"
    tensors = {**reference._parameters, **reference._buffers}
    for name, want in tensors.items():
        have = getattr(layer, name, None)
        if want is None and have is None:
            continue
        if want is None or not isinstance(have, Tensor):
            found = "none" if have is None else f"a {type(have).__name__}"
            expected = "none" if want is None else f"a tensor of shape {tuple(want.shape)}"
            return f"its {name} is {found} where nn.{target.__name__} would hold {expected}"
        if have.shape != want.shape:
            return (
                f"its {name} has shape {tuple(have.shape)} where nn.{target.__name__} built from "
                f"its settings holds {tuple(want.shape)}"
            )
    return None


__all__ = ["DECLARABLE", "check_declared_layers", "checked_kernels"]
