"""Real SGLang servers at different ``--page-size`` on prefill and decode: a plain server, then a prefill
server at page size P and a decode server at page size D with ``--disaggregation-transfer-backend kvferry``
behind SGLang's router, driven over HTTP as a client would. Every answer must equal the plain server's
greedy tokens; SGLang's own /metrics must show decode computed no prompt token, that later turns of a
session hit decode's radix cache (whole pages of decode's size, announced to prefill in decode's tokens
and cut by kvferry's sender to whole pages of prefill's), and that neither side holds a token afterwards.

SGLang 0.5.23's own backends refuse this pair at decode's first request ("Page size mismatch",
tests/test_sglang_page_sizes.py); kvferry's bootstrap server states no page size and its handshake
translates token ranges (``plan.tokens.PageSizePlanner``). Same tiny Llama and server flags as
tests/test_sglang_server.py (tests/sglang_servers.py). ``KVFERRY_TEST_ROLL_DECODE_PAGES=1`` (the
``mutation`` run below, tests/sglang_sitecustomize) lands each chunk's tokens in decode's pages in the wrong
order: the tests must then fail.
"""

from __future__ import annotations

import concurrent.futures as cf
import os
import random
import time
from collections.abc import Iterator
from typing import Any

import pytest
import requests

pytest.importorskip("sglang.srt.disaggregation.common.conn")
pytest.importorskip("sglang_router")
pytest.importorskip("nixl")
pytestmark = [pytest.mark.sglang, pytest.mark.nixl, pytest.mark.timeout(900)]

from tests import sglang_servers as ss  # noqa: E402

NEW_TOKENS = 8
TIMINGS: dict[str, Any] = {}
# A forced wrong mapping for showing the tests can fail (by hand: KVFERRY_TEST_MUTATION=1 pytest ...).
MUTATION = os.environ.get("KVFERRY_TEST_MUTATION") == "1"


def report_lines() -> list[str]:
    """Start-up and test timings of this module (printed by tests/conftest.py's terminal summary)."""
    return [f"{k:48} {v:8.1f} s" if isinstance(v, float) else f"{k:48} {v}" for k, v in TIMINGS.items()]


class Servers:
    """A plain server (page 1, started once) and one PD set at a time (a set takes ~4 GB and both cores
    while it starts: the previous set is stopped before the next starts)."""

    def __init__(self, root: Any) -> None:
        self.root = root
        self.model = ss.write_tiny_model(root / "tiny-llama")
        self.plain: ss.Server | None = None
        self.pd: ss.PD | None = None
        self.pair: tuple[int, int] | None = None
        self.references: dict[tuple[tuple[int, ...], int], list[int]] = {}

    def ensure(self, pair: tuple[int, int]) -> ss.PD:
        if self.pair == pair and self.pd is not None:
            return self.pd
        if self.pd is not None:
            for s in self.pd.all():
                s.kill()
        new: list[ss.Server] = []
        if self.plain is None:
            self.plain = ss.plain_server(self.model, 1, self.root)
            new.append(self.plain)
        patches = ["KVFERRY_TEST_ROLL_DECODE_PAGES"] if MUTATION else []
        self.pd = ss.pd_servers(self.model, pair[0], "kvferry", self.root, prefill_radix=False,
                                decode_page_size=pair[1], patches=patches)
        self.pair = pair
        new.extend(reversed(self.pd.all()))
        t0 = time.monotonic()
        ss.start_all(new)
        TIMINGS[f"start {len(new)} processes, pages {pair[0]} -> {pair[1]}"] = time.monotonic() - t0
        return self.pd

    def reference(self, ids: list[int], n: int = NEW_TOKENS) -> list[int]:
        """The plain server's greedy tokens for ``ids`` (cached for the session)."""
        assert self.plain is not None
        key = (tuple(ids), n)
        if key not in self.references:
            self.references[key] = ss.generate(self.plain.url, ids, n)["output_ids"]
        return self.references[key]

    def stop(self) -> None:
        for s in ([] if self.pd is None else self.pd.all()) + ([] if self.plain is None else [self.plain]):
            s.kill()


