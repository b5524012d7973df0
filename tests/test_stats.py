"""Endpoint stats (``control.stats``) and their Prometheus export (``kvferry.metrics``): exact counts.

Every figure is checked against what the test itself moved (pages, bytes, requests), never against a
measured number; failures are provoked (a corrupted page, an abort, a deadline) and counted by cause.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
import time
import urllib.request
from pathlib import Path

import numpy as np
import pytest

import kvferry as kv
from kvferry.control.stats import CAUSES, EndpointStats, Histogram, failure_cause
from kvferry.errors import (
    EndpointClosed,
    IncompatiblePeer,
    IntegrityError,
    KVFerryError,
    LeaseError,
    PeerLost,
    PlanError,
    RequestAborted,
    TransferTimeout,
    TransportError,
)
from kvferry.metrics import METRICS, serve
from kvferry.transport import LocalTransport
from kvferry.workload.faults import FaultyTransport

DOC = Path(__file__).resolve().parents[1] / "docs" / "metrics.md"
KV, IDX, SWA = 64 * 4, 32 * 4, 16 * 4   # page bytes of the three buffers


def layout() -> kv.Layout:
    return kv.Layout([
        kv.Pool("c4", [kv.Buffer("c4.kv", page_bytes=KV, num_pages=64, kind="kv", layer=0),
                       kv.Buffer("c4.idx", page_bytes=IDX, num_pages=64, kind="index_k", layer=0)],
                tokens_per_page=16),
        kv.Pool("swa", [kv.Buffer("swa.kv", page_bytes=SWA, num_pages=32, kind="kv", layer=0)], tokens_per_page=16),
    ])


def run_requests(prefill: kv.PrefillEndpoint, decode: kv.DecodeEndpoint, num: int, *, first: int = 0,
                 expect_ok: bool = True) -> None:
    """``num`` requests of 3 c4 pages (sources 3, 4, 5) and 2 swa pages, one after another."""
    for i in range(first, first + num):
        decode.announce(f"r{i}", {"c4": [10, 11, 12], "swa": [7, 8]})
        prefill.send(f"r{i}", {"c4": [3, 4, 5], "swa": [1, 2]})
        if expect_ok:
            decode.wait(f"r{i}", timeout=10.0)
        else:
            with pytest.raises(kv.RequestFailed):
                decode.wait(f"r{i}", timeout=10.0)
        settle(decode, f"r{i}")


def settle(decode: kv.DecodeEndpoint, request_id: str) -> None:
    deadline = time.monotonic() + 30.0   # generous: a loaded 2-core machine stalls threads for seconds
    while decode.holds_lease(request_id):
        assert time.monotonic() < deadline, f"{request_id}: lease still held"
        time.sleep(0.002)


def until(check, timeout: float = 30.0) -> None:
    deadline = time.monotonic() + timeout
    while not check():
        assert time.monotonic() < deadline, "condition not met in time"
        time.sleep(0.005)


@pytest.fixture()
def pair():
    mem = layout()
    with kv.PrefillEndpoint(kv.KVMemory.allocate(mem), "local", digest_mode="full") as prefill, \
            kv.DecodeEndpoint(kv.KVMemory.allocate(mem), "local", digest_mode="full") as decode:
        decode.connect(prefill.address)
        yield prefill, decode


def test_counts_equal_what_moved(pair) -> None:
    prefill, decode = pair
    before = decode.stats(), prefill.stats()
    run_requests(prefill, decode, 12)
    until(lambda: prefill.stats().requests_done == before[1].requests_done + 12)
    dec, pre = decode.stats().minus(before[0]), prefill.stats().minus(before[1])
    request_bytes = 3 * (KV + IDX) + 2 * SWA
    for side in (dec, pre):
        assert (side.requests_done, side.num_failed, side.pages, side.page_bytes) == (12, 0, 12 * 5, 12 * request_bytes)
        assert side.request_seconds.count == 12 and side.request_seconds.sum > 0
    # Full digests: every page once per buffer of its pool; decode checks, prefill posts.
    assert dec.verified_pages == 12 * (3 * 2 + 2) and pre.verified_pages == 0
    assert pre.posted_bytes == 12 * request_bytes and dec.posted_bytes == 0 and dec.transfers == 0
    assert pre.transfers >= 1 and pre.transfer_seconds.count == pre.transfers and pre.transfers_failed == 0
    # Runs: c4 pages 3..5 -> 10..12 is one run per buffer, swa 1..2 -> 7..8 one more: 3 rows per request.
    assert pre.posted_descriptors == 12 * 3
    assert (dec.peers, pre.peers, dec.leases, dec.leased_pages, dec.live_requests) == (1, 1, 0, 0, 0)


def test_stats_are_monotone_and_differences_add_up(pair) -> None:
    prefill, decode = pair
    first = decode.stats()
    run_requests(prefill, decode, 3)
    middle = decode.stats()
    run_requests(prefill, decode, 4, first=3)
    last = decode.stats()
    for older, newer in ((first, middle), (middle, last)):
        for name in ("requests_done", "pages", "page_bytes", "verified_pages"):
            assert getattr(newer, name) >= getattr(older, name), name
    whole, parts = last.minus(first), middle.minus(first).plus(last.minus(middle))
    for name in ("requests_done", "pages", "page_bytes", "verified_pages"):
        assert getattr(whole, name) == getattr(parts, name), name
    assert whole.request_seconds.counts == parts.request_seconds.counts
    assert last.minus(middle).requests_done == 4 and middle.minus(first).requests_done == 3
    assert EndpointStats.from_dict(last.to_dict()) == last
    assert last.minus(last).is_empty() and not last.minus(first).is_empty()


def test_a_corrupted_page_counts_by_pool_and_buffer_kind() -> None:
    mem = layout()
    # The indexer page written to decode's page 11 flips while each write reads it: one bad digest a request.
    faulty = FaultyTransport(LocalTransport(), "flip:c4.idx:11")
    with kv.PrefillEndpoint(kv.KVMemory.allocate(mem), faulty, digest_mode="full") as prefill, \
            kv.DecodeEndpoint(kv.KVMemory.allocate(mem), "local", digest_mode="full") as decode:
        decode.connect(prefill.address)
        run_requests(prefill, decode, 5, expect_ok=False)
        until(lambda: prefill.stats().num_failed == 5)
        dec, pre = decode.stats(), prefill.stats()
    assert dec.digest_failed_pages == {("c4", "index_k"): 5}
    assert dec.requests_failed == {"digest_mismatch": 5} and dec.requests_done == 0
    # Prefill hears decode's verdict: the same cause on its side.
    assert pre.requests_failed == {"digest_mismatch": 5}
    # A chunk's digests are checked together: a chunk with a bad page counts none as verified.
    assert dec.verified_pages == 0


def test_aborts_and_deadlines_are_counted_by_cause(pair) -> None:
    prefill, decode = pair
    decode.announce("gone", {"c4": [20]})
    decode.abort("gone")
    settle(decode, "gone")
    until(lambda: prefill.stats().requests_failed.get("aborted", 0) == 1 or "gone" not in prefill.peers)
    assert decode.stats().requests_failed == {"aborted": 1}
    mem = layout()
    options = kv.EndpointOptions(request_timeout=0.2)
    with kv.DecodeEndpoint(kv.KVMemory.allocate(mem), "local", options=options) as slow:
        slow.connect(prefill.address)
        slow.announce("late", {"c4": [1]})   # prefill never sends it
        with pytest.raises(kv.RequestFailed):
            slow.wait("late", timeout=5.0)
        assert slow.stats().requests_failed == {"deadline": 1}
        assert slow.stats().live_requests == 0


def test_quarantined_pages_show_while_a_write_may_land(pair) -> None:
    _prefill, decode = pair
    decode.announce("q", {"c4": [30, 31]})
    stats = decode.stats()
    assert (stats.leases, stats.leased_pages, stats.live_requests) == (1, 2, 1)
    decode.abort("q")
    settle(decode, "q")
    assert (decode.stats().leases, decode.stats().quarantined_pages) == (0, 0)


@pytest.mark.parametrize(("error", "cause"), [
    (IntegrityError("x"), "digest_mismatch"),
    (TransferTimeout("x"), "deadline"), (PeerLost("x"), "peer_lost"), (TransportError("x"), "transport"),
    (IncompatiblePeer("x"), "refused_layout"), (PlanError("x"), "refused_layout"), (LeaseError("x"), "lease"),
    (RequestAborted("x"), "aborted"), (EndpointClosed("x"), "closed"), (KVFerryError("x"), "other"), (None, "other"),
])
def test_failure_causes_come_from_the_exception_tree(error: BaseException | None, cause: str) -> None:
    assert failure_cause(error) == cause and cause in CAUSES


def test_histogram_replay_reproduces_buckets_and_sum() -> None:
    hist = Histogram(counts=(0, 2, *([0] * 16), 1), sums=(0.0, 0.0003, *([0.0] * 16), 100.0))
    values = [v for v, n in hist.replay() for _ in range(n)]
    assert len(values) == hist.count == 3 and sum(values) == pytest.approx(hist.sum)
    assert hist.quantile(0.5) == hist.bounds[1] and hist.quantile(1.0) == hist.bounds[-1]


def test_stats_off_records_nothing() -> None:
    mem = layout()
    off = kv.EndpointOptions(stats=False)
    with kv.PrefillEndpoint(kv.KVMemory.allocate(mem), "local", options=off) as prefill, \
            kv.DecodeEndpoint(kv.KVMemory.allocate(mem), "local", options=off) as decode:
        decode.connect(prefill.address)
        run_requests(prefill, decode, 2)
        stats = decode.stats()
    assert stats.minus(EndpointStats("decode")).is_empty() and stats.peers == 1


def scrape(port: int) -> dict[str, float]:
    """``/metrics`` as ``{'name{labels}': value}``, labels as the exposition writes them."""
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as answer:
        text = answer.read().decode()
    return {line.rsplit(" ", 1)[0]: float(line.rsplit(" ", 1)[1])
            for line in text.splitlines() if line and not line.startswith("#")}


def test_prometheus_scrape_shows_the_snapshot(pair) -> None:
    pytest.importorskip("prometheus_client")
    prefill, decode = pair
    server = serve(0, lambda: [prefill, decode])
    try:
        run_requests(prefill, decode, 6)
        until(lambda: prefill.stats().requests_done == 6)
        got = scrape(server.server_port)
    finally:
        server.shutdown()
    if os.environ.get("KVFERRY_WRITE_SCRAPE"):   # how docs/metrics.md's sample scrape was made
        Path(os.environ["KVFERRY_WRITE_SCRAPE"]).write_text("".join(f"{k} {v}\n" for k, v in got.items()))
    assert got['kvferry_requests_done_total{role="decode"}'] == 6
    assert got['kvferry_requests_done_total{role="prefill"}'] == 6
    assert got['kvferry_verified_pages_total{role="decode"}'] == 6 * 8
    assert got['kvferry_page_bytes_total{role="decode"}'] == 6 * (3 * (KV + IDX) + 2 * SWA)
    assert got['kvferry_request_seconds_count{role="decode"}'] == 6
    assert got['kvferry_request_seconds_bucket{le="+Inf",role="decode"}'] == 6
    assert all(got[f'kvferry_requests_failed_total{{cause="{c}",role="decode"}}'] == 0 for c in CAUSES)
    for metric in METRICS:   # every metric of the table is exported (digest failures once one happened)
        assert metric.name == "digest_failed_pages" or any(k.startswith("kvferry_" + metric.name) for k in got)
        assert f"`kvferry_{metric.exposed}`" in DOC.read_text(), f"docs/metrics.md lacks {metric.exposed}"


PUBLISHER = textwrap.dedent("""
    import sys
    import kvferry as kv
    from kvferry.metrics import Publisher
    layout = kv.Layout([kv.Pool("c4", [kv.Buffer("c4.kv", page_bytes=256, num_pages=64, kind="kv", layer=0),
                                       kv.Buffer("c4.idx", page_bytes=128, num_pages=64, kind="index_k", layer=0)],
                                tokens_per_page=16)])
    with kv.PrefillEndpoint(kv.KVMemory.allocate(layout), "local", digest_mode="full") as prefill, \\
            kv.DecodeEndpoint(kv.KVMemory.allocate(layout), "local", digest_mode="full") as decode:
        publisher = Publisher(lambda: [decode], interval=0.05).start()
        decode.connect(prefill.address)
        for i in range(int(sys.argv[1])):
            decode.announce(f"r{i}", {"c4": [10, 11, 12, 13]})
            prefill.send(f"r{i}", {"c4": [3, 4, 5, 6]})
            decode.wait(f"r{i}", timeout=10.0)
        publisher.close()
