"""One side of a cross-TP transfer in its own OS process: all of that side's TP ranks, one NIXL agent each.

Used by ``tests/test_tp.py`` (two processes on one host) and ``bench/tp.py`` (also across the veth pair of
``make_veth_pair``, below, which ``tests/test_netns.py`` uses to run the real endpoints on two "hosts").
Why one process per *side* and not per rank: each rank still has its own memory, its own
``NixlTransport`` (agent, registration, connections), so the data path is exactly the per-rank one; but
on a 2-core CI host, six processes each importing nixl and spinning UCX would measure the scheduler, not
kvferry.

Control channel (ZMQ REQ/REP, decode binds): prefill sends its ranks' transport metadata; decode answers
with its ranks' metadata, manifests and the page lists; prefill plans with ``kvferry.plan.tp`` and writes
``reps`` times; decode drives progress until every expected notification arrived, checks every requested
page of every buffer byte for byte against the logical KV, and sends the verdict back.

Modes: ``kvferry`` (TP plans over ``NixlTransport``) and ``raw`` (the NIXL API directly, one descriptor per
whole region of a TP 1 layout holding the same bytes: the link's ceiling for the bandwidth comparison).
Prints one JSON line on stdout.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import msgspec
import numpy as np

from kvferry import Buffer, KVMemory, Layout, Pool
from kvferry.layout import HeadGeometry
from kvferry.plan import TPPlanner, shard_layout, source_ranks

KV_HEADS, HEAD_DIM, BF16 = 8, 128, 2  # Llama 3.1 8B: num_key_value_heads=8, head_dim=128, bfloat16


# -- the layout and its logical contents (shared by both sides and by the tests) -------------------------
def llama_like(num_layers: int = 2, num_pages: int = 24, tokens: int = 16, major: str = "head",
               heads: int = KV_HEADS, head_bytes: int = HEAD_DIM * BF16) -> Layout:
    """A full (TP 1) GQA layout, heterogeneous: sharded K/V per layer, a replicated indexer-like buffer with
    fewer pages, and a replicated per-request state pool."""
    kv = []
    for i in range(num_layers):
        geo = HeadGeometry(heads, head_bytes, tokens, major)
        kv += [Buffer(f"L{i}.{r}", geo.page_bytes, num_pages, "bf16", r, i, geo) for r in ("k", "v")]
        idx = HeadGeometry(1, 132, tokens, major, replicated=True)
        kv.append(Buffer(f"L{i}.idx", idx.page_bytes, num_pages - 4, "fp8_e4m3", "index_k", i, idx))
    state = HeadGeometry.whole_page(3000)
    return Layout([Pool("kv", kv, tokens), Pool("state", [Buffer("state", 3000, 6, "uint8", "state", None, state)])])


def full_arrays(layout: Layout, seed: int) -> dict[str, np.ndarray]:
    """The logical KV of every page of ``layout`` (TP 1), reproducible from ``seed`` on either side."""
    rng = np.random.default_rng(seed)
    return {b.name: rng.integers(0, 256, (b.num_pages, b.page_bytes), dtype=np.uint8) for b in layout.buffers}


def rank_pages(full: np.ndarray, buf: Buffer, tp: int, rank: int) -> np.ndarray:
    """Rank ``rank``'s bytes of every page of ``full`` (``buf`` is the TP 1 buffer)."""
    h = buf.heads
    if h is None or h.replicated or tp == 1:
        return full
    per = h.num_heads // tp
    lo, hi, n = rank * per, (rank + 1) * per, len(full)
    if h.major == "head":
        return full.reshape(n, h.num_heads, -1)[:, lo:hi].reshape(n, -1)
    return full.reshape(n, h.tokens_per_page, h.num_heads, -1)[:, :, lo:hi].reshape(n, -1)


def rank_memory(full_layout: Layout, tp: int, rank: int, data: dict[str, np.ndarray] | None) -> KVMemory:
    """Rank ``rank``'s memory: filled from the logical KV when ``data`` is given, zeroed otherwise."""
    layout = shard_layout(full_layout, tp, rank)
    if data is None:
        return KVMemory.allocate(layout)
    # A copy per rank, as real ranks own their memory: a replicated buffer's pages are the full array
    # itself, and a view shared between ranks let one rank's transport fault corrupt another's bytes.
    arrays = {b.name: np.array(rank_pages(data[b.name], b, tp, rank), order="C", copy=True)
              for b in full_layout.buffers}
    return KVMemory.from_arrays(layout, arrays)


