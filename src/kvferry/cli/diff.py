"""``kvferry diff``: a self-contained transfer, optionally faulted, compared byte for byte.

A command module, above ``args`` and ``diagnostics``, below ``main``. Builds a small prefill and decode memory
from a preset, fills prefill with random bytes, moves one request through ``LocalTransport`` (with the fault
``--inject`` names, if any), then prints the byte diff, the digest verdict, the indexer top-k Jaccard and,
with ``--plan``, the rows that were posted. Exit status: 0 when decode holds exactly what was sent, 1 when
anything differs, 2 on usage errors.
"""

from __future__ import annotations

import argparse
import sys
from dataclasses import dataclass
from typing import Any

import numpy as np

from kvferry.cli.args import emit_json, make_console
from kvferry.diagnostics.diff import DiffReport, diff_pages, indexer_topk_jaccard, plan_dump
from kvferry.diagnostics.faults import FaultKind, FaultSpec, FaultSpecError
from kvferry.errors import IntegrityError, PageMismatchError
from kvferry.integrity.digests import DigestMode, PageMismatch, digest_plan, verify_digests
from kvferry.layout.memory import KVMemory
from kvferry.layout.presets import PRESETS, get_preset
from kvferry.layout.spec import Layout
from kvferry.plan.planner import TransferPlan, plan_transfer
from kvferry.transport.local import LocalTransport

__all__ = ["Scenario", "add_parser", "build_scenario", "run_diff"]

DEFAULT_PRESET = "token_salad"
JACCARD_QUERIES = 8
INDEX_DTYPES = {"bf16": "bf16", "fp8_e4m3": "fp8"}

DESCRIPTION = (
    "Build a small prefill and decode memory from a preset, fill prefill with random bytes, move one request "
    "through the in-process transport (with the fault --inject names, if any), then print the byte diff, the "
    "digest verdict, the indexer top-k Jaccard and, with --plan, the rows that were posted. Exit status: 0 "
    "when decode holds exactly what was sent, 1 when anything differs, 2 on usage errors.")


def add_parser(subparsers: argparse._SubParsersAction) -> None:
    """Register ``kvferry diff`` (handler ``run_diff``)."""
    p = subparsers.add_parser("diff", help="transfer one request (optionally faulted) and diff both sides",
                              description=DESCRIPTION)
    p.add_argument("--preset", default=DEFAULT_PRESET, choices=sorted(PRESETS),
                   help=f"layout preset (default: {DEFAULT_PRESET})")
    p.add_argument("--pages", type=int, default=16, help="pages in the preset's main pool (default 16)")
    p.add_argument("--request-pages", type=int, default=None,
                   help="pages per pool in the request (default: half of each pool's smallest buffer)")
    p.add_argument("--inject", type=_fault_arg, action="append", default=[], metavar="FAULT",
                   help="none | buffer0-slots | flip:BUFFER[:PAGE,...] (repeatable)")
    p.add_argument("--digests", default="full", choices=[m.value for m in DigestMode],
                   help="digest mode to verify with (default: full)")
    p.add_argument("--topk", type=int, default=64, help="k for the indexer top-k Jaccard (default 64)")
    p.add_argument("--plan", action="store_true", help="also print the rows that were posted")
    p.add_argument("--seed", type=int, default=0, help="seed for bytes, pages and queries")
    p.add_argument("--json", action="store_true", help="print one JSON object instead of tables")
    p.set_defaults(handler=run_diff)


def _fault_arg(text: str) -> FaultSpec:
    try:
        return FaultSpec.parse(text)
    except FaultSpecError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None





@dataclass(frozen=True)
class Scenario:
    """Prefill and decode memory of one preset and one request's pages (pool -> (src, dst))."""

    src: KVMemory
    dst: KVMemory
    pages: dict[str, tuple[np.ndarray, np.ndarray]]


