"""A `torch.optim` optimizer's state as a tree keyed by parameter path, and back.

`optimizer.state_dict()` names parameters by integer position in the optimizer, which breaks as
soon as the model or the optimizer is rebuilt differently. Here each parameter is named by its
dotted path in the module (`module.named_parameters()`; a tied parameter, held at several paths,
by the first of them), as `torch.distributed.checkpoint.state_dict.get_optimizer_state_dict` does,
and the per-parameter state is nested at that path so the result is an ordinary tree.
"""

from __future__ import annotations

import copy
from collections.abc import Mapping, Sequence
from typing import Any

import torch
from torch import Tensor, nn

from modstate._core.torch_facts import is_dtensor
from modstate._core.trees.flat import flatten, unflatten

# State entries that torch.optim keeps with the shape of their parameter; others (such as the
# 0-dim "step", or Adafactor's factored moments) have their own shapes and are not checked.
_PARAMETER_SHAPED = frozenset(
    {
        "exp_avg",
        "exp_avg_sq",
        "max_exp_avg_sq",
        "momentum_buffer",
        "square_avg",
        "grad_avg",
        "acc_delta",
        "sum",
        "exp_inf",
        "ax",
        "prev",
        "step_size",
    }
)
_GROUP_PATH_KEYS = ("params", "param_names")
_LOAD = "load_optimizer_state"


def _group_paths(
    optimizer: torch.optim.Optimizer, module: nn.Module, function: str
) -> list[list[str]]:
    """The dotted path of every parameter of every group of `optimizer`, in the group's order."""
    if not isinstance(optimizer, torch.optim.Optimizer):
        if hasattr(optimizer, "init") and hasattr(optimizer, "step"):
            raise TypeError(
                f"{function}: 'optimizer': expected a torch.optim.Optimizer, got modstate's pure "
                f"{type(optimizer).__name__}, which holds no state: its state is the tree that "
                f"its init and step return, already keyed by parameter path; save that tree "
                f"directly (e.g. modstate.checkpoint.save)"
            )
        raise TypeError(
            f"{function}: 'optimizer': expected a torch.optim.Optimizer, got "
            f"{type(optimizer).__name__}; pass the torch.optim optimizer that steps the module"
        )
    path_of = {id(p): name for name, p in module.named_parameters()}
    result = []
    for g, group in enumerate(optimizer.param_groups):
        paths = []
        for i, param in enumerate(group["params"]):
            path = path_of.get(id(param))
            if path is None:
                raise ValueError(
                    f"{function}: 'param_groups.{g}.params.{i}': parameter {i} of the "
                    f"optimizer's param group {g} (shape {tuple(param.shape)}) is not a "
                    f"parameter of the {type(module).__name__}; pass the module the optimizer "
                    f"steps"
                )
            paths.append(path)
        result.append(paths)
    return result


def optimizer_state(optimizer: torch.optim.Optimizer, module: nn.Module) -> dict[str, Any]:
    """The state of `optimizer`, which optimizes (some of) `module`'s parameters, as a tree.

    Returns ``{"state": tree, "param_groups": [...]}``. In ``state`` each parameter's entries
    (``exp_avg``, ``step``, ``momentum_buffer``, ...) sit at that parameter's path; parameters
    without state (frozen, or not stepped yet) are absent. Each group lists its hyperparameters
    and its parameters as dotted paths. The leaves are the optimizer's own state tensors, as
    `optimizer.state_dict()` gives them: clone the tree to keep a snapshot across steps.

    Args:
        optimizer: a stateful `torch.optim.Optimizer`.
        module: the module whose parameters it steps (a parameter is named by its path here).

    Returns:
        ``{"state": tree, "param_groups": [{"params": [paths], <hyperparameters>}, ...]}``.

    Raises:
        TypeError: `optimizer` is not a `torch.optim.Optimizer` (a modstate optimizer's state
            is already a tree: the message says so).
        ValueError: the optimizer holds a parameter that is not the module's.

    Example:
        >>> model = nn.Sequential(nn.Linear(2, 2))
        >>> opt = torch.optim.Adam(model.parameters())
        >>> model(torch.ones(1, 2)).sum().backward()
        >>> opt.step()
        >>> tree = optimizer_state(opt, model)
        >>> sorted(modstate.flatten(tree["state"]))[:3]
        ['0.bias.exp_avg', '0.bias.exp_avg_sq', '0.bias.step']
        >>> tree["param_groups"][0]["params"]
        ['0.weight', '0.bias']
    """
    group_paths = _group_paths(optimizer, module, "optimizer_state")
    packed = optimizer.state_dict()
    path_of_id: dict[Any, str] = {}
    for saved, paths in zip(packed["param_groups"], group_paths, strict=True):
        path_of_id.update(zip(saved["params"], paths, strict=True))

    by_path: dict[str, Mapping[str, Any]] = {}
    for param_id, entries in packed["state"].items():
        if param_id not in path_of_id:
            raise ValueError(
                f"optimizer_state: 'state.{param_id}': the optimizer holds state under a key "
                f"that names none of its parameters; repair the optimizer's state_dict first"
            )
        by_path[path_of_id[param_id]] = entries

    flat: dict[str, Any] = {}
    for path, _ in module.named_parameters():
        for key, value in by_path.get(path, {}).items():
            if not isinstance(key, str) or "." in key:
                raise ValueError(
                    f"optimizer_state: '{path}': state key {key!r} cannot be part of a dotted "
                    f"path; use state keys that are strings without dots"
                )
            flat[f"{path}.{key}"] = value

    param_groups = []
    for saved, paths in zip(packed["param_groups"], group_paths, strict=True):
        group = {k: v for k, v in saved.items() if k not in _GROUP_PATH_KEYS}
        group["params"] = list(paths)
        param_groups.append(group)
    return {"state": unflatten(flat), "param_groups": param_groups}


