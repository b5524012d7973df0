"""Digest cost benchmark: sampled and full page digests as a fraction of the transfer they prove.

Request: DeepSeek-V3.2-sized, as in bench/plan.py: 61 layers x 3 buffers of 64-token pages (MLA latent fp8
at 656 B/token, indexer keys fp8 + scale at 132 B/token, bf16 indexer keys at 256 B/token), 512 pages
(2.09 GB), source and destination pages drawn independently as random runs of mean length 4. The pools are
scaled down from a real engine's to ``--pool-pages`` per side so both sides fit in RAM (768 pages: 3.1 GB
per side); pages are still scattered, and the request is far larger than the last-level cache.

Transfer baselines, measured in the same run on the same bytes:
  memcpy      one contiguous copy per buffer of the same number of bytes (the best a copy can do)
  local       ``LocalTransport.write`` of the plan (one memmove per coalesced row)
Digest variants (full mode; the first is what ``kvferry.integrity`` ships):
  rows        a Python loop of xxh3_64 over numpy row views, page by page
  runs        ``map(xxh3, arr[start:stop])`` per coalesced run (fewer index operations)
  gather      gather the pages into one block (a copy), then hash its rows
  threads2    the rows variant split over 2 threads by buffer
Also timed: ``local+full_overlapped``, the local write with the full digest computed in a second thread
while it runs (prefill may digest while its write is in flight: digests only read source pages).

    .venv/bin/python bench/integrity.py [--pool-pages 768] [--repeat 3] [--json out.json]
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import xxhash
from rich.console import Console
from rich.table import Table

from kvferry import Buffer, KVMemory, Layout, Pool, TransferPlan, plan_transfer
from kvferry.integrity import digest_plan, verify_digests
from kvferry.transport import LocalTransport

LAYERS = 61
TOKENS_PER_PAGE = 64
BYTES_PER_TOKEN = {"mla": 656, "idx": 132, "idx_bf16": 256}


def layout(num_pages: int) -> Layout:
    bufs = [Buffer(f"L{layer}.{role}", TOKENS_PER_PAGE * bpt, num_pages, "fp8", role, layer)
            for layer in range(LAYERS) for role, bpt in BYTES_PER_TOKEN.items()]
    return Layout([Pool("kv", bufs, TOKENS_PER_PAGE)])


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


def median_s(fn: Callable[[int], object], repeat: int) -> float:
    fn(-1)  # warm-up: page faults, imports
    samples = []
    for i in range(repeat):
        t0 = time.perf_counter()
        fn(i)
        samples.append(time.perf_counter() - t0)
    return statistics.median(samples)


# -- transfers ---------------------------------------------------------------------------------------------
def memcpy_same_bytes(src: KVMemory, dst: KVMemory, num_pages: int) -> None:
    for buf in src.layout.buffers:
        np.copyto(dst.array(buf.name)[:num_pages], src.array(buf.name)[:num_pages])


def local_write(plan: TransferPlan, prefill: LocalTransport, peer: str) -> None:
    with prefill.write(plan, peer, b"done") as handle:
        handle.wait(60.0)


def write_with_full_digest(plan: TransferPlan, prefill: LocalTransport, peer: str,
                           pool: ThreadPoolExecutor) -> None:
    """Post the write and digest the source pages meanwhile, as prefill can (digests only read the source;
    ctypes.memmove releases the GIL, xxhash on pages under 64 KiB does not)."""
    pending = pool.submit(digest_plan, plan, "full")
    local_write(plan, prefill, peer)
    pending.result()


# -- digest variants (full mode) ---------------------------------------------------------------------------
def _pairs(plan: TransferPlan) -> list[tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]]:
    pp = plan.pools[0]
    names = plan.src_memory.layout.buffers
    return [(plan.src_memory.array(names[g].name), pp.src_pages, pp.run_src, pp.run_len)
            for g in pp.buffer_ids.tolist()]


def variant_rows(work: list) -> list[int]:
    f = xxhash.xxh3_64_intdigest
    return [f(arr[p]) for arr, pages, _, _ in work for p in pages.tolist()]


def variant_runs(work: list) -> list[int]:
    f = xxhash.xxh3_64_intdigest
    out: list[int] = []
    for arr, _, starts, lens in work:
        for s, n in zip(starts.tolist(), lens.tolist()):
            out.extend(map(f, arr[s:s + n]))
    return out


def variant_gather(work: list) -> list[int]:
    f = xxhash.xxh3_64_intdigest
    return [h for arr, pages, _, _ in work for h in map(f, arr[pages])]


def variant_threads2(work: list, pool: ThreadPoolExecutor) -> list[int]:
    halves = [work[:len(work) // 2], work[len(work) // 2:]]
    return [h for part in pool.map(variant_rows, halves) for h in part]


# -- run ---------------------------------------------------------------------------------------------------
def run(pool_pages: int = 768, pages: int = 512, repeat: int = 3, seed: int = 0) -> dict:
    lay = layout(pool_pages)
    src, dst = KVMemory.allocate(lay), KVMemory.allocate(lay)
    rng = np.random.default_rng(seed)
    for buf in lay.buffers:
        arr = src.array(buf.name)
        arr[...] = np.frombuffer(rng.bytes(arr.size), dtype=np.uint8).reshape(arr.shape)
    s, d = random_runs(rng, pages, pool_pages, 4.0), random_runs(rng, pages, pool_pages, 4.0)
    plan = plan_transfer(src, dst, {"kv": (s, d)})
    prefill, decode = LocalTransport(), LocalTransport()
    prefill.register(src)
    peer = prefill.add_peer(decode.register(dst))

    t = {"memcpy": median_s(lambda _: memcpy_same_bytes(src, dst, pages), repeat),
         "local": median_s(lambda _: local_write(plan, prefill, peer), repeat)}
    # The local write ran last: decode now holds the request, so verify checks real bytes.
    full = digest_plan(plan, "full")
    verify_digests(dst, full)
    t["sampled"] = median_s(lambda i: digest_plan(plan, "sampled", seed=i), max(repeat, 20))
    t["full"] = median_s(lambda _: digest_plan(plan, "full"), repeat)
    t["verify_full"] = median_s(lambda _: verify_digests(dst, full), repeat)
    work = _pairs(plan)
    reference = full.digests.tolist()
    with ThreadPoolExecutor(2) as threads:
        t["local+full_overlapped"] = median_s(lambda _: write_with_full_digest(plan, prefill, peer, threads),
                                              repeat)
        variants = {"rows": variant_rows, "runs": variant_runs, "gather": variant_gather,
                    "threads2": lambda w: variant_threads2(w, threads)}
        for name, fn in variants.items():
            assert fn(work) == reference, name  # every variant hashes the same pages in the same order
            t[f"variant_{name}"] = median_s(lambda _, fn=fn: fn(work), repeat)
    prefill.close()
    decode.close()
    return {"bytes": plan.nbytes, "rows": plan.num_descriptors, "pages": pages, "pool_pages": pool_pages,
            "digests_full": len(full), "digests_sampled": len(digest_plan(plan, "sampled")),
            "seconds": t}


def report(res: dict) -> Table:
    t, nbytes = res["seconds"], res["bytes"]
    table = Table(title=f"Digest cost, {res['pages']} pages x {LAYERS * 3} buffers = {nbytes / 1e9:.2f} GB "
                        f"({res['rows']} rows), pool {res['pool_pages']} pages/side")
    for col in ("what", "seconds", "GB/s", "% of memcpy", "% of local write"):
        table.add_column(col, justify="left" if col == "what" else "right")
    for name, sec in t.items():
        table.add_row(name, f"{sec:.4f}", f"{nbytes / sec / 1e9:.2f}" if name != "sampled" else "-",
                      f"{100 * sec / t['memcpy']:.2f}", f"{100 * sec / t['local']:.2f}")
    return table


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--pool-pages", type=int, default=768)
    ap.add_argument("--pages", type=int, default=512)
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--json", metavar="PATH")
    args = ap.parse_args()
    res = run(args.pool_pages, args.pages, args.repeat)
    Console().print(report(res))
    if args.json:
        with open(args.json, "w") as fh:
            json.dump(res, fh, indent=2)


if __name__ == "__main__":
    main()
