"""`summary`: a tree as a table of its leaves (path, shape, dtype, device, size) with a total."""

from __future__ import annotations

import html
from dataclasses import dataclass
from typing import Any

from torch import Tensor

from modstate._core.trees.nodes import leaves_with_paths

_HEADER = ("path", "shape", "dtype", "device", "size")
_UNITS = ("B", "KiB", "MiB", "GiB", "TiB")


def human_bytes(count: int) -> str:
    """``1536 -> "1.5 KiB"``: bytes in binary units, three significant digits."""
    value = float(count)
    for unit in _UNITS:
        if value < 1024 or unit == _UNITS[-1]:
            return f"{count} B" if unit == "B" else f"{value:.3g} {unit}"
        value /= 1024
    raise AssertionError("unreachable")


@dataclass(frozen=True)
class SummaryRow:
    """One leaf. ``shape``, ``numel`` and ``nbytes`` are None for a leaf that is not a tensor."""

    path: str
    shape: tuple[int, ...] | None
    dtype: str
    device: str
    numel: int | None
    nbytes: int | None

    def cells(self) -> tuple[str, str, str, str, str]:
        shape = "-" if self.shape is None else str(tuple(self.shape))
        size = "-" if self.nbytes is None else human_bytes(self.nbytes)
        return (self.path or "<root>", shape, self.dtype, self.device, size)


@dataclass(frozen=True)
class TreeSummary:
    """The leaves of a tree, in order; prints as an aligned table and renders as HTML in Jupyter.

    Made by [`summary`][modstate.tree.summary]. The totals count a tensor that appears at several
    paths (tied weights) once.

    Attributes:
        rows: One `SummaryRow` per leaf, in walk order: ``path``, ``shape``, ``dtype``,
            ``device``, ``numel`` and ``nbytes`` (the last three None for a non-tensor leaf).
        total_numel: Elements over the distinct tensors.
        total_bytes: Bytes over the distinct tensors.
        tensor_count: How many distinct tensors the tree holds.

    Example:
        >>> report = ms.tree.summary({"w": torch.zeros(2, 3)})
        >>> report.rows[0].shape, report.total_bytes
        ((2, 3), 24)
    """

    rows: tuple[SummaryRow, ...]
    total_numel: int
    total_bytes: int
    tensor_count: int

    def total_line(self) -> str:
        """The table's last line, the totals.

        Returns:
            The line, such as ``total: 2 tensors, 16 elements, 64 B``.
        """
        return (
            f"total: {self.tensor_count} tensors, {self.total_numel:,} elements, "
            f"{human_bytes(self.total_bytes)}"
        )

    def __str__(self) -> str:
        table = [_HEADER, *(row.cells() for row in self.rows)]
        widths = [max(len(line[col]) for line in table) for col in range(len(_HEADER))]
        lines = []
        for line in table:
            left = [cell.ljust(width) for cell, width in zip(line[:-1], widths[:-1], strict=True)]
            lines.append("  ".join([*left, line[-1].rjust(widths[-1])]).rstrip())
        rule = "-" * max(len(line) for line in lines)
        return "\n".join([lines[0], rule, *lines[1:], rule, self.total_line()])

    def __repr__(self) -> str:
        return str(self)

    def _repr_html_(self) -> str:
        def row_html(cells: tuple[str, ...], tag: str) -> str:
            inner = "".join(
                f'<{tag} style="text-align:{"right" if i == 4 else "left"}">{html.escape(c)}</{tag}>'
                for i, c in enumerate(cells)
            )
            return f"<tr>{inner}</tr>"

        body = "".join(row_html(row.cells(), "td") for row in self.rows)
        foot = f'<tr><td colspan="5"><b>{html.escape(self.total_line())}</b></td></tr>'
        return (
            f"<table><thead>{row_html(_HEADER, 'th')}</thead>"
            f"<tbody>{body}</tbody><tfoot>{foot}</tfoot></table>"
        )


def summary(tree: Any) -> TreeSummary:
    """A table of the tree's leaves: dotted path, shape, dtype, device and size, with a total.

    ``print(ms.tree.summary(tree))`` shows an aligned text table; in a notebook the object renders
    as an HTML table. Sizes are ``numel * element_size`` in binary units (KiB, MiB).

    Args:
        tree: Any pytree; a leaf that is not a tensor gets a row with its type and no size.

    Returns:
        A [`TreeSummary`][modstate.tree.TreeSummary], one row per leaf.

    Example:
        >>> print(ms.tree.summary({"0": {"weight": torch.zeros(4, 3), "bias": torch.zeros(4)}}))
        path      shape   dtype    device  size
        ---------------------------------------
        0.weight  (4, 3)  float32  cpu     48 B
        0.bias    (4,)    float32  cpu     16 B
        ---------------------------------------
        total: 2 tensors, 16 elements, 64 B
    """
    rows = []
    seen: set[int] = set()
    total_numel = total_bytes = 0
    for path, leaf in leaves_with_paths(tree):
        if isinstance(leaf, Tensor):
            numel = leaf.numel()
            nbytes = numel * leaf.element_size()
            rows.append(
                SummaryRow(
                    path,
                    tuple(leaf.shape),
                    str(leaf.dtype).removeprefix("torch."),
                    str(leaf.device),
                    numel,
                    nbytes,
                )
            )
            if id(leaf) not in seen:
                seen.add(id(leaf))
                total_numel += numel
                total_bytes += nbytes
        else:
            rows.append(SummaryRow(path, None, type(leaf).__name__, "-", None, None))
    return TreeSummary(tuple(rows), total_numel, total_bytes, len(seen))