@pytest.fixture(scope="session")
def servers(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Servers]:
    s = Servers(tmp_path_factory.mktemp("sglang-page-sizes"))
    try:
        yield s
    finally:
        s.stop()


# (prefill's, decode's) --page-size. make test runs 16 -> 64 (decode's page bigger); the rest are slow.
@pytest.fixture(scope="module", params=[(16, 64),
                                        pytest.param((64, 16), marks=pytest.mark.slow),
                                        pytest.param((1, 16), marks=pytest.mark.slow),
                                        pytest.param((16, 1), marks=pytest.mark.slow)],
                ids=lambda p: f"p{p[0]}-d{p[1]}")
def pd(request: pytest.FixtureRequest, servers: Servers) -> ss.PD:
    return servers.ensure(request.param)


def prompt(rng: random.Random, n: int) -> list[int]:
    return [rng.randrange(3, 380) for _ in range(n)]


def decode_prefilled(pd: ss.PD) -> float:
    """Prompt tokens decode computed itself, by SGLang's own counters (prefill compute + prefill input)."""
    m = pd.decode.metrics()
    return m.get("sglang:realtime_tokens_total.prefill_compute", 0.0) + \
        m.get("sglang:prefill_effective_tokens_total.input", 0.0)


def wait_idle(pd: ss.PD, timeout: float = 60.0) -> None:
    """Neither side holds a token for a request (SGLang's ``num_used_tokens`` gauge, radix-cached pages
    excluded): nothing leaked."""
    deadline = time.monotonic() + timeout
    last: dict[str, float] = {}
    while time.monotonic() < deadline:
        last = {s.name: s.metrics().get("sglang:num_used_tokens", -1.0) for s in (pd.prefill, pd.decode)}
        if all(v == 0 for v in last.values()):
            return
        time.sleep(0.5)
    raise AssertionError(f"token usage not back to 0 after {timeout} s: {last}")


def lengths_for(p: int, d: int) -> list[int]:
    """Under, at and just past a page and two pages of each side, and long prompts."""
    got = {1, 2, 257, 700}
    for page in (p, d):
        got |= {page, page + 1, 2 * page, 2 * page + 1, 3 * page - 1}
        if page > 1:
            got.add(page - 1)
    return sorted(got)


def test_servers_run_at_their_page_sizes(pd: ss.PD) -> None:
    """Each server reports the page size it was started with (SGLang's /server_info)."""
    for server, want in ((pd.prefill, pd.page_size), (pd.decode, pd.decode_page_size)):
        info = requests.get(server.url + "/server_info", timeout=10).json()
        assert info["page_size"] == want, (server.name, info["page_size"], want)


def test_prompt_lengths_equal_plain(pd: ss.PD, servers: Servers) -> None:
    """Each length alone through the router: the plain server's tokens; decode computed no prompt token;
    prefill did; kvferry moved the pages (each server's log)."""
    p, d = pd.page_size, pd.decode_page_size
    assert d is not None and p != d
    rng = random.Random(p * 1000 + d)
    t0 = time.monotonic()
    bad = []
    for n in lengths_for(p, d):
        ids = prompt(rng, n)
        got = ss.generate(pd.url, ids, NEW_TOKENS)
        assert got["meta_info"]["prompt_tokens"] == n
        if got["output_ids"] != servers.reference(ids):
            bad.append(n)
    TIMINGS[f"pages {p} -> {d}: {len(lengths_for(p, d))} prompt lengths"] = time.monotonic() - t0
    assert not bad, f"pages {p} -> {d}: answers differ from the plain server's at prompt lengths {bad}"
    assert decode_prefilled(pd) == 0.0
    assert pd.prefill.metrics()["sglang:realtime_tokens_total.prefill_compute"] > 0
    for server in (pd.prefill, pd.decode):
        assert "kvferry SGLang backend: pages move over nixl" in server.log(), server.log_path
    wait_idle(pd)


