"""The report as text: a table in 100 columns (or one line per case and peer), and its footer."""

from __future__ import annotations

import datetime
from typing import Any

from .results import Report, versions


def format_seconds(seconds: float) -> str:
    """``1.5e-6 -> "1.5 us"``: three significant digits in ns, us, ms or s."""
    for unit, scale in (("s", 1.0), ("ms", 1e-3), ("us", 1e-6), ("ns", 1e-9)):
        if seconds >= scale or unit == "ns":
            value = seconds / scale
            text = f"{value:.3g}"
            return f"{value:.0f} {unit}" if "e" in text else f"{text} {unit}"
    raise AssertionError("unreachable")


TABLE_WIDTH = 100
IMPL_WIDTH = 48  # the widest line is then 87 columns


def format_spread(spread: float | None) -> str:
    """``0.034 -> "±3%"``; ``"-"`` when unknown."""
    if spread is None:
        return "-"
    return f"±{spread * 100:.0f}%" if spread >= 0.005 else "±0%"


def _clip(text: str, width: int) -> str:
    return text if len(text) <= width else text[: width - 1] + "…"


def _title(report: Report, has_overheads: bool) -> list[str]:
    lines = [
        "Median time per call over interleaved rounds; ± is half the interquartile range.",
        "ratio = modstate / peer (below 1.00: modstate is faster).",
    ]
    if has_overheads:
        lines.append("overhead = (modstate - baseline) / (peer - baseline).")
    return lines


def _notes(report: Report) -> list[str]:
    notes = [skip.note for skip in report.skipped] + report.notes
    return ["", "Notes:", *(f"  {note}" for note in notes)] if notes else []


def format_table(report: Report, *, wide: bool = False) -> str:
    """The side-by-side report: each case, then modstate, its baseline and each peer under it,
    in 100 columns; ``wide=True``: one line per (case, peer), however long, then the notes."""
    has_overheads = any(p.overhead_ratio is not None for c in report.cases for p in c.peers)
    if wide:
        return _format_wide(report, has_overheads)
    header = f"  {'implementation':<{IMPL_WIDTH}}  {'time':>9}  {'spread':>6}  {'ratio':>6}"
    if has_overheads:
        header += f"  {'overhead':>8}"
    out = [*_title(report, has_overheads), "", header, "-" * len(header)]

    def line(impl: str, seconds: float | None, spread: float | None, *rest: str) -> str:
        time = "-" if seconds is None else format_seconds(seconds)
        text = f"  {_clip(impl, IMPL_WIDTH):<{IMPL_WIDTH}}  {time:>9}  {format_spread(spread):>6}"
        for cell, width in zip(rest, (6, 8)[: len(rest)], strict=True):
            text += f"  {cell:>{width}}"
        return text.rstrip()

    for case in report.cases:
        out.append(_clip(case.case, TABLE_WIDTH))
        out.append(line("modstate", case.modstate_s, case.modstate_spread))
        if case.baseline is not None:
            out.append(line(case.baseline, case.baseline_s, case.baseline_spread))
        for peer in case.peers:
            ratio = "-" if peer.ratio is None else f"{peer.ratio:.2f}"
            overhead = "-" if peer.overhead_ratio is None else f"{peer.overhead_ratio:.2f}"
            rest = (ratio, overhead) if has_overheads else (ratio,)
            out.append(line(peer.impl, peer.median_s, peer.spread, *rest))
        if not case.peers:
            out.append("  (no peer ran)")
    return "\n".join(out + _notes(report))


def _format_wide(report: Report, has_overheads: bool) -> str:
    header: tuple[str, ...] = ("case", "modstate", "±", "peer", "peer time", "±", "ratio")
    if has_overheads:
        header += ("overhead",)
    rows: list[tuple[str, ...]] = []
    for case in report.cases:
        own = "-" if case.modstate_s is None else format_seconds(case.modstate_s)
        lines: list[tuple[str, ...]] = []
        if case.baseline is not None and case.baseline_s is not None:
            lines.append(
                (
                    "",
                    "",
                    "",
                    case.baseline,
                    format_seconds(case.baseline_s),
                    format_spread(case.baseline_spread),
                    "",
                )
            )
        for peer in case.peers:
            line: tuple[str, ...] = (
                "",
                "",
                "",
                peer.impl,
                format_seconds(peer.median_s),
                format_spread(peer.spread),
                "-" if peer.ratio is None else f"{peer.ratio:.2f}",
            )
            if has_overheads:
                line += ("-" if peer.overhead_ratio is None else f"{peer.overhead_ratio:.2f}",)
            lines.append(line)
        if not lines:
            lines.append(("", "", "", "(no peer ran)", "", "", ""))
        lines[0] = (case.case, own, format_spread(case.modstate_spread), *lines[0][3:])
        rows.extend(lines)
    rows = [row + ("",) * (len(header) - len(row)) for row in rows]
    widths = [max(len(r[i]) for r in [header, *rows]) for i in range(len(header))]
    right = {1, 2, 4, 5, 6, 7}

    def render(row: tuple[str, ...]) -> str:
        cells = [
            cell.rjust(width) if i in right else cell.ljust(width)
            for i, (cell, width) in enumerate(zip(row, widths, strict=True))
        ]
        return "  ".join(cells).rstrip()

    rule = "-" * len(render(header))
    out = [*_title(report, has_overheads), "", render(header), rule, *map(render, rows)]
    return "\n".join(out + _notes(report))


def footer_line(data: dict[str, Any], *, quick: bool, when: datetime.datetime | None = None) -> str:
    """``"full run · torch 2.13.0 · Intel Xeon, 2 CPUs · 2026-12-02"``: what the figures are from."""
    machine = data.get("machine_info") or {}
    cpu = machine.get("cpu") or {}
    where = cpu.get("brand_raw") or machine.get("processor") or machine.get("machine") or "?"
    if cpu.get("count"):
        where += f", {cpu['count']} CPUs"
    when = when or datetime.datetime.now(datetime.UTC)
    torch_version = versions("torch")["torch"] or "?"
    return " · ".join(
        (
            "quick run" if quick else "full run",
            f"torch {torch_version}",
            where,
            when.strftime("%Y-%m-%d"),
        )
    )
