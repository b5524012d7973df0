"""``kvferry bench``: run the benchmark suite, write its figures as JSON and PNG plots, print tables.

A command module, above ``args``, below ``main``. The measuring is ``kvferry.benchmark.suite``; this module
parses options, shows progress on stderr, writes ``bench.json`` and three plots (``bandwidth.png``,
``planning.png``, ``latency.png``) under ``--out``, and prints the figures as tables (or, with ``--json``, as
one JSON object on stdout). matplotlib (Agg backend) and the suite are imported inside the handler, so
``kvferry --help`` stays fast; without matplotlib (the ``bench`` extra) it says so before the work starts,
and writes ``bench.json`` and the tables without plots.
"""

from __future__ import annotations

import argparse
import json
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from rich.console import Console
from rich.table import Table

from kvferry.cli.args import emit_json, make_console

__all__ = ["add_parser", "run_bench", "write_plots"]

DEFAULT_OUT = "bench/out"
JSON_NAME = "bench.json"
MiB = 1 << 20


def add_parser(subparsers: argparse._SubParsersAction) -> None:
    """Register ``kvferry bench`` (handler ``run_bench``)."""
    p = subparsers.add_parser(
        "bench", help="benchmark planner, transport and request latency; write JSON and PNG plots",
        description="Measure on this machine, every baseline in the same run: planning time against "
                    "request size (kvferry and two baselines); bandwidth against request size (~1 MiB to "
                    "~1 GiB) from this process to a decode process over NIXL, for kvferry, raw NIXL posting "
                    "the same rows, raw NIXL with one descriptor per buffer, and memcpy within one process; "
                    "request latency in a control-plane run (the demo's multi-session workload, two "
                    "processes) and of transport round trips. Writes bench.json, bandwidth.png, planning.png "
                    "and latency.png under --out and prints tables. The full run takes about a minute on 2 "
                    "cores and needs ~5 GiB of memory. Without the nixl package, transfers run in one "
                    "process over the local transport and the raw NIXL figures are left out. Exit status 1 "
                    "when a run failed (the suite checks the bytes it moves).")
    size = p.add_mutually_exclusive_group()
    size.add_argument("--quick", action="store_true",
                      help="fewer sizes and repeats, requests up to ~256 MiB (under a minute on 2 cores)")
    size.add_argument("--tiny", action="store_true",
                      help="smallest run, requests of ~1 and ~4 MiB (a smoke test for CI; figures are rough)")
    p.add_argument("--out", default=DEFAULT_OUT, metavar="DIR",
                   help=f"directory for {JSON_NAME} and the PNG plots (default: {DEFAULT_OUT})")
    p.add_argument("--json", action="store_true", help="print the figures as one JSON object instead of tables")
    p.set_defaults(handler=run_bench)


def run_bench(args: argparse.Namespace) -> int:
    """Run the suite in the chosen mode, write the files, print. Returns 0, or 1 when a run failed."""
    from kvferry.benchmark.suite import MODES, run_suite

    config = MODES["tiny" if args.tiny else "quick" if args.quick else "full"]
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    missing = _plots_missing()
    if missing is not None:   # said before the work starts: the figures still go to bench.json
        Console(stderr=True).print(f"kvferry bench: {missing}", style="yellow", soft_wrap=True, markup=False)
    try:
        with _progress() as say:
            results = run_suite(config, say)
    except RuntimeError as exc:  # a run that failed (the suite verifies what it moves): no figures
        Console(stderr=True).print(f"kvferry bench: error: {exc}", style="red", soft_wrap=True)
        return 1
    results["files"] = {"json": str(out / JSON_NAME)}
    if missing is not None:
        results["plots_skipped"] = missing
    (out / JSON_NAME).write_text(json.dumps(results, indent=1) + "\n")   # first: a failing plot loses nothing
    if missing is None:
        results["files"].update(write_plots(results, out))
        (out / JSON_NAME).write_text(json.dumps(results, indent=1) + "\n")
    if args.json:
        emit_json(results)
        return 0
    console = make_console()
    for table in (_bandwidth_table(results), _planning_table(results), _latency_table(results)):
        console.print(table)
    console.print(f"{_machine_line(results)}; {results['seconds']:.1f} s", soft_wrap=True)
    console.print(f"wrote {', '.join(results['files'].values())}", soft_wrap=True)
    return 0


