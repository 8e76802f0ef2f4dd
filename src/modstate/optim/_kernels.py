"""Which kernels a step runs: `torch.optim`'s ``foreach=`` and ``fused=`` flags, with torch's meaning.

A step runs one of four paths, each giving the numbers of the `torch.optim` path of that name:

- ``"fused"``: torch's fused kernels (``torch._fused_adam_``, ``_fused_adamw_``,
  ``_fused_sgd_``, ``_fused_adagrad_``), one pass over each leaf's memory, as
  ``torch.optim.Adam(fused=True)`` runs them. A pure step copies params and state first and runs
  the kernel on the copies, so no input is written.
- ``"foreach"``: torch.optim's multi-tensor algorithm (its ``_multi_tensor_*`` order of
  operations), one ``torch._foreach_*`` kernel per operation.
- ``"single"``: torch.optim's single-tensor algorithm (its for-loop order of operations). On the
  CPU it runs as ``_foreach_*`` kernels too, which loop the very single-tensor ops there, so the
  numbers are the same and the Python overhead is one call per operation; on other devices it
  runs one op per leaf, as torch does.
- ``"differentiable"``: a step that autograd records (a param, gradient or hyperparameter that
  requires grad) or that runs under a ``torch.func`` transform (``vmap``, ``grad``): one
  out-of-place op per leaf in the single-tensor order, which autograd and the batching rules
  see. It runs whatever the flags say, as torch.optim refuses ``fused`` and ``foreach`` with
  ``differentiable=True``; its numbers are the single-tensor path's.

The flags choose among the first three as torch.optim does: ``fused=True`` is fused;
``foreach=True`` / ``False`` is foreach / single; with both None (the default) torch's default for
the device: foreach where torch has foreach kernels (CUDA, XPU, ...), single elsewhere (the CPU).
Note that torch applies its default only when both flags are None (``fused=False`` alone means
single).
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Sequence

from torch import Tensor

FUSED = "fused"
FOREACH = "foreach"
SINGLE = "single"
DIFFERENTIABLE = "differentiable"


def _torch_device_list(name: str, fallback: list[str]) -> list[str]:
    """A device list torch.optim keeps in ``torch.utils._foreach_utils`` (a private module, so
    the list torch had when this was written stands in if it moves)."""
    try:
        from torch.utils import _foreach_utils

        found: list[str] = getattr(_foreach_utils, name)()
        return found
    except (ImportError, AttributeError):
        return fallback


@functools.cache
def foreach_devices() -> list[str]:
    """The device types on which torch.optim defaults to its foreach path."""
    return _torch_device_list("_get_foreach_kernels_supported_devices", ["cuda", "xpu", "mtia"])


@functools.cache
def fused_devices() -> list[str]:
    """The device types on which torch.optim has fused kernels."""
    return _torch_device_list(
        "_get_fused_kernels_supported_devices", ["mps", "cuda", "xpu", "hpu", "cpu", "mtia"]
    )


def eager_kernel(
    function: str,
    foreach: bool | None,
    fused: bool | None,
    leaves: Sequence[Tensor],
    path_of: Callable[[int], str],
) -> str:
    """The path an eager step takes for these flags and leaves (the params to update).

    Raises:
        TypeError / ValueError: ``fused=True`` with a leaf the fused kernels do not take (a
            complex tensor, a device without them), naming its path, as torch.optim refuses it.
    """
    if fused:
        if all(leaf.is_cpu and leaf.is_floating_point() for leaf in leaves):
            return FUSED  # the common case, decided without the slower checks below
        devices = fused_devices()
        for index, leaf in enumerate(leaves):
            if not leaf.is_floating_point():
                raise TypeError(
                    f"{function}: '{path_of(index)}': a {leaf.dtype} leaf; fused=True takes "
                    f"floating-point leaves only (as torch.optim); pass fused=None or "
                    f"foreach=True"
                )
            if leaf.device.type not in devices:
                raise ValueError(
                    f"{function}: '{path_of(index)}': on {leaf.device.type}, where torch has no "
                    f"fused optimizer kernels (it has them on {devices}); pass fused=None or "
                    f"foreach=True"
                )
        return FUSED
    if foreach is not None:
        return FOREACH if foreach else SINGLE
    if fused is None and all(
        not leaf.is_cpu and leaf.device.type in foreach_devices() for leaf in leaves
    ):
        return FOREACH
    return SINGLE
