"""kvferry's vLLM stats classes against vLLM's contract (``kv_connector/v1/metrics.py``), without an engine.

Endpoints over the local transport stand in for a worker's; the figures must survive vLLM's path: the
worker's difference (``StatsTaker.take``), ``aggregate`` over workers and steps, the serialised ``data``,
``reduce`` for the log line, and ``observe`` into Prometheus metrics with vLLM's labels. The end-to-end
checks (real servers' ``/metrics``) are in tests/test_vllm.py.
"""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

import pytest

import kvferry as kv

pytest.importorskip("vllm", reason="vLLM is not installed (make test-vllm)")

from prometheus_client import REGISTRY, Counter, Gauge, Histogram

from kvferry.integrations.vllm import KVFerryConnector
from kvferry.integrations.vllm.stats import KVFerryConnectorStats, StatsTaker

pytestmark = [pytest.mark.vllm]

PAGE = 4096


@pytest.fixture()
def pair() -> Any:
    layout = kv.Layout([kv.Pool("0", [kv.Buffer("model.layers.0.self_attn.attn", page_bytes=PAGE, num_pages=64,
                                                 kind="kv/test", layer=0)], tokens_per_page=32)])
    with kv.PrefillEndpoint(kv.KVMemory.allocate(layout), "local", digest_mode="full") as prefill, \
            kv.DecodeEndpoint(kv.KVMemory.allocate(layout), "local") as decode:
        decode.connect(prefill.address)
        yield prefill, decode


def move(prefill: Any, decode: Any, first: int, num: int, pages: int = 3) -> None:
    for i in range(first, first + num):
        decode.announce(f"r{i}", {"0": list(range(10, 10 + pages))})
        prefill.send(f"r{i}", {"0": list(range(pages))})
        decode.wait(f"r{i}", timeout=10.0)
        prefill.wait(f"r{i}", timeout=10.0)   # prefill counts a request once decode's verdict reached it


def test_a_workers_stats_are_what_happened_since_its_last_call(pair: Any) -> None:
    prefill, decode = pair
    taker = StatsTaker()
    taker.take([decode])
    move(prefill, decode, 0, 4)
    step = taker.take([decode])
    assert step is not None and not step.is_empty()
    got = step.roles()["decode"]
    assert (got.requests_done, got.pages, got.page_bytes, got.verified_pages) == (4, 12, 12 * PAGE, 12)
    assert taker.take([decode]) is None   # nothing happened since: vLLM ships nothing this step
    move(prefill, decode, 4, 2)
    later = KVFerryConnector.build_kv_connector_stats(taker.take([decode]).to_dict())   # serialised, rebuilt
    total = step.aggregate(later)
    assert isinstance(total, KVFerryConnectorStats) and total.roles()["decode"].requests_done == 6
    line = total.reduce()
    assert (line["kvferry decode done"], line["decode failed"], line["pages verified"], line["pages bad"]) == \
        (6, 0, 18, 0)
    assert KVFerryConnector.build_kv_connector_stats().is_empty()


def test_prometheus_metrics_carry_vllms_labels(pair: Any) -> None:
    prefill, decode = pair
    labels = {"model_name": "stats-test", "engine": "7"}
    config = SimpleNamespace(kv_transfer_config=None)   # all vLLM's base class reads of it
    prom = KVFerryConnector.build_prom_metrics(config, {Counter: Counter, Gauge: Gauge, Histogram: Histogram},
                                               list(labels), {7: list(labels.values())})
    taker = StatsTaker()
    before = REGISTRY.get_sample_value("vllm:kvferry_requests_done_total", {**labels, "role": "decode"}) or 0
    move(prefill, decode, 0, 5)
    prom.observe(taker.take([decode, prefill]).to_dict(), engine_idx=7)
    sample = REGISTRY.get_sample_value
    assert sample("vllm:kvferry_requests_done_total", {**labels, "role": "decode"}) - before == 5
    assert sample("vllm:kvferry_page_bytes_total", {**labels, "role": "prefill"}) >= 5 * 3 * PAGE
    assert sample("vllm:kvferry_request_seconds_count", {**labels, "role": "decode"}) >= 5
    assert sample("vllm:kvferry_peers", {**labels, "role": "decode"}) == 1
