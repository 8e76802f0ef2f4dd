"""Take a module's state out as a tree."""

from __future__ import annotations

from typing import Any

from torch import Tensor, nn
from torch.compiler import is_dynamo_compiling

from modstate._core.errors import not_a_module
from modstate._core.module.anatomy import anatomy_of
from modstate._core.module.state_dict import state_dict_tree
from modstate._core.torch_facts import eager_route
from modstate._core.trees.flat import iter_leaves, unflatten
from modstate._core.types import Tree


def extract(
    module: nn.Module,
    *,
    buffers: bool = True,
    use_state_dict: bool = False,
    detach: bool = False,
    copy: bool = False,
) -> Tree:
    """The module's parameters and buffers as a nested dict that mirrors the module tree.

    Keys are the attribute names of children, parameters and buffers; children without state are
    left out, and a module reachable twice appears once (as in ``named_modules``). Leaves are the
    module's own objects, non-persistent buffers included.

    Which leaves share memory with the module:

    - default: the module's own objects (same ``id``): an optimizer step shows in the tree.
    - ``detach=True``: new tensor objects cut from the autograd graph, but **sharing storage**
      with the module (as ``state_dict()`` values do): an in-place change on either side shows on
      the other, so this is not a snapshot. It is what a functional loop wants (no copy).
    - ``copy=True``: detached copies in memory of their own: a snapshot (a target network,
      the start of an EMA) that stays as it is whatever the module does next.

    Args:
        module: Any ``nn.Module`` (TorchScript modules are refused).
        buffers: Include buffers (BatchNorm statistics, non-persistent caches); ``False`` keeps
            parameters only.
        use_state_dict: Give ``module.state_dict(keep_vars=True)`` nested instead: every
            state_dict hook, ``_save_to_state_dict`` override and ``get_extra_state`` runs, so
            leaves may be transformed tensors, renamed paths, or opaque non-tensor values
            (``_extra_state``); non-persistent buffers are not in it.
        detach: Detached leaves sharing the module's storage; ties kept (a tensor held at two
            paths is one detached tensor at both).
        copy: Detached copies with their own memory (implies ``detach``); ties kept (one copy
            at all the paths of a tie). Non-tensor leaves are not copied.

    Returns:
        A new nested ``dict``; ``ms.flatten`` of it has ``state_dict``'s dotted keys (plus the
        non-persistent buffers, unless ``use_state_dict``).

    Raises:
        TypeError: ``module`` is not an ``nn.Module`` (a state dict is a tree already:
            ``ms.unflatten(state_dict)`` nests it), or is a TorchScript module.

    Example:
        >>> import torch, modstate as ms
        >>> model = torch.nn.Sequential(torch.nn.Linear(3, 4), torch.nn.ReLU(), torch.nn.BatchNorm1d(4))
        >>> tree = ms.extract(model)
        >>> list(tree), list(tree["2"])
        (['0', '2'], ['weight', 'bias', 'running_mean', 'running_var', 'num_batches_tracked'])
        >>> tree["0"]["weight"] is model[0].weight
        True
        >>> snapshot = ms.extract(model, copy=True)       # a target network's weights
        >>> _ = torch.nn.init.zeros_(model[0].weight)
        >>> bool(snapshot["0"]["weight"].eq(0).all())     # unaffected by the change
        False
    """
    if not isinstance(module, nn.Module):
        raise not_a_module("extract", module)
    if use_state_dict:
        tree = state_dict_tree(module, buffers=buffers)
    elif is_dynamo_compiling():
        tree = _read_while_compiling(module, buffers)
    else:
        tree = eager_route(_read, module, buffers)
    return detached(tree, copy=copy) if detach or copy else tree


def _read(module: nn.Module, buffers: bool) -> Tree:
    anatomy = anatomy_of(module)
    if buffers:
        return anatomy.new_tree(anatomy.holding)
    return unflatten({slot.path: slot.get() for slot in anatomy.slots if not slot.is_buffer})


def _read_while_compiling(module: nn.Module, buffers: bool) -> Tree:
    """What `_read` returns, read as Dynamo can trace it (a trace cannot build or cache an
    anatomy): the anatomy's walk is ``named_modules``' (each module once, depth first), and
    each module's own parameters, then its buffers."""
    flat: dict[str, Tensor] = {}
    for prefix, sub in module.named_modules():
        dot = f"{prefix}." if prefix else ""
        tables = (sub._parameters, sub._buffers) if buffers else (sub._parameters,)
        for table in tables:
            for name, tensor in table.items():
                if tensor is not None:
                    flat[dot + name] = tensor
    return unflatten(flat)


def detached(tree: Tree, *, copy: bool = False) -> Tree:
    """A copy of ``tree`` with every tensor leaf detached (and, with ``copy``, cloned into memory
    of its own), one new tensor per distinct leaf so that ties stay ties."""
    memo: dict[int, Any] = {}

    def detach(value: Any) -> Any:
        if not isinstance(value, Tensor):
            return value
        out = memo.get(id(value))
        if out is None:
            out = value.detach()
            if copy:
                out = out.clone()
            memo[id(value)] = out
        return out

    return unflatten({path: detach(leaf) for path, leaf in iter_leaves(tree)})
