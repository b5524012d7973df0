"""``kvferry demo``: the first run. A prefill and a decode process exchange real KV pages, with a verdict.

A command module, above ``stress`` (whose helpers it reuses), below ``main``. The same engine as
``kvferry stress`` (``run_workload``), sized to finish in
seconds on a 2-core laptop: a few dozen sessions of a few turns on the DeepSeek-V4-style hybrid layout,
whose bf16 indexer-key buffers have fewer pages than the KV buffers beside them. It ends with a summary
(requests, bytes, GB/s, p50/p99 latency, pages verified, corrupted pages), the layout it moved and a
PASS/FAIL verdict line. ``--inject buffer0-slots`` replays the motivating bug to show it caught and
localised. Exit status: 0 on PASS, 1 on FAIL, 2 on usage or kvferry errors.
"""

from __future__ import annotations

import argparse

from kvferry.cli.stress import add_workload_arguments, config_from_args, execute

__all__ = ["DEMO_SESSIONS", "DEMO_TURNS", "add_parser", "run_demo"]

DEMO_SESSIONS = 24
DEMO_TURNS = 4


def add_parser(subparsers: argparse._SubParsersAction) -> None:
    """Register ``kvferry demo`` (handler ``run_demo``)."""
    p = subparsers.add_parser(
        "demo", help="see prefill and decode processes move real KV pages, verified byte for byte",
        description="Start a decode and a prefill process (NIXL over UCX), run a short multi-session "
                    "workload on a real model's layout (default: the DeepSeek-V4-style hybrid), verify every "
                    "page decode received, and print a summary, the layout moved and a PASS/FAIL verdict. "
                    "--inject buffer0-slots replays the buffer-0 slot-count bug to show it caught.")
    add_workload_arguments(p, sessions=DEMO_SESSIONS, turns=DEMO_TURNS, timeout=180.0)
    p.set_defaults(handler=run_demo)


def run_demo(args: argparse.Namespace) -> int:
    """Handler: run the demo workload, print the summary and verdict, return 0 (PASS) or 1 (FAIL)."""
    return execute(config_from_args(args), as_json=args.json, title="kvferry demo")
