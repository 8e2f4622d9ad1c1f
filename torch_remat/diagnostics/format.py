"""Text formatting shared by every diagnostic: bytes, shapes, dtypes, aligned tables.

All reports format sizes through :func:`format_bytes`, so one storage reads the
same in a memory report, a saved-tensors report and an OOM message.
"""

from __future__ import annotations

from collections.abc import Sequence

from .._tensors import format_dtype, format_shape

__all__ = ["align_rows", "format_bytes", "format_dtype", "format_shape", "plural"]

_UNITS = ("KiB", "MiB", "GiB")


def format_bytes(n: int) -> str:
    """Format a byte count: ``"48 B"``, ``"1.50 KiB"``, ``"12.00 MiB"``, ``"3.25 GiB"``.

    Below 1024 the exact count is shown; above it two decimals of the largest unit
    (binary: 1 KiB = 1024 B) that keeps the number at least 1, up to GiB.
    """
    n = int(n)
    if -1024 < n < 1024:
        return f"{n} B"
    value = float(n)
    for unit in _UNITS:
        value /= 1024.0
        if abs(value) < 1024.0 or unit == _UNITS[-1]:
            return f"{value:.2f} {unit}"
    raise AssertionError("unreachable")


def plural(count: int, word: str) -> str:
    return f"{count} {word}" if count == 1 else f"{count} {word}s"


def align_rows(rows: Sequence[Sequence[str]], right: Sequence[bool], indent: str = "") -> list[str]:
    """Lay out rows of cells in columns two spaces apart.

    ``right[i]`` right-aligns column ``i``; other columns are padded on the left
    side. Trailing blanks are removed, so a row ends at its last non-empty cell.
    """
    if not rows:
        return []
    ncols = max(len(r) for r in rows)
    widths = [0] * ncols
    for r in rows:
        for i, cell in enumerate(r):
            widths[i] = max(widths[i], len(cell))
    lines = []
    for r in rows:
        cells = []
        for i in range(ncols):
            cell = r[i] if i < len(r) else ""
            cells.append(cell.rjust(widths[i]) if right[i] else cell.ljust(widths[i]))
        lines.append((indent + "  ".join(cells)).rstrip())
    return lines
