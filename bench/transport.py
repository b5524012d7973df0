"""Transport benchmark: NixlTransport between two processes against memcpy and raw NIXL, same bytes.

Decode runs in a spawned process (``tests/nixl_peer.py``) busy-polling for the notification; this process
is prefill. A request is timed from ``plan_transfer`` to the notification's arrival on the decode side
(both clocks are CLOCK_MONOTONIC). For each request size and mean page-run length it measures:

* ``memcpy``: ``np.copyto`` of the request's byte count, one contiguous block, in this process;
* ``local rows``: planning plus the plan's rows memmoved in this process (what ``LocalTransport`` does);
* ``kvferry auto`` / ``kvferry dlist`` / ``kvferry prepped``: ``NixlTransport.write`` with each descriptor
  strategy (``auto``, the default, posts page indices for runs of <= 4 pages on average, else rows);
* ``raw 1 desc/buffer``: NIXL WRITE of the same byte count as one descriptor per buffer (no planning);
* ``raw prepped/page``: NIXL ``make_prepped_xfer`` with one index per page over prepared per-page lists.

Usage: ``python bench/transport.py [--quick] [--layers N] [--pool-pages N] [--repeats N]``.
"""

from __future__ import annotations

import argparse
import ctypes
import statistics
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import numpy as np
from rich.console import Console
from rich.table import Table

from kvferry import Buffer, KVMemory, Layout, Pool, TransferPlan, plan_transfer
from kvferry.transport.nixl import NixlTransport

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
from nixl_peer import PeerProcess, fill, start_peer

# DeepSeek-V3.2-like per-layer buffers, 64 tokens per page: MLA latent KV (656 B/token), indexer K
# (132 B/token) and a small per-token scale buffer (4 B/token).
PAGE_BYTES = {"kv": 64 * 656, "idx": 64 * 132, "scale": 64 * 4}
SRC_FILL, DST_FILL = -1, -2  # cheap page patterns (see nixl_peer.pattern)
console = Console(width=170)


@dataclass
class Case:
    name: str
    num_pages: int
    mean_run: int


def build_layout(layers: int, pool_pages: int) -> Layout:
    bufs = [Buffer(f"{kind}.L{layer}", page, pool_pages, "uint8", kind, layer)
            for layer in range(layers) for kind, page in PAGE_BYTES.items()]
    return Layout([Pool("main", bufs, tokens_per_page=64)])


def run_pages(rng: np.random.Generator, num_pages: int, mean_run: int, capacity: int) -> np.ndarray:
    """``num_pages`` distinct pages in runs of geometric length (mean ``mean_run``), runs in random order."""
    lengths: list[int] = []
    while sum(lengths) < num_pages:
        lengths.append(min(int(rng.geometric(1 / mean_run)), num_pages - sum(lengths)))
    gaps = np.diff(np.sort(rng.integers(0, capacity - num_pages + 1, len(lengths))), prepend=0)
    starts = np.cumsum(np.array([0, *lengths[:-1]], dtype=np.int64)) + np.cumsum(gaps)
    order = rng.permutation(len(lengths))
    return np.concatenate([np.arange(starts[i], starts[i] + lengths[i]) for i in order])


def pages_for(case: Case, capacity: int, seed: int) -> dict[str, tuple[np.ndarray, np.ndarray]]:
    rng = np.random.default_rng(seed)
    src = run_pages(rng, case.num_pages, case.mean_run, capacity)
    dst = run_pages(rng, case.num_pages, case.mean_run, capacity)
    return {"main": (src, dst)}


