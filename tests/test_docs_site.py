"""The reference site's tooling (docs/_tools): what it generates and what its check refuses.

The site itself is built by ``make docs-check`` in ``.ci/run``; these tests need no build.
"""

from __future__ import annotations

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