def _subtree_at(tree: Mapping[str, Any], path: str) -> Any:
    node: Any = tree
    for part in path.split("."):
        if not isinstance(node, Mapping) or part not in node:
            return None
        node = node[part]
    return node


def _check_groups(
    optimizer: torch.optim.Optimizer,
    groups: Any,
    group_paths: list[list[str]],
    module_paths: set[str],
) -> None:
    current = optimizer.param_groups
    if not isinstance(groups, Sequence) or isinstance(groups, (str, bytes)):
        raise ValueError(
            f"{_LOAD}: 'param_groups': a {type(groups).__name__}; pass the list that "
            f"optimizer_state returned"
        )
    if len(groups) != len(current):
        raise ValueError(
            f"{_LOAD}: 'param_groups': the tree has {len(groups)} param groups, the optimizer "
            f"has {len(current)}; build the optimizer with the saved optimizer's groups"
        )
    group_of = {path: g for g, paths in enumerate(group_paths) for path in paths}
    for g, (saved, paths) in enumerate(zip(groups, group_paths, strict=True)):
        if not isinstance(saved, Mapping) or "params" not in saved:
            raise ValueError(
                f"{_LOAD}: 'param_groups.{g}': not a dict with a 'params' list of paths; pass "
                f"the groups that optimizer_state returned"
            )
        saved_paths = list(saved["params"])
        for path in saved_paths:
            if path not in module_paths:
                raise ValueError(
                    f"{_LOAD}: '{path}': param group {g} lists it, but it is not a parameter "
                    f"of the module; load the tree into the model it was saved from"
                )
            if path not in paths:
                where = f"group {group_of[path]}" if path in group_of else "none of its groups"
                raise ValueError(
                    f"{_LOAD}: '{path}': param group {g} lists it, but the optimizer holds it "
                    f"in {where}; group the optimizer's parameters as the saved one did"
                )
        if len(set(saved_paths)) != len(saved_paths):
            twice = next(p for p in saved_paths if saved_paths.count(p) > 1)
            raise ValueError(
                f"{_LOAD}: '{twice}': param group {g} lists it twice; list each path once"
            )
        missing = [path for path in paths if path not in saved_paths]
        if missing:
            raise ValueError(
                f"{_LOAD}: '{missing[0]}': the optimizer's group {g} holds it, but param group "
                f"{g} of the tree does not list it; group the optimizer's parameters as the "
                f"saved one did"
            )
        # One-sided differences are versions (a hyperparameter torch added later) or LR
        # schedulers ("initial_lr"); differences both ways mean another kind of optimizer.
        extra = sorted(set(saved) - set(current[g]) - set(_GROUP_PATH_KEYS) - {"initial_lr"})
        lacking = sorted(set(current[g]) - set(saved) - set(_GROUP_PATH_KEYS) - {"initial_lr"})
        if extra and lacking:
            raise ValueError(
                f"{_LOAD}: 'param_groups.{g}': has hyperparameters {extra} and lacks "
                f"{lacking} of {type(optimizer).__name__}: it comes from another kind of "
                f"optimizer; load it into the kind of optimizer that saved it"
            )


def _check_state(
    state: Any, group_paths: list[list[str]], module_params: Mapping[str, Tensor]
) -> dict[str, Mapping[str, Any]]:
    """Each optimized parameter's state entries in `state`, checked; nothing else may be there."""
    if not isinstance(state, Mapping):
        raise ValueError(
            f"{_LOAD}: 'state': a {type(state).__name__}; pass the dict that optimizer_state "
            f"returned"
        )
    optimized = [path for paths in group_paths for path in paths]
    entries_of: dict[str, Mapping[str, Any]] = {}
    for path in optimized:
        entries = _subtree_at(state, path)
        if entries is None:
            continue
        if not isinstance(entries, Mapping):
            raise ValueError(
                f"{_LOAD}: '{path}': the state there is a {type(entries).__name__}; it must be "
                f"a dict of that parameter's state (exp_avg, step, ...)"
            )
        entries_of[path] = entries

    optimized_set = set(optimized)
    for key in flatten(state):
        parts = key.split(".")
        prefixes = (".".join(parts[:n]) for n in range(1, len(parts)))
        if not any(prefix in optimized_set for prefix in prefixes):
            owner = next((p for p in module_params if key.startswith(p + ".")), None)
            if owner is not None:
                raise ValueError(
                    f"{_LOAD}: '{key}': state for {owner!r}, which the optimizer does not "
                    f"hold; give the optimizer that parameter, or drop its state from the tree"
                )
            raise ValueError(
                f"{_LOAD}: '{key}': state under no parameter of the module; load the tree into "
                f"the model it was saved from"
            )

    for path, entries in entries_of.items():
        shape = module_params[path].shape
        for key, value in entries.items():
            if not isinstance(value, Tensor):
                continue
            if key in _PARAMETER_SHAPED and value.shape != shape:
                raise ValueError(
                    f"{_LOAD}: '{path}.{key}': state of shape {tuple(value.shape)}, but the "
                    f"parameter {path!r} has shape {tuple(shape)}; load the tree into the "
                    f"model it was saved from"
                )
            if key == "step" and value.numel() != 1:
                raise ValueError(
                    f"{_LOAD}: '{path}.step': shape {tuple(value.shape)}; a step holds one number"
                )
    return entries_of


