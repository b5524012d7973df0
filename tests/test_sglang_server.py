"""kvferry inside running SGLang servers: a plain server, then a prefill server and a decode server with
``--disaggregation-transfer-backend kvferry`` (``SGLANG_PLUGINS=kvferry``) behind SGLang's router, driven
over HTTP as a client would. Every answer must equal the plain server's greedy tokens, and SGLang's own
/metrics must show that decode computed no prompt token and, on radix hits, that decode reused its prefix
(prefill sent only the suffix). A tiny random-weights Llama and a tokenizer are written by the test.

One plain server (page size 1) and one PD set per page size (1 and 16) serve every default test of the
session: they start together, once. SGLang's own ``nixl`` backend on the same tests, the 64-session soak and
the bench are marked slow (``make test-sglang-slow``); the server faults are in test_sglang_server_faults.py.
"""

from __future__ import annotations

import concurrent.futures as cf
import json
import os
import random
import statistics
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import requests

pytest.importorskip("sglang.srt.disaggregation.common.conn")
pytest.importorskip("sglang_router")
pytest.importorskip("nixl")
pytestmark = [pytest.mark.sglang, pytest.mark.nixl, pytest.mark.timeout(900)]

from tests import sglang_servers as ss  # noqa: E402

PAGE_SIZES = (1, 16)
NEW_TOKENS = 8
TIMINGS: dict[str, Any] = {}


def report_lines() -> list[str]:
    """Start-up and test timings of this module (printed by tests/conftest.py's terminal summary)."""
    return [f"{k:48} {v:8.1f} s" if isinstance(v, float) else f"{k:48} {v}" for k, v in TIMINGS.items()]


class Cluster:
    """The session's servers, started on first use, all stopped at the end of the session."""

    def __init__(self, root: Path) -> None:
        self.root = root
        self.model = ss.write_tiny_model(root / "tiny-llama")
        self.plain: ss.Server | None = None
        self.sets: dict[tuple[str, int], ss.PD] = {}
        self.started: list[ss.Server] = []

    def ensure(self, wanted: list[tuple[str, int]]) -> None:
        """Start the plain server and the ``wanted`` PD sets that are not running. A server takes ~2.3 GB
        here (three processes that each import torch and SGLang): sets not wanted now are stopped first."""
        new: list[ss.Server] = []
        if any(key not in self.sets for key in wanted):
            for key in [k for k in self.sets if k not in wanted]:
                for s in self.sets.pop(key).all():
                    TIMINGS["CPU of every server process (s)"] = TIMINGS.get(
                        "CPU of every server process (s)", 0.0) + s.cpu_seconds()
                    s.kill()
        if self.plain is None:
            self.plain = ss.plain_server(self.model, 1, self.root)
            new.append(self.plain)
        for backend, page in wanted:
            if (backend, page) not in self.sets:
                # "kvferry-mooncake": kvferry's backend over Mooncake; "kvferry-pull": decode reads
                engine_backend, _, variant = backend.partition("-")
                pd = ss.pd_servers(self.model, page, engine_backend, self.root, prefill_radix=False,
                                   transport="mooncake" if variant == "mooncake" else "nixl",
                                   mode="pull" if variant == "pull" else "push")
                self.sets[backend, page] = pd
                new.extend(reversed(pd.all()))
        if new:
            t0 = time.monotonic()
            self.started.extend(new)
            ss.start_all(new)
            TIMINGS[f"start {len(new)} servers: " + ",".join(s.log_path.stem for s in new)[:30]] = \
                time.monotonic() - t0

    def stop(self) -> None:
        TIMINGS["CPU of every server process (s)"] = TIMINGS.get("CPU of every server process (s)", 0.0) + sum(
            s.cpu_seconds() for s in self.started)
        for s in self.started:
            s.kill()


@pytest.fixture(scope="session")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Cluster]:
    c = Cluster(tmp_path_factory.mktemp("sglang-servers"))
    try:
        yield c
    finally:
        c.stop()


