"""Prefill and decode with different page sizes, through the endpoints: byte-exact, push and pull.

Every pair moves requests in several chunks with a decode prefix (a source page straddling it where the
ratio does not divide) and checks each byte of decode's buffers against a token-by-token reference
(``page_size_peer.expected``): every token past the prefix lands where decode keeps it, nothing else
changes. Over the local transport in this process, and over NIXL with prefill in another process. A pair
that cannot be translated is refused at connect time by name; a wrong mapping is caught by the digests.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from kvferry import Buffer, IncompatiblePeer, IntegrityError, Layout, Pool
from kvferry.control import DecodeEndpoint, EndpointOptions, PrefillEndpoint
from kvferry.errors import PlanError, RequestFailed
from kvferry.layout import HeadGeometry
from kvferry.plan import tokens as token_plan
from tests.json_peer import JsonPeer

from .page_size_peer import TIMEOUTS, expected, filled, layout, request

OPTS = EndpointOptions(heartbeat_interval=0.1, peer_timeout=0.6, lease_grace=0.4, request_timeout=20.0)
PEER = Path(__file__).with_name("page_size_peer.py")
# (prefill's tokens per page, decode's): both directions, a ratio of 4, and one that does not divide.
PAIRS = [(16, 64), (64, 16), (32, 128), (48, 32)]


def _requests(ts: int, td: int, seed: int) -> list[tuple[str, int, np.ndarray, np.ndarray, list]]:
    """Two requests: one whose decode holds a prefix page (so 48 -> 32 straddles it), one without, both
    ending inside a page on both sides."""
    out: list = []
    for i, (tokens, prefix) in enumerate(((203, 1), (150, 0))):
        src, dst, chunks = request(ts, td, tokens, prefix, seed + i, taken=[p for r in out for p in r[3]])
        out.append((f"r{i}", prefix * td, src, dst, chunks))
    return out


def _check(src_mem: Any, dst_mem: Any, before: Any, reqs: list) -> None:
    """Decode's buffers equal the reference, request after request applied to the bytes it had."""
    want = before
    for _, first, src, dst, _ in reqs:
        want = expected(src_mem, _Snapshot(dst_mem, want), src, dst, first)
    for name, arr in want.items():
        assert np.array_equal(dst_mem.array(name), arr), name


class _Snapshot:
    """``expected`` reads decode's bytes from ``array``: these, not the live memory."""

    def __init__(self, mem: Any, arrays: dict[str, np.ndarray]) -> None:
        self.layout, self._arrays = mem.layout, arrays

    def array(self, name: str) -> np.ndarray:
        return self._arrays[name]


@pytest.mark.parametrize("mode", ["push", "pull"])
@pytest.mark.parametrize("major", ["head", "token"])
@pytest.mark.parametrize(("ts", "td"), PAIRS)
def test_every_token_lands_where_decode_keeps_it_over_the_local_transport(ts: int, td: int, major: str,
                                                                          mode: str) -> None:
    src_mem = filled(layout(ts, major=major), 1)
    dst_mem = filled(layout(td, major=major, pages=60), 2)
    before = {b.name: dst_mem.array(b.name).copy() for b in dst_mem.layout.buffers}
    reqs = _requests(ts, td, seed=ts * td)
    with PrefillEndpoint(src_mem, "local", options=OPTS, digest_mode="full") as prefill, \
            DecodeEndpoint(dst_mem, "local", options=OPTS, digest_mode="full", mode=mode) as decode:
        decode.connect(prefill.address)
        for rid, first, _, dst, _ in reqs:
            decode.announce(rid, {"kv": dst}, prefix=first)
        for rid, _, _, _, chunks in reqs:
            for i, (pages, offset) in enumerate(chunks):
                prefill.send(rid, {"kv": pages}, offset=offset, last=i == len(chunks) - 1)
        for rid, *_ in reqs:
            decode.wait(rid, 10)
            prefill.wait(rid, 10)
    _check(src_mem, dst_mem, before, reqs)