def build_scenario(preset: str, num_pages: int, request_pages: int | None = None, seed: int = 0) -> Scenario:
    """Random prefill bytes, zeroed decode memory, and distinct random pages per pool on each side."""
    layout: Layout = get_preset(preset, num_pages=num_pages)
    rng = np.random.default_rng(seed)
    src, dst = KVMemory.allocate(layout), KVMemory.allocate(layout)
    for buf in layout.buffers:
        arr = src.array(buf.name)
        arr[...] = np.frombuffer(rng.bytes(arr.size), dtype=np.uint8).reshape(arr.shape)
    pages = {}
    for pool in layout.pools:
        n = max(1, min(request_pages or pool.min_pages // 2, pool.min_pages))
        pages[pool.name] = (np.sort(rng.choice(pool.min_pages, n, replace=False)),
                            np.sort(rng.choice(pool.min_pages, n, replace=False)))
    return Scenario(src, dst, pages)


def transfer(scenario: Scenario, faults: list[FaultSpec], seed: int = 0) -> TransferPlan:
    """Post the request through two ``LocalTransport`` endpoints under ``faults``; returns the posted plan."""
    spec = next((f for f in faults if f.kind is FaultKind.BUFFER0_SLOTS), FaultSpec())
    plan = spec.plan(scenario.src, scenario.dst, scenario.pages)
    with LocalTransport() as prefill, LocalTransport() as decode:
        prefill.register(scenario.src)
        peer = prefill.add_peer(decode.register(scenario.dst))
        with prefill.write(plan, peer, b"done", label="diff") as handle:
            handle.wait(timeout=60.0)
    for i, fault in enumerate(faults):
        fault.after_write(scenario.dst, scenario.pages, seed=seed + i)
    return plan


def run_diff(args: argparse.Namespace) -> int:
    """Handler of ``kvferry diff``: 0 clean, 1 differences found."""
    scenario = build_scenario(args.preset, args.pages, args.request_pages, args.seed)
    _warn_outside(scenario, args.inject)
    posted = transfer(scenario, args.inject, args.seed)
    report = diff_pages(scenario.src, scenario.dst, scenario.pages)
    verdict, mismatches = _verify(scenario, args.digests, args.seed)
    jaccard = _jaccard(scenario, args.topk, args.seed)
    if args.json:
        emit_json({"preset": args.preset, "faults": [str(f) for f in args.inject], **report.to_dict(),
                   "digests": verdict, "jaccard": jaccard,
                   **({"plan": plan_dump(posted)} if args.plan else {})})
    else:
        _print(report, verdict, mismatches, jaccard, posted if args.plan else None)
    return 0 if report.clean and verdict["ok"] else 1


def _verify(scenario: Scenario, mode: str, seed: int) -> tuple[dict[str, Any], list[PageMismatch]]:
    """Digest the clean plan's source pages, verify decode's: (JSON-ready verdict, every mismatch)."""
    clean = plan_transfer(scenario.src, scenario.dst, scenario.pages)
    digests = digest_plan(clean, mode, seed=seed)
    verdict: dict[str, Any] = {"ok": True, "mode": mode, "checked": len(digests), "mismatches": 0}
    try:
        verify_digests(scenario.dst, digests)
    except PageMismatchError as exc:
        verdict.update(ok=False, error=str(exc), mismatches=len(exc.mismatches))
        return verdict, list(exc.mismatches)
    except IntegrityError as exc:
        verdict.update(ok=False, error=str(exc))
    return verdict, []


def _jaccard(scenario: Scenario, k: int, seed: int) -> dict[str, float]:
    index_bufs = [b for b in scenario.src.layout.buffers if b.kind == "index_k" and b.dtype in INDEX_DTYPES]
    if not index_bufs:
        return {}
    queries = np.random.default_rng(seed).standard_normal((JACCARD_QUERIES, 128)).astype(np.float32)
    return indexer_topk_jaccard(scenario.src, scenario.dst, scenario.pages, queries, k,
                                INDEX_DTYPES[index_bufs[0].dtype], buffers=[b.name for b in index_bufs])


def _warn_outside(scenario: Scenario, faults: list[FaultSpec]) -> None:
    for f in faults:
        if f.kind is FaultKind.FLIP and f.pages is not None and f.buffer in scenario.dst.layout.pool_of:
            meant = set(scenario.pages.get(scenario.dst.layout.pool_of[f.buffer], ((), ()))[1].tolist())
            outside = sorted(set(f.pages) - meant)
            if outside:
                print(f"kvferry diff: note: {f} flips pages {outside} outside the request "
                      f"(its destination pages: {sorted(meant)}); the diff will not see them", file=sys.stderr)


def _print(report: DiffReport, verdict: dict[str, Any], mismatches: list[PageMismatch],
           jaccard: dict[str, float], posted: TransferPlan | None) -> None:

    from kvferry.diagnostics.render import (
        diff_headline,
        diff_summary_table,
        diff_table,
        jaccard_table,
        mismatch_table,
        plan_table,
    )

    console = make_console()
    if posted is not None:
        console.print(plan_table(plan_dump(posted)))
    if report.diffs:
        console.print(diff_summary_table(report))
        console.print(diff_table(report))
    console.print(f"diff: {diff_headline(report)}")
    if mismatches:
        console.print(mismatch_table(mismatches))
    state = "[green]ok[/]" if verdict["ok"] else f"[red]FAILED[/]: {verdict['error']}"
    console.print(f"digests ({verdict['mode']}, {verdict['checked']} pages): {state}")
    if jaccard:
        console.print(jaccard_table(jaccard))