# Module scope: pytest then runs every test of one set before the next set's, so no set is started twice.
@pytest.fixture(scope="module", params=[("kvferry", 1),
                        # Page 16 is slow for make test's time (3 server processes, ~100 s with its tests): the
                        # transfer-layer tests (test_sglang.py) run SGLang's own pools at pages of 16 and more,
                        # and page 1 (SGLang's default, a page per token) is only here.
                        pytest.param(("kvferry", 16), marks=pytest.mark.slow),
                        pytest.param(("nixl", 1), marks=pytest.mark.slow),
                        pytest.param(("nixl", 16), marks=pytest.mark.slow),
                        pytest.param(("kvferry-mooncake", 1), marks=pytest.mark.slow),
                        pytest.param(("kvferry-mooncake", 16), marks=pytest.mark.slow),
                        pytest.param(("kvferry-pull", 1), marks=pytest.mark.slow)],
                ids=lambda p: f"{p[0]}-page{p[1]}")
def pd(request: pytest.FixtureRequest, cluster: Cluster) -> ss.PD:
    """A PD set; the page sizes of a backend that this run selected (and the plain server) start at once.
    ``kvferry-mooncake``: kvferry's backend on Mooncake's Transfer Engine (``KVFERRY_SGLANG_TRANSPORT=mooncake``);
    ``kvferry-pull``: decode reads prefill's pages (``KVFERRY_SGLANG_MODE=pull``)."""
    backend, page = request.param
    if backend.endswith("-mooncake"):
        from kvferry.transport import mooncake_available

        if not mooncake_available():
            pytest.skip("Mooncake's Transfer Engine cannot import (pip install 'kvferry[mooncake]', docs/mooncake.md)")
    cluster.ensure([(backend, p) for p in PAGE_SIZES if (backend, p) in _selected_sets(request.session)])
    return cluster.sets[backend, page]


def _selected_sets(session: pytest.Session) -> set[tuple[str, int]]:
    """The PD sets (backend, page size) the selected tests use: only those start."""
    return {item.callspec.params["pd"] for item in session.items
            if hasattr(item, "callspec") and "pd" in item.callspec.params}


@pytest.fixture
def plain(cluster: Cluster) -> ss.Server:
    cluster.ensure([])
    assert cluster.plain is not None
    return cluster.plain


_REFERENCE: dict[tuple[tuple[int, ...], int], list[int]] = {}


def reference(plain: ss.Server, ids: list[int], n: int = NEW_TOKENS) -> list[int]:
    """The plain server's greedy tokens for ``ids`` (cached for the session)."""
    key = (tuple(ids), n)
    if key not in _REFERENCE:
        _REFERENCE[key] = ss.generate(plain.url, ids, n)["output_ids"]
    return _REFERENCE[key]


def prompt(rng: random.Random, n: int) -> list[int]:
    return [rng.randrange(3, 380) for _ in range(n)]


def decode_prefilled(pd: ss.PD) -> float:
    """Prompt tokens decode computed itself, by SGLang's own counters (prefill compute + prefill input)."""
    m = pd.decode.metrics()
    return m.get("sglang:realtime_tokens_total.prefill_compute", 0.0) + \
        m.get("sglang:prefill_effective_tokens_total.input", 0.0)


def wait_idle(pd: ss.PD, timeout: float = 60.0) -> dict[str, float]:
    """Wait until neither side holds a token for a running request (SGLang's ``num_used_tokens`` gauge,
    radix-cached pages excluded); their last gauges."""
    deadline = time.monotonic() + timeout
    last: dict[str, float] = {}
    while time.monotonic() < deadline:
        last = {s.name: s.metrics().get("sglang:num_used_tokens", -1.0) for s in (pd.prefill, pd.decode)}
        if all(v == 0 for v in last.values()):
            return last
        time.sleep(0.5)
    raise AssertionError(f"token usage not back to 0 after {timeout} s: {last}")


def lengths_for(page: int) -> list[int]:
    """Prompt lengths: shorter than a page, exact page multiples and one past, long prompts."""
    got = {1, 2, 5, page, page + 1, 2 * page, 2 * page + 1, 4 * page - 1, 4 * page, 257, 700}
    if page > 1:
        got.add(page - 1)
    return sorted(got)


