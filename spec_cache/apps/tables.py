"""Text the applications print: a table of columns, a byte count a person reads.

Its own module, imported by the CLI (``spec_cache.apps.cli`` re-exports both names) and the demos alike, so a
demo never imports the CLI package (which imports the demos to run them: that was an import circle).
"""

from __future__ import annotations

__all__ = ["human_bytes", "table"]


def human_bytes(n: int | None) -> str:
    """``n`` bytes in binary units (``1.5 KiB``); ``-`` for None."""
    if n is None:
        return "-"
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return str(n)


def table(rows: list[list[str]], header: list[str]) -> str:
    """Left-aligned columns under a header and a rule."""
    widths = [max(len(str(x)) for x in col) for col in zip(header, *rows)]

    def line(r):
        return "  ".join(str(x).ljust(w) for x, w in zip(r, widths)).rstrip()
    return "\n".join([line(header), line(["-" * w for w in widths])] + [line(r) for r in rows])
