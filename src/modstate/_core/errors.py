"""The errors of the engine that every route raises alike."""

from __future__ import annotations

from .anatomy import Anatomy


class MissingPaths(KeyError):
    """A strict tree that leaves out some of the module's paths; ``paths`` lists them all."""

    def __init__(self, paths: list[str], fix: str) -> None:
        self.paths = paths
        shown = ", ".join(repr(p) for p in paths[:5]) + (" ..." if len(paths) > 5 else "")
        super().__init__(f"the tree has no tensor for {shown} ({len(paths)} missing); {fix}")

    def __str__(self) -> str:
        return str(self.args[0])


def unknown_path_message(anatomy: Anatomy, path: str) -> str:
    if path in anatomy.module_paths:
        return f"{path!r} is a submodule: give a dict of its tensors, not a single value"
    owner = path.rpartition(".")[0]
    while owner and owner not in anatomy.module_paths:
        if owner in anatomy.by_path:
            return f"{path!r}: {owner!r} is a tensor, not a submodule"
        owner = owner.rpartition(".")[0]
    return f"unknown path {path!r}: the module has no parameter or buffer there"
