"""A prefill process for the page-size tests over NIXL, and the layouts and requests those tests share.

As a module: ``layout`` (a pool of K/V and indexer buffers at some tokens per page, head- or token-major),
``request`` (one request's source pages, decode's lease and prefill's chunks) and ``expected`` (decode's
buffers once the request landed, token by token: the slow, obvious way). As a program
(``python tests/page_size_peer.py '<json list>'``, each item with keys ``tokens``, ``major``, ``mode``,
``digest_mode``, ``seed``): one prefill endpoint over NIXL per item; prints ``{"addresses": [...]}``, then
answers JSON lines: ``send`` (``index`` of the endpoint, ``rid``, ``chunks``: [[pages, offset], ...], the
last marked last), ``wait`` (``index``, ``rid``), ``exit``.
"""

from __future__ import annotations

import itertools
import json
import sys
from typing import Any

import numpy as np

from kvferry import Buffer, KVMemory, Layout, Pool
from kvferry.layout import HeadGeometry

TIMEOUTS = {"heartbeat_interval": 0.2, "peer_timeout": 1.0, "lease_grace": 1.0, "request_timeout": 30.0}


def layout(tokens: int, *, major: str = "head", pages: int = 40, heads: int = 2, head_bytes: int = 8) -> Layout:
    """K and V of two layers and an fp8 indexer (one head of 4 bytes), each its own page count."""
    bufs = []
    for i in range(2):
        geo = HeadGeometry(heads, head_bytes, tokens, major)
        idx = HeadGeometry(1, 4, tokens, major)
        bufs += [Buffer(f"L{i}.k", geo.page_bytes, pages, "bf16", "k", i, geo),
                 Buffer(f"L{i}.v", geo.page_bytes, pages + 3, "bf16", "v", i, geo),
                 Buffer(f"L{i}.idx", idx.page_bytes, pages - 2, "fp8", "index_k", i, idx)]
    return Layout([Pool("kv", bufs, tokens)])


def filled(lay: Layout, seed: int) -> KVMemory:
    mem = KVMemory.allocate(lay)
    rng = np.random.default_rng(seed)
    for buf in lay.buffers:
        arr = mem.array(buf.name)
        arr[...] = rng.integers(0, 256, size=arr.shape, dtype=np.uint8)
    return mem


def request(ts: int, td: int, tokens: int, prefix: int, seed: int, *, src_cap: int = 37, dst_cap: int = 57,
            chunks: int = 3, taken: Any = ()) -> tuple[np.ndarray, np.ndarray, list[tuple[np.ndarray, int]]]:
    """(prefill's pages of the whole request, decode's lease past its ``prefix`` pages, none of ``taken``,
    prefill's chunks as (pages, position)): pages drawn at random, chunks cut at random source positions."""
    rng = np.random.default_rng(seed)
    ns, nd = -(-tokens // ts), -(-tokens // td) - prefix
    src = rng.permutation(src_cap)[:ns]
    free = np.setdiff1d(np.arange(dst_cap), np.asarray(taken, dtype=np.int64))
    dst = rng.permutation(free)[:nd]
    cuts = sorted({0, ns, *rng.integers(1, max(ns, 2), size=chunks - 1).tolist()})
    return src, dst, [(src[a:b], a) for a, b in itertools.pairwise(cuts)]


def expected(src: KVMemory, dst: KVMemory, src_pages: np.ndarray, dst_pages: np.ndarray,
             dst_first: int) -> dict[str, np.ndarray]:
    """Decode's buffers once the request landed: token by token, head by head, every token that both
    sides' pages cover past decode's prefix (``dst_first`` tokens) copied where decode keeps it."""
    out = {b.name: dst.array(b.name).copy() for b in dst.layout.buffers}
    sp, dp = src.layout.pools[0], dst.layout.pools[0]
    ts, td = sp.tokens_per_page, dp.tokens_per_page
    assert ts is not None and td is not None
    stop = min(len(src_pages) * ts, dst_first + len(dst_pages) * td)
    for sb, db in zip(sp.buffers, dp.buffers):
        sh, dh = sb.heads, db.heads
        assert sh is not None and dh is not None
        hb, src_arr = sh.head_bytes, src.array(sb.name)
        for t in range(dst_first, stop):
            spage, se = src_pages[t // ts], t % ts
            dpage, de = dst_pages[(t - dst_first) // td], (t - dst_first) % td
            for h in range(sh.num_heads):
                if sh.major == "head":
                    so, do = (h * ts + se) * hb, (h * td + de) * hb
                else:
                    so, do = (se * sh.num_heads + h) * hb, (de * dh.num_heads + h) * hb
                out[db.name][dpage, do:do + hb] = src_arr[spage, so:so + hb]
    return out


def _serve(cfgs: list[dict[str, Any]]) -> None:
    from kvferry.control import EndpointOptions, PrefillEndpoint

    eps = [PrefillEndpoint(filled(layout(cfg["tokens"], major=cfg.get("major", "head")), cfg.get("seed", 1)),
                           "nixl", options=EndpointOptions(**TIMEOUTS), mode=cfg.get("mode", "push"),
                           digest_mode=cfg.get("digest_mode", "full")) for cfg in cfgs]
    try:
        _reply({"addresses": [ep.address for ep in eps]})
        for line in sys.stdin:
            cmd = json.loads(line)
            if cmd["op"] == "exit":
                break
            ep = eps[cmd.get("index", 0)]
            try:
                if cmd["op"] == "send":
                    chunks = cmd["chunks"]
                    for i, (pages, offset) in enumerate(chunks):
                        ep.send(cmd["rid"], {"kv": np.array(pages, dtype=np.int64)}, offset=offset,
                                last=i == len(chunks) - 1)
                elif cmd["op"] == "wait":
                    ep.wait(cmd["rid"], cmd.get("timeout", 30.0))
                _reply({"ok": True})
            except Exception as exc:  # reported to the test, which reads it
                _reply({"error": f"{type(exc).__name__}: {exc}"})
    finally:
        for ep in eps:
            ep.close()
    _reply({"ok": True})


def _reply(obj: dict[str, Any]) -> None:
    sys.stdout.write(json.dumps(obj) + "\n")
    sys.stdout.flush()


if __name__ == "__main__":
    _serve(json.loads(sys.argv[1]))
