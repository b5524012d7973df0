"""Control-plane benchmark: many small requests between two processes, against the raw transport.

Prefill runs in a spawned process (this file with ``--role prefill``), decode in this one; both over
NIXL. Every request moves 16 pages (12 of a main pool with per-layer KV and bf16 indexer-key buffers of
different page sizes and capacities, 4 of a compressed pool), decode keeping ``--in-flight`` requests
outstanding and reusing its pages as requests finish (so every announce goes through the lease table).

* ``raw``: decode sends "go i" as a NIXL notification; prefill plans and posts request i's write with a
  notification; decode times "go" -> notification. The transport alone, same bytes, same window.
* ``raw read`` (run when pull mode is): decode plans and posts request i's NIXL READ from prefill's pages
  itself and times post -> complete, prefill only driving its side's progress. The transport alone doing
  what pull mode does, so pull's rows also say ``p50 vs raw read``.
* ``raw batched`` (with ``--raw-batched``): as ``raw``, but prefill posts all the requests one poll of its
  notifications brought as one NIXL write, with one notification naming them all. Not what kvferry does
  (one write per chunk): it measures what per-transfer costs add (bench/RESULTS.md, issue 13, sixth round).
* ``control <push|pull> digest=<mode>``: ``DecodeEndpoint.announce`` -> ``DONE`` (``timing()``), with prefill
  calling ``PrefillEndpoint.send`` up to a window ahead. Handshake, ZMQ messages, leases, states,
  coverage checks, digests (per ``--digests``) and the decode's verdict back to prefill included. In pull
  mode (``--transfer pull``) prefill sends a Ready and decode posts the NIXL READ itself.

Decode keeps ``--in-flight`` requests announced throughout: a slot is reused as soon as its request ends,
in whatever order they end (``DecodeEndpoint.ended``). Each row reports ``in_flight``, the requests
outstanding on average (throughput x mean latency): p50s compare like with like only where it is the same.

Usage: ``python bench/control.py [--quick] [--requests N] [--in-flight N] [--digests off,sampled]
[--transfer push,pull] [--repeats N] [--raw-batched] [--json] [--profile]``. Clocks: latencies are measured
in this process only. ``--profile`` runs one control-plane run per digest mode with decode's progress
thread and this (application) thread under ``cProfile`` and prints where each spends its time, waits
included (cProfile's clock is wall time): it shows which calls block or hand off to another thread, not
CPU alone.
"""

from __future__ import annotations

import argparse
import functools
import json
import resource
import subprocess
import sys
import time
from collections import deque
from typing import Any

import numpy as np

from kvferry import Buffer, KVMemory, Layout, Pool, plan_transfer
from kvferry.control import EndpointOptions

LAYERS = 4
METRICS = ("requests_per_s", "p50_us", "mean_us", "p99_us", "prefill_cpu_us", "decode_cpu_us", "in_flight")
MAIN_PER_REQ, C4_PER_REQ = 12, 4
CAPS = {"prefill": (1000, 900, 300), "decode": (800, 780, 270)}


def build_layout(side: str) -> Layout:
    kv, idx, c4 = CAPS[side]
    main = [b for layer in range(LAYERS) for b in (
        Buffer(f"main.kv.L{layer}", 4096, kv, "fp8_e4m3", "kv", layer),
        Buffer(f"main.idx.L{layer}", 1024, idx, "bf16", "index_k", layer))]
    comp = [Buffer(f"c4.kv.L{layer}", 2048, c4, "fp8_e4m3", "kv", layer) for layer in range(LAYERS)]
    return Layout([Pool("main", main, tokens_per_page=64), Pool("c4", comp, tokens_per_page=256)])


def memory(side: str) -> KVMemory:
    mem = KVMemory.allocate(build_layout(side))
    rng = np.random.default_rng(1 if side == "prefill" else 2)
    for buf in mem.layout.buffers:
        arr = mem.array(buf.name)
        arr[...] = rng.integers(0, 256, size=arr.shape, dtype=np.uint8)
    return mem


