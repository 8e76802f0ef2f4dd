"""The parts of modstate import downwards only (docs/architecture.md, "Layers").

``cli`` -> ``ensemble`` / ``optim`` / ``checkpoint`` -> ``tree`` -> ``_core``:

- ``_core`` imports no other part of modstate;
- ``tree`` imports at most ``_core``;
- ``ensemble``, ``optim`` and ``checkpoint`` import only ``_core`` and ``tree`` (not each other);
- ``cli`` uses only public names (``modstate``, ``modstate.tree``, ``modstate.optim``, ...), never a
  private module of another part.

``modstate/__init__.py``, ``__main__.py`` and ``typing.py`` are the faces: they re-export from
everywhere. Imports are read with ``ast`` from the sources, at module level and inside functions
alike (a lazy import is still a dependency), ``TYPE_CHECKING`` blocks included.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

SOURCE = Path(__file__).resolve().parent.parent / "src"
PACKAGE = SOURCE / "modstate"

FACES = {"modstate", "modstate.__main__", "modstate.typing"}
# Which parts each part may import (its own part always).
ALLOWED = {
    "_core": set(),
    "tree": {"_core"},
    "ensemble": {"_core", "tree"},
    "optim": {"_core", "tree"},
    "checkpoint": {"_core", "tree"},
}
PUBLIC_MODULES = {
    "modstate",
    "modstate.tree",
    "modstate.optim",
    "modstate.optim.schedules",
    "modstate.checkpoint",
    "modstate.typing",
}


def module_name(path: Path, root: Path = SOURCE) -> str:
    parts = list(path.relative_to(root).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def is_module(name: str) -> bool:
    """Whether ``name`` is a module of the sources (``modstate.tree._walk``), not a name in one."""
    path = SOURCE.joinpath(*name.split("."))
    return path.with_suffix(".py").is_file() or (path / "__init__.py").is_file()


def imported_modules(source: str, module: str, is_package: bool) -> list[tuple[int, str]]:
    """``(line, module)`` for every import in ``source``, relative ones resolved, anywhere in the
    file; ``from X import name`` counts as ``X.name`` where that is a module, else as ``X``."""
    found = []
    package = module if is_package else module.rpartition(".")[0]
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            found += [(node.lineno, alias.name) for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")[: len(package.split(".")) - (node.level - 1)]
                origin = ".".join(base + ([node.module] if node.module else []))
            else:
                origin = node.module or ""
            for alias in node.names:
                name = f"{origin}.{alias.name}"
                found.append((node.lineno, name if is_module(name) else origin))
    return found


def part_of(module: str) -> str | None:
    """``"tree"`` for ``modstate.tree._walk``; None for the faces and for other packages."""
    parts = module.split(".")
    if parts[0] != "modstate" or module in FACES:
        return None
    return parts[1] if len(parts) > 1 else None


def is_modstate(name: str) -> bool:
    return name == "modstate" or name.startswith("modstate.")


def problems(module: str, imports: list[tuple[int, str]]) -> list[str]:
    """Every import of ``module`` that breaks the rules, as ``"module:line imports X (why)"``."""
    own = part_of(module)
    if own is None:
        return []
    found = []
    for line, name in imports:
        if not is_modstate(name):
            continue
        where = f"{module}:{line} imports {name}"
        target = part_of(name)
        if own == "cli":
            if target != "cli" and name not in PUBLIC_MODULES:
                found.append(f"{where} (cli uses public names only)")
            continue
        if target is None:
            found.append(f"{where} (a part never imports the faces, which import every part)")
        elif target != own and target not in ALLOWED[own]:
            allowed = sorted(ALLOWED[own]) or "no other part"
            found.append(f"{where} ({own} may import {allowed})")
    return found


def check(package_dir: Path, root: Path) -> list[str]:
    found = []
    for path in sorted(package_dir.rglob("*.py")):
        module = module_name(path, root)
        imports = imported_modules(path.read_text(), module, path.name == "__init__.py")
        found += problems(module, imports)
    return found


# Inside _core, its rooms import downwards too (see _core/__init__.py): the base modules, then
# trees/, sharded/, module/, swap/ and grad/, then the verbs at its top.
CORE_BASE = {"errors", "types", "torch_facts", "vmap_levels"}
CORE_FOLDERS = {"trees", "sharded", "module", "swap", "grad"}
CORE_ALLOWED = {
    "base": set(),
    "trees": {"base"},
    "sharded": {"base"},
    "module": {"base", "trees", "sharded"},
    "swap": {"base", "trees", "sharded", "module"},
    "grad": {"base", "trees"},
    "verbs": {"base", "trees", "sharded", "module", "swap", "grad"},
}


def room_of(module: str) -> str | None:
    """The room of ``_core`` a module is in (``"module"`` for ``modstate._core.module.anatomy``,
    ``"base"`` for ``errors``, ``"verbs"`` for ``call``); None outside ``_core`` and for its
    ``__init__``, which is a map with no imports."""
    parts = module.split(".")
    if parts[:2] != ["modstate", "_core"] or len(parts) < 3:
        return None
    if parts[2] in CORE_FOLDERS:
        return parts[2]
    return "base" if parts[2] in CORE_BASE else "verbs"


def core_problems(module: str, imports: list[tuple[int, str]]) -> list[str]:
    """Every import of a ``_core`` module that reaches a room above its own."""
    own = room_of(module)
    if own is None:
        return []
    found = []
    for line, name in imports:
        target = room_of(name)
        if target is None or target == own or target in CORE_ALLOWED[own]:
            continue
        allowed = sorted(CORE_ALLOWED[own]) or "no other room"
        found.append(f"{module}:{line} imports {name} (_core/{own} may import {allowed})")
    return found


def test_the_rooms_of_core_import_downwards_only():
    found = []
    for path in sorted((PACKAGE / "_core").rglob("*.py")):
        module = module_name(path)
        imports = imported_modules(path.read_text(), module, path.name == "__init__.py")
        found += core_problems(module, imports)
    assert not found, "imports against _core's rooms:\n" + "\n".join(found)


def test_every_room_of_core_has_its_rule():
    folders = {
        path.name for path in (PACKAGE / "_core").iterdir() if (path / "__init__.py").is_file()
    }
    assert folders == CORE_FOLDERS
    modules = {path.stem for path in (PACKAGE / "_core").glob("*.py")} - {"__init__"}
    assert modules >= CORE_BASE


@pytest.mark.parametrize(
    ("module", "source", "expected"),
    [
        (
            "modstate._core.trees.flat",
            "from modstate._core.module.anatomy import anatomy_of",
            "_core/trees may import ['base']",
        ),
        (
            "modstate._core.errors",
            "from modstate._core.trees.flat import flatten",
            "_core/base may import no other room",
        ),
        (
            "modstate._core.module.anatomy",
            "from ..swap.prepare import prepare",
            "_core/module may import",
        ),
        (
            "modstate._core.grad.routes",
            "from modstate._core.call import call",
            "_core/grad may import",
        ),
    ],
)
def test_the_check_names_an_import_against_the_rooms(module, source, expected):
    (problem,) = core_problems(module, imported_modules(source, module, False))
    assert expected in problem and problem.startswith(module)


def test_the_check_lets_downward_imports_in_core_pass():
    source = "from modstate._core.swap.prepare import prepare\nfrom ..trees.flat import flatten"
    assert (
        core_problems(
            "modstate._core.swap.swaps",
            imported_modules(source, "modstate._core.swap.swaps", False),
        )
        == []
    )


def test_every_part_imports_downwards_only():
    found = check(PACKAGE, SOURCE)
    assert not found, "imports against the layers:\n" + "\n".join(found)


def test_every_part_has_its_rule():
    parts = {path.name for path in PACKAGE.iterdir() if (path / "__init__.py").is_file()}
    assert parts == {*ALLOWED, "cli"}


# The checker itself, on made-up sources: each rule can fail.


@pytest.mark.parametrize(
    ("module", "source", "expected"),
    [
        ("modstate._core.call", "from modstate.tree import map", "(_core may import no other"),
        ("modstate._core.call", "def f():\n    from ..tree import _walk", "imports modstate.tree"),
        ("modstate.tree._map", "import modstate.optim._base", "(tree may import ['_core'])"),
        ("modstate.tree._map", "from modstate import extract", "never imports the faces"),
        ("modstate.optim._adam", "from modstate.ensemble import stack", "may import ['_core'"),
        ("modstate.ensemble._vmap", "from ..checkpoint import save", "imports modstate.checkp"),
        ("modstate.cli._demo", "from modstate._core.call import call", "public names only"),
        ("modstate.cli._demo", "from modstate.tree._walk import map_leaves", "public names only"),
    ],
)
def test_the_check_names_an_import_against_the_layers(module, source, expected):
    is_package = module.endswith("__init__")
    (problem,) = problems(module, imported_modules(source, module, is_package))
    assert expected in problem and problem.startswith(module)


@pytest.mark.parametrize(
    ("module", "source"),
    [
        ("modstate.tree._map", "from modstate._core.torch_facts import foreach_allowed"),
        ("modstate.tree._map", "from ._walk import map_leaves"),
        ("modstate.optim._adam", "from modstate._core.trees.ties import keeping_ties"),
        ("modstate.cli._demo", "import modstate as ms\nfrom modstate import optim, tree"),
        ("modstate.cli", "from modstate.cli._demo import run\nimport torch"),
        ("modstate", "from modstate.ensemble import Ensemble"),
    ],
)
def test_the_check_lets_downward_imports_pass(module, source):
    is_package = module in {"modstate", "modstate.cli"}
    assert problems(module, imported_modules(source, module, is_package)) == []


def test_relative_imports_are_resolved_from_the_package():
    assert imported_modules("from ..tree import _walk", "modstate._core.call", False) == [
        (1, "modstate.tree._walk")
    ]
    assert imported_modules("from . import _walk", "modstate.tree", True) == [
        (1, "modstate.tree._walk")
    ]


# torch's private functorch API (``torch._C._functorch``, ``torch._functorch``) changes between
# releases; one module of modstate calls it, so a torch upgrade is fixed in one place.
FUNCTORCH_SEAM = "modstate._core.vmap_levels"


def functorch_callers(sources: dict[str, str]) -> list[str]:
    """The modules among ``sources`` (name -> text) other than the seam that reach torch's
    private functorch API, by import or by attribute."""
    found = []
    for module, source in sorted(sources.items()):
        if module == FUNCTORCH_SEAM:
            continue
        names = [name for _, name in imported_modules(source, module, False)]
        names += [ast.unparse(node) for node in ast.walk(ast.parse(source))
                  if isinstance(node, ast.Attribute)]  # fmt: skip
        if any(name.startswith(("torch._C._functorch", "torch._functorch")) for name in names):
            found.append(module)
    return found


def test_only_the_seam_calls_torchs_private_functorch_api():
    sources = {module_name(path): path.read_text() for path in sorted(PACKAGE.rglob("*.py"))}
    assert FUNCTORCH_SEAM in sources
    assert functorch_callers(sources) == []


@pytest.mark.parametrize(
    "source",
    [
        "import torch\nx = torch._C._functorch.get_unwrapped(t)",
        "from torch._C._functorch import is_batchedtensor",
        "from torch._functorch.pyfunctorch import coerce_cinterpreter",
    ],
)
def test_the_seam_check_names_a_module_that_calls_functorch_itself(source):
    sources = {"modstate._core.sharded.units": source, FUNCTORCH_SEAM: source}
    assert functorch_callers(sources) == ["modstate._core.sharded.units"]
