"""Per-request CPU of kvferry's own work before NIXL sees a row (issue 13), by component.

Components, each the median (or ``--stat min``) of ``--repeat`` calls, warm and "cold" (after a 3 MiB copy
that evicts the caches, as a transfer does between two requests):

* ``plan_transfer``: validated, compact plan;
* ``region_check``: the transport's check of the plan's rows against both sides' regions;
* ``rows``: the N x 3 rows a transport posts (written into a reused buffer; before issue 13: the plan's
  fresh ``src_descs``/``dst_descs``);
* ``total``: all three for one request, as ``NixlTransport(descriptors="dlist").write`` runs them;
* ``index_check`` and ``indices`` (issue 13's default, ``descriptors="auto"``): the check of pages and
  vectors that lets the transport post page indices, and the int32 indices into its prepared lists;
  ``total_auto``: plan, then what ``NixlTransport.write`` runs by default for that plan (indices for runs
  of at most ``base.INDEX_MAX_MEAN_RUN`` pages on average, else the row check and the rows).

Cases: the DeepSeek-V3.2 request of ``bench/plan.py`` (512 pages x 183 buffers) and the 1.2 MiB and 16 MiB
requests of ``kvferry bench``'s bandwidth section (8 layers of deepseek_v32, 16 buffers). Synthetic
addresses: nothing is copied.

With ``--posting`` it also times what one write costs in place: two NIXL agents in this process, kvferry
(``plan_transfer`` + ``NixlTransport.write``) against raw NIXL posting the same rows (``get_xfer_descs``,
``initialize_xfer``, ``transfer``), interleaved, the copy included (cma copies inside ``transfer``).

With ``--bandwidth 1,4,16`` it also runs the bandwidth rows of ``kvferry bench`` at those sizes (MiB; a
decode process of its own, end to end to the notification seen there, kvferry and raw NIXL taken in turn
``--bandwidth-repeats`` times, medians) and reports kvferry / raw NIXL posting the same rows.

With ``--handles`` it also times, for the DeepSeek-V3.2-shaped request (61 x 3 buffers of 20,000 pages, 512
pages in runs of mean length 4; page sizes cut to 16-48 bytes so that both sides fit in ~100 MB: the cost
of a handle depends on its descriptor count, not on page sizes), everything up to NIXL's ``transfer`` in
one process with two agents, each method in fresh processes (three each, medians of 35 calls):
kvferry's write by default (plan, checks, page indices, ``make_prepped_xfer``),
kvferry with ``descriptors="dlist"`` (plan, checks, rows, ``get_xfer_descs`` twice, ``initialize_xfer``)
and raw NIXL posting the plan's rows (the last two steps only). The handle is released untransferred.

With ``--steps`` it also times each step of one write in place, right after the previous request's copy
(two agents in this process, as ``--posting``; the 1.2 MiB request): ``plan_transfer``, the transport's
check, the page indices, ``make_prepped_xfer``, ``transfer`` (the copy) and the handle.

With ``--control`` it also times, per request of ``bench/control.py`` (16 pages, 2 pools, 12 buffers), the
control plane's own steps in one process, warm: prefill's ``make_spec`` and ``plan_pages``, the sampled
digests (``source_digests`` in ``send``, ``chunk_digests`` at posting), decode's ``PageDigests.from_bytes``
and ``verify_digests``; and ``digest_pages`` by where its pages are (``digest_reads_us``): the same pages
every call (cached), each request's own pages, and those after a 3 MiB copy (cold, as above).

Runs against whichever kvferry is importable, so the same command measures an older checkout:
``git archive <commit> src | tar -x -C /tmp/before`` then ``PYTHONPATH=/tmp/before/src python bench/overhead.py``.

    PYTHONPATH=src .venv/bin/python bench/overhead.py [--repeat 300] [--stat median|min] [--posting]
        [--bandwidth 1,4,16 [--bandwidth-repeats 15]] [--json out]
"""

from __future__ import annotations

import argparse
import dataclasses
import itertools
import json
import statistics
import subprocess
import sys
import time
from collections.abc import Callable
from typing import Any

import numpy as np

from kvferry.benchmark import suite
from kvferry.layout.memory import KVMemory
from kvferry.plan.planner import plan_transfer
from kvferry.transport import base

NEW = hasattr(base, "RowBuffer")  # issue 13's transport; older checkouts materialise rows on the plan
INDICES = hasattr(base, "pages_in_regions")  # issue 13, second round: page indices into prepared lists
_EVICT = np.ones(3 << 20, dtype=np.uint8), np.empty(3 << 20, dtype=np.uint8)


