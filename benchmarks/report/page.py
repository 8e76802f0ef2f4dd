"""The report as the docs page's Markdown: a headline, then one table per family.

``docs/benchmarks.md`` holds a region between `BEGIN` and `END` that is written from a
``bench.json`` (`render`), so the page can be read on GitHub as it is on the site, and never
drifts from the figures (``tests/cli/test_report.py`` checks it against
``docs/bench/bench.json``). Refresh it with::

    python -m modstate bench --out docs/bench --page docs/benchmarks.md    # run, then write
    python benchmarks/report --from docs/bench/bench.json --page docs/benchmarks.md  # write only

The headline says, per family, how modstate's time compares with each peer's over that family's
cases; the tables list every case with the ratio modstate / peer next to its name.
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

from .results import FAMILIES, family_of
from .text import format_seconds

BEGIN = (
    "<!-- The headline and tables below are written by benchmarks/report/page.py from "
    "docs/bench/bench.json; edit that generator, not this region. -->"
)
END = "<!-- end of the generated benchmark tables -->"
ON_PAR = 0.05  # ratios within 5% of 1 read as "on par": runs here move that much (see the page)


def render(data: dict[str, Any]) -> str:
    """The generated region (without its markers) for the figures of one ``bench.json``."""
    families = _by_family(data)
    lines = ["## Headline", "", _source_line(data), ""]
    for family, cases in families.items():
        lines.append(f"- {family} ({_count(len(cases), 'case')}): {_headline(cases)}.")
    for family, cases in families.items():
        lines += ["", f"## {family}", "", *_table(cases)]
    return "\n".join(lines) + "\n"


def update_page(page: Path, data: dict[str, Any]) -> None:
    """Replace the region between `BEGIN` and `END` of ``page`` with `render` of ``data``."""
    text = page.read_text(encoding="utf-8")
    if BEGIN not in text or END not in text:
        raise ValueError(f"{page} has no generated region (the lines {BEGIN!r} and {END!r})")
    head, rest = text.split(BEGIN, 1)
    _, tail = rest.split(END, 1)
    page.write_text(f"{head}{BEGIN}\n\n{render(data)}\n{END}{tail}", encoding="utf-8")


def generated_region(page_text: str) -> str:
    """What stands between the markers of a page, as `render` writes it."""
    return page_text.split(BEGIN, 1)[1].split(END, 1)[0].strip("\n") + "\n"


def speed_words(ratios: list[float]) -> str:
    """``[0.5, 0.25] -> "2–4x faster"``: ratios modstate / peer over some cases, in words.

    A ratio within 5% of 1 reads as on par: ``[0.13, 1.0] -> "1–7.7x faster"``,
    ``[1.0] -> "on par"``; both ways: ``[0.5, 1.5] -> "2x faster to 1.5x slower"``.
    """
    low, high = min(ratios), max(ratios)
    faster = low < 1 - ON_PAR
    slower = high > 1 + ON_PAR
    if faster and slower:
        return f"{_times(1 / low)} faster to {_times(high)} slower"
    if faster:
        return _range(1 / high if high < 1 - ON_PAR else 1.0, 1 / low) + " faster"
    if slower:
        return _range(low if low > 1 + ON_PAR else 1.0, high) + " slower"
    return "on par"


def _times(value: float) -> str:
    return f"{value:.2g}x" if value < 10 else f"{value:.0f}x"


def _range(low: float, high: float) -> str:
    if _times(low) == _times(high):
        return _times(low)
    return f"{_times(low)[:-1]}–{_times(high)}"


def _count(number: int, noun: str) -> str:
    return f"{number} {noun}" if number == 1 else f"{number} {noun}s"


def _family_order(family: str) -> tuple[int, str]:
    known = list(dict.fromkeys(FAMILIES.values()))
    return (known.index(family), "") if family in known else (len(known), family)


def _by_family(data: dict[str, Any]) -> dict[str, list[dict[str, Any]]]:
    # a bench.json from before cases named their family: the family of the case's benchmarks
    suites = {bench.get("group"): bench.get("fullname") for bench in data.get("benchmarks", [])}
    grouped: dict[str, list[dict[str, Any]]] = {}
    for case in data.get("cases", []):
        family = case.get("family") or family_of(suites.get(case["case"]))
        grouped.setdefault(family, []).append(case)
    return {family: grouped[family] for family in sorted(grouped, key=_family_order)}


def _source_line(data: dict[str, Any]) -> str:
    machine = data.get("machine") or {}
    where = machine.get("cpu") or "an unnamed CPU"
    if machine.get("cpu_count"):
        where += f", {machine['cpu_count']} CPUs"
    torch_version = (data.get("versions") or {}).get("torch") or "?"
    when = str(data.get("generated") or "?")[:10]
    run = "a quick run (few rounds)" if data.get("quick") else "a full run"
    return (
        f"From {run} on {when}: {where}, torch {torch_version}. Ratios are modstate's time / "
        "the peer's (below 1: modstate is faster), medians over interleaved rounds."
    )


# Rows of a table that are no peer: modstate's other configurations (its foreach path beside
# its fused one) and references such as the allocation floor or the same method written by hand
# ("reference: ..."). The tables show them; the headline, which says how modstate compares with
# what a user would run instead, does not.
NOT_PEERS = ("modstate", "allocation floor", "baseline", "reference")


def _headline(cases: list[dict[str, Any]]) -> str:
    ratios: dict[str, list[float]] = {}
    for case in cases:
        for peer in case.get("peers", []):
            if peer["impl"].startswith(NOT_PEERS):
                continue
            if peer.get("ratio") is not None:
                ratios.setdefault(peer["impl"], []).append(float(peer["ratio"]))
    if not ratios:
        return "no peer ran"
    parts = []
    for peer, values in ratios.items():
        words = speed_words(values)
        part = f"**{words}** {'with' if words == 'on par' else 'than'} {peer}"
        parts.append(part + (f" ({len(values)} of {len(cases)})" if len(cases) > 1 else ""))
    return "; ".join(parts)


def _cell(text: str) -> str:
    return text.replace("|", "\\|")


def _ratio_cell(ratio: float | None) -> str:
    if ratio is None:
        return "–"
    return f"**{ratio:.2f}** ({speed_words([ratio])})"


def _table(cases: list[dict[str, Any]]) -> list[str]:
    overheads = any(p.get("overhead_ratio") is not None for c in cases for p in c.get("peers", []))
    header = "| case | peer | modstate / peer | modstate | peer |"
    rule = "|---|---|---|--:|--:|"
    if overheads:
        header += " overhead ratio |"
        rule += "--:|"
    rows = [header, rule]
    for case in cases:
        own = _seconds(case.get("modstate_s"))
        first = True
        entries = [
            (peer["impl"], peer.get("ratio"), peer.get("median_s"), peer.get("overhead_ratio"))
            for peer in case.get("peers", [])
        ]
        if case.get("baseline"):
            entries.append((case["baseline"], None, case.get("baseline_s"), None))
        for impl, ratio, seconds, overhead in entries or [("(no peer ran)", None, None, None)]:
            name = _cell(case["case"]) if first else ""
            row = f"| {name} | {_cell(impl)} | {_ratio_cell(ratio)} | {own if first else ''} | "
            row += f"{_seconds(seconds)} |"
            if overheads:
                row += f" {'–' if overhead is None else f'{overhead:.2f}'} |"
            rows.append(row)
            first = False
    return rows


def _seconds(value: float | None) -> str:
    if value is None or (isinstance(value, float) and math.isnan(value)):
        return "–"
    return format_seconds(float(value))