def test_prompt_lengths_equal_plain(pd: ss.PD, plain: ss.Server) -> None:
    """Each length alone through the router: the plain server's tokens; decode computed no prompt token."""
    rng = random.Random(pd.page_size)
    before = decode_prefilled(pd)
    for n in lengths_for(pd.page_size):
        ids = prompt(rng, n)
        got = ss.generate(pd.url, ids, NEW_TOKENS)
        assert got["output_ids"] == reference(plain, ids), f"prompt of {n} tokens, page {pd.page_size}"
        assert got["meta_info"]["prompt_tokens"] == n
    assert decode_prefilled(pd) == before == 0.0
    assert pd.prefill.metrics()["sglang:realtime_tokens_total.prefill_compute"] > 0
    if pd.backend == "kvferry":   # the transport asked for is the one both servers moved pages with
        for server in (pd.prefill, pd.decode):
            assert f"kvferry SGLang backend: pages move over {pd.transport}" in server.log(), server.log_path


def test_streaming_equals_plain(pd: ss.PD, plain: ss.Server) -> None:
    rng = random.Random(100 + pd.page_size)
    for n in (3, pd.page_size + 1, 90):
        ids = prompt(rng, n)
        assert ss.generate_stream(pd.url, ids, 12) == reference(plain, ids, 12), f"{n} tokens streamed"


def test_chat_completions_equal_plain(pd: ss.PD, plain: ss.Server) -> None:
    """OpenAI chat completions, plain and streamed, through the router: the plain server's text."""
    for i, text in enumerate(["hello there", "how are the pages of the cache moved between servers today?"]):
        messages = [{"role": "user", "content": text}]
        want = ss.chat(plain.url, messages, 10)
        assert ss.chat(pd.url, messages, 10) == want, i
        assert ss.chat(pd.url, messages, 10, stream=True) == want, i


def test_concurrent_requests_equal_plain(pd: ss.PD, plain: ss.Server) -> None:
    """32 requests in flight at once, lengths across page boundaries: every answer the plain server's."""
    rng = random.Random(200 + pd.page_size)
    prompts = [prompt(rng, rng.choice([1, 7, pd.page_size, pd.page_size + 1, 40, 129, 300])) for _ in range(32)]
    want = [reference(plain, p) for p in prompts]
    with cf.ThreadPoolExecutor(32) as pool:
        got = list(pool.map(lambda p: ss.generate(pd.url, p, NEW_TOKENS)["output_ids"], prompts))
    bad = [i for i, (g, w) in enumerate(zip(got, want)) if g != w]
    assert not bad, f"{len(bad)} of {len(prompts)} answers differ: {bad}"
    assert decode_prefilled(pd) == 0.0
    wait_idle(pd)


def run_sessions(url: str, plain: ss.Server, n_sessions: int, turns: int, seed: int, workers: int
                 ) -> list[list[dict[str, Any]]]:
    """``n_sessions`` multi-turn sessions at once: each turn's prompt is the previous prompt, its answer and
    new user tokens. Every turn's answer is checked against the plain server's; the decode responses'
    ``meta_info`` per turn."""
    rngs = [random.Random(seed * 1000 + s) for s in range(n_sessions)]

    def session(s: int) -> list[dict[str, Any]]:
        rng, ids, metas = rngs[s], [], []
        for turn in range(turns):
            ids = ids + prompt(rng, rng.randrange(5, 40))
            got = ss.generate(url, ids, NEW_TOKENS, timeout=300)
            want = reference(plain, ids)
            assert got["output_ids"] == want, f"session {s} turn {turn}: {got['output_ids']} != {want}"
            metas.append({**got["meta_info"], "len": len(ids)})
            ids = ids + got["output_ids"]
        return metas

    with cf.ThreadPoolExecutor(workers) as pool:
        return list(pool.map(session, range(n_sessions)))


