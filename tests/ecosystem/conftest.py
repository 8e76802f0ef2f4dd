"""Set-up for the ecosystem zoo: third-party libraries imported as a user would, plus one
explicit, test-only stand-in for torchvision's missing C++ operators.

Why the stand-in: the torchvision wheel that the package registry serves for torch 2.13.0 is a
CUDA build. On a CPU-only torch its C extension (``torchvision/_C.so``) cannot load (it links
``libtorch_cuda.so``). torchvision is meant to cope with that (``torchvision.extension._has_ops()``
is then False and every operator raises a clear error when called), but ``torchvision/
_meta_registrations.py`` registers fake kernels for ``torchvision::nms`` and ``torchvision::qnms``
unconditionally, and registering a kernel for an operator that was never defined fails, so
``import torchvision`` itself fails, and with it ``import timm`` and transformers' vision classes.

What the stand-in does, only when that extension cannot load: it defines the *schemas* of those
two operators (no kernel) in a ``torch.library.Library`` owned by this conftest, so that the
registration succeeds. Calling ``torchvision.ops.nms`` still raises torchvision's own "Couldn't
load custom C++ ops" error; no model of the zoo uses those operators. Nothing is patched, the
torch install is untouched, and modstate itself registers nothing: this lives in the tests only.
With a torchvision whose extension loads (a CPU build matching torch), it does nothing.
"""

from __future__ import annotations

import importlib.util
import pathlib

import torch

_STAND_IN: torch.library.Library | None = None


def _torchvision_extension_loads() -> bool:
    spec = importlib.util.find_spec("torchvision")
    if spec is None or not spec.submodule_search_locations:
        return True  # not installed: the tests that need it are skipped
    folder = pathlib.Path(next(iter(spec.submodule_search_locations)))
    extension = next(folder.glob("_C.*"), None)
    if extension is None:
        return False
    try:
        torch.ops.load_library(str(extension))  # what torchvision/extension.py does first
    except OSError:
        return False
    return True


def define_missing_torchvision_operator_schemas() -> bool:
    """Define ``torchvision::nms`` / ``qnms`` schemas when torchvision's extension cannot load.

    Returns whether it did. Idempotent."""
    global _STAND_IN
    if _STAND_IN is not None:
        return True
    if _torchvision_extension_loads():
        return False
    _STAND_IN = torch.library.Library("torchvision", "DEF")
    for name in ("nms", "qnms"):
        _STAND_IN.define(f"{name}(Tensor dets, Tensor scores, float iou_threshold) -> Tensor")
    return True


STANDING_IN = define_missing_torchvision_operator_schemas()