@functools.cache
def src_pages(i: int) -> dict[str, np.ndarray]:
    """Request ``i``'s prefill pages (cached: the workload, not its generation, is what is measured)."""
    rng = np.random.default_rng(i)
    kv, idx, c4 = CAPS["prefill"]
    return {"main": rng.choice(min(kv, idx), MAIN_PER_REQ, replace=False), "c4": rng.choice(c4, C4_PER_REQ, False)}


@functools.cache
def dst_pages(slot: int, in_flight: int) -> dict[str, np.ndarray]:
    """Slot ``slot``'s decode pages: fixed per slot, reused by every request that gets the slot."""
    kv, idx, c4 = CAPS["decode"]
    main = np.random.default_rng(10).permutation(min(kv, idx))[: in_flight * MAIN_PER_REQ]
    comp = np.random.default_rng(11).permutation(c4)[: in_flight * C4_PER_REQ]
    return {"main": main[slot * MAIN_PER_REQ:(slot + 1) * MAIN_PER_REQ],
            "c4": comp[slot * C4_PER_REQ:(slot + 1) * C4_PER_REQ]}


def warm_pages(n: int, in_flight: int) -> None:
    for i in range(n):
        src_pages(i)
    for slot in range(in_flight):
        dst_pages(slot, in_flight)


# -- prefill process ---------------------------------------------------------------------------------------
def cpu_s() -> float:
    """User + system CPU seconds of this process, all threads (CPU per request is the figure to cut)."""
    ru = resource.getrusage(resource.RUSAGE_SELF)
    return ru.ru_utime + ru.ru_stime


def _say(obj: dict[str, Any]) -> None:
    sys.stdout.write(json.dumps(obj) + "\n")
    sys.stdout.flush()


def prefill_control(args: argparse.Namespace) -> None:
    from kvferry.control import PrefillEndpoint

    # Accepts both transfer modes: each decode run chooses one (--transfer).
    with PrefillEndpoint(memory("prefill"), "nixl", digest_mode=args.digest, mode=("push", "pull"),
                         options=options(args)) as ep:
        _say({"address": ep.address})
        json.loads(sys.stdin.readline())                  # "start": decode is connected
        cpu0 = cpu_s()
        backlog: deque[str] = deque()
        for i in range(args.requests):
            ep.send(f"b{i}", src_pages(i))
            backlog.append(f"b{i}")
            while len(backlog) > args.in_flight + 32:     # run a little ahead of decode, as engines do
                ep.wait(backlog.popleft(), 60)
        while backlog:
            ep.wait(backlog.popleft(), 60)
        _say({"done": True, "cpu_s": cpu_s() - cpu0})
        sys.stdin.readline()


def prefill_raw(args: argparse.Namespace) -> None:
    from kvferry.transport.nixl import NixlTransport

    src = memory("prefill")
    with NixlTransport() as transport:
        _say({"meta": transport.register(src).hex()})
        peer_info = json.loads(sys.stdin.readline())
        peer = transport.add_peer(bytes.fromhex(peer_info["meta"]))
        dst = KVMemory.from_manifest(bytes.fromhex(peer_info["manifest"]))
        handles: list[Any] = []
        served = 0
        cpu0 = cpu_s()
        while served < args.requests or handles:
            asked = [tuple(int(x) for x in msg.split()[1:]) for _, msg in transport.get_notifications()]
            for group in ([asked] if args.mode == "raw-batched" and asked else [[a] for a in asked]):
                pages = {p: (np.concatenate([src_pages(i)[p] for i, _ in group]),
                             np.concatenate([dst_pages(slot, args.in_flight)[p] for _, slot in group]))
                         for p in ("main", "c4")}
                done = "done " + " ".join(str(i) for i, _ in group)
                handles.append(transport.write(plan_transfer(src, dst, pages), peer, done.encode()))
                served += len(group)
            handles = [h for h in handles if not _settled(h)]
            time.sleep(50e-6)
        _say({"done": True, "cpu_s": cpu_s() - cpu0})
        sys.stdin.readline()