def timed(fn: Callable[[], object], repeat: int, cold: bool, stat: str) -> float:
    fn()
    samples = []
    for _ in range(repeat):
        if cold:
            np.copyto(_EVICT[1], _EVICT[0])
        t0 = time.perf_counter()
        fn()
        samples.append(time.perf_counter() - t0)
    return (min(samples) if stat == "min" else statistics.median(samples)) * 1e6


def cases() -> dict[str, tuple[Any, int, int]]:
    return {"v32_512_pages": (suite.planner_layout(20_000), 512, 20_000),
            "bench_1.2MiB": (suite.transfer_layout(100), 3, 100),
            "bench_16MiB": (suite.transfer_layout(400), 43, 400)}


def components(repeat: int, stat: str) -> dict[str, Any]:
    return {name: _case(layout, pages, capacity, repeat, stat) for name, (layout, pages, capacity) in cases().items()}


def _case(layout: Any, pages: int, capacity: int, repeat: int, stat: str) -> dict[str, Any]:
    src, dst = suite.synthetic_memory(layout, 1 << 40), suite.synthetic_memory(layout, 1 << 44)
    rng = np.random.default_rng(0)
    req = {"kv": (suite.random_runs(rng, pages, capacity), suite.random_runs(rng, pages, capacity))}
    plan = plan_transfer(src, dst, req)
    sd, dd = plan.src_descs, plan.dst_descs
    buf = base.RowBuffer() if NEW else None

    def plan_only() -> None:
        plan_transfer(src, dst, req)

    def check() -> None:
        if NEW:
            base.check_plan_in_regions(plan, src, dst, "p", "l")
        else:
            base.check_rows_in_regions(sd, src, "source", "p", "l")
            base.check_rows_in_regions(dd, dst, "destination", "p", "l")

    def plan_and_rows() -> None:
        p = plan_transfer(src, dst, req)
        if NEW:
            buf.rows(p)
        else:
            p.src_descs, p.dst_descs  # noqa: B018 - materialise both sides

    def total() -> None:
        p = plan_transfer(src, dst, req)
        if NEW:
            base.check_plan_in_regions(p, src, dst, "p", "l")
            buf.rows(p)
        else:
            base.check_rows_in_regions(p.src_descs, src, "source", "p", "l")
            base.check_rows_in_regions(p.dst_descs, dst, "destination", "p", "l")

    def index_check() -> None:
        base.pages_in_regions(plan, src, dst)

    def plan_and_indices() -> None:
        buf.selectors(plan_transfer(src, dst, req))

    def total_auto() -> None:
        p = plan_transfer(src, dst, req)
        if base.short_runs(p) and base.pages_in_regions(p, src, dst):
            buf.selectors(p)
        else:
            base.check_plan_in_regions(p, src, dst, "p", "l")
            buf.rows(p)

    row: dict[str, Any] = {"rows": plan.num_descriptors}
    if INDICES:
        row["indices"] = plan.num_selectors
        row["auto_posts"] = "indices" if base.short_runs(plan) else "rows"
    for cold in (False, True):
        r = {"plan_transfer": timed(plan_only, repeat, cold, stat), "region_check": timed(check, repeat, cold, stat)}
        r["rows"] = timed(plan_and_rows, repeat, cold, stat) - r["plan_transfer"]
        r["total"] = timed(total, repeat, cold, stat)
        if INDICES:
            r["index_check"] = timed(index_check, repeat, cold, stat)
            r["indices"] = timed(plan_and_indices, repeat, cold, stat) - r["plan_transfer"]
            r["total_auto"] = timed(total_auto, repeat, cold, stat)
        row["cold" if cold else "warm"] = {k: round(v, 1) for k, v in r.items()}
    return row


def _settle(handle: Any, receiver: Any, tag: bytes) -> None:
    """Wait until the write completed here and its notification ``tag`` reached the receiver (untimed)."""
    while not handle.poll():
        receiver.get_notifications()
    handle.release()
    seen: list[bytes] = []
    while tag not in seen:
        seen += [msg for _, msg in receiver.get_notifications()]