def test_streaming_and_concurrent_equal_plain(pd: ss.PD, servers: Servers) -> None:
    """Streamed requests, then 16 requests in flight at once with lengths across both sides' pages: every
    answer the plain server's; both sides back to 0 tokens."""
    p, d = pd.page_size, pd.decode_page_size
    assert d is not None
    rng = random.Random(7 + p * 1000 + d)
    for n in (3, p + 1, d + 1, 90):
        ids = prompt(rng, n)
        assert ss.generate_stream(pd.url, ids, 12) == servers.reference(ids, 12), f"{n} tokens streamed"
    prompts = [prompt(rng, rng.choice([1, 7, p, p + 1, d, d + 1, 40, 129, 300])) for _ in range(16)]
    want = [servers.reference(x) for x in prompts]
    with cf.ThreadPoolExecutor(16) as pool:
        got = list(pool.map(lambda x: ss.generate(pd.url, x, NEW_TOKENS)["output_ids"], prompts))
    bad = [len(x) for x, g, w in zip(prompts, got, want) if g != w]
    assert not bad, f"{len(bad)} of {len(prompts)} answers differ (prompt lengths {bad})"
    assert decode_prefilled(pd) == 0.0
    wait_idle(pd)


def test_multi_turn_sessions_hit_decode_radix_cache(pd: ss.PD, servers: Servers) -> None:
    """4 sessions x 3 turns at once, then each session's last prompt again. Prefill's radix cache is off, so
    the cached tokens decode reports are its own radix hits, whole pages of decode's size; decode announced
    them to prefill as ``decode_prefix_len`` and kvferry's sender started prefill at that prefix cut to whole
    pages of prefill's size, sending only the tokens decode lacks. The repeated prompt is held whole where
    decode's page is 1: decode leases nothing, and prefill's page straddling the prefix holds only tokens
    past the request (this failed every such request until ``plan.tokens.chunk_span`` let it move nothing).
    Every answer the plain server's."""
    p, d = pd.page_size, pd.decode_page_size
    assert d is not None
    first = 2 * max(p, d)   # a first turn past two decode pages: the second turn hits at least one

    def session(s: int) -> list[dict[str, Any]]:
        rng, ids, metas = random.Random(p * 1000 + d * 10 + s), [], []
        for turn in range(4):
            if turn < 3:   # turn 3 repeats turn 2's prompt
                ids = ids + prompt(rng, first + rng.randrange(0, max(p, d)) if turn == 0 else rng.randrange(5, 40))
            got = ss.generate(pd.url, ids, NEW_TOKENS, timeout=300)
            want = servers.reference(ids)
            assert got["output_ids"] == want, f"pages {p} -> {d}, session {s} turn {turn} ({len(ids)} tokens)"
            metas.append({**got["meta_info"], "len": len(ids)})
            if turn < 2:
                ids = ids + got["output_ids"]
        return metas

    prefill_before = pd.prefill.metrics()
    t0 = time.monotonic()
    with cf.ThreadPoolExecutor(4) as pool:
        metas = list(pool.map(session, range(4)))
    TIMINGS[f"pages {p} -> {d}: 4 sessions x 4 turns"] = time.monotonic() - t0
    TIMINGS[f"pages {p} -> {d}: cached tokens per turn"] = str([[t["cached_tokens"] for t in m] for m in metas])
    for s, turns in enumerate(metas):
        assert turns[0]["cached_tokens"] == 0, (s, turns[0])
        for t in turns[1:3]:
            assert 0 < t["cached_tokens"] < t["len"], (s, t)
            assert t["cached_tokens"] % d == 0, (s, t)
        # the repeat: decode holds every whole page of its size of the prompt (at page 1, the whole prompt)
        assert turns[3]["cached_tokens"] == turns[3]["len"] // d * d, (s, turns[3])
    after = pd.prefill.metrics()
    key = "sglang:realtime_tokens_total.prefill_cache"
    assert after.get(key, 0.0) == prefill_before.get(key, 0.0) == 0.0
    assert decode_prefilled(pd) == 0.0
    wait_idle(pd)