def _copied(value: Any) -> Any:
    if isinstance(value, Tensor):
        return value.detach().clone()
    if isinstance(value, Mapping):
        return {k: _copied(v) for k, v in value.items()}
    return copy.deepcopy(value)


def _laid_out_like(param: Tensor, entries: dict[str, Any]) -> dict[str, Any]:
    """Full plain tensors (a checkpoint read as saved) laid out like their DTensor parameter."""
    if not is_dtensor(param):
        return entries
    from torch.distributed.tensor import DTensor, distribute_tensor

    assert isinstance(param, DTensor)
    return {
        key: distribute_tensor(value, param.device_mesh, param.placements, src_data_rank=None)
        if isinstance(value, Tensor) and not is_dtensor(value) and value.shape == param.shape
        else value
        for key, value in entries.items()
    }


def load_optimizer_state(
    optimizer: torch.optim.Optimizer, module: nn.Module, tree: Mapping[str, Any]
) -> None:
    """Load a tree from `optimizer_state` into `optimizer`, which optimizes `module`.

    The optimizer may be a fresh one, of a freshly built model: parameters are matched by path,
    so its next step is the one the saved optimizer would have taken. Where a parameter is a
    DTensor (FSDP2, tensor parallel) and the tree holds a full plain tensor of its shape (a
    checkpoint read with ``load_distributed(..., as_saved=["optimizer"])``), the tensor is laid
    out like the parameter. Hyperparameters the tree's
    groups give replace the optimizer's; those it lacks are kept. Tensors are copied, so the tree
    is not tied to the optimizer afterwards.

    Everything is checked first; a tree that does not fit (a path that is no parameter of the
    module or that the optimizer does not hold in that group, a group that misses one, a state
    tensor whose shape differs from its parameter's, the hyperparameters of another kind of
    optimizer) raises a ValueError naming the path, and the optimizer is left as it was.

    Args:
        optimizer: the `torch.optim.Optimizer` to load into (fresh or not).
        module: the module whose parameters it steps.
        tree: what `optimizer_state` returned (or a checkpoint of it).

    Returns:
        None; `optimizer` holds the tree's state and hyperparameters.

    Raises:
        TypeError: `optimizer` is not a `torch.optim.Optimizer`.
        ValueError: the tree does not fit the optimizer and module (the message names the
            path); nothing was changed.

    Example:
        >>> model = nn.Sequential(nn.Linear(2, 2))
        >>> opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
        >>> fresh = nn.Sequential(nn.Linear(2, 2))
        >>> fresh_opt = torch.optim.SGD(fresh.parameters(), lr=0.1, momentum=0.9)
        >>> load_optimizer_state(fresh_opt, fresh, optimizer_state(opt, model))
    """
    if not isinstance(tree, Mapping) or set(tree) != {"state", "param_groups"}:
        keys = sorted(tree) if isinstance(tree, Mapping) else type(tree).__name__
        raise ValueError(
            f"{_LOAD}: '<root>': got {keys}; pass the dict with keys 'state' and "
            f"'param_groups' that optimizer_state returned"
        )
    group_paths = _group_paths(optimizer, module, _LOAD)
    module_params = dict(module.named_parameters())
    _check_groups(optimizer, tree["param_groups"], group_paths, set(module_params))
    entries_of = _check_state(tree["state"], group_paths, module_params)

    packed = optimizer.state_dict()
    id_of: dict[str, Any] = {}
    param_groups = []
    for saved, current, paths in zip(
        tree["param_groups"], packed["param_groups"], group_paths, strict=True
    ):
        id_of.update(zip(paths, current["params"], strict=True))
        group = {k: v for k, v in current.items() if k != "params"}
        group.update({k: _copied(v) for k, v in saved.items() if k not in _GROUP_PATH_KEYS})
        group["params"] = current["params"]
        param_groups.append(group)
    state = {
        id_of[path]: _laid_out_like(module_params[path], _copied(entries))
        for path, entries in entries_of.items()
    }
    optimizer.load_state_dict({"state": state, "param_groups": param_groups})
