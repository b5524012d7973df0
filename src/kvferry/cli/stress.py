"""``kvferry stress``: many concurrent multi-turn sessions, prefill and decode as two processes, every byte checked.

A command module, above ``args`` and ``workload``, below ``demo`` and ``main``. Builds a ``WorkloadConfig``
from the arguments, runs it with ``runner.run_workload`` (progress bar on stderr when it is a terminal and
``--json`` is off), then prints a summary table or one JSON object. Exit status: 0 when every request
completed and no page was corrupted, 1 otherwise, 2 on usage or kvferry errors. ``kvferry demo`` reuses the
argument helpers and the rendering below.
"""

from __future__ import annotations

import argparse
import sys
from typing import Any

from rich.console import Console
from rich.table import Table

from kvferry.cli.args import (
    add_metrics_argument,
    human_bytes,
    make_console,
    parse_knob,
    parse_size,
    positive_int,
    progress_bar,
    start_metrics,
)
from kvferry.diagnostics.audit import buffer_role
from kvferry.errors import UsageError
from kvferry.layout.presets import DEFAULT_PRESET, PRESETS
from kvferry.transport import mooncake_available, nixl_available
from kvferry.workload.runner import DEFAULT_BUDGET, WorkloadConfig, WorkloadResult
from kvferry.workload.sim import WorkloadSpec

__all__ = ["add_parser", "add_workload_arguments", "config_from_args", "render", "run_stress", "verdict"]

# Corrupted buffers listed by name in the verdict; beyond that, by role.
MAX_NAMED_BUFFERS = 6
_SPEC = WorkloadSpec()  # defaults of the prompt-length model


def add_parser(subparsers: argparse._SubParsersAction) -> None:
    """Register ``kvferry stress`` (handler ``run_stress``)."""
    p = subparsers.add_parser(
        "stress", help="many concurrent multi-turn sessions, every page verified (two processes over NIXL)",
        description="Run prefill and decode as two OS processes, drive many concurrent multi-turn sessions "
                    "through them with pages allocated, freed and reused per pool, and verify every byte of "
                    "every page that decode received. Exit status 1 if any page was corrupted or any "
                    "request failed.")
    add_workload_arguments(p, sessions=80, turns=25, timeout=900.0)
    p.add_argument("--reuse-prefix", action="store_true",
                   help="decode keeps each session's whole pages between turns (sliding-window pools and "
                        "state slots move whole) and kvferry moves only the pages it lacks; reports pages and "
                        "bytes moved per turn against the whole prompt's")
    add_metrics_argument(p)
    p.set_defaults(handler=run_stress)



def add_workload_arguments(p: argparse.ArgumentParser, *, sessions: int, turns: int, timeout: float) -> None:
    """The arguments ``stress`` and ``demo`` share, with per-command defaults for the size."""
    w = p.add_argument_group("workload")
    w.add_argument("--sessions", type=positive_int, default=sessions, help=f"concurrent sessions (default {sessions})")
    w.add_argument("--turns", type=positive_int, default=turns, help=f"turns per session (default {turns})")
    w.add_argument("--first-tokens", type=positive_int, default=_SPEC.first_tokens, metavar="N",
                   help=f"median first-prompt length (default {_SPEC.first_tokens})")
    w.add_argument("--turn-tokens", type=positive_int, default=_SPEC.turn_tokens, metavar="N",
                   help=f"median tokens each turn adds (default {_SPEC.turn_tokens})")
    w.add_argument("--max-tokens", type=positive_int, default=_SPEC.max_tokens, metavar="N",
                   help=f"context limit (default {_SPEC.max_tokens})")
    w.add_argument("--seed", type=int, default=0, help="seed of the schedule, prompt lengths and bytes")
    lay = p.add_argument_group("layout")
    lay.add_argument("--preset", default=DEFAULT_PRESET, choices=sorted(PRESETS),
                     help=f"model preset (default {DEFAULT_PRESET})")
    size = lay.add_mutually_exclusive_group()
    size.add_argument("--pages", type=positive_int, metavar="N", help="pages in the preset's main pool, per side")
    size.add_argument("--budget", type=parse_size, metavar="SIZE",
                      help=f"memory per side, e.g. 1GiB (default {DEFAULT_BUDGET >> 20}MiB)")
    lay.add_argument("--knob", type=parse_knob, action="append", default=[], metavar="NAME=VALUE",
                     help="a preset knob, e.g. num_layers=8 (repeatable)")
    run = p.add_argument_group("run")
    run.add_argument("--transport", choices=("auto", "nixl", "mooncake", "local"), default="auto",
                     help="nixl: two OS processes over NIXL/UCX; mooncake: two OS processes over Mooncake's "
                          "Transfer Engine (kvferry[mooncake]); local: two threads, in-process; auto "
                          "(default): nixl when the nixl package is installed, else local, saying so")
    run.add_argument("--mode", choices=("push", "pull"), default="push",
                     help="push (default): prefill writes into decode's pages; pull: decode reads prefill's")
    run.add_argument("--digests", choices=("off", "sampled", "full"), default="full",
                     help="kvferry's own digest mode (default full); the byte check runs regardless")
    run.add_argument("--inject", type=_inject, metavar="FAULT", default=None,
                     help="inject a fault on the prefill side: buffer0-slots | flip:BUFFER[:PAGE,...]")
    run.add_argument("--timeout", type=float, default=timeout, metavar="S",
                     help=f"deadline for the whole run, start-up included (default {timeout:g} s)")
    run.add_argument("--json", action="store_true", help="print one JSON object instead of tables")


