"""Argument helpers every ``kvferry`` command shares: sizes, counts, knobs, layouts, JSON and consoles.

The bottom of the command line: the commands (``layouts``, ``demo``, ``stress``, ``diff``, ``bench``) import
it, and ``main`` imports the commands; nothing here imports a command.
"""

from __future__ import annotations

import argparse
import json
import re
import sys
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

from rich.console import Console

from kvferry.layout.presets import DEFAULT_PRESET, PRESETS, get_preset
from kvferry.layout.spec import Layout

__all__ = ["DEFAULT_BUDGET", "add_layout_arguments", "add_metrics_argument", "emit_json", "human_bytes",
           "layout_from_args", "make_console", "parse_knob", "parse_size", "per_token", "positive_int", "progress_bar",
           "start_metrics"]

DEFAULT_BUDGET = "4GiB"
_UNITS = {"": 1, "b": 1, "k": 1 << 10, "kib": 1 << 10, "m": 1 << 20, "mib": 1 << 20, "g": 1 << 30,
          "gib": 1 << 30, "t": 1 << 40, "tib": 1 << 40, "kb": 10**3, "mb": 10**6, "gb": 10**9, "tb": 10**12}
_SIZE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([a-zA-Z]*)\s*$")


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


def make_console() -> Console:
    # Created per call so it writes to the sys.stdout of the moment (tests capture it). Rich assumes 80
    # columns when stdout is not a terminal, which truncates buffer names; pipes and logs get 140.
    console = Console(highlight=False)
    if not console.is_terminal:
        console.width = max(console.width, 140)
    return console


@contextmanager
def progress_bar(*, enabled: bool, total: int, label: str, auto_refresh: bool = True
                 ) -> Iterator[Callable[[int, int], None] | None]:
    """A transient rich progress bar on stderr fed by ``progress(done, total)``; None when disabled.
    ``auto_refresh`` false: drawn only at each update, no refresh thread (a command that reports its own
    CPU time, which that thread's would enter)."""
    if not enabled:
        yield None
        return
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

    bar = Progress(TextColumn(label), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(),
                   console=Console(stderr=True), transient=True, auto_refresh=auto_refresh)
    with bar:
        task = bar.add_task(label, total=total)
        yield lambda done, _total: bar.update(task, completed=done, refresh=not auto_refresh)


def human_bytes(num_bytes: float) -> str:
    """``1536`` -> ``"1.50 KiB"``: binary units, two decimals."""
    for unit in ("B", "KiB", "MiB", "GiB"):
        if num_bytes < 1024:
            return f"{num_bytes:.0f} {unit}" if unit == "B" else f"{num_bytes:.2f} {unit}"
        num_bytes /= 1024
    return f"{num_bytes:.2f} TiB"


def per_token(value: float | None) -> str:
    return "-" if value is None else f"{value:g}"

def add_metrics_argument(p: argparse.ArgumentParser) -> None:
    """``--metrics-port``, for ``stress`` and ``chaos``: the sides' endpoint stats served to Prometheus."""
    p.add_argument("--metrics-port", type=int, default=None, metavar="PORT",
                   help="serve both sides' kvferry metrics at http://127.0.0.1:PORT/metrics while the run lasts "
                        "(docs/metrics.md; needs prometheus_client); --json includes the stats either way")


def start_metrics(args: argparse.Namespace) -> Any:
    """The ``--metrics-port`` server (before the sides start), or None."""
    if args.metrics_port is None:
        return None
    from kvferry.workload.metrics import serve_metrics

    server = serve_metrics(args.metrics_port)
    print(f"kvferry: metrics at http://127.0.0.1:{server.server_port}/metrics", file=sys.stderr)
    return server