def posting(pages: int, repeat: int, stat: str) -> dict[str, Any]:
    """kvferry's write against raw NIXL posting the same rows, two agents in this process."""
    from kvferry.transport.nixl import NixlHandle, NixlTransport

    layout = suite.transfer_layout(pages * 4 + 64)
    src_mem, dst_mem = KVMemory.allocate(layout), KVMemory.allocate(layout)
    a, b = NixlTransport(), NixlTransport()
    try:
        meta_a, meta_b = a.register(src_mem), b.register(dst_mem)
        peer = a.add_peer(meta_b)
        b.add_peer(meta_a)
        dst = a._peers[peer].memory  # the peer's memory as its manifest describes it
        rng = np.random.default_rng(0)
        cap = layout.pools[0].min_pages
        req = {"kv": (suite.random_runs(rng, pages, cap), suite.random_runs(rng, pages, cap))}
        plan = plan_transfer(src_mem, dst, req)
        sd, dd, agent = plan.src_descs, plan.dst_descs, a.agent

        def kvferry(tag: bytes) -> Any:
            return a.write(plan_transfer(src_mem, dst, req), peer, tag, label="bench")

        def raw(tag: bytes) -> Any:
            xfer = agent.initialize_xfer("WRITE", agent.get_xfer_descs(sd, "DRAM"), agent.get_xfer_descs(dd, "DRAM"),
                                         peer, tag)
            return NixlHandle(a, xfer, peer, "raw", done=agent.transfer(xfer) == "DONE")

        samples: dict[str, list[float]] = {"kvferry": [], "raw": []}
        for i in range(repeat + 20):
            for name, post in (("kvferry", kvferry), ("raw", raw)):
                tag = f"{name}-{i}".encode()
                t0 = time.perf_counter()
                handle = post(tag)
                elapsed = time.perf_counter() - t0
                _settle(handle, b, tag)
                if i >= 20:
                    samples[name].append(elapsed)
        pick = min if stat == "min" else statistics.median
        k, r = pick(samples["kvferry"]) * 1e6, pick(samples["raw"]) * 1e6
        return {"pages": pages, "rows": plan.num_descriptors, "nbytes": plan.nbytes, "kvferry_us": round(k, 1),
                "raw_rows_us": round(r, 1), "ratio": round(r / k, 3)}
    finally:
        a.close()
        b.close()


def control_steps(repeat: int, stat: str) -> dict[str, float]:
    """Per-request CPU of the control plane's planning and sampled-digest steps (us), in this process."""
    import control  # bench/control.py, beside this file
    from kvferry.control.core.digests import chunk_digests, source_digests
    from kvferry.control.core.prefill_requests import make_spec
    from kvferry.integrity import digests
    from kvferry.plan.planner import plan_pages

    src, dst = control.memory("prefill"), control.memory("decode")
    rng = np.random.default_rng(0)
    spec = make_spec(src, control.src_pages(0), 0, True, None)
    dpages = control.dst_pages(0, 64)
    pairs = {p: (spec.src[p], np.asarray(dpages[p], dtype=np.int64)) for p in spec.src}
    plan = plan_pages(src, dst, pairs, spec.buffer_ids)
    sd = source_digests(src, "sampled", spec.src, spec.buffers, rng)
    wire_bytes = chunk_digests("sampled", sd, pairs, plan, 1, 0)
    # decode checks digests of its own pages: made from them here, as if the bytes had landed
    mine = digests.digest_pages(dst, {p: pairs[p][1] for p in pairs}, "sampled", seed=rng)
    landed = mine.keyed({p: pairs[p][1] for p in pairs})
    steps = {
        "make_spec": lambda: make_spec(src, control.src_pages(0), 0, True, None),
        "plan_pages": lambda: plan_pages(src, dst, pairs, spec.buffer_ids),
        "source_digests": lambda: source_digests(src, "sampled", spec.src, spec.buffers, rng),
        "chunk_digests": lambda: chunk_digests("sampled", sd, pairs, plan, 1, 0),
        "from_bytes": lambda: digests.PageDigests.from_bytes(wire_bytes),
        "verify_digests": lambda: digests.verify_digests(dst, landed),
    }
    return {name: round(timed(fn, repeat, False, stat), 1) for name, fn in steps.items()}