def _plots_missing() -> str | None:
    """Why the plots cannot be drawn (matplotlib, the ``bench`` extra, is not installed), or None."""
    try:
        import matplotlib  # noqa: F401
    except ImportError as exc:
        return (f"no plots: matplotlib is not importable ({exc}; pip install 'kvferry[bench]'); the figures "
                f"go to {JSON_NAME} and the tables only")
    return None


@contextmanager
def _progress() -> Iterator[Callable[[str], None]]:
    """A spinner on stderr naming the current step, only when stderr is a terminal (logs stay clean)."""
    console = Console(stderr=True)
    if not console.is_terminal:
        yield lambda _msg: None
        return
    with console.status("kvferry bench: starting") as spinner:
        yield lambda msg: spinner.update(f"kvferry bench: {msg}")



def _machine_line(results: dict[str, Any]) -> str:
    m = results["machine"]
    return (f"{m['cpu']}, {m['cores']} cores, {m['memory_gib']} GiB, {m['system']}, Python {m['python']}, "
            f"numpy {m['numpy']}, nixl {m['nixl']}; kvferry {results['kvferry_version']}, "
            f"mode {results['config']['mode']}")


def _num(value: float | None, fmt: str) -> str:
    return "-" if value is None else format(value, fmt)


# -- tables --------------------------------------------------------------------------------------------
def _bandwidth_table(results: dict[str, Any]) -> Table:
    bw = results["bandwidth"]
    table = Table(title=f"Bandwidth, GB/s: {_route(bw)}, timed to the decode-side notification",
                  caption=bw["layout"])
    for col in ("request", "pages", "descriptors", "kvferry", "raw NIXL, same rows", "raw NIXL, 1 desc/buffer",
                "memcpy", "kvferry / memcpy"):
        table.add_column(col, justify="right")
    for r in bw["rows"]:
        table.add_row(f"{r['nbytes'] / MiB:.1f} MiB", str(r["pages"]), str(r["descriptors"]),
                      _num(r["kvferry_gbps"], ".2f"), _num(r["raw_nixl_rows_gbps"], ".2f"),
                      _num(r["raw_nixl_gbps"], ".2f"), _num(r["memcpy_gbps"], ".2f"),
                      f"{r['kvferry_gbps'] / r['memcpy_gbps']:.2f}")
    return table


def _route(bw: dict[str, Any]) -> str:
    if bw["transport"] == "nixl":
        return "prefill process -> decode process over NIXL"
    return f"one process, {bw['transport']} transport (nixl not installed)"


def _planning_table(results: dict[str, Any]) -> Table:
    pl = results["planning"]
    table = Table(title="Planning one request, median us", caption=pl["layout"])
    for col in ("pages", "rows per-page / kvferry", "per-page", "runs + loop", "kvferry plan",
                "kvferry plan + arrays", "kvferry plan + what is posted", "plan speedup vs runs + loop"):
        table.add_column(col, justify="right")
    for r in pl["rows"]:
        table.add_row(str(r["pages"]), f"{r['per_page_rows']:,} / {r['kvferry_rows']:,}",
                      f"{r['per_page_us']:.0f}", f"{r['runs_loop_us']:.0f}", f"{r['kvferry_plan_us']:.0f}",
                      f"{r['kvferry_plan_expand_us']:.0f}", _us(r.get("kvferry_plan_post_us")),
                      f"{r['runs_loop_us'] / r['kvferry_plan_us']:.1f}x")
    return table


def _us(value: float | None) -> str:
    return "-" if value is None else f"{value:.0f}"


def _latency_table(results: dict[str, Any]) -> Table:
    table = Table(title="Request latency, ms")
    for col in ("run", "requests", "mean request", "p50", "p90", "p99", "max"):
        table.add_column(col, justify="left" if col == "run" else "right")
    for lat in _latency_runs(results):
        table.add_row(lat["source"], str(lat["requests"]), f"{lat['mean_request_bytes'] / MiB:.1f} MiB",
                      *(_num(lat[f"{q}_ms"], ".2f") for q in ("p50", "p90", "p99", "max")))
    return table


def _latency_runs(results: dict[str, Any]) -> list[dict[str, Any]]:
    """The latency runs, control plane first."""
    return [results["latency"][k] for k in ("control_plane", "transport") if k in results["latency"]]


