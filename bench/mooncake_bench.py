"""Mooncake benchmark: kvferry over Mooncake's Transfer Engine against raw Mooncake posting the same rows, and
against kvferry over NIXL, between two processes, in one run.

Decode runs in spawned processes (``tests/nixl_peer.py``: one over Mooncake, one over NIXL), each driving its
transport's progress; this process is prefill. For each request size (pages of a DeepSeek-V3.2-like layout,
page runs of mean length 4, so rows are coalesced runs per buffer) it measures, interleaved, repeat by repeat:

* ``kvferry mooncake``: ``plan_transfer`` + ``MooncakeTransport.write`` + ``wait`` (every byte acknowledged by
  decode's engine; the notification is sent right after);
* ``raw mooncake``: the same plan's rows, computed beforehand, posted on the same engine as kvferry posts them
  (``batch_transfer_async_write`` in batches of <= 1024 rows, ``get_batch_transfer_status`` on each) in this
  thread: no planning, no checks, no thread hand-off, no notification;
* ``kvferry nixl``: ``plan_transfer`` + ``NixlTransport.write`` + ``wait`` to a NIXL peer, same pages.

Every method's bytes are checked on decode once per size (the whole written region against the source).
Medians of ``--repeats``; GB/s counts the request's bytes; ``kvferry/raw`` is the median of each repeat's
raw time over the kvferry time measured beside it (kvferry's throughput as a fraction of raw's).
Usage: ``python bench/mooncake_bench.py [--quick] [--repeats N] [--json]``.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import numpy as np
from rich.console import Console
from rich.table import Table

from kvferry import Buffer, KVMemory, Layout, Pool, plan_transfer
from kvferry.transport import make_transport
from kvferry.transport.mooncake import MAX_BATCH_ROWS

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
from nixl_peer import fill, start_peer

PAGE_BYTES = {"kv": 64 * 656, "idx": 64 * 132, "scale": 64 * 4}   # as bench/transport.py
LAYERS = 8
POOL_PAGES = 1024


def build_layout() -> Layout:
    bufs = [Buffer(f"{kind}.L{layer}", page, POOL_PAGES, "uint8", kind, layer)
            for layer in range(LAYERS) for kind, page in PAGE_BYTES.items()]
    return Layout([Pool("main", bufs, tokens_per_page=64)])


def run_pages(rng: np.random.Generator, num_pages: int, mean_run: int) -> np.ndarray:
    lengths: list[int] = []
    while sum(lengths) < num_pages:
        lengths.append(min(int(rng.geometric(1 / mean_run)), num_pages - sum(lengths)))
    gaps = np.diff(np.sort(rng.integers(0, POOL_PAGES - num_pages + 1, len(lengths))), prepend=0)
    starts = np.cumsum(np.array([0, *lengths[:-1]], dtype=np.int64)) + np.cumsum(gaps)
    order = rng.permutation(len(lengths))
    return np.concatenate([np.arange(starts[i], starts[i] + lengths[i]) for i in order])


def raw_post(engine: object, session: str, src_rows: np.ndarray, dst_rows: np.ndarray) -> None:
    local, remote, lengths = src_rows[:, 0].tolist(), dst_rows[:, 0].tolist(), src_rows[:, 1].tolist()
    for start in range(0, len(lengths), MAX_BATCH_ROWS):
        end = start + MAX_BATCH_ROWS
        batch = engine.batch_transfer_async_write(session, local[start:end], remote[start:end],  # type: ignore[attr-defined]
                                                  lengths[start:end])
        if engine.get_batch_transfer_status([batch]) != 0:  # type: ignore[attr-defined]
            raise RuntimeError("raw Mooncake batch failed")


def check_bytes(peer: object, src: KVMemory, pages: dict, label: str) -> None:
    """Decode's pages of this request equal the source's, buffer by buffer."""
    src_pages, dst_pages = pages["main"]
    dump = peer.call("dump", timeout=120)  # type: ignore[attr-defined]
    for buf in src.layout.buffers:
        got = np.frombuffer(dump[buf.name], dtype=np.uint8).reshape(buf.num_pages, buf.page_bytes)
        if not np.array_equal(got[dst_pages], src.array(buf.name)[src_pages]):
            raise AssertionError(f"{label}: buffer {buf.name} differs")


def main() -> None:
    args = parse_args()
    layout = build_layout()
    page_total = sum(PAGE_BYTES.values()) * LAYERS
    sizes_mib = [1, 4, 16, 64] if args.quick else [1, 4, 16, 64, 128]
    src = KVMemory.allocate(layout)
    fill(src, -1)
    rows_out = []
    mc = make_transport("mooncake")
    nx = make_transport("nixl")
    mc_peer = nx_peer = None
    try:
        mc_meta, nx_meta = mc.register(src), nx.register(src)
        mc_peer = start_peer(layout.to_manifest(), -2, transport="mooncake")
        nx_peer = start_peer(layout.to_manifest(), -2, transport="nixl", descriptors="auto")
        mc.add_peer(mc_peer.metadata)
        nx.add_peer(nx_peer.metadata)
        mc_peer.call("add_peer", mc_meta)
        nx_peer.call("add_peer", nx_meta)
        session = mc._peers[mc_peer.name].session  # type: ignore[attr-defined]
        rng = np.random.default_rng(0)
        for size in sizes_mib:
            num_pages = -(-(size << 20) // page_total)   # at least ``size`` MiB
            pages = {"main": (run_pages(rng, num_pages, 4), run_pages(rng, num_pages, 4))}
            mc_dst = mc._peers[mc_peer.name].memory  # type: ignore[attr-defined]
            nx_dst = nx._peers[nx_peer.name].memory  # type: ignore[attr-defined]
            ref = plan_transfer(src, mc_dst, pages)
            raw_src, raw_dst = ref.src_descs.copy(), ref.dst_descs.copy()

            def kv_mc(pages=pages, mc_dst=mc_dst) -> None:
                with mc.write(plan_transfer(src, mc_dst, pages), mc_peer.name, b"k") as h:
                    h.wait(120)

            def raw_mc(raw_src=raw_src, raw_dst=raw_dst) -> None:
                raw_post(mc.engine, session, raw_src, raw_dst)  # type: ignore[attr-defined]

            def kv_nx(pages=pages, nx_dst=nx_dst) -> None:
                with nx.write(plan_transfer(src, nx_dst, pages), nx_peer.name, b"k") as h:
                    h.wait(120)

            methods = {"kvferry mooncake": kv_mc, "raw mooncake": raw_mc, "kvferry nixl": kv_nx}
            times: dict[str, list[float]] = {m: [] for m in methods}
            for fn in methods.values():   # warm-up: connections, first-touch of pages
                fn()
            for _ in range(args.repeats):
                for name, fn in methods.items():
                    t0 = time.perf_counter()
                    fn()
                    times[name].append(time.perf_counter() - t0)
            # Bytes: kvferry's and raw's writes land the same pages; check each after a fresh fill.
            for name, fn, peer in (("kvferry mooncake", kv_mc, mc_peer), ("raw mooncake", raw_mc, mc_peer),
                                   ("kvferry nixl", kv_nx, nx_peer)):
                peer.call("fill", -2)
                fn()
                check_bytes(peer, src, pages, f"{name} {size} MiB")
            nbytes = ref.nbytes if hasattr(ref, "nbytes") else int(ref.src_descs[:, 1].sum())
            med = {m: statistics.median(t) for m, t in times.items()}
            rows_out.append({"mib": round(nbytes / 2**20, 2), "rows": int(ref.num_descriptors), "pages": num_pages,
                             **{f"{m} ms": round(v * 1e3, 3) for m, v in med.items()},
                             **{f"{m} GB/s": round(nbytes / v / 1e9, 3) for m, v in med.items()},
                             # Paired: each repeat's raw time over the kvferry time measured next to it.
                             "kvferry/raw mooncake": round(statistics.median(
                                 r / k for r, k in zip(times["raw mooncake"], times["kvferry mooncake"])), 3),
                             "bytes checked": True})
    finally:
        for peer in (mc_peer, nx_peer):
            if peer is not None:
                peer.stop()
        mc.close()
        nx.close()
    if args.json:
        print(json.dumps({"repeats": args.repeats, "rows": rows_out}))
        return
    table = Table(title=f"kvferry over Mooncake (TCP) vs raw Mooncake vs kvferry over NIXL, median of {args.repeats}")
    for col in ("MiB", "rows", "kvferry mc ms", "raw mc ms", "kvferry nixl ms", "kvferry mc GB/s", "raw mc GB/s",
                "kvferry nixl GB/s", "kvferry/raw mc"):
        table.add_column(col, justify="right")
    for r in rows_out:
        table.add_row(str(r["mib"]), str(r["rows"]), str(r["kvferry mooncake ms"]), str(r["raw mooncake ms"]),
                      str(r["kvferry nixl ms"]), str(r["kvferry mooncake GB/s"]), str(r["raw mooncake GB/s"]),
                      str(r["kvferry nixl GB/s"]), str(r["kvferry/raw mooncake"]))
    Console(width=160).print(table)
    print("every method's bytes checked on decode at every size")


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--quick", action="store_true", help="sizes up to 64 MiB")
    p.add_argument("--repeats", type=int, default=7)
    p.add_argument("--json", action="store_true")
    return p.parse_args()


if __name__ == "__main__":
    main()