def prefill_raw_read(args: argparse.Namespace) -> None:
    """Raw reads: decode reads this side's pages by itself; this process only drives NIXL's progress (the
    first read of a connection needs this side to answer) until told to stop."""
    import select

    from kvferry.transport.nixl import NixlTransport

    src = memory("prefill")
    with NixlTransport() as transport:
        _say({"meta": transport.register(src).hex(), "manifest": src.manifest().hex()})
        transport.add_peer(bytes.fromhex(json.loads(sys.stdin.readline())["meta"]))
        cpu0 = cpu_s()
        while not select.select([sys.stdin], [], [], 1e-3)[0]:
            transport.get_notifications()
        sys.stdin.readline()                         # "done": decode has every byte
        _say({"done": True, "cpu_s": cpu_s() - cpu0})
        sys.stdin.readline()


def _settled(handle: Any) -> bool:
    if handle.poll():
        handle.release()
        return True
    return False


# -- decode (this process) ---------------------------------------------------------------------------------
def options(args: argparse.Namespace, stats: str | None = None) -> EndpointOptions:
    """Both sides' options; ``stats`` (``on``/``off``, default: the prefill role's ``--stats``) is
    ``EndpointOptions.stats``, the endpoint's running totals (``control.stats``)."""
    return EndpointOptions(batch_chunks=args.batch_chunks, batch_bytes=args.batch_bytes,
                           stats=(stats or args.stats) == "on", peer_timeout=args.peer_timeout)


def spawn(args: argparse.Namespace, mode: str, digest: str = "off", stats: str = "on") -> subprocess.Popen[str]:
    cmd = [sys.executable, __file__, "--role", "prefill", "--mode", mode, "--digest", digest, "--stats", stats,
           "--peer-timeout", str(args.peer_timeout),
           "--requests", str(args.requests), "--in-flight", str(args.in_flight),
           "--batch-chunks", str(args.batch_chunks), "--batch-bytes", str(args.batch_bytes)]
    return subprocess.Popen(cmd, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)


def _read(proc: subprocess.Popen[str]) -> dict[str, Any]:
    assert proc.stdout is not None
    while True:
        line = proc.stdout.readline()
        if not line:
            raise RuntimeError(f"prefill process exited with {proc.wait()}")
        if line.startswith("{"):
            return json.loads(line)


def _write(proc: subprocess.Popen[str], obj: dict[str, Any]) -> None:
    assert proc.stdin is not None
    proc.stdin.write(json.dumps(obj) + "\n")
    proc.stdin.flush()


def run_raw(args: argparse.Namespace, batched: bool = False) -> dict[str, Any]:
    from kvferry.transport.nixl import NixlTransport

    dst = memory("decode")
    proc = spawn(args, "raw-batched" if batched else "raw")
    with NixlTransport() as transport:
        meta = transport.register(dst)
        peer = transport.add_peer(bytes.fromhex(_read(proc)["meta"]))
        _write(proc, {"meta": meta.hex(), "manifest": dst.manifest().hex()})
        sent: dict[int, tuple[float, int]] = {}
        lat: list[float] = []
        nxt = 0
        t0, cpu0 = time.monotonic(), cpu_s()
        for slot in range(min(args.in_flight, args.requests)):
            sent[nxt] = (time.monotonic(), slot)
            transport.send_notification(peer, f"go {nxt} {slot}".encode())
            nxt += 1
        while len(lat) < args.requests:
            for i in (int(x) for _, msg in transport.get_notifications() for x in msg.split()[1:]):
                start, slot = sent.pop(i)
                lat.append(time.monotonic() - start)
                if nxt < args.requests:
                    sent[nxt] = (time.monotonic(), slot)
                    transport.send_notification(peer, f"go {nxt} {slot}".encode())
                    nxt += 1
            time.sleep(50e-6)
        wall, cpu = time.monotonic() - t0, cpu_s() - cpu0
        prefill_cpu = _read(proc)["cpu_s"]
        _write(proc, {"exit": True})
    proc.wait(30)
    return _summary("raw batched" if batched else "raw transport", lat, wall, args.requests, prefill_cpu, cpu)


