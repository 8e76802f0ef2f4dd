"""`update_bn`: BatchNorm statistics recomputed over batches, purely, for averaged weights.

Averaged weights (SWA, an EMA, a model soup) need BatchNorm statistics of their own: those of
the members describe other weights. ``torch.optim.swa_utils.update_bn`` recomputes them in
place: it resets every BatchNorm's statistics, sets ``momentum=None`` (a cumulative average,
each batch weighing the same), runs the model in train mode over the batches, and puts the
momenta back. Here the same runs through ``modstate.apply`` on a copy of the module that shares
its tensors, so the module, ``params`` and ``state`` stay as they were.
"""

from __future__ import annotations

import contextlib
import copy
from collections.abc import Iterable, Iterator
from typing import Any

import torch
from torch import Tensor, nn
from torch.nn.modules.batchnorm import _BatchNorm

from modstate._core.types import Tree
from modstate.tree import map_with_path

from ._ensemble import Ensemble
from ._members_apply import apply

_STATISTICS = {
    "running_mean": torch.zeros_like,
    "running_var": torch.ones_like,
    "num_batches_tracked": torch.zeros_like,
}


def update_bn(
    module: nn.Module, params: Tree, state: Tree, batches: Iterable[Any], *, progress: bool = True
) -> Tree:
    """The carried ``state`` with BatchNorm statistics recomputed over ``batches`` with ``params``.

    What ``torch.optim.swa_utils.update_bn(batches, model)`` does to a copy of the model with
    these weights, done purely: each BatchNorm's running statistics start afresh (mean 0,
    variance 1, no batches), the model runs in train mode over every batch (the first item of a
    list or tuple batch, as ``swa_utils`` takes it), and each BatchNorm averages its batches
    cumulatively (``momentum=None``: every batch weighs the same). The statistics equal
    ``swa_utils``' bit for bit (on an ``Ensemble``, to the last bits, as its batched kernels
    agree with a loop over the members). ``module``, ``params`` and ``state`` are not changed:
    the passes run through [`modstate.apply`][modstate.apply] on a copy of ``module`` that
    shares its tensors. Other buffers that ``forward`` changes in train mode change as they would under
    ``swa_utils``; without a BatchNorm, ``state`` comes back as it is and no batch is read. A
    module that cannot be copied (one sharded with FSDP2's ``fully_shard``, whose trees are
    DTensors) runs the passes itself: its BatchNorms' ``momentum`` and its training modes are
    set for them and put back after, so no other thread may call it meanwhile.

    On an [`Ensemble`][modstate.Ensemble] (``params, state = ms.split(ensemble)``) every member
    gets statistics of its own, over the same batches, as ``swa_utils`` would give each member
    model; in a ``torch.vmap`` over stacked trees the same holds. A progress bar (tqdm) shows the
    batches done where ``len(batches)`` is known.

    Args:
        module: the model (or an ``Ensemble``) whose BatchNorm statistics to recompute.
        params: its parameters (averaged weights), as [`modstate.split`][modstate.split] gives.
        state: its carried state, holding the BatchNorm statistics (the other half of ``split``).
        batches: an iterable of inputs (a ``DataLoader``; of a ``(input, target)`` batch the
            first item is used).
        progress: show a tqdm progress bar where ``batches`` has a length.

    Returns:
        A new tree shaped like ``state``: the recomputed statistics, and every other leaf as
        ``apply`` returns it.

    Raises:
        ValueError: ``state`` lacks the statistics of a BatchNorm of ``module`` (naming the path).
        TypeError: a member-parallel ensemble (a ``mesh``), which cannot be copied.

    Example:
        >>> model = torch.nn.Sequential(torch.nn.Linear(3, 4), torch.nn.BatchNorm1d(4))
        >>> params, state = ms.split(model, detach=True)
        >>> batches = [torch.randn(8, 3) for _ in range(5)]
        >>> state = ms.update_bn(model, params, state, batches, progress=False)
        >>> int(state["1"]["num_batches_tracked"]), int(model[1].num_batches_tracked)
        (5, 0)
    """
    norms = _batch_norms(module)
    if not norms:
        return state
    fresh = _reset(state, norms)
    with _cumulative(module) as runner, torch.no_grad():
        for batch in _with_progress(batches, progress):
            x = batch[0] if isinstance(batch, (list, tuple)) else batch
            _, fresh = apply(runner, params, fresh, x)
    return fresh


