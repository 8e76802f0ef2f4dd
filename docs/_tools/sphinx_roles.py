"""Rewrite Sphinx roles in the package's docstrings as the Markdown the reference site renders.

``python docs/_tools/sphinx_roles.py`` replaces every ``:func:`x```, ``:class:`~a.b```,
``:meth:`m``` ... in ``src/modstate`` (rendered raw on the site, as ":func:`call`"): a public name
becomes an autorefs link, ``[`call`][modstate.call]`` (the site links it; ``help()`` reads it as
it is), anything else plain code, ```Anatomy```. It prints each file it changed.
``tests/test_docs_site.py`` fails while a role is left.
"""

from __future__ import annotations

import re
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from public_api import SOURCE, public_packages

ROLE = re.compile(r":(?:func|class|meth|mod|attr|data|obj|exc):`(~?)([^`]+)`")


def public_names() -> dict[str, str]:
    """Every public name, by its full and by its short name (``modstate``'s own first:
    ``split`` is ``modstate.split``, not ``modstate.tree.split``)."""
    names: dict[str, str] = {}
    for package in public_packages():
        for name in package.members:
            full = f"{package.name}.{name}"
            names.setdefault(full, full)
            names.setdefault(name, full)
    return names


def rewrite(text: str, names: dict[str, str]) -> str:
    def replace(match: re.Match[str]) -> str:
        tilde, target = match.groups()
        shown = target.rsplit(".", 1)[-1] if tilde else target
        public = names.get(target)
        return f"[`{shown}`][{public}]" if public else f"`{shown}`"

    return ROLE.sub(replace, text)


def main() -> int:
    names = public_names()
    for path in sorted((SOURCE / "modstate").rglob("*.py")):
        text = path.read_text(encoding="utf-8")
        new = rewrite(text, names)
        if new != text:
            path.write_text(new, encoding="utf-8")
            print(path.relative_to(SOURCE.parent))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
