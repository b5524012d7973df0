"""Digest cost benchmark: sampled and full page digests as a fraction of the transfer they prove.

Request: DeepSeek-V3.2-sized, as in bench/plan.py: 61 layers x 3 buffers of 64-token pages (MLA latent fp8
at 656 B/token, indexer keys fp8 + scale at 132 B/token, bf16 indexer keys at 256 B/token), 512 pages
(2.09 GB), source and destination pages drawn independently as random runs of mean length 4. The pools are
scaled down from a real engine's to ``--pool-pages`` per side so both sides fit in RAM (768 pages: 3.1 GB
per side); pages are still scattered, and the request is far larger than the last-level cache.

Transfer baselines, measured in the same run on the same bytes:
  memcpy      one contiguous copy per buffer of the same number of bytes (the best a copy can do)
  local       ``LocalTransport.write`` of the plan (one memmove per coalesced row)
Digest variants (full mode; the first is what ``kvferry.integrity.digests`` ships):
  rows        a Python loop of xxh3_64 over numpy row views, page by page
  runs        ``map(xxh3, arr[start:stop])`` per coalesced run (fewer index operations)
  gather      gather the pages into one block (a copy), then hash its rows
  threads2    the rows variant split over 2 threads by buffer
Also timed: ``local+full_overlapped``, the local write with the full digest computed in a second thread
while it runs (prefill may digest while its write is in flight: digests only read source pages).

Pipelined (``--chunks K``, full mode): the request split into K chunks of pages, each its own write, as the
control plane sends chunked prefill. The writer is NIXL (two agents in this process, UCX cma: the copy runs
inside ``transfer()`` with the GIL released, as between two processes) or ``LocalTransport`` when NIXL is
missing. Timed, all with the same K writes:
  pipe_write        the K writes alone (the baseline the added time is measured against)
  pipe_serial       digest, write, verify per chunk in series (what a digest costs without overlap)
  pipe_prefill      the caller hashes chunk i+1 while a writer thread writes chunk i (PrefillEndpoint.send)
  pipe_decode       chunk i is verified while chunk i+1 is written (decode verifies per chunk notification)
  pipe_both         both at once: hashing, writing and verifying threads (in one process they share a GIL,
                    unlike real prefill and decode processes)

    .venv/bin/python bench/integrity.py [--pool-pages 768] [--repeat 3] [--chunks 8] [--json out.json]
"""

from __future__ import annotations

import argparse
import itertools
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


# -- pipelined chunks (full mode) ----------------------------------------------------------------------------
def nixl_writer(src: KVMemory, dst: KVMemory) -> tuple[Callable[[TransferPlan], None], list] | None:
    """A blocking write through two in-process NIXL agents, or None when NIXL is unavailable."""
    try:
        from kvferry.transport.nixl import NixlTransport

        a, b = NixlTransport(), NixlTransport()
        meta_a, meta_b = a.register(src), b.register(dst)
    except Exception:  # no nixl wheel: fall back to LocalTransport
        return None
    peer = a.add_peer(meta_b)
    b.add_peer(meta_a)

    def write(plan: TransferPlan) -> None:
        handle = a.write(plan, peer, b"c")
        while not handle.poll():
            b.get_notifications()   # the receiving agent must drive progress (NIXL-NOTES)
        handle.release()
        b.get_notifications()
    return write, [a, b]


def pipe_write(chunks: list[TransferPlan], write: Callable[[TransferPlan], None]) -> None:
    for c in chunks:
        write(c)


def pipe_serial(chunks: list[TransferPlan], write: Callable[[TransferPlan], None], dst: KVMemory) -> None:
    for c in chunks:
        d = digest_plan(c, "full")
        write(c)
        verify_digests(dst, d)


def pipe_prefill(chunks: list[TransferPlan], write: Callable[[TransferPlan], None],
                 writer: ThreadPoolExecutor) -> None:
    """Hash on this thread, write on the writer thread: hashing chunk i+1 overlaps writing chunk i."""
    posted = []
    for c in chunks:
        digest_plan(c, "full")                  # the notification of chunk i carries its digests
        posted.append(writer.submit(write, c))
    for f in posted:
        f.result()


