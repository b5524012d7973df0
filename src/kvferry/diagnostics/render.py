"""Rich tables for the diagnostics in ``diff`` and ``integrity`` (CLI and notebooks).

The top of the diagnostics layer, above ``diff``; imports ``rich`` (a light dependency) but nothing from the
CLI. Each function returns a renderable and prints nothing, so callers choose the console (and tests can
render to text).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from rich.table import Table

from kvferry.diagnostics.diff import DiffReport
from kvferry.integrity.digests import PageMismatch

__all__ = ["diff_headline", "diff_summary_table", "diff_table", "jaccard_table", "mismatch_table", "plan_table"]


def diff_summary_table(report: DiffReport) -> Table:
    """One row per buffer with differing pages: counts by kind (no rows when clean)."""
    table = Table(title="Differing pages by buffer")
    for col in ("buffer", "zeros", "misplaced", "partial"):
        table.add_column(col, justify="left" if col == "buffer" else "right")
    for name, counts in report.by_buffer().items():
        table.add_row(name, *(str(counts[k]) for k in ("zeros", "misplaced", "partial")))
    return table


def diff_table(report: DiffReport, limit: int = 40) -> Table:
    """The first ``limit`` differing pages: pool, buffer, layer, pages, kind and how they differ."""
    table = Table(title=f"Differing pages (first {min(limit, len(report.diffs))} of {len(report.diffs)})")
    for col in ("pool", "buffer", "layer", "src page", "dst page", "kind", "detail"):
        table.add_column(col)
    for d in report.diffs[:limit]:
        style = {"zeros": "yellow", "misplaced": "magenta", "partial": "red"}[d.kind]
        table.add_row(d.pool, d.buffer, _layer(d.layer), str(d.src_page), str(d.dst_page),
                      f"[{style}]{d.kind}[/]", d.describe())
    return table


def mismatch_table(mismatches: Sequence[PageMismatch], limit: int = 40) -> Table:
    """Digest mismatches (``PageMismatchError.mismatches``) as a table."""
    table = Table(title=f"Digest mismatches (first {min(limit, len(mismatches))} of {len(mismatches)})")
    for col in ("pool", "buffer", "layer", "page", "expected", "actual"):
        table.add_column(col)
    for m in mismatches[:limit]:
        table.add_row(m.pool, m.buffer, _layer(m.layer), str(m.page), f"{m.expected:#018x}", f"{m.actual:#018x}")
    return table


def jaccard_table(scores: Mapping[str, float], threshold: float = 0.999) -> Table:
    """Top-k Jaccard per index-K buffer; values below ``threshold`` highlighted."""
    table = Table(title="Indexer top-k Jaccard")
    table.add_column("buffer")
    table.add_column("jaccard", justify="right")
    for name, value in scores.items():
        table.add_row(name, f"[red]{value:.4f}[/]" if value < threshold else f"{value:.4f}")
    return table


def plan_table(rows: Sequence[Mapping[str, Any]], limit: int = 60) -> Table:
    """``diagnose.plan_dump`` rows: buffer, pages, bytes, offsets, and which page each row really hits."""
    table = Table(title=f"Plan rows (first {min(limit, len(rows))} of {len(rows)})")
    for col in ("row", "pool", "buffer", "layer", "src pages", "dst pages", "bytes", "src offset",
                "dst offset", "src read from", "dst lands in"):
        table.add_column(col, justify="right" if col in ("row", "bytes", "src offset", "dst offset") else "left")
    for r in rows[:limit]:
        table.add_row(str(r["row"]), r["pool"], r["buffer"], _layer(r["layer"]), _span(r["src_pages"]),
                      _span(r["dst_pages"]), str(r["nbytes"]), str(r["src_offset"]), str(r["dst_offset"]),
                      _hit(r, "src"), _hit(r, "dst"))
    return table


def diff_headline(report: DiffReport) -> str:
    """One line: what was compared and whether anything differs."""
    state = "[green]clean[/]" if report.clean else f"[red]{len(report.diffs)} page(s) differ[/]"
    return (f"{report.pages_compared} pages in {len(report.buffers_compared)} buffers compared "
            f"({report.bytes_compared / 2**20:.1f} MiB): {state}")


def _hit(row: Mapping[str, Any], side: str) -> str:
    """Where the row really reads or writes; red when that is not the buffer and page it names."""
    hit = row[f"{side}_hits"]
    return hit if hit == f"{row['buffer']}[{row[f'{side}_pages'][0]}]" else f"[red]{hit}[/]"


def _layer(layer: int | None) -> str:
    return "-" if layer is None else str(layer)


def _span(pages: Sequence[int]) -> str:
    return str(pages[0]) if pages[0] == pages[1] else f"{pages[0]}-{pages[1]}"