def request_pages(src_layout: Layout, dst_layout: Layout, seed: int) -> dict[str, tuple[list[int], list[int]]]:
    """Scattered, partly consecutive source and destination pages per pool (reuse is where bugs live)."""
    rng = np.random.default_rng(seed + 1)
    out = {}
    for sp, dp in zip(src_layout.pools, dst_layout.pools):
        n = min(sp.min_pages, dp.min_pages) * 2 // 3
        src = rng.permutation(sp.min_pages)[:n]
        dst = np.sort(rng.choice(dp.min_pages, n, replace=False))  # sorted: some runs stay consecutive
        out[sp.name] = (src.tolist(), dst.tolist())
    return out


def check_rank(mem: KVMemory, full_layout: Layout, data: dict[str, np.ndarray], tp: int, rank: int,
               pages: dict[str, tuple[list[int], list[int]]]) -> list[str]:
    """Every buffer's requested pages hold the rank's heads of the source pages; other pages are zero."""
    errors = []
    for pool in full_layout.pools:
        src, dst = (np.asarray(x, dtype=np.int64) for x in pages[pool.name])
        for buf in pool.buffers:
            got = mem.array(buf.name)
            want = rank_pages(data[buf.name][src], buf, tp, rank)
            if not np.array_equal(got[dst], want):
                bad = int(np.flatnonzero((got[dst] != want).any(axis=1))[0])
                errors.append(f"rank {rank} buffer {buf.name}: page {int(dst[bad])} differs")
            rest = np.ones(len(got), dtype=bool)
            rest[dst] = False
            if got[rest].any():
                errors.append(f"rank {rank} buffer {buf.name}: a page outside the request was written")
    return errors


# -- harness: run both roles as subprocesses (tests, bench) -----------------------------------------------
def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run_pair(args: list[str], prefill_prefix: list[str] | None = None, decode_prefix: list[str] | None = None,
             addr: str | None = None, timeout: float = 60) -> dict[str, Any]:
    """Run this script as decode then prefill (each after its command prefix, e.g. ``ip netns exec NS``);
    return prefill's JSON result. Both must exit 0."""
    addr = addr or f"tcp://127.0.0.1:{free_port()}"
    cmd = [sys.executable, str(Path(__file__).resolve()), "--addr", addr, *args]
    kw: dict[str, Any] = {"cwd": Path(__file__).resolve().parents[1], "stdout": subprocess.PIPE,
                          "stderr": subprocess.PIPE, "text": True}
    dec = subprocess.Popen([*(decode_prefix or []), *cmd, "--role", "decode"], **kw)
    try:
        pre = subprocess.run([*(prefill_prefix or []), *cmd, "--role", "prefill"], timeout=timeout, **kw)
        _, d_err = dec.communicate(timeout=timeout)
    finally:
        dec.kill()
    lines = [x for x in pre.stdout.splitlines() if x.startswith("{")]
    if pre.returncode or dec.returncode or not lines:
        raise RuntimeError(f"peers failed (prefill rc {pre.returncode}, decode rc {dec.returncode}):\n"
                           f"prefill stdout: {pre.stdout[-2000:]}\nprefill stderr: {pre.stderr[-2000:]}\n"
                           f"decode stderr: {d_err[-2000:]}")
    return json.loads(lines[-1])


# -- two "hosts": network namespaces joined by a veth pair (tests, bench) -----------------------------------
class NetnsUnavailable(RuntimeError):
    """Network namespaces cannot be made here (not root, no iproute2, no CAP_SYS_ADMIN)."""


@dataclass(frozen=True)
class Side:
    netns: str
    dev: str
    ip: str

    def prefix(self) -> list[str]:
        """Run a command inside this namespace with UCX on TCP over this side's veth only."""
        return ["ip", "netns", "exec", self.netns, "env", "UCX_TLS=tcp", f"UCX_NET_DEVICES={self.dev}"]

    def tx_bytes(self) -> int:
        link = json.loads(ip("-n", self.netns, "-j", "-s", "link", "show", "dev", self.dev))[0]
        return int(link["stats64"]["tx"]["bytes"])


def ip(*args: str) -> str:
    return subprocess.run(["ip", *args], check=True, capture_output=True, text=True, timeout=10).stdout


def _unavailable_reason() -> str | None:
    if os.geteuid() != 0:
        return "needs root to create network namespaces"
    if shutil.which("ip") is None:
        return "needs iproute2's `ip` to create network namespaces"
    return None


