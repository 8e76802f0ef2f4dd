"""An ``Ensemble``'s options, checked once for both constructors, and a rank's share of them."""

from __future__ import annotations

from typing import Any

from ._choice import ROUTES
from ._declared import checked_kernels
from ._vmap import RANDOMNESS, InDims


def on_ranks(options: dict[str, Any]) -> dict[str, Any]:
    """A rank's part of a member-parallel ensemble runs batched unless the loop is asked for:
    ranks measuring apart could choose apart."""
    route = "loop" if options["route"] == "loop" else "batched"
    return {**options, "route": route, "measure": False}


def checked_options(
    caller: str,
    compile: bool,
    in_dims: InDims,
    randomness: str,
    fast: bool,
    route: str,
    kernels: Any = None,
    measure: Any = True,
) -> dict[str, Any]:
    if route not in ROUTES:
        raise ValueError(f"{caller}: route={route!r}; use one of {', '.join(map(repr, ROUTES))}")
    if randomness not in RANDOMNESS:
        raise ValueError(
            f"{caller}: randomness={randomness!r}; use one of {', '.join(map(repr, RANDOMNESS))}"
        )
    if not isinstance(measure, bool):
        raise TypeError(f"{caller}: measure is a {type(measure).__name__}; give True or False")
    if in_dims is not None and not isinstance(in_dims, (int, tuple, list)):
        raise TypeError(
            f"{caller}: in_dims is a {type(in_dims).__name__}; give None, an int or a tuple"
        )
    return {
        "compile": compile,
        "in_dims": in_dims,
        "randomness": randomness,
        "fast": fast,
        "route": route,
        "kernels": checked_kernels(kernels, caller),
        "measure": measure,
    }