# -- timed operations ------------------------------------------------------------------------------------
class Bench:
    def __init__(self, transport: NixlTransport, peer: PeerProcess, src: KVMemory, repeats: int) -> None:
        self.transport, self.peer, self.src, self.repeats = transport, peer, src, repeats
        self.dst = transport._peers[peer.name].memory
        self.agent = transport._agent
        self.seq = 0

    def e2e(self, post: Callable[[bytes], None]) -> float:
        """Seconds from calling ``post(notif)`` to the notification's arrival on the decode side."""
        self.seq += 1
        tag = f"n{self.seq}".encode()
        self.peer.conn.send(("arrival", tag, 30.0))  # the peer busy-polls from now on
        time.sleep(0.002)
        start = time.perf_counter()
        post(tag)
        arrived = self.peer.conn.recv()
        if not isinstance(arrived, float):
            raise RuntimeError(f"notification {tag!r} did not arrive: {arrived!r}")
        return arrived - start

    def kvferry(self, pages: dict, descriptors: str) -> Callable[[], float]:
        def post(tag: bytes) -> None:
            self.transport.descriptors = descriptors  # type: ignore[assignment]
            plan = plan_transfer(self.src, self.dst, pages)
            with self.transport.write(plan, self.peer.name, tag) as handle:
                handle.wait(30.0)
        return lambda: self.e2e(post)

    def raw_per_buffer(self, num_pages: int) -> Callable[[], float]:
        src = _whole_buffer_rows(self.src, num_pages)
        dst = _whole_buffer_rows(self.dst, num_pages)

        def post(tag: bytes) -> None:
            ag = self.agent
            xfer = ag.initialize_xfer("WRITE", ag.get_xfer_descs(src, "DRAM"), ag.get_xfer_descs(dst, "DRAM"),
                                      self.peer.name, tag)
            _finish(ag, xfer)
        return lambda: self.e2e(post)

    def raw_prepped(self, plan: TransferPlan) -> Callable[[], float]:
        ag = self.agent
        local = self.transport._local_list()
        remote = self.transport._remote_list(self.transport._peers[self.peer.name])

        def post(tag: bytes) -> None:
            src_idx, dst_idx = plan.page_selectors()
            xfer = ag.make_prepped_xfer("WRITE", local, src_idx.astype(np.int32), remote,
                                        dst_idx.astype(np.int32), tag)
            _finish(ag, xfer)
        return lambda: self.e2e(post)


def _whole_buffer_rows(mem: KVMemory, num_pages: int) -> np.ndarray:
    rows = np.array([(r.address, num_pages * b.page_bytes, r.device_id)
                     for r, b in zip(mem.regions, mem.layout.buffers)], dtype=np.uint64)
    return rows


def _finish(agent: object, xfer: object) -> None:
    status = agent.transfer(xfer)  # type: ignore[attr-defined]
    while status == "PROC":
        status = agent.check_xfer_state(xfer)  # type: ignore[attr-defined]
    if status != "DONE":
        raise RuntimeError(f"raw NIXL transfer ended {status}")
    xfer.release()  # type: ignore[attr-defined]


def memcpy(nbytes: int) -> Callable[[], float]:
    a = np.ones(nbytes, dtype=np.uint8)
    b = np.zeros_like(a)

    def once() -> float:
        t = time.perf_counter()
        np.copyto(b, a)
        return time.perf_counter() - t
    return once


def local_rows(plan: TransferPlan, scratch: KVMemory, pages: dict) -> Callable[[], float]:
    def once() -> float:
        t = time.perf_counter()
        local = plan_transfer(plan.src_memory, scratch, pages)
        for (s, n, _), (d, _, _) in zip(local.src_descs.tolist(), local.dst_descs.tolist()):
            ctypes.memmove(d, s, n)
        return time.perf_counter() - t
    return once


def measure(methods: dict[str, Callable[[], float]], repeats: int) -> dict[str, list[float]]:
    """Warm every method up, then run them round-robin: load from other processes on the machine then
    hits every method alike instead of whichever happened to run during it."""
    for fn in methods.values():
        fn()
    times: dict[str, list[float]] = {name: [] for name in methods}
    for _ in range(repeats):
        for name, fn in methods.items():
            times[name].append(fn())
    return times


def verify(peer: PeerProcess, src: KVMemory, plan: TransferPlan, rng: np.random.Generator) -> None:
    """Spot-check: a few destination pages of a few buffers hold the source pages they were planned from."""
    pp = plan.pools[0]
    for gid in rng.choice(pp.buffer_ids, size=min(4, len(pp.buffer_ids)), replace=False):
        name = src.layout.buffers[int(gid)].name
        pick = rng.choice(len(pp.src_pages), size=min(8, len(pp.src_pages)), replace=False)
        got = peer.call("pages", name, pp.dst_pages[pick].tolist())
        if got != src.array(name)[pp.src_pages[pick]].tobytes():
            raise AssertionError(f"benchmark write landed wrong bytes in {name}")


