"""Planner benchmark: a DeepSeek-V3.2-sized request, kvferry against two baselines measured in the same run.

Layout: 61 layers x 3 buffers of different page sizes in one pool of 64-token pages (MLA latent fp8 at
656 B/token, indexer keys fp8+scale at 132 B/token, and a bf16 indexer-key shadow at 256 B/token, as in the
token-salad case), capacities of 20,000 pages per side. Request: 512 pages, source and destination pages
drawn independently on each side as random runs of mean length 4.

Baselines (both written as engines commonly do, numpy inside, a Python loop over buffers):
  per-page    one descriptor per (buffer, page)
  runs+loop   coalesce joint runs once, then loop over buffers to emit rows
kvferry is timed twice: ``plan_transfer`` (validated, compact plan) and plan + materialised N x 3 arrays.

    .venv/bin/python bench/plan.py [--repeat 300] [--json out.json]
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from collections.abc import Callable

import numpy as np
from rich.console import Console
from rich.table import Table

from kvferry import Buffer, KVMemory, Layout, Pool, Region, plan_transfer

LAYERS = 61
TOKENS_PER_PAGE = 64
BYTES_PER_TOKEN = {"mla": 656, "idx": 132, "idx_bf16": 256}


def layout(num_pages: int) -> Layout:
    bufs = [Buffer(f"L{layer}.{role}", TOKENS_PER_PAGE * bpt, num_pages, "fp8", role, layer)
            for layer in range(LAYERS) for role, bpt in BYTES_PER_TOKEN.items()]
    return Layout([Pool("kv", bufs, TOKENS_PER_PAGE)])


def synthetic_memory(lay: Layout, base: int) -> KVMemory:
    """Addresses only: planning never touches the bytes, and 80 GB of RAM is not needed to plan them."""
    regions, addr = [], base
    for b in lay.buffers:
        regions.append(Region(b.name, addr, b.nbytes))
        addr += b.nbytes + 4096
    return KVMemory(lay, regions, remote=True)


def random_runs(rng: np.random.Generator, n: int, capacity: int, mean_run: float) -> np.ndarray:
    """n unique pages as runs of geometric length (mean ``mean_run``) at random places."""
    used = np.zeros(capacity, dtype=bool)
    out: list[int] = []
    while len(out) < n:
        length = min(int(rng.geometric(1 / mean_run)), n - len(out))
        start = int(rng.integers(0, capacity - length))
        if used[start:start + length].any():
            continue
        used[start:start + length] = True
        out.extend(range(start, start + length))
    return np.array(out, dtype=np.int64)


def per_page(src: KVMemory, dst: KVMemory, s: np.ndarray, d: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    rows_s, rows_d = [], []
    for buf, rs, rd in zip(src.layout.buffers, src.regions, dst.regions):
        n = len(s)
        a = np.empty((n, 3), np.uint64)
        a[:, 0] = rs.address + s.astype(np.uint64) * buf.page_bytes
        a[:, 1] = buf.page_bytes
        a[:, 2] = 0
        b = a.copy()
        b[:, 0] = rd.address + d.astype(np.uint64) * buf.page_bytes
        rows_s.append(a)
        rows_d.append(b)
    return np.concatenate(rows_s), np.concatenate(rows_d)


def runs_then_loop(src: KVMemory, dst: KVMemory, s: np.ndarray, d: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    brk = np.ones(len(s), dtype=bool)
    brk[1:] = (s[1:] != s[:-1] + 1) | (d[1:] != d[:-1] + 1)
    starts = np.flatnonzero(brk)
    lens = np.diff(np.append(starts, len(s))).astype(np.uint64)
    rs0, rd0 = s[starts].astype(np.uint64), d[starts].astype(np.uint64)
    rows_s, rows_d = [], []
    for buf, rs, rd in zip(src.layout.buffers, src.regions, dst.regions):
        a = np.empty((len(starts), 3), np.uint64)
        a[:, 0] = rs.address + rs0 * buf.page_bytes
        a[:, 1] = lens * buf.page_bytes
        a[:, 2] = 0
        b = a.copy()
        b[:, 0] = rd.address + rd0 * buf.page_bytes
        rows_s.append(a)
        rows_d.append(b)
    return np.concatenate(rows_s), np.concatenate(rows_d)


def median_us(fn: Callable[[], object], repeat: int) -> float:
    for _ in range(min(20, repeat)):
        fn()
    samples = []
    for _ in range(repeat):
        t0 = time.perf_counter()
        fn()
        samples.append(time.perf_counter() - t0)
    return statistics.median(samples) * 1e6


def run(repeat: int = 300, pages: int = 512, capacity: int = 20_000, mean_run: float = 4.0,
        seed: int = 0) -> dict:
    lay = layout(capacity)
    src, dst = synthetic_memory(lay, 1 << 40), synthetic_memory(lay, 1 << 44)
    rng = np.random.default_rng(seed)
    s, d = random_runs(rng, pages, capacity, mean_run), random_runs(rng, pages, capacity, mean_run)
    req = {"kv": (s, d)}
    plan = plan_transfer(src, dst, req)
    # Same rows, same order: the baselines and kvferry must agree before their speeds are compared.
    base_s, base_d = runs_then_loop(src, dst, s, d)
    assert np.array_equal(base_s, plan.src_descs) and np.array_equal(base_d, plan.dst_descs)

    def kv_full() -> None:
        p = plan_transfer(src, dst, req)
        p.src_descs, p.dst_descs  # noqa: B018 - materialise both sides

    results = {
        "per_page_us": median_us(lambda: per_page(src, dst, s, d), repeat),
        "runs_loop_us": median_us(lambda: runs_then_loop(src, dst, s, d), repeat),
        "kvferry_plan_us": median_us(lambda: plan_transfer(src, dst, req), repeat),
        "kvferry_plan_expand_us": median_us(kv_full, repeat),
        "per_page_rows": pages * len(lay.buffers),
        "kvferry_rows": plan.num_descriptors,
        "joint_runs": plan.num_descriptors // len(lay.buffers),
        "buffers": len(lay.buffers),
        "pages": pages,
        "nbytes": plan.nbytes,
    }
    results["speedup_vs_runs_loop"] = results["runs_loop_us"] / results["kvferry_plan_us"]
    results["speedup_vs_per_page"] = results["per_page_us"] / results["kvferry_plan_us"]
    results["expand_speedup_vs_runs_loop"] = results["runs_loop_us"] / results["kvferry_plan_expand_us"]
    return results


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
    console.print(t)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--repeat", type=int, default=300)
    ap.add_argument("--mean-run", type=float, default=4.0)
    ap.add_argument("--json", help="also write the figures to this file")
    args = ap.parse_args(argv)
    r = run(repeat=args.repeat, mean_run=args.mean_run)
    render(r, Console())
    if args.json:
        with open(args.json, "w") as f:
            json.dump(r, f, indent=2)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