def test_multi_turn_sessions_hit_decode_radix_cache(pd: ss.PD, plain: ss.Server) -> None:
    """6 sessions x 3 turns at once. Prefill's radix cache is off in these sets, so the cached tokens decode
    reports are its own radix hits: turn 1 none, turns 2-3 whole pages of the earlier turns (sent to prefill
    as ``decode_prefix_len``; prefill sent only the pages after them). Decode computed no prompt token."""
    prefill_before = pd.prefill.metrics()
    metas = run_sessions(pd.url, plain, 6, 3, seed=pd.page_size, workers=6)
    for s, turns in enumerate(metas):
        assert turns[0]["cached_tokens"] == 0, (s, turns[0])
        for t in turns[1:]:
            assert 0 < t["cached_tokens"] < t["len"], (s, t)
            assert t["cached_tokens"] % pd.page_size == 0, (s, t)
    hits = sum(t["cached_tokens"] for turns in metas for t in turns)
    after = pd.prefill.metrics()
    # prefill computed every prompt token (its cache is off) and reports no cache hit of its own
    key = "sglang:realtime_tokens_total.prefill_cache"
    assert after.get(key, 0.0) == prefill_before.get(key, 0.0) == 0.0
    assert after["sglang:realtime_tokens_total.prefill_compute"] > prefill_before[
        "sglang:realtime_tokens_total.prefill_compute"]
    assert hits > 0
    assert decode_prefilled(pd) == 0.0
    wait_idle(pd)


def test_client_disconnect_mid_stream(pd: ss.PD, plain: ss.Server) -> None:
    """A client drops a streamed request after a few chunks: both sides free its tokens, and the next
    requests still get the plain server's tokens."""
    rng = random.Random(300 + pd.page_size)
    ids = prompt(rng, 50)
    body = {"input_ids": ids, "stream": True, "sampling_params": {"temperature": 0.0, "max_new_tokens": 400,
                                                                  "ignore_eos": True}}
    with requests.post(pd.url + "/generate", json=body, stream=True, timeout=60) as r:
        chunks = 0
        for line in r.iter_lines():
            if line.startswith(b"data:"):
                chunks += 1
            if chunks >= 3:
                break
    # the response is closed here, mid-stream
    wait_idle(pd, timeout=90)
    for n in (pd.page_size + 1, 33):
        again = prompt(rng, n)
        assert ss.generate(pd.url, again, NEW_TOKENS)["output_ids"] == reference(plain, again)


def _timed(url: str, ids: list[int], n: int) -> tuple[float, float, list[int]]:
    """(time to first token, time for the request, output ids) of a streamed /generate."""
    body = {"input_ids": ids, "stream": True, "sampling_params": {"temperature": 0.0, "max_new_tokens": n,
                                                                  "ignore_eos": True}}
    t0 = time.perf_counter()
    ttft = None
    out: list[int] = []
    with requests.post(url + "/generate", json=body, stream=True, timeout=300) as r:
        r.raise_for_status()
        for chunk in ss._sse(r.iter_lines()):
            if ttft is None:
                ttft = time.perf_counter() - t0
            out = list(chunk.get("output_ids") or out)
    return ttft or 0.0, time.perf_counter() - t0, out


@pytest.mark.slow
def test_bench_kvferry_vs_nixl(cluster: Cluster) -> None:
    """TTFT and time per request through the router, kvferry's backend and SGLang's nixl, page 16, at
    concurrency 1 and 24; every answer the plain server's. Writes bench/out/sglang_servers.json."""
    cluster.ensure([("kvferry", 16), ("nixl", 16)])
    plain = cluster.plain
    assert plain is not None
    rng = random.Random(7)
    prompts = [prompt(rng, rng.choice([40, 129, 300, 600])) for _ in range(48)]
    want = [reference(plain, p, 16) for p in prompts]
    rows = []
    for backend in ("kvferry", "nixl", "kvferry", "nixl"):   # twice, interleaved: load drifts on this box
        url = cluster.sets[backend, 16].url
        for conc in (1, 24):
            batch = prompts[:12] if conc == 1 else prompts
            with cf.ThreadPoolExecutor(conc) as pool:
                res = list(pool.map(lambda p, u=url: _timed(u, p, 16), batch))
            assert [r[2] for r in res] == want[:len(batch)], backend
            rows.append({"backend": backend, "concurrency": conc, "requests": len(batch),
                         "ttft_median_s": statistics.median(r[0] for r in res),
                         "ttft_p90_s": sorted(r[0] for r in res)[int(0.9 * len(res)) - 1],
                         "request_median_s": statistics.median(r[1] for r in res)})
    out = Path(__file__).resolve().parent.parent / "bench" / "out"
    out.mkdir(parents=True, exist_ok=True)
    (out / "sglang_servers.json").write_text(json.dumps(rows, indent=1))
    for r in rows:
        key = f"bench {r['backend']} c{r['concurrency']}: TTFT, request median"
        TIMINGS[key] = (*TIMINGS.get(key, ()), (round(r["ttft_median_s"], 3), round(r["request_median_s"], 3)))
    assert os.path.exists(out / "sglang_servers.json")