def pipe_decode(chunks: list[TransferPlan], digests: list, write: Callable[[TransferPlan], None],
                writer: ThreadPoolExecutor, dst: KVMemory) -> None:
    """Writes land one after another on the writer thread; each chunk is verified as soon as it landed."""
    landed = [writer.submit(write, c) for c in chunks]
    for f, d in zip(landed, digests):
        f.result()
        verify_digests(dst, d)


def pipe_both(chunks: list[TransferPlan], write: Callable[[TransferPlan], None], writer: ThreadPoolExecutor,
              verifier: ThreadPoolExecutor, dst: KVMemory) -> None:
    def write_then_verify(c: TransferPlan, d: object) -> object:
        write(c)
        return verifier.submit(verify_digests, dst, d)
    posted = [writer.submit(write_then_verify, c, digest_plan(c, "full")) for c in chunks]
    for f in posted:
        f.result().result()


def pipeline(src: KVMemory, dst: KVMemory, s: np.ndarray, d: np.ndarray, num_chunks: int,
             repeat: int, fallback: Callable[[TransferPlan], None]) -> dict:
    bounds = np.linspace(0, len(s), num_chunks + 1).astype(int)
    chunks = [plan_transfer(src, dst, {"kv": (s[a:b], d[a:b])}) for a, b in itertools.pairwise(bounds.tolist())]
    made = nixl_writer(src, dst)
    write, owned = made if made is not None else (fallback, [])
    t: dict[str, float] = {}
    with ThreadPoolExecutor(1) as writer, ThreadPoolExecutor(1) as verifier:
        pipe_write(chunks, write)
        digests = [digest_plan(c, "full") for c in chunks]
        runs = {"pipe_write": lambda: pipe_write(chunks, write),
                "pipe_serial": lambda: pipe_serial(chunks, write, dst),
                "pipe_prefill": lambda: pipe_prefill(chunks, write, writer),
                "pipe_decode": lambda: pipe_decode(chunks, digests, write, writer, dst),
                "pipe_both": lambda: pipe_both(chunks, write, writer, verifier, dst)}
        samples: dict[str, list[float]] = {k: [] for k in runs}
        for _ in range(repeat):   # interleaved: load from other jobs hits every variant alike
            for name, fn in runs.items():
                t0 = time.perf_counter()
                fn()
                samples[name].append(time.perf_counter() - t0)
        t = {k: statistics.median(v) for k, v in samples.items()}
    for transport in owned:
        transport.close()
    return {"writer": "nixl" if made is not None else "local", "chunks": num_chunks, "seconds": t}


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
def run(pool_pages: int = 768, pages: int = 512, repeat: int = 3, seed: int = 0, chunks: int = 8) -> dict:
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
    pipe = pipeline(src, dst, s, d, chunks, repeat, lambda c: local_write(c, prefill, peer))
    prefill.close()
    decode.close()
    return {"bytes": plan.nbytes, "rows": plan.num_descriptors, "pages": pages, "pool_pages": pool_pages,
            "digests_full": len(full), "digests_sampled": len(digest_plan(plan, "sampled")),
            "seconds": t, "pipeline": pipe}


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


def report_pipeline(res: dict) -> Table:
    pipe, nbytes = res["pipeline"], res["bytes"]
    t, base = pipe["seconds"], pipe["seconds"]["pipe_write"]
    table = Table(title=f"Full digests overlapped with {pipe['chunks']} chunked {pipe['writer']} writes: "
                        "wall time added to the writes alone")
    for col in ("what", "seconds", "GB/s", "added s", "added % of writes"):
        table.add_column(col, justify="left" if col == "what" else "right")
    for name, sec in t.items():
        table.add_row(name, f"{sec:.4f}", f"{nbytes / sec / 1e9:.2f}", f"{sec - base:+.4f}",
                      f"{100 * (sec - base) / base:+.1f}")
    return table


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--pool-pages", type=int, default=768)
    ap.add_argument("--pages", type=int, default=512)
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--chunks", type=int, default=8, help="chunks of the pipelined runs")
    ap.add_argument("--json", metavar="PATH")
    args = ap.parse_args()
    res = run(args.pool_pages, args.pages, args.repeat, chunks=args.chunks)
    Console().print(report(res))
    Console().print(report_pipeline(res))
    if args.json:
        with open(args.json, "w") as fh:
            json.dump(res, fh, indent=2)


if __name__ == "__main__":
    main()
