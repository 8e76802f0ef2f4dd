"""Take a module's state out as a tree."""

from __future__ import annotations

from typing import Any

from torch import Tensor, nn

from .anatomy import anatomy_of
from .flat import iter_leaves, unflatten
from .hooks import state_dict_tree
from .types import Tree


def extract(
    module: nn.Module,
    *,
    buffers: bool = True,
    use_state_dict: bool = False,
    detach: bool = False,
) -> Tree:
    """The module's parameters and buffers as a nested dict that mirrors the module tree.

    Keys are the attribute names of children, parameters and buffers; children without state are
    left out, and a module reachable twice appears once (as in ``named_modules``). Leaves are the
    module's own objects, non-persistent buffers included; ``buffers=False`` keeps parameters only.

    ``use_state_dict=True`` gives ``module.state_dict(keep_vars=True)`` nested instead: every
    state_dict hook, ``_save_to_state_dict`` override and ``get_extra_state`` runs, so leaves may
    be transformed tensors, renamed paths, or opaque non-tensor values (``_extra_state``);
    non-persistent buffers are not in it. ``detach=True`` gives detached leaves (sharing storage,
    ties kept: a tensor held at two paths is one detached tensor at both).

    >>> import torch, modstate as ms
    >>> model = torch.nn.Sequential(torch.nn.Linear(3, 4), torch.nn.ReLU(), torch.nn.BatchNorm1d(4))
    >>> tree = ms.extract(model)
    >>> list(tree), list(tree["2"])
    (['0', '2'], ['weight', 'bias', 'running_mean', 'running_var', 'num_batches_tracked'])
    >>> tree["0"]["weight"] is model[0].weight
    True
    """
    if use_state_dict:
        tree = state_dict_tree(module, buffers=buffers)
    else:
        anatomy = anatomy_of(module)
        if buffers:
            tree = anatomy.new_tree(anatomy.holding)
        else:
            tree = unflatten(
                {slot.path: slot.get() for slot in anatomy.slots if not slot.is_buffer}
            )
    return detached(tree) if detach else tree


def detached(tree: Tree) -> Tree:
    """A copy of ``tree`` with every tensor leaf detached, one detached tensor per distinct leaf."""
    memo: dict[int, Any] = {}

    def detach(value: Any) -> Any:
        if not isinstance(value, Tensor):
            return value
        out = memo.get(id(value))
        if out is None:
            out = memo[id(value)] = value.detach()
        return out

    return unflatten({path: detach(leaf) for path, leaf in iter_leaves(tree)})
