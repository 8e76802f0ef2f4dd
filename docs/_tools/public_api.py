"""The public API as the reference site sees it: each public package and its ``__all__`` (for a
public module without one, the public functions and classes it defines).

The public packages are ``modstate`` and, recursively, every sub-module that a public package
lists in ``__all__``, or that a public package other than ``modstate`` holds as a public
attribute (``modstate.optim.schedules``), and the modules of `PUBLIC_BY_PATH`. ``modstate``'s own
sub-packages that it does not list (``ensemble``, ``cli``) are parts of the architecture whose
public names ``modstate`` re-exports.
"""

from __future__ import annotations

import importlib
import inspect
import re
from dataclasses import dataclass
from pathlib import Path
from types import ModuleType

ROOT = "modstate"
SOURCE = Path(__file__).resolve().parents[2] / "src"

# Public modules that ``modstate.__all__`` leaves out on purpose: ``from modstate import *`` must
# not bind ``typing`` over the standard library's.
PUBLIC_BY_PATH = ("modstate.typing",)


@dataclass(frozen=True)
class Package:
    name: str  # "modstate.tree"
    members: tuple[str, ...]  # its __all__, sub-modules left out
    subpackages: tuple[str, ...]  # full names of its public sub-modules

    @property
    def subpackages_short(self) -> tuple[str, ...]:
        """Sub-package names as ``__all__`` lists them (``"tree"``)."""
        return tuple(name.rsplit(".", 1)[1] for name in self.subpackages)

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
        names = tuple(getattr(module, "__all__", None) or _defined_in(module))
        members = tuple(n for n in names if not inspect.ismodule(getattr(module, n, None)))
        subs = [
            value
            for key, value in vars(module).items()
            if inspect.ismodule(value)
            and not key.startswith("_")
            and value.__name__ == f"{module.__name__}.{key}"
            and (key in names or module.__name__ != ROOT)
        ]
        if module.__name__ == ROOT:
            subs += [importlib.import_module(name) for name in PUBLIC_BY_PATH]
        found.append(Package(module.__name__, members, tuple(s.__name__ for s in subs)))
        queue.extend(subs)
    return found


def _defined_in(module: ModuleType) -> list[str]:
    """A module without ``__all__``: its public functions and classes defined there."""
    return [
        name
        for name, value in vars(module).items()
        if not name.startswith("_")
        and (inspect.isfunction(value) or inspect.isclass(value))
        and value.__module__ == module.__name__
    ]


def summary_line(package: str, name: str) -> str:
    """The first sentence of a member's docstring, for the reference's tables (a type alias's is the
    string under its assignment, read by griffe; an RST role such as ``:func:`x``` reads as
    ```x```)."""
    value = getattr(importlib.import_module(package), name)
    if isinstance(value, (str, int, float)):
        return f"`{value!r}`"
    if inspect.isroutine(value) or inspect.isclass(value) or inspect.ismodule(value):
        doc = inspect.getdoc(value) or ""
    else:
        doc = _attribute_docstring(package, name)
    paragraph = " ".join(doc.strip().split("\n\n", 1)[0].split())
    first = re.split(r"(?<=[.!?])\s+(?=[A-Z`(])", paragraph, maxsplit=1)[0]
    return _ROLE.sub("`", first)


_ROLE = re.compile(r":(?:func|class|meth|mod|attr|data|obj|exc):`")


def _attribute_docstring(package: str, name: str) -> str:
    """The docstring of a module attribute (the string under ``Tree: TypeAlias = ...``)."""
    import griffe

    found = griffe.load(package, search_paths=[str(SOURCE)], resolve_aliases=True)[name]
    docstring = found.docstring
    return docstring.value if docstring is not None else ""


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
