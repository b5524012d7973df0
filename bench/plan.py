"""Planner benchmark: a DeepSeek-V3.2-sized request, kvferry against two baselines measured in the same run.

Layout: 61 layers x 3 buffers of different page sizes in one pool of 64-token pages (MLA latent fp8 at
656 B/token, indexer keys fp8+scale at 132 B/token, and a bf16 indexer-key shadow at 256 B/token, as in the
token-salad case), capacities of 20,000 pages per side. Request: 512 pages, source and destination pages
drawn independently on each side as random runs of mean length 4.

Baselines (both written as engines commonly do, numpy inside, a Python loop over buffers):
  per-page    one descriptor per (buffer, page)
  runs+loop   coalesce joint runs once, then loop over buffers to emit rows
kvferry is timed four times: ``plan_transfer`` (validated, compact plan); plan + materialised N x 3 arrays
(``src_descs``/``dst_descs``, fresh arrays cached on the plan); plan + the region check + the rows written
into a reused buffer (``NixlTransport(descriptors="dlist")``); and plan + what ``NixlTransport.write`` does
before NIXL by default (``descriptors="auto"``: for runs of <= 4 pages on average, runs and pages checked
against the capacities and int32 page indices into NIXL's prepared lists; else the rows).

The measuring code lives in ``kvferry.benchmark.suite`` (``plan_case``), which ``kvferry bench`` also runs for a
sweep of request sizes; this script times one size in depth.

    .venv/bin/python bench/plan.py [--repeat 300] [--pages 512] [--mean-run 4] [--json out.json]
"""

from __future__ import annotations

import argparse
import json

from rich.console import Console
from rich.table import Table

from kvferry.benchmark.suite import plan_case


def run(repeat: int = 300, pages: int = 512, capacity: int = 20_000, mean_run: float = 4.0,
        seed: int = 0) -> dict:
    """Figures of one request of ``pages`` pages (median us of ``repeat`` runs each), with speedups."""
    r = plan_case(pages, capacity=capacity, mean_run=mean_run, seed=seed, max_repeats=repeat, min_repeats=repeat)
    r["speedup_vs_runs_loop"] = r["runs_loop_us"] / r["kvferry_plan_us"]
    r["speedup_vs_per_page"] = r["per_page_us"] / r["kvferry_plan_us"]
    r["expand_speedup_vs_runs_loop"] = r["runs_loop_us"] / r["kvferry_plan_expand_us"]
    r["post_speedup_vs_runs_loop"] = r["runs_loop_us"] / r["kvferry_plan_post_us"]
    return r


def render(r: dict, console: Console) -> None:
    t = Table(title=f"Planning one request: {r['pages']} pages x {r['buffers']} buffers "
                    f"({r['nbytes'] / 2**30:.2f} GiB), {r['joint_runs']} joint runs")
    for col in ("planner", "median us", "rows per side", "kvferry plan speedup"):
        t.add_column(col, justify="right" if col != "planner" else "left")
    t.add_row("per-page baseline", f"{r['per_page_us']:.0f}", f"{r['per_page_rows']:,}",
              f"{r['speedup_vs_per_page']:.1f}x")
    t.add_row("runs + loop over buffers", f"{r['runs_loop_us']:.0f}", f"{r['kvferry_rows']:,}",
              f"{r['speedup_vs_runs_loop']:.1f}x")
    t.add_row("kvferry plan_transfer", f"{r['kvferry_plan_us']:.0f}", f"{r['kvferry_rows']:,}", "1.0x")
    t.add_row("kvferry plan + N x 3 arrays", f"{r['kvferry_plan_expand_us']:.0f}", f"{r['kvferry_rows']:,}",
              f"{r['kvferry_plan_us'] / r['kvferry_plan_expand_us']:.2f}x")
    t.add_row("kvferry plan + check + rows (dlist)", f"{r['kvferry_plan_rows_us']:.0f}", f"{r['kvferry_rows']:,}",
              f"{r['kvferry_plan_us'] / r['kvferry_plan_rows_us']:.2f}x")
    t.add_row(f"kvferry plan + what NixlTransport posts ({r['kvferry_posts']}, auto)",
              f"{r['kvferry_plan_post_us']:.0f}",
              f"{r['kvferry_selectors']:,} indices" if r["kvferry_posts"] == "page indices"
              else f"{r['kvferry_rows']:,}",
              f"{r['kvferry_plan_us'] / r['kvferry_plan_post_us']:.2f}x")
    console.print(t)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--repeat", type=int, default=300)
    ap.add_argument("--pages", type=int, default=512)
    ap.add_argument("--mean-run", type=float, default=4.0)
    ap.add_argument("--json", help="also write the figures to this file")
    args = ap.parse_args(argv)
    r = run(repeat=args.repeat, pages=args.pages, mean_run=args.mean_run)
    render(r, Console())
    if args.json:
        with open(args.json, "w") as f:
            json.dump(r, f, indent=2)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
