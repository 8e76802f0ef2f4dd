"""Small facts about torch tensors that several parts need, each stated once."""

from __future__ import annotations

import sys
from collections.abc import Callable, Iterable, Mapping
from typing import Any, TypeVar

import torch
from torch import Tensor
from torch.compiler import is_dynamo_compiling

from modstate._core.vmap_levels import unwrapped

T = TypeVar("T")

# The dtypes that autograd differentiates and optimizers step: floating point and complex. (A
# set, for the common case's one lookup; `is_trainable` says it in full for any tensor.)
DIFFERENTIABLE_DTYPES = frozenset(
    {torch.float32, torch.float64, torch.float16, torch.bfloat16, torch.complex64, torch.complex128}
)


def differentiable_dtype(dtype: torch.dtype) -> bool:
    """Whether ``dtype`` is floating point or complex, every such dtype (float8 included)."""
    return dtype.is_floating_point or dtype.is_complex


def is_trainable(leaf: object) -> bool:
    """A tensor that requires grad and is floating point or complex: what ``split`` trains."""
    return isinstance(leaf, Tensor) and leaf.requires_grad and differentiable_dtype(leaf.dtype)


def version(tensor: Tensor) -> int:
    """The version counter that in-place ops bump; under ``torch.func`` transforms the counter
    that moves is the wrapped tensor's."""
    return unwrapped(tensor)._version


def is_dtensor(value: Any) -> bool:
    """Whether ``value`` is a ``torch.distributed.tensor.DTensor``; imports nothing (a tensor can
    only be a DTensor once ``torch.distributed.tensor`` was imported)."""
    api = sys.modules.get("torch.distributed.tensor")
    return api is not None and isinstance(value, api.DTensor)


def functorch_active() -> bool:
    """Whether a ``torch.func`` transform (``grad``, ``vmap``, ...) is running."""
    return bool(torch._C._are_functorch_transforms_active())


def _dynamo_callback() -> Any:
    """Dynamo's per-frame hook as torch's C side holds it (private: a function answering None
    where a torch release moved it, and `eager_route` then never turns Dynamo off)."""
    try:
        from torch._C._dynamo.eval_frame import get_eval_frame_callback
    except ImportError:
        return lambda: None
    return get_eval_frame_callback


_frame_hook = _dynamo_callback()


def eager_route(fn: Callable[..., T], /, *args: Any, **kwargs: Any) -> T:
    """``fn(*args, **kwargs)``, the eager engine of a verb, run where Dynamo cannot reach it.

    A frame that ``torch.compile`` gave up on (an error raised in the trace, the recompile limit)
    runs eagerly with Dynamo still installed, and Dynamo then traces every function it calls
    as a frame of its own. The eager engine traced piecemeal reads its caches as Dynamo sees
    them (guards on a weak dictionary whose keys the collector removes mid-compile fail with an
    IndexError) and its slot tables as plain dicts (the compiled semantics, which a swap outside
    a trace must not have). So while a hook is installed the engine runs with Dynamo off, as
    ``torch.compiler.disable`` does; otherwise, the common case, it costs two C-speed checks (50 ns).
    Reached in a trace (a verb with no compiled route), the call graph-breaks there and runs
    eagerly; under ``fullgraph=True`` Dynamo refuses it, naming ``fn``."""
    # is_dynamo_compiling first: Dynamo folds it to True and never meets the C call it cannot
    # trace (and it costs a third of torch.compiler.is_compiling, which also asks TorchScript)
    if is_dynamo_compiling() or _frame_hook():
        return torch.compiler.disable(fn)(*args, **kwargs)
    return fn(*args, **kwargs)


def write_back(tree: dict[str, Any], changed: Mapping[str, Any]) -> None:
    """Put the leaves of the nested ``changed`` into ``tree`` at the same paths, in place (a
    buffer that ``forward`` reassigned goes back into the caller's tree, as
    ``torch.func.functional_call`` does)."""
    for key, value in changed.items():
        if isinstance(value, Mapping) and isinstance(tree.get(key), dict):
            write_back(tree[key], value)
        else:
            tree[key] = value


def foreach_allowed(tensors: Iterable[Tensor]) -> bool:
    """Whether ``torch._foreach_*`` kernels may replace one op per tensor: no ``torch.func``
    transform is running (foreach ops have no vmap rule and are not traced by functorch), and
    autograd records nothing (so no tensor that requires grad takes part while grad is on)."""
    if functorch_active():
        return False
    return not (torch.is_grad_enabled() and any(t.requires_grad for t in tensors))


def _engine_entry() -> Any:
    """torch's own entry to the autograd engine under ``torch.autograd.grad`` (private: None
    where a torch release moved it, and `scalar_gradients` then calls the public function)."""
    try:
        from torch.autograd.graph import _engine_run_backward
    except ImportError:
        return None
    return _engine_run_backward


_run_backward = _engine_entry()
_Plain = frozenset({Tensor})


def scalar_gradients(output: Tensor, inputs: list[Tensor]) -> tuple[Tensor | None, ...]:
    """``torch.autograd.grad(output, inputs, allow_unused=True)`` for a real 0-dim ``output``.

    For plain tensors with no ``__torch_function__`` override or mode in play, it enters the
    engine as ``grad`` does (through the same entry, which keeps torch's backward logging and
    context), without ``grad``'s argument checks and the general ``grad_outputs`` handling,
    whose Python cost is a third of a small model's backward on the CPU (measured 39 of 87 µs
    on a one-op graph). Same call, same result; anything else takes ``torch.autograd.grad``.
    """
    if (
        _run_backward is None
        or type(output) is not Tensor
        or not output.dtype.is_floating_point
        or set(map(type, inputs)) != _Plain
        or torch.overrides.has_torch_function((output, *inputs))
    ):
        return torch.autograd.grad(output, inputs, allow_unused=True)
    seed = torch.ones_like(output, memory_format=torch.preserve_format)
    found: tuple[Tensor | None, ...] = _run_backward(
        (output,), (seed,), False, False, tuple(inputs), True, accumulate_grad=False
    )  # outputs, grad_outputs, retain_graph, create_graph, inputs, allow_unused: as grad calls it
    return found