def digest_reads(repeat: int, stat: str) -> dict[str, float]:
    """``digest_pages`` (sampled, us) for one request of ``bench/control.py``: it reads 24 pages of 1-4 KiB
    at scattered addresses, so where those pages are decides its cost more than its Python. The same
    pages every call (cached), each call a request's own pages, and those after a 3 MiB copy (cold); drawing
    per call from a generator, and (``own pages, sampler``) from a ``PageSampler`` as ``send`` does."""
    import control  # bench/control.py, beside this file
    from kvferry.integrity import digests
    from kvferry.integrity.sampling import PageSampler

    src, rng = control.memory("prefill"), np.random.default_rng(0)
    sampler = PageSampler(np.random.default_rng(0))
    control.warm_pages(3 * repeat + 3, 1)   # every request's pages made before the clock runs (cached)
    requests = itertools.count()

    def own() -> object:
        return digests.digest_pages(src, control.src_pages(next(requests)), "sampled", seed=rng)

    return {"cached": round(timed(lambda: digests.digest_pages(src, control.src_pages(0), "sampled", seed=rng),
                                  repeat, False, stat), 1),
            "own pages": round(timed(own, repeat, False, stat), 1),
            "own pages, cold": round(timed(own, repeat, True, stat), 1),
            "own pages, sampler": round(timed(
                lambda: digests.digest_pages(src, control.src_pages(next(requests)), "sampled", seed=sampler),
                repeat, False, stat), 1)}


def handles(rounds: int = 3) -> dict[str, Any]:
    """Handle creation for the V3.2-shaped request, each method in fresh processes (``handles_one``), medians
    of ``rounds`` processes: NIXL's allocations make a method pay for another's freed memory when they
    share a process, and the figures then swap places from run to run."""
    runs: dict[str, list[dict[str, Any]]] = {}
    for _ in range(rounds):
        for method in ("auto", "dlist", "raw"):
            proc = subprocess.run([sys.executable, __file__, "--handles-one", method], capture_output=True,
                                  text=True, check=True)
            runs.setdefault(method, []).append(json.loads(proc.stdout))
    out: dict[str, Any] = {k: runs["auto"][0][k] for k in ("rows", "indices")}
    for method, rs in runs.items():
        for key in ("cpu_us", "wall_us"):
            out[f"{method}_{key}"] = round(statistics.median(r[key] for r in rs), 1)
    return out


def handles_one(method: str, calls: int = 40) -> dict[str, Any]:
    """One method's handle creation, ``calls`` times in this process (first 5 dropped): CPU and wall us."""
    from kvferry.layout.spec import Buffer, Layout, Pool
    from kvferry.transport.nixl import NixlTransport

    cap = 20_000
    bufs = [Buffer(f"L{layer}.{role}", pb, cap, "fp8", role, layer)
            for layer in range(suite.PLAN_LAYERS) for role, pb in (("mla", 48), ("idx", 16), ("idx_bf16", 32))]
    layout = Layout([Pool("kv", bufs, 64)])
    a, b = NixlTransport(descriptors="dlist" if method == "dlist" else "auto"), NixlTransport()
    try:
        meta_a = a.register(KVMemory.allocate(layout))
        peer = a.add_peer(b.register(KVMemory.allocate(layout)))
        b.add_peer(meta_a)
        src, dst = a._memory, a._peers[peer].memory
        rng = np.random.default_rng(0)
        req = {"kv": (suite.random_runs(rng, 512, cap), suite.random_runs(rng, 512, cap))}
        plan = plan_transfer(src, dst, req)
        sd, dd, agent, state = plan.src_descs, plan.dst_descs, a.agent, a._peers[peer]

        def kvferry() -> Any:
            p = plan_transfer(src, dst, req)
            return a._make_xfer(p, state, b"x", a._check_plan(p, state, "bench"))

        def raw() -> Any:
            return agent.initialize_xfer("WRITE", agent.get_xfer_descs(sd, "DRAM"), agent.get_xfer_descs(dd, "DRAM"),
                                         peer, b"x")

        make = raw if method == "raw" else kvferry
        cpu, wall = [], []
        for _ in range(calls):
            c0, t0 = time.thread_time(), time.perf_counter()
            handle = make()
            cpu.append(time.thread_time() - c0)
            wall.append(time.perf_counter() - t0)
            handle.release()
        return {"rows": plan.num_descriptors, "indices": plan.num_selectors,
                "cpu_us": statistics.median(cpu[5:]) * 1e6, "wall_us": statistics.median(wall[5:]) * 1e6}
    finally:
        a.close()
        b.close()


