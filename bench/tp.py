"""Cross-TP planning and transfer benchmark (not a test): ``.venv/bin/python bench/tp.py [--quick]``.

Part 1, planning (no memory touched; addresses are synthetic): for TP 8 -> 2 and 2 -> 8 on a Llama 3.1 8B
request and a DeepSeek V3.2 request, head-major vs token-major pages, scattered vs contiguous pages:
descriptors over all decode ranks and planning time (planner setup once per rank pair, then ``plan``),
against a one-descriptor-per-token-per-head baseline planned in numpy in the same run.

Part 2, bandwidth over a veth pair between two network namespaces (root only; skipped otherwise): the
Llama-like layout of ``tests/netns_peer.py`` moved by kvferry's TP plans over ``NixlTransport`` with UCX
on TCP, against raw NIXL (one descriptor per whole region, TP 1) over the same pair.

Prints Markdown tables; ``--json PATH`` also writes the raw figures.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from tests.netns_peer import NetnsUnavailable, make_veth_pair, run_pair

from kvferry import Buffer, KVMemory, Layout, Pool
from kvferry.benchmark.suite import synthetic_memory
from kvferry.layout import HeadGeometry
from kvferry.plan import TPPlanner, shard_layout, source_ranks

# Llama 3.1 8B config.json: 32 layers, num_key_value_heads 8, head_dim 128, bf16; 16-token pages (vLLM).
# DeepSeek V3.2: 61 layers, MLA latent 656 B/token (fp8_ds_mla), indexer keys 132 B/token (fp8 + scale),
# 64-token pages (FlashMLA); both replicated on every TP rank.
MODELS = {
    "llama3.1-8b": dict(layers=32, tokens=16),
    "deepseek-v3.2": dict(layers=61, tokens=64),
}


def full_layout(model: str, num_pages: int, major: str) -> Layout:
    if model == "llama3.1-8b":
        geo = HeadGeometry(8, 128 * 2, 16, major)
        bufs = [Buffer(f"L{i}.{r}", geo.page_bytes, num_pages, "bf16", r, i, geo)
                for i in range(32) for r in ("k", "v")]
        return Layout([Pool("kv", bufs, 16)])
    kv, idx = HeadGeometry(1, 656, 64, major, True), HeadGeometry(1, 132, 64, major, True)
    bufs = [Buffer(f"L{i}.kv", kv.page_bytes, num_pages, "fp8_ds_mla", "kv", i, kv) for i in range(61)]
    bufs += [Buffer(f"L{i}.idx", idx.page_bytes, num_pages, "fp8_e4m3", "index_k", i, idx) for i in range(61)]
    return Layout([Pool("kv", bufs, 64)])


def median_time(fn: Any, reps: int) -> tuple[float, Any]:
    times, out = [], None
    for _ in range(reps):
        t0 = time.perf_counter()
        out = fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times), out


def baseline_rows(src: KVMemory, dst: KVMemory, s: np.ndarray, d: np.ndarray) -> int:
    """One descriptor per (buffer, page, token, head) for the heads the pair shares, built in numpy."""
    total = 0
    for sb, db, sr, dr in zip(src.layout.buffers, dst.layout.buffers, src.regions, dst.regions):
        sh, dh = sb.heads, db.heads
        if sh.replicated:
            if src.layout.tp_rank != source_ranks(dst.layout.tp_rank, src.layout.tp_size,
                                                  dst.layout.tp_size)[0]:
                continue
            lo, hi, hs, hd = 0, sh.num_heads, 0, 0
        else:
            lo = max(src.layout.tp_rank * sh.num_heads, dst.layout.tp_rank * dh.num_heads)
            hi = min((src.layout.tp_rank + 1) * sh.num_heads, (dst.layout.tp_rank + 1) * dh.num_heads)
            if lo >= hi:
                continue
            hs, hd = lo - src.layout.tp_rank * sh.num_heads, lo - dst.layout.tp_rank * dh.num_heads
        t = np.arange(sh.tokens_per_page, dtype=np.uint64)
        h = np.arange(hi - lo, dtype=np.uint64)
        hb = np.uint64(sh.head_bytes)
        # token-major offsets (the layout the naive path assumes); head-major would only permute them
        s_off = (np.uint64(sr.address) + s.astype(np.uint64)[:, None, None] * np.uint64(sb.page_bytes)
                 + t[None, :, None] * np.uint64(sh.num_heads) * hb + (h + np.uint64(hs))[None, None, :] * hb)
        d_off = (np.uint64(dr.address) + d.astype(np.uint64)[:, None, None] * np.uint64(db.page_bytes)
                 + t[None, :, None] * np.uint64(dh.num_heads) * hb + (h + np.uint64(hd))[None, None, :] * hb)
        rows = np.stack([s_off.ravel(), np.full(s_off.size, hb), d_off.ravel()], axis=1)
        total += len(rows)
    return total


def plan_case(model: str, ptp: int, dtp: int, major: str, num_tokens: int, scattered: bool,
              reps: int) -> dict[str, Any]:
    tokens = MODELS[model]["tokens"]
    n = -(-num_tokens // tokens)
    capacity = 4 * n
    full = full_layout(model, capacity, major)
    rng = np.random.default_rng(0)
    s = rng.permutation(capacity)[:n] if scattered else np.arange(n)
    d = np.sort(rng.choice(capacity, n, replace=False)) if scattered else np.arange(n) + 7
    pages = {"kv": (s, d)}
    srcs = [synthetic_memory(shard_layout(full, ptp, r), 1 << 40) for r in range(ptp)]
    dsts = [synthetic_memory(shard_layout(full, dtp, k), 1 << 44) for k in range(dtp)]
    pairs = [(srcs[r], dsts[k]) for k in range(dtp) for r in source_ranks(k, ptp, dtp)]
    t_setup, planners = median_time(lambda: [TPPlanner(a, b) for a, b in pairs], reps)
    t_plan, plans = median_time(lambda: [p.plan(pages) for p in planners], reps)
    t_base, base = median_time(lambda: sum(baseline_rows(a, b, s, d) for a, b in pairs), reps)
    rows = sum(p.num_descriptors for p in plans)
    nbytes = sum(p.nbytes for p in plans)
    return {"model": model, "tp": f"{ptp}->{dtp}", "major": major, "pages": "scattered" if scattered else
            "contiguous", "tokens": n * tokens, "MiB": nbytes / 2**20, "descriptors": rows,
            "bytes/desc": nbytes / max(rows, 1), "baseline_descriptors": base,
            "setup_ms": t_setup * 1e3, "plan_ms": t_plan * 1e3, "baseline_ms": t_base * 1e3}


def planning(args: argparse.Namespace) -> list[dict[str, Any]]:
    out = []
    for model in MODELS:
        for ptp, dtp in ((8, 2), (2, 8)):
            for major in ("head", "token"):
                for scattered in (True, False):
                    out.append(plan_case(model, ptp, dtp, major, args.tokens, scattered, args.reps))
    return out


def bandwidth(args: argparse.Namespace) -> list[dict[str, Any]]:
    common = ["--layers", str(args.bw_layers), "--pages", str(args.bw_pages), "--reps", str(args.bw_reps),
              "--timeout", "120"]
    cases = [["--mode", "raw", "--ptp", "1", "--dtp", "1"],
             ["--ptp", "4", "--dtp", "2", "--major", "head"], ["--ptp", "2", "--dtp", "4", "--major", "head"],
             ["--ptp", "4", "--dtp", "2", "--major", "token"]]
    out = []
    try:
        with make_veth_pair(f"b{os.getpid() % 10000}") as (pre, dec):
            for i, case in enumerate(cases):
                res = run_pair([*common, *case], pre.prefix(), dec.prefix(), f"tcp://{dec.ip}:{5600 + i}", 600)
                secs = res["seconds"][1:] or res["seconds"]  # the first rep includes connection set-up
                t = statistics.median(secs)
                out.append({"case": " ".join(case), "ok": res["ok"], "MiB": res["bytes"] / 2**20,
                            "descriptors": res["descriptors"], "median_s": t, "GB/s": res["bytes"] / t / 1e9})
    except NetnsUnavailable as exc:
        print(f"bandwidth skipped: {exc}", file=sys.stderr)
    return out


def table(rows: list[dict[str, Any]]) -> str:
    if not rows:
        return "(none)\n"
    keys = list(rows[0])
    fmt = [lambda v: f"{v:.3g}" if isinstance(v, float) else str(v)] * len(keys)
    lines = ["| " + " | ".join(keys) + " |", "|" + "---|" * len(keys)]
    lines += ["| " + " | ".join(f(r[k]) for f, k in zip(fmt, keys)) + " |" for r in rows]
    return "\n".join(lines) + "\n"


def main() -> int:
    ap = argparse.ArgumentParser(description="kvferry cross-TP benchmark")
    ap.add_argument("--tokens", type=int, default=8192, help="request length in tokens")
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--bw-layers", type=int, default=8)
    ap.add_argument("--bw-pages", type=int, default=192)
    ap.add_argument("--bw-reps", type=int, default=5)
    ap.add_argument("--no-bandwidth", action="store_true")
    ap.add_argument("--quick", action="store_true", help="small sizes, for a smoke run")
    ap.add_argument("--json", type=Path)
    args = ap.parse_args()
    if args.quick:
        args.tokens, args.reps, args.bw_layers, args.bw_pages, args.bw_reps = 1024, 2, 2, 24, 2
    print(f"host: {platform.node()} {os.cpu_count()} cpus, python {platform.python_version()}, "
          f"numpy {np.__version__}\n")
    plan_rows = planning(args)
    print(f"## Planning ({args.tokens}-token request, all decode ranks)\n\n{table(plan_rows)}")
    bw_rows = [] if args.no_bandwidth else bandwidth(args)
    print(f"## Bandwidth over a veth pair (UCX_TLS=tcp)\n\n{table(bw_rows)}")
    if args.json:
        args.json.write_text(json.dumps({"planning": plan_rows, "bandwidth": bw_rows}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
