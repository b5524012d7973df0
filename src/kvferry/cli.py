"""The ``kvferry`` command line: a small registry of subcommands over argparse.

Top layer of the package. Each subcommand is one function listed in ``COMMANDS`` that adds its parser
to the subparsers and sets ``handler=fn(args) -> int`` with ``set_defaults``. To add a command (``demo``,
``stress``, ``bench``, ``diff``), write ``add_<name>_parser`` in its own module and list it here; import
heavy dependencies (nixl, zmq, torch) inside the handler so ``kvferry --help`` stays fast. Commands that
take a layout reuse ``add_layout_arguments`` and ``layout_from_args``; ``--json`` output goes through
``emit_json`` (one JSON object on stdout). ``KVFerryError`` from a handler becomes a one-line message on
stderr and exit status 2.
"""

from __future__ import annotations

import argparse
import importlib
import json
import re
import sys
from collections.abc import Callable, Sequence

from rich.console import Console
from rich.table import Table

from .audit import AuditReport, SizingReport, audit, sizing
from .errors import KVFerryError
from .layout import Layout
from .presets import DEFAULT_PRESET, PRESETS, describe_presets, get_preset, preset_knobs

__all__ = [
    "COMMANDS",
    "add_layout_arguments",
    "build_parser",
    "emit_json",
    "human_bytes",
    "layout_from_args",
    "main",
    "parse_knob",
    "parse_size",
    "positive_int",
]

# "module:function" entries, each adding one subcommand; imported when the parser is built.
COMMANDS: tuple[str, ...] = (
    "kvferry.cli:add_presets_parser",
    "kvferry.cli:add_audit_parser",
    "kvferry.cli:add_sizing_parser",
    "kvferry.commands.demo_cmd:add_parser",
    "kvferry.commands.stress_cmd:add_parser",
    "kvferry.commands.diagnose_cmd:add_diff_parser",
    "kvferry.commands.bench_cmd:add_bench_parser",
)

DEFAULT_BUDGET = "4GiB"
# Above this many buffers, audit collapses layers into one row per buffer role unless --all is given.
COLLAPSE_OVER = 12

_UNITS = {"": 1, "b": 1, "k": 1 << 10, "kib": 1 << 10, "m": 1 << 20, "mib": 1 << 20, "g": 1 << 30,
          "gib": 1 << 30, "t": 1 << 40, "tib": 1 << 40, "kb": 10**3, "mb": 10**6, "gb": 10**9, "tb": 10**12}
_SIZE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([a-zA-Z]*)\s*$")


def main(argv: Sequence[str] | None = None) -> int:
    """Run one subcommand; return its exit status (0 ok, 2 usage or kvferry error)."""
    parser = build_parser()
    try:
        args = parser.parse_args(argv)
    except SystemExit as exc:  # argparse exits on --help and on usage errors; hand back the status
        return exc.code if isinstance(exc.code, int) else 2
    try:
        return int(args.handler(args))
    except KVFerryError as exc:
        print(f"kvferry {args.command}: error: {exc}", file=sys.stderr)
        return 2


def build_parser() -> argparse.ArgumentParser:
    """The top-level parser with every command in ``COMMANDS`` registered."""
    parser = argparse.ArgumentParser(
        prog="kvferry", description="Move paged, heterogeneous KV cache from prefill to decode workers.")
    subparsers = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)
    for entry in COMMANDS:
        _resolve(entry)(subparsers)
    return parser


def _resolve(entry: str) -> Callable[[argparse._SubParsersAction], None]:
    module, _, name = entry.partition(":")
    return getattr(importlib.import_module(module), name)


# -- shared helpers for commands ---------------------------------------------------------------------------
def parse_size(text: str) -> int:
    """``4GiB`` -> 4294967296. Binary units (K, KiB, M, G, T...) and decimal ones (KB, MB, GB, TB)."""
    match = _SIZE.match(text)
    unit = match and _UNITS.get(match.group(2).lower())
    if not match or unit is None:
        raise argparse.ArgumentTypeError(
            f"invalid size {text!r}: use a number with an optional unit, e.g. 4GiB, 512MiB, 2GB")
    value = int(float(match.group(1)) * unit)
    if value < 1:
        raise argparse.ArgumentTypeError(f"invalid size {text!r}: must be at least 1 byte")
    return value


def positive_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected an integer, got {text!r}") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be >= 1, got {value}")
    return value