def steps(repeat: int, stat: str, pages: int = 3) -> dict[str, float]:
    """Each step of ``NixlTransport.write``'s default path in place, after the previous copy (us)."""
    from kvferry.transport.nixl import NixlHandle, NixlTransport

    layout = suite.transfer_layout(pages * 4 + 64)
    src_mem, dst_mem = KVMemory.allocate(layout), KVMemory.allocate(layout)
    a, b = NixlTransport(), NixlTransport()
    try:
        meta_a = a.register(src_mem)
        peer = a.add_peer(b.register(dst_mem))
        b.add_peer(meta_a)
        state = a._peers[peer]
        dst, agent = state.memory, a.agent
        rng = np.random.default_rng(0)
        cap = layout.pools[0].min_pages
        req = {"kv": (suite.random_runs(rng, pages, cap), suite.random_runs(rng, pages, cap))}
        names = ("plan_transfer", "check", "indices", "make_prepped_xfer", "transfer", "handle")
        samples: dict[str, list[float]] = {name: [] for name in names}
        for i in range(repeat + 20):
            tag = f"s{i}".encode()
            t = [time.perf_counter()]
            plan = plan_transfer(src_mem, dst, req)
            t.append(time.perf_counter())
            a._check_plan(plan, state, "bench")
            t.append(time.perf_counter())
            src_idx, dst_idx = a._rows.selectors(plan)
            t.append(time.perf_counter())
            xfer = agent.make_prepped_xfer("WRITE", a._local_list(), src_idx, a._remote_list(state), dst_idx, tag)
            t.append(time.perf_counter())
            status = agent.transfer(xfer)
            t.append(time.perf_counter())
            handle = NixlHandle(a, xfer, peer, "bench", done=status == "DONE")
            t.append(time.perf_counter())
            _settle(handle, b, tag)
            if i >= 20:
                for k, name in enumerate(names):
                    samples[name].append(t[k + 1] - t[k])
        pick = min if stat == "min" else statistics.median
        return {name: round(pick(s) * 1e6, 1) for name, s in samples.items()}
    finally:
        a.close()
        b.close()


def bandwidth(sizes_mib: list[float], repeats: int) -> list[dict[str, Any]]:
    """``kvferry bench``'s bandwidth rows at ``sizes_mib``, with kvferry / raw NIXL (same rows) ratios."""
    config = dataclasses.replace(suite.MODES["quick"], sizes_mib=tuple(sizes_mib), repeats=repeats)
    rows = suite.transfer_sections(config, lambda _msg: None, latency=False)[0]["rows"]
    return [{"mib": round(r["nbytes"] / 2**20, 2), "rows": r["descriptors"],
             "kvferry_gbps": round(r["kvferry_gbps"], 3), "raw_nixl_rows_gbps": round(r["raw_nixl_rows_gbps"], 3),
             "raw_nixl_gbps": round(r["raw_nixl_gbps"], 3),
             "ratio_vs_same_rows": round(r["kvferry_gbps"] / r["raw_nixl_rows_gbps"], 3)} for r in rows]


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--repeat", type=int, default=300)
    ap.add_argument("--stat", choices=("median", "min"), default="median")
    ap.add_argument("--posting", action="store_true", help="also time one write in place over NIXL")
    ap.add_argument("--bandwidth", metavar="MIB", help="also the bandwidth rows at these sizes, e.g. 1,4,16")
    ap.add_argument("--bandwidth-repeats", type=int, default=15)
    ap.add_argument("--no-components", action="store_true", help="skip the per-component timings")
    ap.add_argument("--control", action="store_true", help="also the control plane's per-request steps")
    ap.add_argument("--steps", action="store_true", help="also each step of a 1.2 MiB write in place")
    ap.add_argument("--handles", action="store_true", help="also NIXL handle creation for the V3.2 request")
    ap.add_argument("--handles-one", choices=("auto", "dlist", "raw"), help=argparse.SUPPRESS)
    ap.add_argument("--json", help="also write the figures to this file")
    args = ap.parse_args(argv)
    if args.handles_one:
        print(json.dumps(handles_one(args.handles_one)))
        return 0
    out: dict[str, Any] = {"version": "issue-13" if NEW else "before issue 13", "stat": args.stat}
    if not args.no_components:
        out["components_us"] = components(args.repeat, args.stat)
    if args.posting:
        out["posting"] = [posting(pages, args.repeat, args.stat) for pages in (3, 43)]
    if args.handles:
        out["handles_v32"] = handles()
    if args.steps:
        out["steps_in_place_us"] = steps(args.repeat, args.stat)
    if args.control:
        out["control_steps_us"] = control_steps(max(args.repeat, 1000), args.stat)
        out["digest_reads_us"] = digest_reads(args.repeat, args.stat)
    if args.bandwidth:
        out["bandwidth"] = bandwidth([float(x) for x in args.bandwidth.split(",")], args.bandwidth_repeats)
    print(json.dumps(out, indent=1))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(out, f, indent=2)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