def run_raw_read(args: argparse.Namespace) -> dict[str, Any]:
    from kvferry.transport.nixl import NixlTransport

    dst = memory("decode")
    proc = spawn(args, "raw-read")
    with NixlTransport() as transport:
        meta = transport.register(dst)
        hello = _read(proc)
        peer = transport.add_peer(bytes.fromhex(hello["meta"]))
        src = KVMemory.from_manifest(bytes.fromhex(hello["manifest"]))
        _write(proc, {"meta": meta.hex()})
        # A request is issued when a slot frees (its clock starts then, as an announce's does) and waits
        # in a queue for its read to be posted: on one host a read copies inside the call, so posting
        # is one read at a time, and ``in_flight`` requests are outstanding throughout.
        queue: deque[tuple[int, int, float]] = deque()
        live: deque[tuple[Any, float, int]] = deque()
        lat: list[float] = []
        nxt = 0
        t0, cpu0 = time.monotonic(), cpu_s()
        for slot in range(min(args.in_flight, args.requests)):
            queue.append((nxt, slot, time.monotonic()))
            nxt += 1
        while len(lat) < args.requests:
            if queue:
                i, slot, start = queue.popleft()
                src_i, dst_i = src_pages(i), dst_pages(slot, args.in_flight)
                plan = plan_transfer(src, dst, {p: (src_i[p], dst_i[p]) for p in ("main", "c4")})
                live.append((transport.read(plan, peer, f"r{i}"), start, slot))
            elif live:
                time.sleep(50e-6)
            while live and _settled(live[0][0]):   # in order, as run_control counts them
                _, start, slot = live.popleft()
                lat.append(time.monotonic() - start)
                if nxt < args.requests:
                    queue.append((nxt, slot, time.monotonic()))
                    nxt += 1
        wall, cpu = time.monotonic() - t0, cpu_s() - cpu0
        _write(proc, {"done": True})
        prefill_cpu = _read(proc)["cpu_s"]
        _write(proc, {"exit": True})
    proc.wait(30)
    return _summary("raw read", lat, wall, args.requests, prefill_cpu, cpu)


def run_control(args: argparse.Namespace, digest: str, transfer: str = "push", stats: str = "on") -> dict[str, Any]:
    from kvferry.control import DecodeEndpoint

    proc = spawn(args, "control", digest, stats)
    with DecodeEndpoint(memory("decode"), "nixl", digest_mode=digest, mode=transfer,
                        options=options(args, stats)) as decode:
        decode.connect(_read(proc)["address"])
        _write(proc, {"start": True})
        lat: list[float] = []
        free = deque(range(args.in_flight))
        live: dict[str, int] = {}                     # request -> its slot
        decode.ended()                                # starts the record of ended requests
        nxt = 0
        t0, cpu0 = time.monotonic(), cpu_s()
        while len(lat) < args.requests:
            while free and nxt < args.requests:
                slot = free.popleft()
                decode.announce(f"b{nxt}", dst_pages(slot, args.in_flight))
                live[f"b{nxt}"] = slot
                nxt += 1
            # Every request that ended frees its slot at once, in whatever order they end, so that
            # ``in_flight`` stay announced, as the raw runs keep theirs. (Until the fifth round of issue 13
            # this loop waited on the oldest and freed slots in announce order: a request that ended
            # early held its slot idle, and push mode ran with ~42-53 in flight, not 64.)
            for rid in decode.ended(60):
                start, end = decode.timing(rid)
                decode.wait(rid, 60)                  # done already; raises if it failed (never counted)
                assert end is not None
                lat.append(end - start)
                free.append(live.pop(rid))
        wall, cpu = time.monotonic() - t0, cpu_s() - cpu0
        prefill_cpu = _read(proc)["cpu_s"]
        _write(proc, {"exit": True})
        counters = decode.counters()
    proc.wait(30)
    name = f"control {transfer} digest={digest}" + (f" stats={stats}" if "," in args.stats else "")
    out = _summary(name, lat, wall, args.requests, prefill_cpu, cpu)
    out["decode_counters"] = counters
    return out


