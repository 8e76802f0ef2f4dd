"""The reference site's tooling (docs/_tools): what it generates and what its check refuses.

The site itself is built by ``make docs-check`` in ``.ci/run``; these tests need no build.
"""

from __future__ import annotations

import re
import sys
from pathlib import Path

import pytest

import modstate

TOOLS = Path(__file__).resolve().parent.parent / "docs" / "_tools"
sys.path.insert(0, str(TOOLS))

import check_site  # noqa: E402
import public_api  # noqa: E402


def test_every_name_in_every_public_all_is_listed():
    packages = {package.name: package for package in public_api.public_packages()}
    assert {"modstate", "modstate.tree", "modstate.optim", "modstate.checkpoint"} <= set(packages)
    assert "modstate.cli" not in packages and "modstate.ensemble" not in packages
    root = packages["modstate"]
    assert set(root.members) == {n for n in modstate.__all__ if n not in root.subpackages_short}
    for name in ("tree", "optim", "checkpoint"):
        assert f"modstate.{name}" in root.subpackages


def test_a_member_is_documented_where_it_is_defined():
    assert public_api.definition_path("modstate", "call") == "modstate._core.call.call"
    assert public_api.definition_path("modstate", "__version__") == "modstate.__version__"


def _site(tmp_path: Path, ids: dict[str, list[str]]) -> Path:
    for package, anchors in ids.items():
        page = tmp_path / "reference" / package / "index.html"
        page.parent.mkdir(parents=True)
        page.write_text("".join(f'<h2 id="{anchor}">x</h2>' for anchor in anchors))
    return tmp_path


def test_the_check_names_each_public_name_without_an_anchor(tmp_path):
    package = public_api.Package("modstate.tree", ("add", "sub"), ())
    site = _site(tmp_path, {"modstate.tree": ["modstate.tree.add"]})
    (problem,) = check_site.missing(site, [package])
    assert problem.startswith("modstate.tree.sub: no anchor on reference/modstate.tree/")
    other = public_api.Package("modstate.optim", ("adam",), ())
    assert check_site.missing(site, [other]) == [
        "modstate.optim: no page (reference/modstate.optim/index.html not built)"
    ]
    (tmp_path / "reference" / "modstate.tree" / "index.html").write_text(
        '<h2 id="modstate.tree.add"></h2><a id="modstate.tree.sub"></a>'
    )
    assert check_site.missing(site, [package]) == []


def test_doctests_render_as_code_blocks():
    pytest.importorskip("griffe")
    import griffe_doctest

    text = "Add:\n\n>>> ms.tree.add(t, 1)  # doctest: +SKIP\n{'w': 2}\n\nSee :func:`sub`::\n"
    assert griffe_doctest.fence_doctests(text).splitlines() == [
        "Add:",
        "",
        "```pycon",
        ">>> ms.tree.add(t, 1)",
        "{'w': 2}",
        "```",
        "",
        "See `sub`:",
    ]


def test_a_public_module_without_all_lists_what_it_defines():
    import types

    module = types.ModuleType("modstate.fake")
    exec(
        "import math\nfrom math import sqrt\ndef cosine(): pass\ndef _hidden(): pass", vars(module)
    )
    assert public_api._defined_in(module) == ["cosine"]


def test_the_check_names_a_preformatted_line_wider_than_the_content_column(tmp_path):
    fits = "x" * check_site.COLUMNS
    page = tmp_path / "benchmarks" / "index.html"
    page.parent.mkdir()
    page.write_text(f"<p>{'p' * 300}</p><pre><code>{fits}\n<span>{'y' * 80}</span>z</code></pre>")
    notebook = tmp_path / "notebooks" / "a" / "index.html"
    notebook.parent.mkdir(parents=True)
    notebook.write_text(f"<pre>{'n' * 300}</pre>")  # notebook pages wrap their outputs
    assert check_site.too_wide(tmp_path) == []
    page.write_text(f"<pre><code>ok\n{'w' * 115}</code></pre>")
    (problem,) = check_site.too_wide(tmp_path)
    assert problem.startswith("benchmarks/: a line of 115 characters (at most 110 fit)")


# The docs' sources read on GitHub: their links lead somewhere there too.

ROOT = TOOLS.parent.parent
_LINK = re.compile(r"(?<!!)\[[^\]]*\]\(([^)\s]+)\)|!\[[^\]]*\]\(([^)\s]+)\)")
_FENCE = re.compile(r"^(```|~~~).*?^\1", re.S | re.M)


def relative_links(markdown: str) -> list[str]:
    """The relative targets of a Markdown text's links and images, outside code blocks."""
    text = _FENCE.sub("", markdown)
    targets = [a or b for a, b in _LINK.findall(text)]
    return [t for t in targets if not re.match(r"[a-z]+:|#", t)]


@pytest.mark.parametrize(
    "page",
    ["README.md", *sorted(p.relative_to(ROOT).as_posix() for p in (ROOT / "docs").rglob("*.md"))],
)
def test_every_relative_link_of_the_sources_leads_to_a_file(page):
    source = ROOT / page
    dead = [
        target
        for target in relative_links(source.read_text())
        if not (source.parent / target.split("#", 1)[0]).exists()
    ]
    assert not dead, f"{page} links to files that do not exist in the repository: {dead}"


def test_the_link_check_sees_links_and_images_but_not_code():
    text = "[a](tour.md) ![b](bench/x.png) [c](https://x.org) [d](#here)\n```\n[e](no.md)\n```\n"
    assert relative_links(text) == ["tour.md", "bench/x.png"]


def test_the_docs_install_line_is_the_readmes():
    readme = (ROOT / "README.md").read_text()
    first_command = re.search(r"```bash\n(.*?)\n", readme).group(1)
    assert "torch==" in first_command
    assert f"\n{first_command}\n" in (ROOT / "docs" / "index.md").read_text()


def test_sphinx_roles_become_links_or_code():
    import sphinx_roles

    names = {"call": "modstate.call", "modstate.Ensemble": "modstate.Ensemble"}
    text = "Like :func:`call`; see :class:`~modstate.Ensemble` and :class:`Anatomy`."
    assert sphinx_roles.rewrite(text, names) == (
        "Like [`call`][modstate.call]; see [`Ensemble`][modstate.Ensemble] and `Anatomy`."
    )


def test_no_docstring_uses_a_sphinx_role():
    """The site shows roles raw (":func:`call`"): ``python docs/_tools/sphinx_roles.py`` rewrites
    them as Markdown links."""
    import sphinx_roles

    found = [
        f"{path.relative_to(ROOT)}: {match[0]}"
        for path in sorted((ROOT / "src" / "modstate").rglob("*.py"))
        for match in sphinx_roles.ROLE.finditer(path.read_text())
    ]
    assert not found, "Sphinx roles left (run docs/_tools/sphinx_roles.py):\n" + "\n".join(found)