def config_from_args(args: argparse.Namespace) -> WorkloadConfig:
    """The ``WorkloadConfig`` the arguments describe (``ValueError`` on inconsistent values)."""
    spec = WorkloadSpec(num_sessions=args.sessions, num_turns=args.turns, seed=args.seed,
                        first_tokens=args.first_tokens, turn_tokens=args.turn_tokens,
                        max_tokens=args.max_tokens, min_tokens=min(_SPEC.min_tokens, args.max_tokens))
    return WorkloadConfig(workload=spec, preset=args.preset, num_pages=args.pages, budget_bytes=args.budget,
                          knobs=tuple(args.knob), transport=_transport(args.transport), digest_mode=args.digests,
                          inject=args.inject, timeout_s=args.timeout, mode=args.mode,
                          reuse_prefix=getattr(args, "reuse_prefix", False))  # demo has no such flag


def _transport(choice: str) -> str:
    if choice == "mooncake" and not mooncake_available():
        raise UsageError("--transport mooncake needs Mooncake's Transfer Engine (pip install 'kvferry[mooncake]')")
    if choice != "auto":
        return choice
    if nixl_available():
        return "nixl"
    print("kvferry: the nixl package is not installed (pip install 'kvferry[nixl]'); running both sides "
          "in this process over the local transport", file=sys.stderr)
    return "local"


def run_stress(args: argparse.Namespace) -> int:
    """Handler: run, print, and return 0 (clean) or 1 (corruption, failures, or the run broke)."""
    config = config_from_args(args)
    server = start_metrics(args)
    try:
        return execute(config, as_json=args.json, title="kvferry stress")
    finally:
        if server is not None:
            server.shutdown()


def execute(config: WorkloadConfig, *, as_json: bool, title: str) -> int:
    """Run ``config`` with a progress bar where useful, print the result, return the exit status."""
    from kvferry.workload.runner import run_workload

    with progress_bar(enabled=not as_json and sys.stderr.isatty(), total=config.workload.num_requests,
                      label="requests") as tick:
        result = run_workload(config, progress=tick)
    if as_json:
        sys.stdout.write(_json(result) + "\n")
    else:
        render(make_console(), result, title)
    return 0 if result.ok else 1


# -- rendering -----------------------------------------------------------------------------------------
def render(console: Console, result: WorkloadResult, title: str) -> None:
    """Summary table, layout table, and the verdict line last (what a reader's eye lands on)."""
    console.print(_summary_table(result, title))
    console.print(_layout_table(result))
    if result.reuse_prefix:
        console.print(turn_table(result))
    console.print(verdict(result), style="bold green" if result.ok else "bold red", soft_wrap=True)


def verdict(result: WorkloadResult) -> str:
    """One line: PASS with what was proven, or FAIL with the fault, the buffers hit and the first failure."""
    fault = f" with injected fault {result.inject}" if result.inject else ""
    if result.ok:
        return (f"PASS{fault}: {result.requests} requests from {result.sessions} sessions, "
                f"{result.pages_verified} pages verified byte for byte, 0 corrupted, 0 failed")
    parts = []
    if result.error:
        parts.append(f"run error: {result.error}")
    if result.corrupted_pages:
        parts.append(f"{result.corrupted_pages} corrupted pages in {len(result.corrupted_by_buffer)} buffers "
                     f"({name_buffers(result.corrupted_by_buffer)})")
    if result.failed_requests:
        parts.append(f"{result.failed_requests} failed requests (first: {result.first_failure})")
    if result.requests < result.requests_expected:
        parts.append(f"{result.requests}/{result.requests_expected} requests finished")
    return f"FAIL{fault}: " + "; ".join(parts)


