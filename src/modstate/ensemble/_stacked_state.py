"""The ensemble's own copy of the model, and the stacked state registered on a mirror of it."""

from __future__ import annotations

import copy
from typing import Any

from torch import Tensor, nn

from modstate._core.extract import extract
from modstate._core.module.anatomy import slot_at
from modstate._core.trees.flat import flatten
from modstate._core.types import Tree

from ._kernels import Home


def private_copy(module: nn.Module) -> nn.Module:
    """``copy.deepcopy(module)``, also for modules that keep a computed tensor in ``__dict__``
    (legacy ``weight_norm`` / ``spectral_norm`` after a forward), which deepcopy refuses.

    The copy has the original's flags whatever its ``__deepcopy__`` does (some re-run
    ``__init__`` and come back in training mode, as torchvision's feature extractors do): every
    submodule's ``training`` and every tensor's ``requires_grad`` are set from the original."""
    memo: dict[int, Any] = {}
    for owner in module.modules():
        for value in vars(owner).values():
            if isinstance(value, Tensor) and not value.is_leaf:
                memo[id(value)] = value.detach().clone()
    copied = copy.deepcopy(module, memo)
    originals = dict(module.named_modules(remove_duplicate=False))
    for path, owner in copied.named_modules(remove_duplicate=False):
        if path in originals:
            owner.training = originals[path].training
    flags = {name: p.requires_grad for name, p in module.named_parameters(remove_duplicate=False)}
    for name, parameter in copied.named_parameters(remove_duplicate=False):
        wanted = flags.get(name)
        if wanted is not None and parameter.requires_grad != wanted:
            parameter.requires_grad_(wanted)
    return copied


def sharing_copy(template: nn.Module) -> nn.Module:
    """A deep copy of ``template`` whose tensors are the template's own objects."""
    memo: dict[int, Any] = {}
    for owner in template.modules():
        for table in (owner._parameters, owner._buffers):
            for tensor in table.values():
                if tensor is not None:
                    memo[id(tensor)] = tensor
        for value in vars(owner).values():
            if isinstance(value, Tensor):
                memo[id(value)] = value
    copied = copy.deepcopy(template, memo)
    originals = dict(template.named_modules(remove_duplicate=False))
    for path, owner in copied.named_modules(remove_duplicate=False):
        if path in originals:  # some __deepcopy__ re-run __init__ and come back training
            owner.training = originals[path].training
    # A __deepcopy__ of its own may ignore the memo: point the copy at the template's tensors.
    for path, tensor in flatten(extract(template)).items():
        slot = slot_at(copied, path)
        if slot.get() is not tensor:
            slot.table[slot.name] = tensor
    return copied


def register_stacked(root: nn.Module, template: nn.Module, stacked: Tree) -> None:
    """Register the stacked tensors on a mirror of the template's module tree, as parameters
    where the template has parameters and as (non-)persistent buffers where it has buffers. Each
    mirror module takes its template module's training mode (``ms.apply`` reads it: a buffer of
    a module in eval mode comes back as the very object given)."""
    owners = {"": root}
    registered: dict[int, Tensor] = {}
    for path, value in flatten(stacked).items():
        prefix, _, name = path.rpartition(".")
        owner = mirror(owners, prefix)
        original = slot_at(template, path)
        tensor = registered.get(id(value))
        if not original.is_buffer:
            parameter = tensor if isinstance(tensor, nn.Parameter) else None
            if parameter is None:
                parameter = nn.Parameter(value, requires_grad=value.requires_grad)
            owner.register_parameter(name, parameter)
            tensor = parameter
        else:
            tensor = value if tensor is None else tensor
            owner.register_buffer(name, tensor, persistent=original.persistent)
        registered[id(value)] = tensor
    modules = dict(template.named_modules(remove_duplicate=False))
    for prefix, owner in owners.items():
        if prefix in modules:
            owner.training = modules[prefix].training


def mirror(owners: dict[str, nn.Module], prefix: str) -> nn.Module:
    owner = owners.get(prefix)
    if owner is None:
        parent_prefix, _, name = prefix.rpartition(".")
        owner = owners[prefix] = nn.Module()
        mirror(owners, parent_prefix).add_module(name, owner)
    return owner


def homes_of(template: nn.Module, root: nn.Module) -> dict[int, Home]:
    """Where the stacked form of each of the template's tensors lives (its first path)."""
    homes: dict[int, Home] = {}
    for path, tensor in flatten(extract(template)).items():
        if id(tensor) not in homes:
            slot = slot_at(root, path)
            homes[id(tensor)] = Home(slot.table, slot.name)
    return homes
