"""Check a built site: every public name has an anchor on its package's reference page.

``python docs/_tools/check_site.py [SITE_DIR]`` (default ``site/``) prints one line per missing
page or anchor and exits 1 if there is any. Internal links are checked by the build itself
(``mkdocs build --strict`` with ``validation:`` set to warn on unknown links and anchors).
"""

from __future__ import annotations

import re
import sys
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


def main(argv: list[str]) -> int:
    site = Path(argv[0]) if argv else Path("site")
    packages = public_packages()
    problems = missing(site, packages)
    for problem in problems:
        print(problem)
    names = sum(len(p.members) for p in packages)
    if problems:
        print(f"docs check: {len(problems)} public names or pages missing from {site}/")
        return 1
    print(f"docs check: {len(packages)} packages, {names} public names, each with its anchor")
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