# -- plots ---------------------------------------------------------------------------------------------
def write_plots(results: dict[str, Any], out: Path) -> dict[str, str]:
    """Write the three PNGs under ``out``; returns {name: path}. Uses matplotlib's Agg backend."""
    import matplotlib

    matplotlib.use("Agg")  # files only: no display, and no GUI toolkit to import
    import matplotlib.pyplot as plt

    subtitle = _machine_line(results)
    paths = {}
    for name, draw in (("bandwidth", _plot_bandwidth), ("planning", _plot_planning), ("latency", _plot_latency)):
        fig = draw(plt, results)
        fig.text(0.5, 0.005, subtitle, ha="center", va="bottom", fontsize=6, color="0.4", wrap=True)
        fig.tight_layout(rect=(0, 0.04, 1, 1))
        path = out / f"{name}.png"
        fig.savefig(path, dpi=120)
        plt.close(fig)
        paths[name] = str(path)
    return paths


def _plot_bandwidth(plt: Any, results: dict[str, Any]) -> Any:
    bw = results["bandwidth"]
    fig, ax = plt.subplots(figsize=(7, 4.5))
    sizes = [r["nbytes"] / MiB for r in bw["rows"]]
    for key, label, style in (("kvferry_gbps", "kvferry (planned page runs)", "o-"),
                              ("raw_nixl_rows_gbps", "raw NIXL, the same rows (no planning, no checks)", "x-."),
                              ("raw_nixl_gbps", "raw NIXL, one descriptor per buffer (contiguous)", "s--"),
                              ("memcpy_gbps", "memcpy, one process", "^:")):
        values = [r[key] for r in bw["rows"]]
        if all(v is not None for v in values):
            ax.plot(sizes, values, style, label=label)
    ax.set(xscale="log", xlabel="request size (MiB)", ylabel="GB/s",
           title=f"Bandwidth against request size: {_route(bw)}")
    _label_ticks(ax, sizes, ".3g")
    ax.set_ylim(bottom=0)
    ax.grid(True, which="both", alpha=0.3)
    ax.legend()
    return fig


def _plot_planning(plt: Any, results: dict[str, Any]) -> Any:
    rows = results["planning"]["rows"]
    fig, ax = plt.subplots(figsize=(7, 4.5))
    pages = [r["pages"] for r in rows]
    for key, label, style in (("per_page_us", "per-page baseline", "s--"),
                              ("runs_loop_us", "runs + loop over buffers", "^:"),
                              ("kvferry_plan_us", "kvferry plan_transfer", "o-"),
                              ("kvferry_plan_expand_us", "kvferry plan + N x 3 arrays", "d-"),
                              ("kvferry_plan_post_us", "kvferry plan + what the transport posts", "v-")):
        if all(key in r for r in rows):  # bench.json files from before the posted-rows figure lack it
            ax.plot(pages, [r[key] for r in rows], style, label=label)
    ax.set(xscale="log", yscale="log", xlabel="pages per request", ylabel="median time (us)",
           title=f"Planning time against request size ({rows[0]['buffers']} buffers)")
    _label_ticks(ax, pages, "d")
    ax.grid(True, which="both", alpha=0.3)
    ax.legend()
    return fig


def _label_ticks(ax: Any, values: list[float], fmt: str) -> None:
    # Log axes label only powers of ten by default; label the sizes that were measured instead.
    ax.set_xticks(values, [format(v, fmt) for v in values])
    ax.minorticks_off()


def _plot_latency(plt: Any, results: dict[str, Any]) -> Any:
    runs = [lat for lat in _latency_runs(results) if lat["samples_ms"]]
    fig, (hist, cdf) = plt.subplots(1, 2, figsize=(10, 4.2))
    for lat, color in zip(runs, ("C0", "C1")):
        samples = sorted(lat["samples_ms"])
        label = f"{lat['source'].split(':')[0]}, {lat['requests']} requests"
        hist.hist(samples, bins=min(40, max(5, len(samples) // 5)), alpha=0.6, color=color, label=label)
        cdf.plot(samples, [(i + 1) / len(samples) for i in range(len(samples))], "-", color=color, label=label)
        for ax in (hist, cdf):
            for q, style in (("p50", "--"), ("p99", ":")):
                ax.axvline(lat[f"{q}_ms"], color=color, linestyle=style, linewidth=0.8)
    hist.set(xlabel="request latency (ms)", ylabel="requests", title="Histogram (dashed p50, dotted p99)")
    cdf.set(xlabel="request latency (ms)", ylabel="fraction of requests", title="CDF")
    for ax in (hist, cdf):
        ax.grid(True, alpha=0.3)
        ax.legend(fontsize=7)
    fig.suptitle("Request latency", fontsize=10)
    return fig