def name_buffers(counts: dict[str, int]) -> str:
    """Buffer names when few, else ``role: n buffers`` groups and the first buffer hit (counts are in
    layout order, so that is where a misaddressing fault starts)."""
    if len(counts) <= MAX_NAMED_BUFFERS:
        return ", ".join(counts)
    roles: dict[str, int] = {}
    for name in counts:
        roles[buffer_role(name)] = roles.get(buffer_role(name), 0) + 1
    groups = ", ".join(f"{role}: {n} buffers" for role, n in roles.items())
    return f"{groups}; first in layout order: {next(iter(counts))}"


def _summary_table(r: WorkloadResult, title: str) -> Table:
    table = Table(title=f"{title}: {r.preset} over {r.transport}, {r.mode} mode, digests {r.digest_mode}")
    table.add_column("metric")
    table.add_column("value", justify="right")
    rows: list[tuple[str, Any]] = [
        ("sessions x turns", f"{r.sessions} x {r.turns}"),
        ("requests", f"{r.requests} / {r.requests_expected}"),
        ("failed requests", r.failed_requests),
        ("bytes moved", human_bytes(r.bytes)),
        ("seconds (start-up)", f"{r.seconds:.2f} ({r.startup_seconds:.2f})"),
        ("throughput", f"{r.gbps:.2f} GB/s"),
        ("latency p50 / p99", f"{r.p50_ms:.1f} / {r.p99_ms:.1f} ms"),
        ("pages verified", r.pages_verified),
        ("corrupted pages", r.corrupted_pages),
        ("... in requests reported done", r.silent_corruptions),
    ]
    if r.inject:
        rows.insert(0, ("injected fault", r.inject))
    for role, count in _by_role(r.corrupted_by_buffer).items():
        rows.append((f"  corrupted in {role}", count))
    for kind, count in r.failures.items():
        rows.append((f"  failed: {kind}", count))
    for name, value in rows:
        table.add_row(name, str(value))
    return table


def _by_role(counts: dict[str, int]) -> dict[str, int]:
    roles: dict[str, int] = {}
    for name, count in counts.items():
        roles[buffer_role(name)] = roles.get(buffer_role(name), 0) + count
    return roles


def _layout_table(r: WorkloadResult) -> Table:
    lay = r.layout
    table = Table(title=f"layout moved: {lay['num_buffers']} buffers in {len(lay['pools'])} pools, "
                        f"{human_bytes(lay['bytes_per_side'])} per side")
    for column in ("pool", "tokens/page", "buffers", "kind", "dtype", "page bytes", "pages"):
        table.add_column(column, justify="left" if column in ("pool", "buffers", "kind", "dtype") else "right")
    for pool in lay["pools"]:
        tpp = "state" if pool["tokens_per_page"] is None else str(pool["tokens_per_page"])
        for role in pool["roles"]:
            table.add_row(pool["pool"], tpp, f"{role['role']} x{role['buffers']}", role["kind"], role["dtype"],
                          str(role["page_bytes"]), str(role["num_pages"]))
    return table


def turn_table(r: WorkloadResult) -> Table:
    """Per turn: pages and bytes decode received against the whole prompt's KV (decode kept the rest)."""
    reuse = r.reuse
    table = Table(title=f"moved per turn (decode kept the rest): {reuse.get('evictions', 0)} evictions, "
                        f"{reuse.get('whole_sends', 0)} whole and {reuse.get('suffix_sends', 0)} suffix sends "
                        "with a prefix")
    for column in ("turn", "requests", "with prefix", "pages moved / whole", "bytes moved", "bytes whole",
                   "moved"):
        table.add_column(column, justify="right")
    total = {k: sum(row[k] for row in r.per_turn) for k in ("requests", "prefix_hits", "pages_moved",
                                                              "pages_whole", "bytes_moved", "bytes_whole")}
    total["moved_fraction"] = total["bytes_moved"] / total["bytes_whole"] if total["bytes_whole"] else 0.0
    for row in [*r.per_turn, {**total, "turn": "all"}]:
        table.add_row(str(row["turn"]), str(row["requests"]), str(row["prefix_hits"]),
                      f"{row['pages_moved']} / {row['pages_whole']}", human_bytes(row["bytes_moved"]),
                      human_bytes(row["bytes_whole"]), f"{row['moved_fraction']:.1%}")
    return table


def _json(result: WorkloadResult) -> str:
    import json

    return json.dumps({**result.to_dict(), "verdict": verdict(result)})



# -- argument types --------------------------------------------------------------------------------------
def _inject(text: str) -> str | None:
    """Validate ``--inject`` while parsing (a typo must not cost a whole run); None for ``none``."""
    from kvferry.diagnostics.faults import FaultKind, FaultSpec, FaultSpecError

    try:
        spec = FaultSpec.parse(text)
    except FaultSpecError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None
    return None if spec.kind is FaultKind.NONE else str(spec)