def profile_control(args: argparse.Namespace, digest: str, top: int = 15) -> None:
    """One control-plane run with decode's progress thread and this thread under cProfile; prints both."""
    import cProfile
    import pstats

    from kvferry.control import endpoints

    progress = cProfile.Profile()
    run = endpoints.EndpointBase._run

    def profiled_run(self: Any) -> None:
        if type(self).__name__ != "DecodeEndpoint":
            run(self)
            return
        progress.enable()
        try:
            run(self)
        finally:
            progress.disable()

    endpoints.EndpointBase._run = profiled_run  # type: ignore[method-assign]
    app = cProfile.Profile()
    try:
        app.enable()
        result = run_control(args, digest)
        app.disable()
    finally:
        endpoints.EndpointBase._run = run  # type: ignore[method-assign]
    print(f"== digests {digest}: decode CPU {result['decode_cpu_us']:.0f} us/request (profiled), "
          f"{args.requests} requests")
    for name, prof in (("decode progress thread", progress), ("decode application thread", app)):
        print(f"-- {name}, by own time (wall clock, waits included)")
        pstats.Stats(prof).sort_stats("tottime").print_stats(top)


def _summary(name: str, lat: list[float], wall: float, n: int, prefill_cpu: float,
             decode_cpu: float) -> dict[str, Any]:
    arr = np.array(lat) * 1e6
    return {"name": name, "requests": n, "requests_per_s": n / wall,
            "p50_us": float(np.percentile(arr, 50)), "p99_us": float(np.percentile(arr, 99)),
            "mean_us": float(arr.mean()), "in_flight": n / wall * float(arr.mean()) * 1e-6,  # Little's law
            "prefill_cpu_us": prefill_cpu / n * 1e6,
            "decode_cpu_us": decode_cpu / n * 1e6}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--role", default="decode", choices=["decode", "prefill"])
    ap.add_argument("--mode", default="control", choices=["control", "raw", "raw-batched", "raw-read"])
    ap.add_argument("--digest", default="off")
    ap.add_argument("--digests", default="off,sampled", help="digest modes to run the control plane with")
    ap.add_argument("--transfer", default="push",
                    help="transfer modes to run the control plane in, comma-separated: push (prefill writes), "
                         "pull (decode reads)")
    ap.add_argument("--requests", type=int, default=2000)
    ap.add_argument("--in-flight", type=int, default=64)
    ap.add_argument("--repeats", type=int, default=3, help="runs of each kind; medians reported")
    ap.add_argument("--quick", action="store_true", help="200 requests, one repeat")
    ap.add_argument("--raw-batched", action="store_true",
                    help="also the raw baseline posting each poll's requests as one write (per-transfer costs)")
    ap.add_argument("--batch-chunks", type=int, default=EndpointOptions().batch_chunks,
                    help="EndpointOptions.batch_chunks of both sides (1: every chunk its own transfer)")
    ap.add_argument("--batch-bytes", type=int, default=EndpointOptions().batch_bytes,
                    help="EndpointOptions.batch_bytes of both sides (bytes one shared transfer may move)")
    ap.add_argument("--stats", default="on",
                    help="EndpointOptions.stats of both sides, comma-separated: on,off runs both, interleaved, and "
                         "reports p50_vs_stats_off (what the endpoints' running totals cost)")
    ap.add_argument("--peer-timeout", type=float, default=EndpointOptions().peer_timeout,
                    help="EndpointOptions.peer_timeout of both sides (raise it on a loaded machine, where a side "
                         "may not run for seconds)")
    ap.add_argument("--json", action="store_true")
    ap.add_argument("--profile", action="store_true", help="cProfile decode's threads in one run per mode")
    args = ap.parse_args()
    if args.quick:
        args.requests, args.repeats = 200, 1
    warm_pages(args.requests, args.in_flight)
    if args.role == "prefill":
        {"raw": prefill_raw, "raw-batched": prefill_raw, "raw-read": prefill_raw_read,
         "control": prefill_control}[args.mode](args)
        return
    if args.profile:
        for digest in args.digests.split(","):
            profile_control(args, digest)
        return
    # Runs interleaved, repeated, medians reported: on a shared 2-core machine one run is noise.
    runs: dict[str, list[dict[str, Any]]] = {}
    for _ in range(args.repeats):
        transfers = args.transfer.split(",")
        controls = [run_control(args, d, t, s) for t in transfers for d in args.digests.split(",")
                    for s in args.stats.split(",")]
        raws = [run_raw(args), *([run_raw_read(args)] if "pull" in transfers else []),
                *([run_raw(args, batched=True)] if args.raw_batched else [])]
        for r in [*raws, *controls]:
            runs.setdefault(r["name"], []).append(r)
    results = [{"name": name, "repeats": len(rs),
                **{k: float(np.median([r[k] for r in rs])) for k in METRICS}}
               for name, rs in runs.items()]
    base = results[0]["p50_us"]
    read_base = next((r["p50_us"] for r in results if r["name"] == "raw read"), None)
    for r in results:
        r["p50_vs_raw"] = r["p50_us"] / base - 1.0
        r["mean_vs_raw"] = r["mean_us"] / results[0]["mean_us"] - 1.0
        if read_base is not None and (r["name"] == "raw read" or " pull " in r["name"]):
            r["p50_vs_raw_read"] = r["p50_us"] / read_base - 1.0
        off = next((o for o in results if r["name"].endswith(" stats=on")
                    and o["name"] == r["name"].replace(" stats=on", " stats=off")), None)
        if off is not None:   # what the endpoints' stats cost, against the same run without them
            r["p50_vs_stats_off"] = r["p50_us"] / off["p50_us"] - 1.0
            r["mean_vs_stats_off"] = r["mean_us"] / off["mean_us"] - 1.0
    if args.json:
        print(json.dumps(results, indent=2))
        return
    layout = build_layout("decode")
    nbytes = sum(b.page_bytes for b in layout.pool("main").buffers) * MAIN_PER_REQ + \
        sum(b.page_bytes for b in layout.pool("c4").buffers) * C4_PER_REQ
    print(f"{args.requests} requests x {MAIN_PER_REQ + C4_PER_REQ} pages ({nbytes} bytes), "
          f"{args.in_flight} in flight")
    print(f"medians of {args.repeats} interleaved runs")
    print("in flight: requests outstanding on average (throughput x mean latency); p50 compares like with")
    print("like only where it is the same")
    print(f"{'run':<30}{'req/s':>10}{'in flight':>10}{'p50 us':>10}{'mean us':>10}{'p99 us':>10}{'p50 vs raw':>12}"
          f"{'prefill CPU us/req':>20}{'decode CPU us/req':>19}{'p50 vs raw read':>17}")
    for r in results:
        vs_read = f"{r['p50_vs_raw_read'] * 100:>16.0f}%" if "p50_vs_raw_read" in r else ""
        if "p50_vs_stats_off" in r:
            vs_read += f"  p50 vs stats off {r['p50_vs_stats_off'] * 100:+.1f}%"
        print(f"{r['name']:<30}{r['requests_per_s']:>10.0f}{r['in_flight']:>10.1f}{r['p50_us']:>10.0f}{r['mean_us']:>10.0f}"
              f"{r['p99_us']:>10.0f}{r['p50_vs_raw'] * 100:>11.0f}%{r['prefill_cpu_us']:>20.0f}"
              f"{r['decode_cpu_us']:>19.0f}{vs_read}")


if __name__ == "__main__":
    main()