""")


def test_multiprocess_mode_sums_the_processes(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Two processes publish into PROMETHEUS_MULTIPROC_DIR; one server reads both: counters add up."""
    pytest.importorskip("prometheus_client")
    env = {**os.environ, "PROMETHEUS_MULTIPROC_DIR": str(tmp_path)}
    root = Path(__file__).resolve().parents[1]
    procs = [subprocess.Popen([sys.executable, "-c", PUBLISHER, str(n)], env=env, cwd=root) for n in (3, 5)]
    assert [p.wait(timeout=60) for p in procs] == [0, 0]
    monkeypatch.setenv("PROMETHEUS_MULTIPROC_DIR", str(tmp_path))
    server = serve(0)
    try:
        got = scrape(server.server_port)
    finally:
        server.shutdown()
    assert got['kvferry_requests_done_total{role="decode"}'] == 8
    assert got['kvferry_verified_pages_total{role="decode"}'] == 8 * 4 * 2   # full digests: 4 pages x 2 buffers
    assert got['kvferry_request_seconds_count{role="decode"}'] == 8
    assert np.isclose(sum(v for k, v in got.items() if k.startswith("kvferry_request_seconds_bucket")
                          and '+Inf' in k), 8)


def test_stress_reports_its_stats_and_publishes_them(tmp_path: Path) -> None:
    """``kvferry stress --json`` carries both sides' stats; with a multiprocess folder set (what
    ``--metrics-port`` serves) the sides publish the same figures there."""
    pytest.importorskip("prometheus_client")
    from prometheus_client import CollectorRegistry, multiprocess

    env = {**os.environ, "PROMETHEUS_MULTIPROC_DIR": str(tmp_path)}
    command = [sys.executable, "-m", "kvferry", "stress", "--sessions", "3", "--turns", "2", "--transport", "local",
               "--pages", "96", "--json"]
    out = subprocess.run(command, env=env, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    result = json.loads(out.stdout)
    stats = {role: EndpointStats.from_dict(d) for role, d in result["stats"].items()}
    assert stats["decode"].requests_done == stats["prefill"].requests_done == result["requests"] == 6
    assert stats["decode"].page_bytes == stats["prefill"].posted_bytes == result["bytes"]
    # Full digests (stress's default): every buffer page the workload checked, kvferry checked too.
    assert stats["decode"].verified_pages == result["pages_verified"]
    registry = CollectorRegistry()
    multiprocess.MultiProcessCollector(registry, path=str(tmp_path))
    for role, snap in stats.items():
        assert registry.get_sample_value("kvferry_requests_done_total", {"role": role}) == snap.requests_done
        assert registry.get_sample_value("kvferry_page_bytes_total", {"role": role}) == snap.page_bytes
    assert registry.get_sample_value("kvferry_verified_pages_total", {"role": "decode"}) == result["pages_verified"]