def _batch_norms(module: nn.Module) -> dict[str, _BatchNorm]:
    """Each BatchNorm that keeps running statistics, by the path of its tensors in the tree."""
    if isinstance(module, Ensemble):
        if module._shards is not None:
            raise TypeError(
                "update_bn: a member-parallel ensemble (built with a mesh) cannot be copied to run "
                "the passes; recompute each member's statistics on ensemble.member(i), or on an "
                "Ensemble without a mesh"
            )
        # The stacked tensors sit on a mirror of the template at "stacked.<path>".
        named = (
            (f"stacked.{n}" if n else "stacked", m) for n, m in module._template.named_modules()
        )
    else:
        named = module.named_modules()
    return {
        name: norm
        for name, norm in named
        if isinstance(norm, _BatchNorm) and norm.track_running_stats
    }


def _reset(state: Tree, norms: dict[str, _BatchNorm]) -> Tree:
    """``state`` with every BatchNorm's statistics started afresh, as ``reset_running_stats``."""
    wanted = {
        f"{name}.{key}" if name else key: fresh
        for name in norms
        for key, fresh in _STATISTICS.items()
    }
    found: set[str] = set()

    def reset(path: str, leaf: Any) -> Any:
        if path in wanted and isinstance(leaf, Tensor):
            found.add(path)
            return wanted[path](leaf)
        return leaf

    fresh = map_with_path(reset, state)
    missing = [path for path in wanted if path not in found]
    if missing:
        raise ValueError(
            f"update_bn: {missing[0]!r}: a BatchNorm statistic of the module that state does not "
            "hold; pass the carried half of the module's tree: params, state = ms.split(module)"
        )
    return fresh


@contextlib.contextmanager
def _cumulative(module: nn.Module) -> Iterator[nn.Module]:
    """``module`` as the passes need it: in train mode, its BatchNorms' ``momentum`` None.

    A copy that shares the module's tensors (the deep copy's memo maps each of them to itself),
    so the module is never changed. A module that refuses to be copied (FSDP2's ``fully_shard``
    does) is set so for the passes and put back as it was after them, even after an error.
    """
    tensors: list[Tensor] = [*module.parameters(), *module.buffers()]
    if isinstance(module, Ensemble):
        tensors += [*module._template.parameters(), *module._template.buffers()]
    try:
        runner = copy.deepcopy(module, {id(tensor): tensor for tensor in tensors})
    except Exception:  # whatever a module raises to refuse copies (FSDP2: AssertionError)
        if isinstance(module, Ensemble):
            raise
        copied = False
    else:
        copied = True
    if not copied:
        yield from _set_for_the_passes(module)
        return
    held = runner._template if isinstance(runner, Ensemble) else runner
    for norm in held.modules():
        if isinstance(norm, _BatchNorm):
            norm.momentum = None
    runner.train()
    if isinstance(runner, Ensemble):
        runner._bind()  # its kernels read each BatchNorm's momentum when they are built
    yield runner


def _set_for_the_passes(module: nn.Module) -> Iterator[nn.Module]:
    momenta = [(m, m.momentum) for m in module.modules() if isinstance(m, _BatchNorm)]
    modes = [(m, m.training) for m in module.modules()]
    try:
        for norm, _ in momenta:
            norm.momentum = None
        module.train()
        yield module
    finally:
        for norm, momentum in momenta:
            norm.momentum = momentum
        for layer, training in modes:
            layer.training = training


def _with_progress(batches: Iterable[Any], progress: bool) -> Iterable[Any]:
    if not progress:
        return batches
    try:
        total = len(batches)  # type: ignore[arg-type]
    except TypeError:  # an iterable without a length: no bar
        return batches
    from tqdm.auto import tqdm  # type: ignore[import-untyped]

    return tqdm(batches, total=total, desc="update_bn", leave=False)