def parse_knob(text: str) -> tuple[str, object]:
    name, sep, raw = text.partition("=")
    if not sep or not name:
        raise argparse.ArgumentTypeError(f"expected NAME=VALUE, got {text!r}")
    for convert in (int, float):
        try:
            return name, convert(raw)
        except ValueError:
            pass
    return name, None if raw.lower() == "none" else raw


def add_layout_arguments(parser: argparse.ArgumentParser) -> None:
    """``--preset``, ``--pages | --budget``, ``--indexer-dtype`` and ``--knob``: what selects a layout."""
    group = parser.add_argument_group("layout")
    group.add_argument("--preset", default=DEFAULT_PRESET, metavar="NAME",
                       help=f"model preset, one of: {', '.join(PRESETS)} (default: {DEFAULT_PRESET})")
    capacity = group.add_mutually_exclusive_group()
    capacity.add_argument("--pages", type=positive_int, metavar="N",
                          help="pages in the preset's main pool (other pools derive theirs)")
    capacity.add_argument("--budget", type=parse_size, metavar="SIZE",
                          help=f"memory budget, e.g. 4GiB or 500MB: the largest capacity that fits "
                               f"(default: {DEFAULT_BUDGET} when --pages is not given)")
    group.add_argument("--indexer-dtype", choices=("fp8", "bf16"),
                       help="indexer-key dtype (deepseek_v32, deepseek_v4, token_salad only)")
    group.add_argument("--knob", type=parse_knob, action="append", default=[], metavar="NAME=VALUE",
                       help="any other preset knob, e.g. num_layers=8 (repeatable; "
                            "`kvferry presets` lists them)")


def layout_from_args(args: argparse.Namespace) -> Layout:
    """Build the layout ``add_layout_arguments`` describes; raises LayoutError on bad choices."""
    kwargs: dict[str, object] = dict(args.knob)
    if args.indexer_dtype is not None:
        kwargs["indexer_dtype"] = args.indexer_dtype
    if args.pages is not None:
        kwargs["num_pages"] = args.pages
    else:
        kwargs["budget_bytes"] = args.budget if args.budget is not None else parse_size(DEFAULT_BUDGET)
    return get_preset(args.preset, **kwargs)


def emit_json(obj: object) -> None:
    """Print ``obj`` as one JSON object on stdout (no colour, no wrapping)."""
    sys.stdout.write(json.dumps(obj) + "\n")


def _console() -> Console:
    # Created per call so it writes to the sys.stdout of the moment (tests capture it). Rich assumes 80
    # columns when stdout is not a terminal, which truncates buffer names; pipes and logs get 140.
    console = Console(highlight=False)
    if not console.is_terminal:
        console.width = max(console.width, 140)
    return console


def human_bytes(num_bytes: float) -> str:
    """``1536`` -> ``"1.50 KiB"``: binary units, two decimals."""
    for unit in ("B", "KiB", "MiB", "GiB"):
        if num_bytes < 1024:
            return f"{num_bytes:.0f} {unit}" if unit == "B" else f"{num_bytes:.2f} {unit}"
        num_bytes /= 1024
    return f"{num_bytes:.2f} TiB"


def _per_token(value: float | None) -> str:
    return "-" if value is None else f"{value:g}"


# -- presets -----------------------------------------------------------------------------------------------
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
    _console().print(table)
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
    console = _console()
    collapse = not args.all and len(report.rows) > COLLAPSE_OVER
    console.print(_roles_table(report, args.preset) if collapse else _buffers_table(report, args.preset))
    console.print(f"total {human_bytes(report.total_bytes)} in {len(report.rows)} buffers, "
                  f"{len(layout.pools)} pools; shape {report.shape_fingerprint}", soft_wrap=True)
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
                      _per_token(r.bytes_per_token), human_bytes(r.total_bytes))
    return table


def _roles_table(report: AuditReport, preset: str) -> Table:
    table = Table(title=f"{preset}: buffers by role (--all for one row per buffer)")
    _add_columns(table, ("pool", "role", "layers", *_GEOMETRY))
    for r in report.roles:
        table.add_row(r.pool, r.role, _layers(r.layers, r.num_buffers), r.kind, r.dtype, str(r.page_bytes),
                      str(r.num_pages), _per_token(r.bytes_per_token), human_bytes(r.total_bytes))
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
    console = _console()
    console.print(_sizing_table(report, args.preset))
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
                      str(p.num_buffers), _per_token(p.bytes_per_token), str(p.pages_needed),
                      human_bytes(p.bytes_needed), str(p.capacity_pages), str(p.requests_that_fit))
    return table