# -- driver ----------------------------------------------------------------------------------------------
def main() -> None:
    args = parse_args()
    layout = build_layout(args.layers, args.pool_pages)
    console.print(f"layout: {args.layers} layers x {len(PAGE_BYTES)} buffers, {args.pool_pages} pages per "
                  f"buffer, {layout.nbytes / 2**30:.2f} GiB per side; repeats={args.repeats}")
    src = KVMemory.allocate(layout)
    fill(src, SRC_FILL)
    scratch = KVMemory.allocate(layout)
    fill(scratch, DST_FILL)
    peer = start_peer(layout.to_manifest(), DST_FILL)
    try:
        with NixlTransport() as transport:
            transport.register(src)
            transport.add_peer(peer.metadata)
            report(run_cases(Bench(transport, peer, src, args.repeats), scratch, args))
    finally:
        peer.stop()


def run_cases(bench: Bench, scratch: KVMemory, args: argparse.Namespace) -> list[dict]:
    rng = np.random.default_rng(1)
    cases = [Case("large", args.large_pages, 16), Case("large", args.large_pages, 4),
             Case("small", args.small_pages, 16), Case("small", args.small_pages, 4)]
    rows = []
    for i, case in enumerate(cases):
        pages = pages_for(case, args.pool_pages, seed=i)
        plan = plan_transfer(bench.src, bench.dst, pages)
        times = measure({
            "memcpy": memcpy(plan.nbytes),
            "local rows": local_rows(plan, scratch, pages),
            "kvferry dlist": bench.kvferry(pages, "dlist"),
            "kvferry auto": bench.kvferry(pages, "auto"),
            "kvferry prepped": bench.kvferry(pages, "prepped"),
            "raw 1 desc/buffer": bench.raw_per_buffer(case.num_pages),
            "raw prepped/page": bench.raw_prepped(plan),
        }, args.repeats)
        verify(bench.peer, bench.src, plan, rng)
        rows.append({"case": case, "nbytes": plan.nbytes, "rows": plan.num_descriptors, "times": times})
        console.print(f"done: {case.name} mean run {case.mean_run}")
    return rows


def report(rows: list[dict]) -> None:
    methods = list(rows[0]["times"])
    for row in rows:
        row["median"] = {m: statistics.median(v) for m, v in row["times"].items()}
    table = Table(title="Transport: GB/s of the median run (ratio to memcpy), plan to decode-side notification")
    for col in ("request", "MiB", "rows", *methods):
        table.add_column(col, justify="right")
    for row in rows:
        case, t = row["case"], row["median"]
        ref = row["nbytes"] / t["memcpy"]
        cells = [f"{row['nbytes'] / t[m] / 1e9:.2f} ({row['nbytes'] / t[m] / ref:.2f})" for m in methods]
        table.add_row(f"{case.name} {case.num_pages}p run~{case.mean_run}", f"{row['nbytes'] / 2**20:.1f}",
                      str(row["rows"]), *cells)
    console.print(table)
    lat = Table(title="Time per request, ms: median / best")
    for col in ("request", *methods):
        lat.add_column(col, justify="right")
    for row in rows:
        case = row["case"]
        lat.add_row(f"{case.name} {case.num_pages}p run~{case.mean_run}",
                    *[f"{row['median'][m] * 1e3:.2f} / {min(row['times'][m]) * 1e3:.2f}" for m in methods])
    console.print(lat)


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="8 layers, small pool, 3 repeats")
    parser.add_argument("--layers", type=int, default=None, help="layers (default 61; 8 with --quick)")
    parser.add_argument("--pool-pages", type=int, default=None,
                        help="pages per buffer on each side (default 1024; 640 with --quick)")
    parser.add_argument("--large-pages", type=int, default=512, help="pages in the large request")
    parser.add_argument("--small-pages", type=int, default=None,
                        help="pages in the small request (default 2: ~6 MiB at 61 layers; 8 with --quick)")
    parser.add_argument("--repeats", type=int, default=None, help="timed repeats per method (default 7)")
    args = parser.parse_args()
    args.layers = args.layers or (8 if args.quick else 61)
    args.pool_pages = args.pool_pages or (640 if args.quick else 1024)
    args.small_pages = args.small_pages or (8 if args.quick else 2)
    args.repeats = args.repeats or (3 if args.quick else 7)
    return args


if __name__ == "__main__":
    main()