@contextmanager
def make_veth_pair(tag: str) -> Iterator[tuple[Side, Side]]:
    """Two namespaces and a veth between them, 10.200.N.1/30 <-> 10.200.N.2/30; always deleted after."""
    reason = _unavailable_reason()
    if reason:
        raise NetnsUnavailable(reason)
    subnet = os.getpid() % 250  # addresses live only inside these namespaces; distinct runs do not clash
    pre = Side(f"kvf{tag}p", f"kvf{tag}p", f"10.200.{subnet}.1")
    dec = Side(f"kvf{tag}d", f"kvf{tag}d", f"10.200.{subnet}.2")
    made: list[str] = []
    try:
        for side in (pre, dec):
            try:
                ip("netns", "add", side.netns)
            except subprocess.CalledProcessError as exc:
                raise NetnsUnavailable(f"cannot create a network namespace here: {exc.stderr.strip()}") from exc
            made.append(side.netns)
        ip("link", "add", pre.dev, "type", "veth", "peer", "name", dec.dev)
        for side in (pre, dec):
            ip("link", "set", side.dev, "netns", side.netns)
            ip("-n", side.netns, "addr", "add", f"{side.ip}/30", "dev", side.dev)
            ip("-n", side.netns, "link", "set", side.dev, "up")
            ip("-n", side.netns, "link", "set", "lo", "up")
        yield pre, dec
    finally:
        for ns in made:  # deleting a namespace deletes its end of the veth, and with it the pair
            subprocess.run(["ip", "netns", "del", ns], capture_output=True, timeout=10)


# -- the two roles -------------------------------------------------------------------------------------
class _Hello(msgspec.Struct):
    metadata: list[bytes]


class _Answer(msgspec.Struct):
    metadata: list[bytes]
    manifests: list[bytes]
    pages: dict[str, tuple[list[int], list[int]]]


def _layout_of(args: argparse.Namespace) -> Layout:
    return llama_like(args.layers, args.pages, args.tokens, args.major)


def _transports(n: int, prefix: str) -> list[Any]:
    from kvferry.transport.nixl import NixlTransport

    return [NixlTransport(f"{prefix}-{r}-{os.getpid()}") for r in range(n)]


def run_decode(args: argparse.Namespace, sock: Any) -> dict[str, Any]:
    full = _layout_of(args)
    dst_full = full.with_capacities({b.name: b.num_pages + 5 for b in full.buffers})  # own capacities
    mems = [rank_memory(dst_full, args.dtp, d, None) for d in range(args.dtp)]
    trs = _transports(args.dtp, "decode")
    meta = [t.register(m) for t, m in zip(trs, mems)]
    hello = msgspec.msgpack.decode(sock.recv(), type=_Hello)
    for t in trs:
        for m in hello.metadata:
            t.add_peer(m)
    pages = request_pages(full, dst_full, args.seed)
    sock.send(msgspec.msgpack.encode(_Answer(meta, [m.manifest() for m in mems], pages)))
    expected = sum(len(source_ranks(d, args.ptp, args.dtp)) for d in range(args.dtp)) * args.reps
    seen = _drain(trs, expected, args.timeout)
    data = full_arrays(full, args.seed)
    errors = [e for d, m in enumerate(mems) for e in check_rank(m, full, data, args.dtp, d, pages)]
    verdict = {"role": "decode", "ok": not errors and seen >= expected, "notifications": seen,
               "expected": expected, "errors": errors[:10]}
    sock.recv()  # prefill's "finished": answer with the verdict, then both sides close
    sock.send(json.dumps(verdict).encode())
    for t in trs:
        t.close()
    return verdict


def _drain(trs: list[Any], expected: int, timeout: float) -> int:
    """Drive progress on every decode agent until ``expected`` notifications arrived (or time runs out)."""
    seen, deadline = 0, time.monotonic() + timeout
    while seen < expected and time.monotonic() < deadline:
        got = sum(len(t.get_notifications()) for t in trs)
        seen += got
        if not got:
            time.sleep(20e-6)
    return seen


def run_prefill(args: argparse.Namespace, sock: Any) -> dict[str, Any]:
    full = _layout_of(args)
    data = full_arrays(full, args.seed)
    mems = [rank_memory(full, args.ptp, r, data) for r in range(args.ptp)]
    trs = _transports(args.ptp, "prefill")
    sock.send(msgspec.msgpack.encode(_Hello([t.register(m) for t, m in zip(trs, mems)])))
    ans = msgspec.msgpack.decode(sock.recv(), type=_Answer)
    remote = [KVMemory.from_manifest(m) for m in ans.manifests]
    jobs = []  # (transport, peer, plan): every pair a decode rank needs, planned once
    for d, meta in enumerate(ans.metadata):
        for r in source_ranks(d, args.ptp, args.dtp):
            peer = trs[r].add_peer(meta)
            jobs.append((trs[r], peer, TPPlanner(mems[r], remote[d]).plan(ans.pages)))
    times = [_write_all(jobs, rep) for rep in range(args.reps)]
    sock.send(b"finished")
    verdict = json.loads(sock.recv())
    for t in trs:
        t.close()
    nbytes = sum(j[2].nbytes for j in jobs)
    return {"role": "prefill", "mode": "kvferry", "ok": verdict["ok"], "decode": verdict, "bytes": nbytes,
            "descriptors": sum(j[2].num_descriptors for j in jobs), "seconds": times}


