"""Plain-text tables of numbers, as the CLI and the benchmarks print them."""

from __future__ import annotations

import math
from typing import Any

__all__ = ["count", "format_table"]


def _fmt(value: Any) -> str:
    if value is None:
        return "-"
    if isinstance(value, bool) or not isinstance(value, float):
        return str(value)
    if value == 0 or not math.isfinite(value):
        return "0" if value == 0 else str(value)
    a = abs(value)
    if a >= 1e7 or a < 1e-3:
        return f"{value:.3e}"
    if a >= 100:
        return f"{value:.1f}"
    if a >= 1:
        return f"{value:.3f}"
    return f"{value:.4f}"


def format_table(rows: list[dict[str, Any]], columns: list[str]) -> str:
    """A plain-text table: numbers right-aligned, text left-aligned.

    Missing entries and ``None`` print as ``-``. Floats get 3-4 significant
    figures, which is all that run-to-run timing noise justifies.
    """
    cells = [[_fmt(row.get(c)) for c in columns] for row in rows]
    numeric = [
        all(isinstance(row.get(c), (int, float)) or row.get(c) is None for row in rows)
        for c in columns
    ]
    widths = [max([len(c)] + [len(r[i]) for r in cells]) for i, c in enumerate(columns)]

    def line(values: list[str]) -> str:
        parts = [v.rjust(w) if num else v.ljust(w) for v, w, num in zip(values, widths, numeric)]
        return "  ".join(parts).rstrip()

    out = [line(list(columns)), "  ".join("-" * w for w in widths)]
    out.extend(line(r) for r in cells)
    return "\n".join(out)


def count(n: int, word: str, plural: str | None = None) -> str:
    """"1 tensor", "2 tensors" (``plural`` where it is not ``word`` + "s")."""
    return f"{n} {word if n == 1 else plural or word + 's'}"
