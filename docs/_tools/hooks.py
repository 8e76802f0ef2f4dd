"""mkdocs hooks that generate the pages kept elsewhere, so they cannot drift.

- ``reference/``: one page per public package, generated from its ``__all__`` (``public_api``):
  a table of its names, then each one rendered from its docstring by mkdocstrings. A name added
  to ``__all__`` appears on the next build.
- ``tour.md``: the tour sections of ``README.md``.
- ``notebooks/``: the executed notebooks of ``notebooks/``, rendered as saved (not run).
- ``changelog.md``: ``CHANGELOG.md``.
- the footer of every page: ``modstate <version>``.

Where ``docs/`` holds a file of the same name (``tour.md``, ``reference/index.md``, ...), it is a
stand-in for readers of the repository (on GitHub its links lead to the sources); the generated
page replaces it in the site.
"""

from __future__ import annotations

import re
import sys
from pathlib import Path

from mkdocs.plugins import event_priority
from mkdocs.structure.files import File, Files

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(ROOT / "src"))

from public_api import Package, definition_path, public_packages, summary_line  # noqa: E402

import modstate  # noqa: E402

# README sections that are not part of the tour (install, pointers, development).
NOT_TOUR = {
    "Two commands on a fresh machine",
    "Documentation",
    "Notebooks",
    "Benchmarks",
    "Development",
    "License",
}


def primary_entries(packages: list[Package]) -> dict[str, str]:
    """Where each object is documented in full: its definition path -> the first public name
    listing it, parents first (``modstate.typing.Optimizer`` is ``modstate.optim.Optimizer``)."""
    primary: dict[str, str] = {}
    for package in packages:
        for name in package.members:
            primary.setdefault(definition_path(package.name, name), f"{package.name}.{name}")
    return primary


def _page_of(public: str, packages: list[Package]) -> str:
    package = max(
        (p for p in packages if public.startswith(p.name + ".")), key=lambda p: len(p.name)
    )
    return f"{package.name}.md"


def reference_page(package: Package, packages: list[Package] | None = None) -> str:
    lines = [
        f"# `{package.name}`",
        "",
        f"::: {package.name}",
        "    options:",
        "      members: false",
        "      show_root_heading: false",
        "",
    ]
    if package.subpackages:
        lines += ["## Packages", ""]
        lines += [f"- [`{sub}`]({sub}.md)" for sub in package.subpackages]
        lines.append("")
    if package.members:
        lines += ["## Contents", "", "| name | what it does |", "|---|---|"]
        for name in package.members:
            summary = summary_line(package.name, name).replace("|", "\\|")
            lines.append(f"| [`{name}`](#{package.name}.{name}) | {summary} |")
        lines.append("")
        primary = primary_entries(packages or [package])
        for name in package.members:
            public, defined = f"{package.name}.{name}", definition_path(package.name, name)
            if primary.get(defined, public) != public:  # documented in full on another page
                other = primary[defined]
                lines += [
                    f"## `{public}` {{#{public}}}",
                    "",
                    f"The same object as [`{other}`]({_page_of(other, packages or [])}#{other}).",
                    "",
                ]
                continue
            if defined != public:
                # the rendered heading's anchor is the definition's: an autorefs anchor with the
                # public name too, so that docstrings can link [`call`][modstate.call]
                lines += [f"[](){{#{public}}}", ""]
            lines += [
                f"::: {defined}",
                "    options:",
                f'      heading: "{public}"',
                f'      toc_label: "{name}"',
                "",
            ]
    return "\n".join(lines)


def reference_index(packages: list[Package]) -> str:
    lines = [
        "# API reference",
        "",
        "Generated from the docstrings; every name a package lists in `__all__` is here. "
        "Public import paths are the ones shown.",
        "",
        "| package | names |",
        "|---|---|",
    ]
    for package in packages:
        names = ", ".join(f"[`{n}`]({package.name}.md#{package.name}.{n})" for n in package.members)
        lines.append(f"| [`{package.name}`]({package.name}.md) | {names} |")
    return "\n".join(lines) + "\n"


def tour_page(readme: str) -> str:
    sections = re.split(r"(?m)^(?=## )", readme)
    kept = [s for s in sections[1:] if s.splitlines()[0][3:].strip() not in NOT_TOUR]
    text = "# Tour\n\n" + "".join(kept).replace("](docs/", "](")
    return re.sub(r"(?m)^##", "##", text)


def notebook_title(path: Path) -> str:
    import json

    for cell in json.loads(path.read_text())["cells"]:
        if cell["cell_type"] == "markdown":
            for line in "".join(cell["source"]).splitlines():
                if line.startswith("# "):
                    return line[2:].strip()
    return path.stem


def notebooks_index(notebooks: list[Path]) -> str:
    lines = [
        "# Notebooks",
        "",
        "Executed notebooks, shown as saved. The test suite runs each again from a fresh "
        "kernel (`python -m pytest -m notebook`).",
        "",
    ]
    lines += [f"- [{notebook_title(nb)}]({nb.name}) (`notebooks/{nb.name}`)" for nb in notebooks]
    return "\n".join(lines) + "\n"


def on_config(config):
    # The version the site documents, read from its one place (modstate.__version__, which the
    # wheel's metadata and `python -m modstate --version` read too), in every page's footer.
    config["copyright"] = f"modstate {modstate.__version__}"
    packages = public_packages()
    for entry in config["nav"]:
        if isinstance(entry, dict) and "API reference" in entry:
            entry["API reference"] = ["reference/index.md"] + [
                {package.name: package.page} for package in packages
            ]
        if isinstance(entry, dict) and "Notebooks" in entry:
            entry["Notebooks"] = ["notebooks/index.md"] + [
                f"notebooks/{nb.name}" for nb in sorted((ROOT / "notebooks").glob("*.ipynb"))
            ]
    return config


def _put(files: Files, file: File) -> None:
    """Add ``file``, in place of the stand-in of the same name in ``docs/`` if there is one."""
    stand_in = files.get_file_from_path(file.src_uri)
    if stand_in is not None:
        files.remove(stand_in)
    files.append(file)


@event_priority(100)  # before mkdocs-jupyter, which must see the notebooks added here
def on_files(files: Files, config) -> Files:
    packages = public_packages()
    for package in packages:
        _put(files, File.generated(config, package.page, content=reference_page(package, packages)))
    _put(files, File.generated(config, "reference/index.md", content=reference_index(packages)))
    readme = (ROOT / "README.md").read_text()
    _put(files, File.generated(config, "tour.md", content=tour_page(readme)))
    changelog = (ROOT / "CHANGELOG.md").read_text()
    _put(files, File.generated(config, "changelog.md", content=changelog))
    notebooks = sorted((ROOT / "notebooks").glob("*.ipynb"))
    _put(files, File.generated(config, "notebooks/index.md", content=notebooks_index(notebooks)))
    for notebook in notebooks:
        # A plain File whose source folder is the repository root: notebooks/<name>.ipynb.
        files.append(
            File(
                f"notebooks/{notebook.name}",
                src_dir=str(ROOT),
                dest_dir=config["site_dir"],
                use_directory_urls=config["use_directory_urls"],
            )
        )
    return files
