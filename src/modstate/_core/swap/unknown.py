"""The error for a tree path that names no tensor of the module, saying what is there instead:
a submodule, a tensor above the path, or the same model under a wrapper's prefix.

It reads two sets of the anatomy only (``module_paths``, ``by_path``), so that a trace, which has
no anatomy, can hand it the same paths read from ``named_modules`` (`swap/traced.py`).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from modstate._core.errors import UnknownPath

if TYPE_CHECKING:
    from modstate._core.module.anatomy import Anatomy

# The prefixes that wrappers put before the paths of the model they hold, and who puts them.
_WRAPPERS = {
    "_orig_mod": "torch.compile (an OptimizedModule)",
    "module": "DistributedDataParallel or DataParallel",
}


def unknown_path(anatomy: Anatomy, path: str) -> UnknownPath:
    """The error for a tree path that names no slot of the module, saying what is there instead."""
    wrapped = wrapper_prefix(anatomy, path)
    if wrapped is not None:
        return wrapped
    if path in anatomy.module_paths:
        return UnknownPath(
            path, "is a submodule, not a tensor", "give a dict of its tensors, not a single value"
        )
    owner = path.rpartition(".")[0]
    while owner and owner not in anatomy.module_paths:
        if owner in anatomy.by_path:
            return UnknownPath(
                path, f"{owner!r} is a tensor, not a submodule", f"give {owner!r} itself"
            )
        owner = owner.rpartition(".")[0]
    return UnknownPath(
        path,
        "unknown path: the module has no parameter or buffer there",
        "leave it out, or check the key against ms.flatten(ms.extract(module))",
    )


def wrapper_prefix(anatomy: Anatomy, path: str) -> UnknownPath | None:
    """The error for a tree and a module of which one has a wrapper's prefix (``_orig_mod.``
    from ``torch.compile``, ``module.`` from DDP) and the other has not; None otherwise."""
    head, _, rest = path.partition(".")
    wrapper = _WRAPPERS.get(head)
    if wrapper is not None and rest in anatomy.by_path:
        return UnknownPath(
            path,
            f"the tree's paths start with '{head}.', as those of a model wrapped by {wrapper} "
            "do, and the module's do not",
            f"strip the prefix: tree = ms.unflatten(tree)[{head!r}] (a flat state dict or a "
            "nested tree alike), or, for a state dict, torch.nn.modules.utils."
            f"consume_prefix_in_state_dict_if_present(state_dict, '{head}.') (in place)",
        )
    for head, wrapper in _WRAPPERS.items():
        if f"{head}.{path}" in anatomy.by_path:
            return UnknownPath(
                path,
                f"the module is wrapped by {wrapper}: its paths start with '{head}.', the "
                "tree's do not",
                f"give the tree to the model inside, wrapped.{head} (e.g. "
                f"ms.call(wrapped.{head}, tree, x)), or add the prefix: {{{head!r}: tree}}",
            )
    return None
