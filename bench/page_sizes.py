"""Different page sizes on the two sides, over NIXL (not a test): ``.venv/bin/python bench/page_sizes.py``.

A Llama 3.1 8B request (32 layers, 8 KV heads of 128 bf16, K and V apart) moves from a prefill process
whose pool holds ``S`` tokens a page into a decode process holding ``D`` (``kvferry.plan.tokens``), for
16 -> 64, 64 -> 16 and equal sizes, head-major pages (vLLM's CPU kernels: each head's tokens contiguous) and
token-major ones (flash-attention's ``[block][token][head]``). For each: the rows kvferry posts, the plan's
time, and GB/s end to end (write posted to decode's notification seen) of kvferry (plan + write) against
raw NIXL posting the same rows (no planning, no checks), in the same run, round-robin. Decode's bytes are
checked against the token-by-token reference before anything is timed.

Then the same through the endpoints (``--no-endpoints`` skips it): a ``PrefillEndpoint`` and a
``DecodeEndpoint`` over NIXL (one process, an agent each), decode announcing the request and prefill sending
it in one chunk, push mode, digests off; timed from ``send`` to decode's ``wait`` returning (the handshake's
``PageSizePlanner`` plans it, the write and its notification land, decode's progress thread sees it DONE).
Beside it, in the same run and round-robin, raw NIXL posting the very rows the session plans between a pair
of agents of its own over the same memory (the target's polled between polls of the write), timed to the write's
completion. Decode's bytes are checked token by token first. ``--quick`` shrinks it to a smoke run (a test
runs it so, as a subprocess, and checks its exit status).

Prints Markdown tables; ``--json PATH`` also writes the figures.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from kvferry import Buffer, KVMemory, Layout, Pool
from kvferry.benchmark.suite import _NixlPeer, _round_robin, nixl_available
from kvferry.layout import HeadGeometry
from kvferry.plan.tokens import PageSizePlanner, TokenPlanner, TokenSpan

LAYERS, HEADS, HEAD_BYTES = 32, 8, 128 * 2   # Llama 3.1 8B config.json, bf16
PAIRS = ((16, 64), (64, 16), (16, 16), (64, 64))


def llama(tokens: int, pages: int, major: str) -> Layout:
    geo = HeadGeometry(HEADS, HEAD_BYTES, tokens, major)
    return Layout([Pool("kv", [Buffer(f"L{i}.{r}", geo.page_bytes, pages, "bf16", r, i, geo)
                               for i in range(LAYERS) for r in ("k", "v")], tokens)])


def case(src_t: int, dst_t: int, major: str, tokens: int, repeats: int, rng: np.random.Generator) -> dict:
    cap_tokens = 4 * tokens
    src = KVMemory.allocate(llama(src_t, cap_tokens // src_t, major))
    for buf in src.layout.buffers:
        src.array(buf.name)[...] = rng.integers(0, 256, size=(buf.num_pages, buf.page_bytes), dtype=np.uint8)
    peer = _NixlPeer(src)
    peer.dst_layout = llama(dst_t, cap_tokens // dst_t, major)
    peer.start()
    try:
        # Scattered pages on both sides, as allocators that reuse pages hand them out
        span = TokenSpan(rng.permutation(cap_tokens // src_t)[:tokens // src_t],
                         rng.permutation(cap_tokens // dst_t)[:tokens // dst_t])
        planner = TokenPlanner(peer.src, peer.dst)
        plan = planner.plan({"kv": span})
        reps = 50
        t0 = time.perf_counter()
        for _ in range(reps):
            planner.plan({"kv": span})
        plan_us = (time.perf_counter() - t0) / reps * 1e6

        def kvferry(tag: bytes) -> None:
            with peer.xport.write(planner.plan({"kv": span}), peer.peer, tag, label="bench") as handle:
                handle.wait(60.0)

        peer.end_to_end(kvferry)
        check(peer, span, src_t, dst_t)
        times = _round_robin(peer, {"kvferry": kvferry, "raw_nixl_rows": peer.raw_write(plan.src_descs,
                                                                                        plan.dst_descs)}, repeats)
    finally:
        peer.close()
    return {"src_tokens": src_t, "dst_tokens": dst_t, "major": major, "tokens": tokens, "rows": plan.num_descriptors,
            "nbytes": plan.nbytes, "plan_us": plan_us,
            **{f"{k}_gbps": plan.nbytes / t / 1e9 for k, t in times.items()},
            "ratio": times["raw_nixl_rows"] / times["kvferry"]}


def check(peer: _NixlPeer, span: TokenSpan, src_t: int, dst_t: int) -> None:
    """Decode's pages hold, token by token, what prefill's did (two buffers, every head)."""
    for name in ("L0.k", f"L{LAYERS - 1}.v"):
        got = np.frombuffer(peer.dst_pages(name, np.asarray(span.dst_pages)), dtype=np.uint8)
        got = got.reshape(len(span.dst_pages), -1)
        src = peer.src.array(name)[np.asarray(span.src_pages)]
        major = peer.src.layout.buffer(name).heads.major
        n = min(len(span.src_pages) * src_t, len(span.dst_pages) * dst_t)
        if not np.array_equal(tokens_of(got, dst_t, major)[:n], tokens_of(src, src_t, major)[:n]):
            raise RuntimeError(f"{name}: decode's tokens differ from prefill's ({src_t} -> {dst_t}, {major}-major)")


def tokens_of(pages: np.ndarray, tpp: int, major: str) -> np.ndarray:
    """[pages][page bytes] -> [token][head][bytes], whichever the page's major."""
    if major == "head":
        shaped = pages.reshape(len(pages), HEADS, tpp, HEAD_BYTES).transpose(0, 2, 1, 3)
    else:
        shaped = pages.reshape(len(pages), tpp, HEADS, HEAD_BYTES)
    return shaped.reshape(len(pages) * tpp, HEADS, HEAD_BYTES)


