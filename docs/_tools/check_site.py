"""Check a built site: every public name has an anchor on its package's reference page, and every
preformatted block fits the content column.

``python docs/_tools/check_site.py [SITE_DIR]`` (default ``site/``) prints one line per missing
page or anchor and per line of a preformatted block (a code example, a table dumped as text)
wider than the content column, and exits 1 if there is any. Internal links are checked by the
build itself (``mkdocs build --strict`` with ``validation:`` set to warn on unknown links and
anchors).

The content column, in a 1300-pixel-wide window (the Material theme with ``toc.integrate``):
the 61rem grid (1220 px at its 20 px rem) less the 12.1rem navigation sidebar and the content's
1.2rem margins leaves 930 px; a code block's 1.18em padding on each side leaves 898 px, which
holds `COLUMNS` characters of its 0.85 x 0.8rem (13.6 px) monospace font, about 8.2 px each.
(Measured once in headless Chromium at 1300 x 2400: a 110-character line fits, a 115-character
one overflows.) Wider lines would be cut off at the block's edge, to be scrolled to. Notebook
pages are left out: mkdocs-jupyter wraps their outputs, and shows their cells as saved.
"""

from __future__ import annotations

import re
import sys
from html.parser import HTMLParser
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "src"))

from public_api import Package, public_packages

_ID = re.compile(r"""\bid=["']([^"']+)["']""")


def page_html(site: Path, package: Package) -> Path:
    return site / "reference" / package.name / "index.html"


def missing(site: Path, packages: list[Package]) -> list[str]:
    """What the site lacks: ``"modstate.tree.add: no anchor on reference/modstate.tree/"``."""
    problems = []
    for package in packages:
        page = page_html(site, package)
        if not page.is_file():
            problems.append(f"{package.name}: no page ({page.relative_to(site)} not built)")
            continue
        ids = set(_ID.findall(page.read_text(encoding="utf-8")))
        for name in package.members:
            if f"{package.name}.{name}" not in ids:
                problems.append(
                    f"{package.name}.{name}: no anchor on reference/{package.name}/ "
                    f"(is it in __all__ but not importable, or not documented?)"
                )
    return problems


COLUMNS = 110


class _Preformatted(HTMLParser):
    """The text of every outermost ``<pre>`` element of a page."""

    def __init__(self) -> None:
        super().__init__()
        self.depth = 0
        self.blocks: list[str] = []
        self._text: list[str] = []

    def handle_starttag(self, tag: str, attrs: list) -> None:
        if tag == "pre":
            if self.depth == 0:
                self._text = []
            self.depth += 1

    def handle_endtag(self, tag: str) -> None:
        if tag == "pre" and self.depth:
            self.depth -= 1
            if self.depth == 0:
                self.blocks.append("".join(self._text))

    def handle_data(self, data: str) -> None:
        if self.depth:
            self._text.append(data)


def preformatted_blocks(html: str) -> list[str]:
    parser = _Preformatted()
    parser.feed(html)
    return parser.blocks


def too_wide(site: Path, columns: int = COLUMNS) -> list[str]:
    """Lines of preformatted blocks wider than the content column: ``"benchmarks/: a line of 123
    characters (at most 110 fit): 'distributed: ...'"``; notebook pages left out."""
    problems = []
    for page in sorted(site.rglob("*.html")):
        where = page.parent.relative_to(site).as_posix() + "/"
        if where.startswith("notebooks/") or where.startswith(("assets/", "search/")):
            continue
        for block in preformatted_blocks(page.read_text(encoding="utf-8")):
            for line in block.splitlines():
                if len(line) > columns:
                    problems.append(
                        f"{where}: a line of {len(line)} characters (at most {columns} fit): "
                        f"{line[:60]!r}"
                    )
    return problems


def main(argv: list[str]) -> int:
    site = Path(argv[0]) if argv else Path("site")
    packages = public_packages()
    problems = missing(site, packages) + too_wide(site)
    for problem in problems:
        print(problem)
    names = sum(len(p.members) for p in packages)
    if problems:
        print(f"docs check: {len(problems)} problems in {site}/")
        return 1
    print(
        f"docs check: {len(packages)} packages, {names} public names, each with its anchor; "
        f"every preformatted line fits in {COLUMNS} columns"
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