@pytest.mark.slow
def test_64_sessions_at_once(cluster: Cluster) -> None:
    """The seed's concurrency: 64 sessions x 3 turns at once through the router (kvferry, page 16), every
    answer the plain server's; decode computed no prompt token; both sides back to 0 tokens."""
    cluster.ensure([("kvferry", 16)])
    pd, plain = cluster.sets["kvferry", 16], cluster.plain
    assert plain is not None
    t0 = time.monotonic()
    metas = run_sessions(pd.url, plain, 64, 3, seed=64, workers=64)
    TIMINGS["64 sessions x 3 turns (kvferry, page 16)"] = time.monotonic() - t0
    assert sum(1 for turns in metas for t in turns[1:] if t["cached_tokens"] > 0) > 0
    assert decode_prefilled(pd) == 0.0
    wait_idle(pd)


@pytest.mark.slow
def test_mla_model_pd_equals_plain(tmp_path_factory: pytest.TempPathFactory) -> None:
    """A tiny DeepSeek-V2-style model (MLA: kv_lora_rank 32, rope 16; MoE configured, dense layers) through
    prefill + decode + router with kvferry's backend, page 16, decode radix cache on: prompt lengths across
    pages, 16 concurrent requests and 4 sessions x 3 turns, every answer the plain server's (how many later
    turns hit decode's radix cache is reported, not asserted). SGLang's CPU
    path needs one run-time patch for MLA on ``torch_native`` (tests/sglang_sitecustomize, docs/sglang.md)."""
    root = tmp_path_factory.mktemp("sglang-mla")
    model = ss.write_tiny_model(root / "tiny-dsv2", arch="deepseek_v2")
    patch = ["KVFERRY_TEST_MLA_ABSORBED"]
    plain = ss.plain_server(model, 1, root, patches=patch)
    pd = ss.pd_servers(model, 16, "kvferry", root, prefill_radix=False, patches=patch)
    every = [plain, *reversed(pd.all())]
    t0 = time.monotonic()
    try:
        ss.start_all(every)
        TIMINGS["MLA: start 4 servers"] = time.monotonic() - t0
        rng = random.Random(5)
        for n in lengths_for(16):
            ids = prompt(rng, n)
            assert ss.generate(pd.url, ids, NEW_TOKENS)["output_ids"] == reference(plain, ids), n
        prompts = [prompt(rng, rng.choice([3, 16, 17, 100])) for _ in range(16)]
        want = [reference(plain, p) for p in prompts]
        with cf.ThreadPoolExecutor(16) as pool:
            assert list(pool.map(lambda p: ss.generate(pd.url, p, NEW_TOKENS)["output_ids"], prompts)) == want
        metas = run_sessions(pd.url, plain, 4, 3, seed=9, workers=4)
        TIMINGS["MLA: later turns with a decode radix hit"] = (
            f"{sum(1 for turns in metas for t in turns[1:] if t['cached_tokens'] > 0)} of "
            f"{sum(len(turns) - 1 for turns in metas)}; cached tokens per turn "
            f"{[[t['cached_tokens'] for t in turns] for turns in metas]}")
        assert decode_prefilled(pd) == 0.0
        wait_idle(pd)
    finally:
        for s in every:
            s.kill()
