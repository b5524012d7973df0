"""``kvferry chaos``: the stress load over NIXL while a supervisor stalls, kills and cuts off either side.

A command module, above ``args`` and ``workload``, below ``main``. Builds a ``ChaosConfig`` from the
arguments, runs it with ``workload.chaos.run_chaos`` (a live line on stderr when it is a terminal and
``--json`` is off), then prints a summary table or one JSON object. Exit status: 0 when no byte was wrong
anywhere and no lease leaked (failed requests are expected under chaos), 1 otherwise, 2 on usage errors.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

from rich.console import Console
from rich.table import Table

from kvferry.cli.args import add_metrics_argument, human_bytes, make_console, parse_size, positive_int, start_metrics
from kvferry.layout.presets import DEFAULT_PRESET, PRESETS
from kvferry.workload.chaos import ChaosProgress
from kvferry.workload.chaos_plan import ChaosConfig, ChaosResult, fault_schedule
from kvferry.workload.config import WorkloadConfig
from kvferry.workload.sim import WorkloadSpec

__all__ = ["add_parser", "config_from_args", "run_chaos_command", "verdict"]


def add_parser(subparsers: argparse._SubParsersAction) -> None:
    """Register ``kvferry chaos`` (handler ``run_chaos_command``)."""
    p = subparsers.add_parser(
        "chaos", help="the stress load while either side is stalled, killed or cut off; every byte checked",
        description="Run prefill and decode as two processes over NIXL (or Mooncake) with many multi-turn "
                    "sessions, while a supervisor at seeded random moments SIGSTOPs a side for longer than "
                    "peer_timeout + lease_grace, SIGKILLs and restarts a side, or cuts the control connections "
                    "(through a TCP relay). Every page of every request reported done is checked when it "
                    "completes, when it is reused and at the end. Exit status 1 if any byte was wrong or a lease "
                    "leaked.")
    w = p.add_argument_group("load")
    w.add_argument("--duration", type=float, default=60.0, metavar="S", help="seconds of chaos (default 60)")
    w.add_argument("--seed", type=int, default=0, help="seed of the load, the bytes and the fault schedule")
    w.add_argument("--sessions", type=positive_int, default=80, help="concurrent sessions (default 80)")
    w.add_argument("--turns", type=positive_int, default=4, help="turns per conversation (default 4)")
    w.add_argument("--preset", default=DEFAULT_PRESET, choices=sorted(PRESETS),
                   help=f"model preset (default {DEFAULT_PRESET})")
    w.add_argument("--budget", type=parse_size, default=128 << 20, metavar="SIZE",
                   help="memory per side (default 128MiB: restarts allocate it again)")
    w.add_argument("--mode", choices=("push", "pull"), default="push",
                   help="push (default): prefill writes into decode's pages; pull: decode reads prefill's")
    w.add_argument("--transport", choices=("nixl", "mooncake"), default="nixl",
                   help="between the two processes: nixl (default, NIXL over UCX) or mooncake (Mooncake's "
                        "Transfer Engine over TCP, kvferry[mooncake])")
    f = p.add_argument_group("faults and deadlines")
    f.add_argument("--mean-gap", type=float, default=4.0, metavar="S", help="mean seconds between faults")
    f.add_argument("--peer-timeout", type=float, default=1.0, metavar="S", help="endpoints' peer_timeout")
    f.add_argument("--lease-grace", type=float, default=0.5, metavar="S", help="endpoints' lease_grace")
    f.add_argument("--request-timeout", type=float, default=10.0, metavar="S", help="per-request deadline")
    f.add_argument("--json", action="store_true", help="print one JSON object instead of tables")
    f.add_argument("--schedule", action="store_true", help="print the fault schedule and exit")
    add_metrics_argument(p)   # a killed side's totals stay: the counters include every incarnation
    p.set_defaults(handler=run_chaos_command)


def config_from_args(args: argparse.Namespace) -> ChaosConfig:
    spec = WorkloadSpec(num_sessions=args.sessions, num_turns=args.turns, seed=args.seed)
    workload = WorkloadConfig(workload=spec, preset=args.preset, budget_bytes=args.budget,
                              transport=getattr(args, "transport", "nixl"),
                              request_timeout_s=args.request_timeout, peer_timeout_s=args.peer_timeout,
                              lease_grace_s=args.lease_grace, mode=args.mode)
    return ChaosConfig(workload=workload, duration_s=args.duration, mean_gap_s=args.mean_gap)


def run_chaos_command(args: argparse.Namespace) -> int:
    """Handler: run, print, and return 0 (no wrong byte, no leaked lease) or 1."""
    from kvferry.transport import mooncake_available, nixl_available
    from kvferry.workload.chaos import run_chaos

    config = config_from_args(args)
    if args.schedule:
        for event in fault_schedule(config):
            print(event.describe())
        return 0
    kind = config.workload.transport
    if not (nixl_available() if kind == "nixl" else mooncake_available()):
        print(f"kvferry chaos: --transport {kind} needs the {kind} package (pip install 'kvferry[{kind}]'): "
              "faults need two processes", file=sys.stderr)
        return 2
    server = start_metrics(args)
    try:
        with _live(enabled=not args.json and sys.stderr.isatty(), duration=config.duration_s) as tick:
            result = run_chaos(config, progress=tick)
    finally:
        if server is not None:
            server.shutdown()
    if args.json:
        sys.stdout.write(json.dumps({**result.to_dict(), "verdict": verdict(result)}) + "\n")
    else:
        render(make_console(), result)
    return 0 if result.ok else 1


def verdict(result: ChaosResult) -> str:
    """One line: PASS with what was proven, or FAIL with what was found."""
    faults = sum(result.faults.values())
    if result.ok:
        return (f"PASS: {faults} faults in {result.duration_s:g} s; {result.requests_done} requests done, "
                f"{result.requests_failed} failed; {result.pages_verified + result.pages_rechecked} page checks, "
                f"0 bytes wrong, 0 leases leaked"
                + (", 0 source holds left" if result.options.get("mode") == "pull" else ""))
    parts = []
    if result.error:
        parts.append(f"run error: {result.error}")
    if result.bytes_wrong:
        parts.append(f"{result.bytes_wrong} bytes wrong in {result.wrong_pages} pages of requests reported done "
                     f"({result.bytes_wrong_at_completion} at completion, {result.bytes_wrong_later} later)")
    if result.leaked_leases:
        parts.append(f"{result.leaked_leases} leases still held after the drain")
    if result.leaked_leases is None:
        parts.append("decode never reported after the drain (leases unknown)")
    if result.requests_done == 0:
        parts.append("no request completed")
    if result.source_holds_left:
        parts.append(f"{result.source_holds_left} source holds still held after the drain (pull mode)")
    if result.source_holds_left is None:
        parts.append("prefill never reported its source holds after the drain")
    return "FAIL: " + "; ".join(parts)


def render(console: Console, result: ChaosResult) -> None:
    console.print(_summary(result))
    if result.fault_log:
        console.print(_faults(result))
    for error in result.side_errors[:5]:
        console.print(f"side error: {error}", style="yellow", soft_wrap=True)
    console.print(verdict(result), style="bold green" if result.ok else "bold red", soft_wrap=True)


def _summary(r: ChaosResult) -> Table:
    opts = r.options
    table = Table(title=f"kvferry chaos: {r.preset}, {opts.get('mode', 'push')} mode, seed {r.seed}, "
                        f"{r.duration_s:g} s (peer_timeout "
                        f"{opts['peer_timeout_s']:g} s, lease_grace {opts['lease_grace_s']:g} s)")
    table.add_column("metric")
    table.add_column("value", justify="right")
    rows: list[tuple[str, Any]] = [
        ("requests done / failed", f"{r.requests_done} / {r.requests_failed}"),
        ("bytes moved (done requests)", human_bytes(r.bytes_moved)),
        ("pages verified at completion", r.pages_verified),
        ("pages re-checked (reuse, end)", r.pages_rechecked),
        ("bytes wrong anywhere", r.bytes_wrong),
        ("leases leaked after drain", "unknown" if r.leaked_leases is None else r.leaked_leases),
        ("pages quarantined at peak", r.quarantined_pages_peak),
        ("source holds at peak / left after drain",
         f"{r.source_holds_peak} / {'unknown' if r.source_holds_left is None else r.source_holds_left}"),
        ("restarts", ", ".join(f"{k} {v}" for k, v in r.restarts.items()) or "0"),
    ]
    rows += [(f"  failed: {kind}", count) for kind, count in r.failures.items()]
    for name, value in rows:
        table.add_row(name, str(value))
    return table


def _faults(r: ChaosResult) -> Table:
    table = Table(title=f"faults applied: {sum(r.faults.values())}")
    table.add_column("fault")
    table.add_column("count", justify="right")
    for kind, count in sorted(r.faults.items()):
        table.add_row(kind, str(count))
    return table


@contextmanager
def _live(*, enabled: bool, duration: float) -> Iterator[ChaosProgress | None]:
    """A rich status line on stderr: seconds, requests done and failed; None when disabled."""
    if not enabled:
        yield None
        return
    console = Console(stderr=True)
    with console.status("starting") as status:
        yield lambda done, failed, secs: status.update(
            f"chaos t+{secs:.0f}/{duration:g} s: {done} done, {failed} failed")