def test_a_chunk_past_the_lease_and_a_leased_page_left_unwritten_fail_the_request_by_name() -> None:
    """16 -> 64: decode leases one page (tokens 0..63) and a source page starting at token 64 is refused;
    decode leases two pages and the last chunk stops at token 32: the second page is never written. A
    request of 32 tokens in one leased page is whole (the rest of that page is past the request)."""
    src_mem, dst_mem = filled(layout(16), 1), filled(layout(64), 2)
    with PrefillEndpoint(src_mem, "local", options=OPTS) as prefill, \
            DecodeEndpoint(dst_mem, "local", options=OPTS) as decode:
        decode.connect(prefill.address)
        decode.announce("past", {"kv": [3]})
        prefill.send("past", {"kv": [1, 2, 3, 4, 5]}, last=True)
        with pytest.raises(RequestFailed) as info:
            prefill.wait("past", 5)
        assert isinstance(info.value.__cause__, PlanError)
        assert "pool 'kv': chunk covers tokens [0, 80)" in str(info.value.__cause__)
        assert "decode leased pages for tokens [0, 64)" in str(info.value.__cause__)
        decode.announce("short", {"kv": [4, 6]})
        prefill.send("short", {"kv": [1, 2]}, last=True)
        with pytest.raises(RequestFailed, match="pool 'kv', buffer 'L0.k', destination page 6 was never written "
                                                "in full \\(token 64 of the request missing"):
            prefill.wait("short", 5)
        decode.announce("whole", {"kv": [7]})
        prefill.send("whole", {"kv": [1, 2]}, last=True)
        decode.wait("whole", 5)
        prefill.wait("whole", 5)


def test_a_token_written_twice_fails_the_request_naming_buffer_page_and_both_chunks() -> None:
    """16 -> 64: a chunk of prefill pages 0-1 (tokens 0..31), then one at page 1 again (tokens 16..31) that
    names only buffer L0.v: refused, naming that buffer, the earlier chunk's tokens and decode's page; a
    chunk of other buffers over the same tokens is not a rewrite."""
    src_mem, dst_mem = filled(layout(16), 1), filled(layout(64), 2)
    with PrefillEndpoint(src_mem, "local", options=OPTS) as prefill, \
            DecodeEndpoint(dst_mem, "local", options=OPTS) as decode:
        decode.connect(prefill.address)
        decode.announce("twice", {"kv": [4, 6]})
        prefill.send("twice", {"kv": [1, 2]}, last=False)
        prefill.send("twice", {"kv": [3]}, offset=1, last=True, buffers=["L0.v"])
        with pytest.raises(RequestFailed) as info:
            prefill.wait("twice", 5)
        assert isinstance(info.value.__cause__, PlanError)
        assert ("request 'twice', pool 'kv', buffer 'L0.v': a chunk writes tokens [16, 32) of the request but an "
                "earlier chunk wrote [0, 32): destination page 4 would receive token 16 twice"
                in str(info.value.__cause__))
        decode.announce("apart", {"kv": [7]})
        names = [b.name for b in src_mem.layout.buffers]
        prefill.send("apart", {"kv": [1, 2]}, buffers=names[:1], last=False)
        prefill.send("apart", {"kv": [1, 2]}, buffers=names[1:], last=True)
        decode.wait("apart", 5)
        prefill.wait("apart", 5)


def test_a_gap_inside_a_leased_page_fails_the_request_naming_the_first_missing_token() -> None:
    """16 -> 64, one leased page: chunks at prefill pages 0 and 2 leave tokens 16..31 unwritten in every
    buffer; chunks of pages 0-1 of which the second names only L0.k leave L0.v short from token 16."""
    src_mem, dst_mem = filled(layout(16), 1), filled(layout(64), 2)
    with PrefillEndpoint(src_mem, "local", options=OPTS) as prefill, \
            DecodeEndpoint(dst_mem, "local", options=OPTS) as decode:
        decode.connect(prefill.address)
        decode.announce("hole", {"kv": [5]})
        prefill.send("hole", {"kv": [1]}, last=False)
        prefill.send("hole", {"kv": [3]}, offset=2, last=True)
        with pytest.raises(RequestFailed, match="pool 'kv', buffer 'L0.k', destination page 5 was never written "
                                                "in full \\(token 16 of the request missing; prefill sent 3 pages"):
            prefill.wait("hole", 5)
        decode.announce("part", {"kv": [6]})
        prefill.send("part", {"kv": [1]}, last=False)
        prefill.send("part", {"kv": [2]}, offset=1, buffers=["L0.k"], last=True)
        with pytest.raises(RequestFailed, match="pool 'kv', buffer 'L0.v', destination page 6 was never written "
                                                "in full \\(token 16 of the request missing"):
            prefill.wait("part", 5)


