"""``kvferry vllm-chaos``: online load through two ``vllm serve`` processes while a seeded schedule kills,
stalls and restarts either of them.

A command module, below ``main``, above ``kvferry.workload.vllm_chaos`` (imported in the handler: it starts
vLLM servers and needs aiohttp and transformers, which come with vLLM). Prints the report (or ``--json``).
Exit status: 0 when no answer had other tokens than one plain instance, none took longer than the stated
bound and both servers ended idle with no KV block in use; 1 otherwise; 2 on usage errors. See docs/vllm.md.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
from pathlib import Path
from typing import Any

from kvferry.cli.args import positive_int

__all__ = ["add_parser", "passed", "run_vllm_chaos"]


def add_parser(subparsers: argparse._SubParsersAction) -> None:
    """Register ``kvferry vllm-chaos`` (handler ``run_vllm_chaos``)."""
    p = subparsers.add_parser(
        "vllm-chaos", help="online load through vLLM servers while they are killed, stalled and restarted",
        description="Start a prefill and a decode vLLM server (a tiny random Llama written on the spot) behind "
                    "kvferry vllm-proxy, run multi-turn sessions through the proxy while a seeded schedule "
                    "SIGKILLs (and restarts on the same port) or SIGSTOPs either server, then check every "
                    "answer against one plain vLLM instance and read both servers' KV blocks from /metrics.")
    p.add_argument("--duration", type=float, default=60.0, metavar="S", help="seconds of load (default 60)")
    p.add_argument("--sessions", type=positive_int, default=32, help="concurrent sessions (default 32)")
    p.add_argument("--turns", type=positive_int, default=4, help="turns per session (default 4)")
    p.add_argument("--seed", type=int, default=0, help="seed of the sessions and the fault schedule")
    p.add_argument("--mean-gap", type=float, default=20.0, metavar="S", help="mean seconds between faults")
    p.add_argument("--targets", default="prefill,decode", help="servers the faults hit (default prefill,decode)")
    p.add_argument("--actions", default="kill,stall", help="fault kinds (default kill,stall)")
    p.add_argument("--stall", type=float, nargs=2, default=(4.0, 8.0), metavar=("MIN", "MAX"),
                   help="stall length range in seconds (default 4 8)")
    p.add_argument("--connector", choices=("kvferry", "nixl"), default="kvferry",
                   help="kvferry's connector (default) or vLLM's NixlConnector, for comparison")
    p.add_argument("--policy", choices=("fail", "recompute"), default="fail", help="kv_load_failure_policy")
    p.add_argument("--fallback", choices=("error", "decode"), default="error",
                   help="the proxy's answer when no prefill answers (default: an error)")
    p.add_argument("--peer-timeout", type=float, default=2.0, metavar="S")
    p.add_argument("--request-timeout", type=float, default=20.0, metavar="S")
    p.add_argument("--prefill-timeout", type=float, default=10.0, metavar="S")
    p.add_argument("--work-dir", type=Path, default=None, help="logs and the model (default: a temporary dir)")
    p.add_argument("--schedule", action="store_true", help="print the fault schedule and exit")
    p.add_argument("--json", action="store_true", help="print one JSON object")
    p.set_defaults(handler=run_vllm_chaos)


def passed(report: dict[str, Any]) -> bool:
    """The soak's verdict: no other tokens, no request over the bound, both servers idle with no block used."""
    idle = all(v["kv_cache_usage"] == 0 and v["running"] == 0 and v["waiting"] == 0
               for v in report["kv_after"].values())
    return report["other"] == 0 and report["over_bound"] == 0 and report["unchecked"] == 0 and idle


def run_vllm_chaos(args: argparse.Namespace) -> int:
    """Handler: run the soak, print the report, 0 when it passed."""
    from kvferry.workload.vllm_chaos import SoakConfig, fault_schedule, run_soak

    work = args.work_dir or Path(tempfile.mkdtemp(prefix="kvferry-vllm-chaos-"))
    config = SoakConfig(work, connector=args.connector, policy=args.policy, duration=args.duration,
                        sessions=args.sessions, turns=args.turns, seed=args.seed, mean_gap=args.mean_gap,
                        targets=tuple(args.targets.split(",")), actions=tuple(args.actions.split(",")),
                        stall=tuple(args.stall), peer_timeout=args.peer_timeout,
                        request_timeout=args.request_timeout, prefill_timeout=args.prefill_timeout,
                        fallback=args.fallback)
    if args.schedule:
        for fault in fault_schedule(config.seed, config.duration, config.mean_gap, config.targets, config.stall,
                                    config.actions):
            print(fault.describe())
        return 0
    report = run_soak(config, progress=lambda line: print(f"vllm-chaos: {line}", file=sys.stderr, flush=True))
    report["passed"] = passed(report)
    report["work_dir"] = str(work)
    if args.json:
        print(json.dumps(report, indent=1))
    else:
        _print(report)
    return 0 if report["passed"] else 1


def _print(report: dict[str, Any]) -> None:
    print(f"{report['connector']} connector, policy {report['policy']}, {report['sessions']} sessions, "
          f"{report['duration_s']:.0f} s, seed {report['seed']}")
    for fault in report["faults"]:
        what = f" {fault['seconds']} s" if fault["action"] == "stall" else f", healthy again in {fault['restart_s']} s"
        print(f"  fault at {fault['started']:7.1f} s: {fault['action']} {fault['target']}{what}")
    print(f"answers {report['answers']}: equal {report['equal']}, error {report['error']}, other tokens "
          f"{report['other']}, unchecked {report['unchecked']}")
    print(f"request time: p50 {report['p50_request_s']} s, p99 {report['p99_request_s']} s, max "
          f"{report['max_request_s']} s; over the {report['bound_s']:.0f} s bound: {report['over_bound']}")
    for name in ("prefill", "decode"):
        b, a = report["kv_before"][name], report["kv_after"][name]
        print(f"{name}: free KV blocks before {b['free_blocks']:.0f} of {b['num_blocks']:.0f}, after "
              f"{a['free_blocks']:.0f} (usage {a['kv_cache_usage']}, running {a['running']:.0f}, waiting "
              f"{a['waiting']:.0f}; idle {a['idle_after_s']} s after the load); restarts {report['restarts'][name]}")
    print(f"decode's quarantine peak: {report['decode_peak_quarantined_pages']} pages")
    for kind, count in report["errors_by_kind"].items():
        print(f"  error x{count}: {kind}")
    print("PASS" if report["passed"] else "FAIL")
