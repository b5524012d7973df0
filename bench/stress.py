"""Full-size stress run: 80 concurrent multi-turn sessions, >= 2,000 requests, every page verified.

Prefill and decode run as two OS processes over NIXL (``kvferry.workload.runner.run_workload``), the DeepSeek-V4-
style hybrid layout by default, kvferry's digests in ``full`` mode and, independently, a byte-for-byte
check of every page decode received. Reports throughput, p50/p99 request latency (decode's announce to
verified completion, which includes prefill writing the pages: the stand-in for its forward pass) and
``corrupted_pages`` (must be 0); with ``--inject`` it shows the fault caught instead.

Usage: ``python bench/stress.py [--sessions 80] [--turns 25] [--budget 1GiB] [--inject buffer0-slots]
[--json PATH] [--markdown]``. Exit status 1 unless the run is clean (0 expected without ``--inject``).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import sys
from pathlib import Path

from rich.console import Console

from kvferry.cli.args import parse_size
from kvferry.cli.stress import _progress, render
from kvferry.workload import WorkloadConfig, WorkloadResult, run_workload
from kvferry.workload.sim import WorkloadSpec


def main() -> int:
    args = _parser().parse_args()
    spec = WorkloadSpec(num_sessions=args.sessions, num_turns=args.turns, seed=args.seed)
    config = WorkloadConfig(workload=spec, preset=args.preset, budget_bytes=args.budget, transport=args.transport,
                            digest_mode=args.digests, inject=args.inject, timeout_s=args.timeout)
    with _progress(enabled=sys.stderr.isatty(), total=spec.num_requests) as tick:
        result = run_workload(config, progress=tick)
    render(Console(), result, "bench/stress.py")
    if args.json:
        Path(args.json).write_text(json.dumps({**result.to_dict(), "machine": _machine()}, indent=1) + "\n")
    if args.markdown:
        print(markdown_row(result))
    return 0 if result.ok else 1


def markdown_row(r: WorkloadResult) -> str:
    """One row for the table in ``bench/RESULTS-stress.md``."""
    return (f"| {r.preset} | {r.transport} | {r.inject or '-'} | {r.sessions} x {r.turns} | {r.requests} | "
            f"{r.bytes / 2**30:.1f} GiB | {r.seconds:.1f} s | {r.gbps:.2f} | {r.p50_ms:.0f} | {r.p99_ms:.0f} | "
            f"{r.pages_verified} | {r.corrupted_pages} | {r.failed_requests} |")


def _machine() -> dict[str, object]:
    return {"platform": platform.platform(), "python": platform.python_version(), "cpus": os.cpu_count()}


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--sessions", type=int, default=80)
    p.add_argument("--turns", type=int, default=25, help="80 x 25 = 2,000 requests")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--preset", default="deepseek_v4")
    p.add_argument("--budget", type=parse_size, default=1 << 30, help="memory per side (default 1GiB)")
    p.add_argument("--transport", choices=("nixl", "local"), default="nixl")
    p.add_argument("--digests", choices=("off", "sampled", "full"), default="full")
    p.add_argument("--inject", default=None)
    p.add_argument("--timeout", type=float, default=1800.0)
    p.add_argument("--json", metavar="PATH", help="write the result (and the machine) as JSON")
    p.add_argument("--markdown", action="store_true", help="print a row for bench/RESULTS-stress.md")
    return p


if __name__ == "__main__":  # the guard matters: the spawned processes re-import this module
    raise SystemExit(main())