def _pair_page_indices(vec: Any, seg: tuple[np.ndarray, ...]) -> Any:
    """The motivating bug's mapping: every source page's tokens land at the start of their destination page,
    as if prefill's page were decode's (the digests still describe the token mapping)."""
    sp, so, dp, _, n = seg
    return _rows(vec, (sp, so, dp, np.zeros_like(so), n))


_rows = token_plan._rows


def test_a_wrong_mapping_is_caught_by_the_digests_naming_buffer_and_page(monkeypatch: pytest.MonkeyPatch) -> None:
    """Rows that pair page indices (16 -> 64: four source pages all written at the start of one decode page)
    are caught by decode's digests over entry ranges: the request fails on both sides, naming the pool, the
    buffer and the page."""
    monkeypatch.setattr(token_plan, "_rows", _pair_page_indices)
    src_mem, dst_mem = filled(layout(16), 1), filled(layout(64), 2)
    with PrefillEndpoint(src_mem, "local", options=OPTS, digest_mode="full") as prefill, \
            DecodeEndpoint(dst_mem, "local", options=OPTS, digest_mode="full") as decode:
        decode.connect(prefill.address)
        decode.announce("r", {"kv": [9, 5]})
        prefill.send("r", {"kv": [1, 2, 3, 4, 5, 6, 7, 8]}, last=True)
        with pytest.raises(RequestFailed) as info:
            decode.wait("r", 5)
        cause = info.value.__cause__
        assert isinstance(cause, IntegrityError)
        assert "pool 'kv', buffer 'L0.k' (layer 0), page 9: expected digest" in str(cause)
        with pytest.raises(RequestFailed):
            prefill.wait("r", 5)


def test_a_pair_that_cannot_be_translated_is_refused_at_connect_naming_pool_buffer_and_values() -> None:
    """Tokens per page differ and so does each token's bytes (head_bytes 8 vs 16): refused before any byte
    moves, by prefill's handshake, naming the pool, the buffer and both values."""
    with PrefillEndpoint(filled(layout(32), 1), "local", options=OPTS) as prefill, \
            DecodeEndpoint(filled(layout(64, head_bytes=16), 2), "local", options=OPTS) as decode, \
            pytest.raises(IncompatiblePeer) as info:
        decode.connect(prefill.address, timeout=5)
    message = str(info.value)
    assert "layouts differ (local: prefill, remote: decode): pool 'kv': buffer 'L0.k': head_bytes" in message
    assert "cannot be translated: local 8, remote 16" in message


