"""Every public name documents its parameters and its result, Google style, as the API site shows.

The public API is every name in ``modstate.__all__``, ``modstate.tree.__all__``,
``modstate.optim.__all__``, ``modstate.optim.schedules``, ``modstate.checkpoint.__all__`` and
``modstate.typing.__all__``; for a class, its ``__init__`` (documented in the class docstring, as
``mkdocs.yml`` merges them) and the public methods it defines. Each docstring is parsed by griffe,
as the reference site parses it (``mkdocs.yml``'s docstring options): a function that takes
arguments has an ``Args:`` section naming each of them (a dataclass may name its fields under
``Attributes:`` instead), and one that returns something (its return annotation is not ``None``)
has a ``Returns:`` (or, for a generator, ``Yields:``) section.

The failure lists every offending name with what it lacks, so that one run says all there is to
fix.
"""

from __future__ import annotations

import importlib
import inspect
import logging
from pathlib import Path
from typing import Any

import pytest

griffe = pytest.importorskip("griffe")

SOURCE = Path(__file__).resolve().parent.parent / "src"
PUBLIC = [
    "modstate",
    "modstate.tree",
    "modstate.optim",
    "modstate.optim.schedules",
    "modstate.checkpoint",
    "modstate.typing",
]
# As mkdocs.yml's docstring_options: a Returns section is free text, as Google's guide writes it.
PARSE = {"returns_multiple_items": False, "returns_named_value": False}
NOTHING = {"None", "NoReturn", "Never"}


def public_names(module_name: str) -> list[str]:
    module = importlib.import_module(module_name)
    names = getattr(module, "__all__", None)
    if names is None:  # schedules: the functions it defines
        names = [
            name
            for name, value in vars(module).items()
            if not name.startswith("_")
            and inspect.isfunction(value)
            and value.__module__ == module_name
        ]
    return [n for n in names if not inspect.ismodule(getattr(module, n))]


def load_sources() -> Any:
    logging.getLogger("griffe").setLevel(logging.ERROR)  # it warns about untyped docstring items
    return griffe.load("modstate", search_paths=[str(SOURCE)], resolve_aliases=False)


def griffe_object(root: Any, module: str, qualname: str) -> Any:
    """The griffe object defined at ``module`` / ``qualname`` (walking sub-modules, so that the
    function ``modstate._core.call.call`` is not taken for the module of the same name)."""
    found = root
    for part in module.split(".")[1:]:
        found = found.modules[part]
    for part in qualname.split("."):
        found = found.members[part]
    return found


def sections(docstring: Any) -> dict[str, Any]:
    if docstring is None:
        return {}
    return {section.kind.value: section for section in docstring.parse("google", **PARSE)}


def documented_names(section: Any) -> set[str]:
    return {item.name.lstrip("*") for item in section.value}


def function_problems(
    function: Any, *, skip_first: bool, returns: bool = True, fields: bool = False
) -> list[str]:
    """What a function's docstring lacks: its Args section (or names in it), its Returns.

    ``fields``: a dataclass's generated ``__init__``, whose arguments may be documented as the
    class's ``Attributes:`` instead.
    """
    problems = []
    found = sections(function.docstring)
    if fields and "parameters" not in found and "attributes" in found:
        found["parameters"] = found["attributes"]
    parameters = [p.name for p in function.parameters]
    if skip_first and parameters and parameters[0] in {"self", "cls"}:
        parameters = parameters[1:]
    if parameters:
        if "parameters" not in found:
            problems.append(f"no Args section (it takes {', '.join(parameters)})")
        else:
            missing = [p for p in parameters if p not in documented_names(found["parameters"])]
            if missing:
                problems.append(f"Args does not name {', '.join(missing)}")
    annotation = str(function.returns) if function.returns is not None else None
    gives = annotation not in NOTHING
    if returns and gives and "returns" not in found and "yields" not in found:
        problems.append(f"no Returns section (it returns {annotation or 'an unannotated value'})")
    return problems


def class_problems(cls: Any) -> list[tuple[str, str]]:
    problems = []
    init = cls.members.get("__init__")
    if init is not None and not init.is_alias and init.is_function:
        merged = griffe.Function("__init__", parameters=init.parameters, returns="None")
        merged.docstring = cls.docstring if cls.docstring is not None else init.docstring
        fields = "dataclass" in cls.labels
        problems += [("", p) for p in function_problems(merged, skip_first=True, fields=fields)]
    for name, member in cls.members.items():
        if name.startswith("_") or member.is_alias or not member.is_function:
            continue
        if "property" in member.labels:
            continue
        static = "staticmethod" in member.labels
        problems += [(f".{name}", p) for p in function_problems(member, skip_first=not static)]
    return problems


def all_problems() -> tuple[int, list[str]]:
    root = load_sources()
    seen: set[str] = set()
    problems: list[str] = []
    checked = 0
    for module_name in PUBLIC:
        module = importlib.import_module(module_name)
        for name in public_names(module_name):
            value = getattr(module, name)
            if not (inspect.isfunction(value) or inspect.isclass(value)):
                continue  # a constant or a type alias: nothing to call
            defined = f"{value.__module__}.{value.__qualname__}"
            if defined in seen or not value.__module__.startswith("modstate"):
                continue
            seen.add(defined)
            checked += 1
            found = griffe_object(root, value.__module__, value.__qualname__)
            public = f"{module_name}.{name}"
            if inspect.isclass(value):
                problems += [f"{public}{member}: {p}" for member, p in class_problems(found)]
            else:
                problems += [f"{public}: {p}" for p in function_problems(found, skip_first=False)]
    return checked, problems


def test_every_public_name_documents_its_args_and_returns():
    checked, problems = all_problems()
    assert checked > 60  # every package was read
    assert not problems, f"{len(problems)} docstring gaps:\n" + "\n".join(sorted(problems))


# The check itself, on made-up functions: each rule can fail, and a complete docstring passes.


def _function(source: str) -> Any:
    module = griffe.visit("fake", filepath=Path("fake.py"), code=source)
    return next(iter(module.functions.values()))


def test_the_check_names_what_a_docstring_lacks():
    bare = _function('def f(tree, *rest, alpha=1) -> dict:\n    """Do it."""\n')
    assert function_problems(bare, skip_first=False) == [
        "no Args section (it takes tree, rest, alpha)",
        "no Returns section (it returns dict)",
    ]
    partial = _function(
        'def f(tree, *rest) -> None:\n    """Do it.\n\n    Args:\n        tree: The tree.\n    """\n'
    )
    assert function_problems(partial, skip_first=False) == ["Args does not name rest"]


def test_a_complete_docstring_passes():
    complete = _function(
        "def f(self, tree, *rest) -> dict:\n"
        '    """Do it.\n\n'
        "    Args:\n        tree: The tree.\n        *rest: More trees.\n\n"
        "    Returns:\n        A new tree, shaped like\n        ``tree``.\n"
        '    """\n'
    )
    assert function_problems(complete, skip_first=True) == []
    nothing = _function('def f() -> None:\n    """Do nothing."""\n')
    assert function_problems(nothing, skip_first=False) == []