def _write_all(jobs: list[tuple[Any, str, Any]], rep: int) -> float:
    t0 = time.perf_counter()
    handles = [t.write(plan, peer, f"{rep}:{i}".encode(), f"rep{rep}.{i}") for i, (t, peer, plan) in enumerate(jobs)]
    for h in handles:
        h.wait(60.0)
        h.release()
    return time.perf_counter() - t0


# -- raw NIXL baseline ---------------------------------------------------------------------------------
def _raw_agent(name: str, mem: KVMemory) -> tuple[Any, list[tuple[int, int, int]]]:
    os.environ.setdefault("NIXL_LOG_LEVEL", "WARN")  # as NixlTransport does: INFO logs go to stdout
    from nixl._api import nixl_agent, nixl_agent_config

    agent = nixl_agent(name, nixl_agent_config(enable_prog_thread=False, backends=["UCX"]))
    regs = [(r.address, r.nbytes, 0) for r in mem.regions]
    agent.register_memory([(*r, "") for r in regs], "DRAM")
    return agent, regs


def run_raw(args: argparse.Namespace, sock: Any) -> dict[str, Any]:
    """Both roles of the baseline: a TP 1 layout of the same bytes, one descriptor per whole region."""
    full = _layout_of(args)
    mem = KVMemory.allocate(full)
    agent, regs = _raw_agent(f"raw-{args.role}-{os.getpid()}", mem)
    if args.role == "decode":
        agent.add_remote_agent(sock.recv())
        sock.send(msgspec.msgpack.encode([agent.get_agent_metadata(), regs]))
        seen, deadline = 0, time.monotonic() + args.timeout
        while seen < args.reps and time.monotonic() < deadline:
            seen += sum(len(v) for v in agent.get_new_notifs().values())
        sock.recv()
        sock.send(json.dumps({"ok": seen == args.reps}).encode())
        return {"role": "decode", "mode": "raw", "ok": seen == args.reps}
    sock.send(agent.get_agent_metadata())
    meta, remote_regs = msgspec.msgpack.decode(sock.recv())
    peer = agent.add_remote_agent(meta)
    src = agent.get_xfer_descs(np.array(regs, dtype=np.uint64), "DRAM")
    dst = agent.get_xfer_descs(np.array(remote_regs, dtype=np.uint64), "DRAM")
    times = []
    for rep in range(args.reps):
        t0 = time.perf_counter()
        xfer = agent.initialize_xfer("WRITE", src, dst, peer, f"raw{rep}".encode())
        state = agent.transfer(xfer)
        while state not in ("DONE", "ERR"):
            state = agent.check_xfer_state(xfer)
        times.append(time.perf_counter() - t0)
        agent.release_xfer_handle(xfer)
    sock.send(b"finished")
    ok = json.loads(sock.recv())["ok"] and state == "DONE"
    return {"role": "prefill", "mode": "raw", "ok": ok, "bytes": mem.layout.nbytes, "descriptors": len(regs),
            "seconds": times}


def main(argv: list[str] | None = None) -> int:
    import zmq

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--role", choices=("prefill", "decode"), required=True)
    ap.add_argument("--addr", required=True, help="ZMQ endpoint: decode binds it, prefill connects to it")
    ap.add_argument("--mode", choices=("kvferry", "raw"), default="kvferry")
    ap.add_argument("--ptp", type=int, default=4)
    ap.add_argument("--dtp", type=int, default=2)
    ap.add_argument("--layers", type=int, default=2)
    ap.add_argument("--pages", type=int, default=24)
    ap.add_argument("--tokens", type=int, default=16)
    ap.add_argument("--major", choices=("head", "token"), default="head")
    ap.add_argument("--reps", type=int, default=1)
    ap.add_argument("--seed", type=int, default=7)
    ap.add_argument("--timeout", type=float, default=60.0)
    args = ap.parse_args(argv)
    ctx = zmq.Context()
    sock = ctx.socket(zmq.REP if args.role == "decode" else zmq.REQ)
    sock.setsockopt(zmq.LINGER, 0)
    sock.setsockopt(zmq.RCVTIMEO, int(args.timeout * 1000))
    (sock.bind if args.role == "decode" else sock.connect)(args.addr)
    try:
        if args.mode == "raw":
            result = run_raw(args, sock)
        else:
            result = (run_decode if args.role == "decode" else run_prefill)(args, sock)
    finally:
        sock.close()
        ctx.term()
    print(json.dumps(result), flush=True)
    return 0 if result["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