def endpoint_case(src_t: int, dst_t: int, major: str, tokens: int, repeats: int, rng: np.random.Generator) -> dict:
    """One pair through the endpoints (push), against raw NIXL posting the session's rows; median seconds."""
    from kvferry.control import DecodeEndpoint, EndpointOptions, PrefillEndpoint
    from kvferry.transport.nixl import NixlHandle, NixlTransport

    cap_tokens = 4 * tokens
    src = KVMemory.allocate(llama(src_t, cap_tokens // src_t, major))
    dst = KVMemory.allocate(llama(dst_t, cap_tokens // dst_t, major))
    for buf in src.layout.buffers:
        src.array(buf.name)[...] = rng.integers(0, 256, size=(buf.num_pages, buf.page_bytes), dtype=np.uint8)
    src_pages = rng.permutation(cap_tokens // src_t)[:tokens // src_t]
    dst_pages = rng.permutation(cap_tokens // dst_t)[:tokens // dst_t]
    opts = EndpointOptions(request_timeout=3600.0)
    with PrefillEndpoint(src, "nixl", digest_mode="off", options=opts) as prefill, \
            DecodeEndpoint(dst, "nixl", digest_mode="off", options=opts) as decode:
        decode.connect(prefill.address)
        # A request decode waits for throughout (its pages apart, never sent): decode's loop then polls as it
        # does while a write is due, for both methods alike (UCX needs the target's progress to finish a write)
        spare = np.setdiff1d(np.arange(cap_tokens // dst_t), dst_pages)[:1]
        decode.announce("keepalive", {"kv": spare})
        plan = PageSizePlanner(src, dst).plan({"kv": TokenSpan(src_pages, dst_pages, 0, 0, 0, tokens)})
        count = iter(range(1 << 30))

        def kvferry() -> float:
            rid = f"r{next(count)}"
            decode.announce(rid, {"kv": dst_pages})
            t0 = time.perf_counter()
            prefill.send(rid, {"kv": src_pages}, last=True)
            decode.wait(rid, 60.0)
            elapsed = time.perf_counter() - t0
            prefill.wait(rid, 60.0)
            return elapsed

        # Raw NIXL: a pair of agents of its own over the same memory (an endpoint's agent belongs to its
        # progress thread; a second thread posting on it races it inside UCX). The target's agent is polled
        # meanwhile, as decode's loop polls its own while a write is due.
        raw_src, raw_dst = NixlTransport(), NixlTransport()
        src_meta = raw_src.register(src)
        peer = raw_src.add_peer(raw_dst.register(dst))
        raw_dst.add_peer(src_meta)
        agent = raw_src.agent

        def raw() -> float:
            t0 = time.perf_counter()
            xfer = agent.initialize_xfer("WRITE", agent.get_xfer_descs(plan.src_descs, "DRAM"),
                                         agent.get_xfer_descs(plan.dst_descs, "DRAM"), peer, b"raw")
            status = agent.transfer(xfer)
            if status == "ERR":
                xfer.release()
                raise RuntimeError("raw NIXL write failed")
            with NixlHandle(raw_src, xfer, peer, "raw", done=status == "DONE") as handle:
                while not handle.poll():   # both agents' progress from this thread, busy
                    if time.perf_counter() - t0 > 60.0:
                        raise RuntimeError("raw NIXL write not done after 60 s")
                    raw_dst.agent.get_new_notifs()
            return time.perf_counter() - t0

        kvferry()
        for name in ("L0.k", f"L{LAYERS - 1}.v"):
            got = tokens_of(dst.array(name)[dst_pages], dst_t, major)
            if not np.array_equal(got, tokens_of(src.array(name)[src_pages], src_t, major)):
                raise RuntimeError(f"{name}: decode's tokens differ from prefill's ({src_t} -> {dst_t}, {major})")
        raw()
        samples: dict[str, list[float]] = {"kvferry": [], "raw": []}
        for _ in range(repeats):   # round-robin: load that comes and goes hits both alike
            samples["kvferry"].append(kvferry())
            samples["raw"].append(raw())
        raw_src.close()
        raw_dst.close()
    med = {k: float(np.median(v)) for k, v in samples.items()}
    return {"src_tokens": src_t, "dst_tokens": dst_t, "major": major, "tokens": tokens,
            "rows": plan.num_descriptors, "nbytes": plan.nbytes,
            "endpoints_gbps": plan.nbytes / med["kvferry"] / 1e9, "raw_nixl_rows_gbps": plan.nbytes / med["raw"] / 1e9,
            "endpoints_ms": med["kvferry"] * 1e3, "raw_ms": med["raw"] * 1e3, "ratio": med["raw"] / med["kvferry"]}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokens", type=int, default=1024, help="tokens per request (default 1024: 128 MiB)")
    parser.add_argument("--repeats", type=int, default=9)
    parser.add_argument("--json", type=Path, default=None)
    parser.add_argument("--no-planner", action="store_true", help="skip the planner's table (TokenPlanner alone)")
    parser.add_argument("--no-endpoints", action="store_true", help="skip the endpoints' table")
    parser.add_argument("--quick", action="store_true", help="64 tokens, one repeat: a smoke run")
    args = parser.parse_args()
    if args.quick:
        args.tokens, args.repeats = 64, 1
    if not nixl_available():
        print("nixl is not installed: nothing to measure")
        return 1
    rng = np.random.default_rng(0)
    out: dict[str, list[dict]] = {}
    if not args.no_planner:
        rows = out["planner"] = [case(s, d, major, args.tokens, args.repeats, rng)
                                 for major in ("head", "token") for s, d in PAIRS]
        print("| pages (prefill -> decode tokens) | major | rows posted | plan | kvferry | raw NIXL, same rows "
              "| ratio |")
        print("|---|---|---|---|---|---|---|")
        for r in rows:
            print(f"| {r['src_tokens']} -> {r['dst_tokens']} | {r['major']} | {r['rows']:,} | {r['plan_us']:,.0f} us "
                  f"| {r['kvferry_gbps']:.2f} GB/s | {r['raw_nixl_rows_gbps']:.2f} GB/s | {r['ratio']:.2f}x |")
    if not args.no_endpoints:
        rows = out["endpoints"] = [endpoint_case(s, d, major, args.tokens, args.repeats, rng)
                                   for major in ("head", "token") for s, d in PAIRS[:3]]
        print()
        print("| endpoints (prefill -> decode tokens) | major | rows posted | send -> decode DONE | "
              "raw NIXL, same rows | ratio |")
        print("|---|---|---|---|---|---|")
        for r in rows:
            print(f"| {r['src_tokens']} -> {r['dst_tokens']} | {r['major']} | {r['rows']:,} | "
                  f"{r['endpoints_gbps']:.2f} GB/s ({r['endpoints_ms']:.1f} ms) | {r['raw_nixl_rows_gbps']:.2f} GB/s "
                  f"({r['raw_ms']:.1f} ms) | {r['ratio']:.2f}x |")
    if args.json:
        args.json.write_text(json.dumps(out, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
