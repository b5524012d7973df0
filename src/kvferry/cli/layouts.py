"""``kvferry presets``, ``kvferry audit`` and ``kvferry sizing``: what a layout holds, before anything moves.

A command module of the command line: above ``args`` and the diagnostics' audit, below ``main``.
"""

from __future__ import annotations

import argparse

from rich.table import Table

from kvferry.cli.args import (
    add_layout_arguments,
    emit_json,
    human_bytes,
    layout_from_args,
    make_console,
    per_token,
    positive_int,
)
from kvferry.diagnostics.audit import AuditReport, SizingReport, audit, sizing
from kvferry.layout.presets import DEFAULT_PRESET, describe_presets, preset_knobs

__all__ = ["add_audit_parser", "add_presets_parser", "add_sizing_parser"]

COLLAPSE_OVER = 12  # more buffers than this: one row per role unless --all


def add_presets_parser(subparsers: argparse._SubParsersAction) -> None:
    p = subparsers.add_parser("presets", help="list the model presets and their knobs",
                              description="List the model presets, what they model, and their knobs.")
    p.add_argument("--json", action="store_true", help="print one JSON object instead of a table")
    p.set_defaults(handler=_run_presets)


def _run_presets(args: argparse.Namespace) -> int:
    described = describe_presets()
    if args.json:
        presets = [{"name": name, "description": text, "knobs": preset_knobs(name)}
                   for name, text in described.items()]
        emit_json({"default": DEFAULT_PRESET, "presets": presets})
        return 0
    table = Table(title="kvferry presets")
    for column in ("preset", "description", "knobs"):
        table.add_column(column)
    for name, text in described.items():
        knobs = ", ".join(f"{k}={v}" for k, v in preset_knobs(name).items())
        table.add_row(name + (" (default)" if name == DEFAULT_PRESET else ""), text, knobs)
    make_console().print(table)
    return 0


# -- audit -------------------------------------------------------------------------------------------------
def add_audit_parser(subparsers: argparse._SubParsersAction) -> None:
    p = subparsers.add_parser(
        "audit", help="per-buffer geometry of a preset layout, with warnings",
        description="Show every buffer of a preset layout (pool, kind, dtype, bytes per page, pages, bytes "
                    "per token, total) and warn where a pool's buffers differ in page count or page size.")
    add_layout_arguments(p)
    p.add_argument("--all", action="store_true", help="one row per buffer, even when there are many layers")
    p.add_argument("--json", action="store_true", help="print one JSON object instead of tables")
    p.set_defaults(handler=_run_audit)


def _run_audit(args: argparse.Namespace) -> int:
    layout = layout_from_args(args)
    report = audit(layout)
    if args.json:
        emit_json({"preset": args.preset, "num_pools": len(layout.pools), **report.to_dict()})
        return 0
    console = make_console()
    collapse = not args.all and len(report.rows) > COLLAPSE_OVER
    console.print(_roles_table(report, args.preset) if collapse else _buffers_table(report, args.preset))
    console.print(f"total {human_bytes(report.total_bytes)} in {len(report.rows)} buffers, "
                  f"{len(layout.pools)} pools; shape {report.shape_fingerprint}", soft_wrap=True)
    for state in report.state_pools:
        console.print(f"state pool {state.pool}: {human_bytes(state.bytes_per_request)} per request (one slot of "
                      f"each buffer, whatever the request's length), {state.slots} slots", soft_wrap=True)
        for role, cut in state.cut:
            console.print(f"  {role}: cut across TP ranks by channel: {cut}", soft_wrap=True)
    for warning in report.warnings:
        console.print(f"warning: {warning}", style="yellow", soft_wrap=True)
    return 0


_GEOMETRY = ("kind", "dtype", "B/page", "pages", "B/token", "total")
_TEXT_COLUMNS = {"pool", "buffer", "role", "layers", "kind", "dtype"}


def _add_columns(table: Table, columns: tuple[str, ...]) -> None:
    for column in columns:
        table.add_column(column, justify="left" if column in _TEXT_COLUMNS else "right")


def _buffers_table(report: AuditReport, preset: str) -> Table:
    table = Table(title=f"{preset}: buffers")
    _add_columns(table, ("pool", "buffer", "layer", *_GEOMETRY))
    for r in report.rows:
        layer = "-" if r.layer is None else str(r.layer)
        table.add_row(r.pool, r.buffer, layer, r.kind, r.dtype, str(r.page_bytes), str(r.num_pages),
                      per_token(r.bytes_per_token), human_bytes(r.total_bytes))
    return table


def _roles_table(report: AuditReport, preset: str) -> Table:
    table = Table(title=f"{preset}: buffers by role (--all for one row per buffer)")
    _add_columns(table, ("pool", "role", "layers", *_GEOMETRY))
    for r in report.roles:
        table.add_row(r.pool, r.role, _layers(r.layers, r.num_buffers), r.kind, r.dtype, str(r.page_bytes),
                      str(r.num_pages), per_token(r.bytes_per_token), human_bytes(r.total_bytes))
    return table


def _layers(layers: tuple[int, ...], num_buffers: int) -> str:
    if not layers:
        return f"{num_buffers} buffers"
    return str(layers[0]) if len(layers) == 1 else f"{len(layers)} ({layers[0]}..{layers[-1]})"


# -- sizing ------------------------------------------------------------------------------------------------
def add_sizing_parser(subparsers: argparse._SubParsersAction) -> None:
    p = subparsers.add_parser(
        "sizing", help="pages and bytes a request of N tokens needs in each pool",
        description="Bytes per token per pool, and the pages and bytes one request of --tokens tokens needs "
                    "in each pool (state pools: one slot), with how many such requests the capacity holds.")
    p.add_argument("--tokens", type=positive_int, required=True, metavar="N", help="tokens in the request")
    add_layout_arguments(p)
    p.add_argument("--json", action="store_true", help="print one JSON object instead of a table")
    p.set_defaults(handler=_run_sizing)


def _run_sizing(args: argparse.Namespace) -> int:
    report = sizing(layout_from_args(args), args.tokens)
    if args.json:
        emit_json({"preset": args.preset, **report.to_dict()})
        return 0
    console = make_console()
    console.print(_sizing_table(report, args.preset))
    for p in report.pools:
        if p.tokens_per_page is None:
            console.print(f"state pool {p.pool}: {human_bytes(p.bytes_per_page)} per request (one slot of each of "
                          f"its {p.num_buffers} buffers, whatever the request's length: not per token), "
                          f"{p.capacity_pages} slots", soft_wrap=True)
    console.print(f"one request of {report.tokens} tokens needs {human_bytes(report.bytes_needed)}; "
                  f"the capacity holds {report.requests_that_fit} such requests", soft_wrap=True)
    return 0


def _sizing_table(report: SizingReport, preset: str) -> Table:
    table = Table(title=f"{preset}: {report.tokens} tokens")
    for column in ("pool", "tokens/page", "buffers", "B/token", "pages needed", "bytes needed", "capacity",
                   "requests fit"):
        table.add_column(column, justify="left" if column == "pool" else "right")
    for p in report.pools:
        table.add_row(p.pool, "state" if p.tokens_per_page is None else str(p.tokens_per_page),
                      str(p.num_buffers), per_token(p.bytes_per_token), str(p.pages_needed),
                      human_bytes(p.bytes_needed), str(p.capacity_pages), str(p.requests_that_fit))
    return table
