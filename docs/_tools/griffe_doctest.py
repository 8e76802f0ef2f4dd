"""A griffe extension for the reference site: docstrings are written for ``help()`` and doctest.

Markdown would read a doctest's ``>>>`` lines as nested quotes and an RST ``::`` paragraph ending
as literal text. This shows each run of doctest lines (prompts and their expected output) as a
``pycon`` code block, drops ``# doctest:`` directives and RST roles (``:func:``), and ends a
``::`` paragraph with ``:``.
The docstrings themselves are untouched: only the rendered copy changes.
"""

from __future__ import annotations

import re
from typing import Any

import griffe

_DIRECTIVE = re.compile(r"\s*#\s*doctest:.*$")
_ROLE = re.compile(r":(?:func|class|meth|mod|attr|data|obj|exc):`")


def fence_doctests(text: str) -> str:
    """Wrap each run of ``>>>`` lines and their output in a fenced ``pycon`` block.

    >>> fence_doctests("Example:\\n\\n>>> 1 + 1  # doctest: +SKIP\\n2\\n\\nAfter.").splitlines()
    ['Example:', '', '```pycon', '>>> 1 + 1', '2', '```', '', 'After.']
    """
    if "```pycon" in text:  # already done (griffe may hand the same docstring over twice)
        return text
    text = _ROLE.sub("`", text)  # RST roles: :func:`x` reads as `x`
    out: list[str] = []
    in_block = False
    indent = ""
    for line in text.splitlines():
        stripped = line.lstrip()
        if not in_block and stripped.startswith(">>>"):
            indent = line[: len(line) - len(stripped)]
            out.append(f"{indent}```pycon")
            in_block = True
        elif in_block and not stripped:
            out.append(f"{indent}```")
            in_block = False
        if in_block:
            line = _DIRECTIVE.sub("", line)
        elif line.rstrip().endswith("::") and not line.rstrip().endswith(":::"):
            line = line.rstrip()[:-1]
        out.append(line)
    if in_block:
        out.append(f"{indent}```")
    return "\n".join(out)


class DoctestsAsCode(griffe.Extension):
    """Render doctest examples as code blocks (see the module docstring)."""

    def on_instance(self, *, obj: griffe.Object, **kwargs: Any) -> None:
        if obj.docstring is not None:
            obj.docstring.value = fence_doctests(obj.docstring.value)