def _tp_layout(tokens: int, tp_size: int) -> Layout:
    geo = HeadGeometry(4 // tp_size, 8, tokens)
    return Layout([Pool("kv", [Buffer("k", geo.page_bytes, 20, "bf16", "k", 0, geo)], tokens)], tp_size, 0)


def test_different_page_sizes_and_tp_sizes_together_are_refused_clearly() -> None:
    from kvferry.layout import KVMemory

    with PrefillEndpoint(KVMemory.allocate(_tp_layout(16, 1)), "local", options=OPTS) as prefill, \
            DecodeEndpoint(KVMemory.allocate(_tp_layout(64, 2)), "local", options=OPTS) as decode, \
            pytest.raises(IncompatiblePeer, match="pool 'kv': tokens_per_page differs \\(local 16, remote 64\\) "
                                                  "and tp_size differs \\(local 1, remote 2\\): page sizes are "
                                                  "translated between equal TP sizes only"):
        decode.connect(prefill.address, timeout=5)


# -- over NIXL, prefill in another process ------------------------------------------------------------------
class _Peer(JsonPeer):
    """Prefill endpoints in a child process (tests/page_size_peer.py), one per configuration."""

    def __init__(self, cfgs: list[dict[str, Any]]) -> None:
        super().__init__(PEER, [json.dumps(cfgs)], ready_timeout=60, timeout=60)
        self.addresses = self.first["addresses"]

    def close(self, wait: float = 20) -> None:
        super().close(wait)


# One prefill endpoint per (pair, major), push and pull alternating so that each ratio goes both ways.
NIXL_CASES = [(ts, td, major, ("push", "pull")[(i + j) % 2])
              for i, (ts, td) in enumerate(PAIRS) for j, major in enumerate(("head", "token"))]


@pytest.mark.nixl
def test_every_token_lands_where_decode_keeps_it_over_nixl_between_processes() -> None:
    pytest.importorskip("nixl")
    pytest.importorskip("kvferry.transport.nixl")
    t0 = time.monotonic()
    peer = _Peer([{"tokens": ts, "major": major, "mode": mode, "seed": 1} for ts, _, major, mode in NIXL_CASES])
    try:
        for (ts, td, major, mode), address in zip(NIXL_CASES, peer.addresses):
            src_mem = filled(layout(ts, major=major), 1)   # the peer's bytes, made again here to check
            dst_mem = filled(layout(td, major=major, pages=60), 2)
            before = {b.name: dst_mem.array(b.name).copy() for b in dst_mem.layout.buffers}
            reqs = _requests(ts, td, seed=ts * td)
            with DecodeEndpoint(dst_mem, "nixl", options=EndpointOptions(**TIMEOUTS), digest_mode="full",
                                mode=mode) as decode:
                decode.connect(address)
                for rid, first, _, dst, chunks in reqs:
                    decode.announce(rid, {"kv": dst}, prefix=first)
                    peer("send", index=NIXL_CASES.index((ts, td, major, mode)), rid=rid,
                         chunks=[[pages.tolist(), offset] for pages, offset in chunks])
                for rid, *_ in reqs:
                    decode.wait(rid, 30)
                    peer("wait", index=NIXL_CASES.index((ts, td, major, mode)), rid=rid)
            _check(src_mem, dst_mem, before, reqs)
    finally:
        peer.close()
    assert time.monotonic() - t0 < 120


@pytest.mark.nixl
def test_the_page_sizes_bench_runs_the_endpoints_and_exits_0() -> None:
    """``bench/page_sizes.py --quick --no-planner`` as a user runs it: the endpoints between page sizes over
    NIXL against raw NIXL (decode's bytes checked token by token inside), exit status 0, a row per pair."""
    pytest.importorskip("nixl")
    root = Path(__file__).resolve().parents[1]
    env = {**os.environ, "PYTHONPATH": str(root / "src")}
    proc = subprocess.run([sys.executable, str(root / "bench" / "page_sizes.py"), "--quick", "--no-planner"],
                          capture_output=True, text=True, env=env, timeout=120)
    assert proc.returncode == 0, (proc.returncode, proc.stderr[-2000:])
    rows = [line for line in proc.stdout.splitlines() if line.startswith("| 16 -> 64") or
            line.startswith("| 64 -> 16") or line.startswith("| 16 -> 16")]
    assert len(rows) == 6 and all("GB/s" in row for row in rows), proc.stdout


@pytest.mark.parametrize("per_entry", [1, 4])
@pytest.mark.parametrize("mode", ["push", "pull"])
def test_a_state_pool_moves_whole_beside_a_translated_pool(mode: str, per_entry: int) -> None:
    """16 -> 64 in the kv pool, a state pool (no tokens) beside it: the state page moves whole to decode's
    leased slot by position, the kv tokens by token, in two chunks, byte for byte; nothing else changes.
    ``per_entry`` 4: a compressed pool (an entry per 4 tokens on both sides)."""
    from kvferry import KVMemory

    from .conftest import fill_random
    from .test_tokens_plan import layout as planner_layout
    from .test_tokens_plan import reference

    src_mem = KVMemory.allocate(planner_layout(16, extra_pool=True, pages=20, per_entry=per_entry))
    dst_mem = KVMemory.allocate(planner_layout(64, extra_pool=True, pages=30, per_entry=per_entry))
    fill_random(src_mem, 1)
    fill_random(dst_mem, 2)
    want = reference(src_mem, dst_mem, token_plan.TokenSpan([3, 1, 4, 5, 9], [7, 2]))
    want["state"][4] = src_mem.array("state")[2]
    with PrefillEndpoint(src_mem, "local", options=OPTS, digest_mode="full") as prefill, \
            DecodeEndpoint(dst_mem, "local", options=OPTS, digest_mode="full", mode=mode) as decode:
        decode.connect(prefill.address)
        decode.announce("r", {"kv": [7, 2], "state": [4]})
        prefill.send("r", {"kv": [3, 1]}, last=False)
        prefill.send("r", {"kv": [4, 5, 9], "state": [2]}, offset={"kv": 2, "state": 0}, last=True)
        decode.wait("r", 5)
        prefill.wait("r", 5)
    for name, arr in want.items():
        assert np.array_equal(dst_mem.array(name), arr), name
