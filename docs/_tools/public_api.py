"""The public API as the reference site sees it: each public package and its ``__all__``.

The public packages are ``modstate`` and, recursively, every sub-module that a public package
lists in ``__all__``, or that a public package other than ``modstate`` holds as a public
attribute (``modstate.optim.schedules``). ``modstate``'s own sub-packages that it does not list
(``ensemble``, ``cli``) are parts of the architecture whose public names ``modstate`` re-exports.
"""

from __future__ import annotations

import importlib
import inspect
from dataclasses import dataclass
from types import ModuleType

ROOT = "modstate"


@dataclass(frozen=True)
class Package:
    name: str  # "modstate.tree"
    members: tuple[str, ...]  # its __all__, sub-modules left out
    subpackages: tuple[str, ...]  # full names of its public sub-modules

    @property
    def page(self) -> str:
        """The page's path in the site's source, such as ``reference/modstate.tree.md``."""
        return f"reference/{self.name}.md"


def public_packages() -> list[Package]:
    """Every public package, parents first, each with its members in ``__all__`` order."""
    found: list[Package] = []
    seen: set[str] = set()
    queue = [importlib.import_module(ROOT)]
    while queue:
        module = queue.pop(0)
        if module.__name__ in seen:
            continue
        seen.add(module.__name__)
        names = tuple(getattr(module, "__all__", ()))
        members = tuple(n for n in names if not inspect.ismodule(getattr(module, n, None)))
        subs = [
            value
            for key, value in vars(module).items()
            if inspect.ismodule(value)
            and not key.startswith("_")
            and value.__name__ == f"{module.__name__}.{key}"
            and (key in names or module.__name__ != ROOT)
        ]
        found.append(Package(module.__name__, members, tuple(s.__name__ for s in subs)))
        queue.extend(subs)
    return found


def summary_line(package: str, name: str) -> str:
    """The first line of a member's docstring, for the reference's tables."""
    value = getattr(importlib.import_module(package), name)
    if isinstance(value, (str, int, float)):
        return f"`{value!r}`"
    doc = inspect.getdoc(value) or ""
    return doc.strip().splitlines()[0] if doc.strip() else ""


def module_of(name: str) -> ModuleType:
    return importlib.import_module(name)


def definition_path(package: str, name: str) -> str:
    """Where a member is defined (``modstate._core.call.call`` for ``modstate.call``), so the
    reference renders the object itself and not a same-named private module; the public path
    for values without a home (``__version__``)."""
    value = getattr(importlib.import_module(package), name)
    module, qualname = getattr(value, "__module__", None), getattr(value, "__qualname__", None)
    if isinstance(module, str) and isinstance(qualname, str) and module.startswith(ROOT):
        return f"{module}.{qualname}"
    return f"{package}.{name}"
