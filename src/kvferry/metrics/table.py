"""Every metric kvferry exports: its name, type, labels and meaning, and where it comes from in a snapshot.

The bottom of ``kvferry.metrics``, above ``control.stats``: one table that the Prometheus exporter
(``prometheus``), vLLM's stats path and docs/metrics.md all read, so a metric has one name and one meaning
wherever it shows. No ``prometheus_client`` import here.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass

from kvferry.control.stats import CAUSES, EndpointStats, Histogram

__all__ = ["METRICS", "Metric", "samples"]


@dataclass(frozen=True, slots=True)
class Metric:
    """One exported metric. ``name`` is the part after the prefix (``kvferry_`` standalone, ``vllm:kvferry_``
    inside vLLM) and before what Prometheus adds (``_total`` for a counter, ``_bucket``/``_sum``/``_count``
    for a histogram); ``field`` the ``EndpointStats`` field it reads; ``labels`` those after ``role``."""

    name: str
    kind: str   # "counter", "gauge" or "histogram"
    field: str
    doc: str
    labels: tuple[str, ...] = ()

    @property
    def exposed(self) -> str:
        """The name a scrape shows for the metric's value (counters: with ``_total``)."""
        return self.name + "_total" if self.kind == "counter" else self.name


METRICS: tuple[Metric, ...] = (
    Metric("requests_done", "counter", "requests_done", "Requests that ended DONE on this side (decode: every "
           "byte landed and its digests verified)."),
    Metric("requests_failed", "counter", "requests_failed", "Requests that ended FAILED on this side, by "
           "cause: " + ", ".join(CAUSES) + ".", ("cause",)),
    Metric("transfers", "counter", "transfers", "Transfers this side posted (prefill's writes in push mode, "
           "decode's reads in pull mode); one may carry several requests' chunks."),
    Metric("transfers_failed", "counter", "transfers_failed", "Posted transfers whose handle reported an error."),
    Metric("posted_bytes", "counter", "posted_bytes", "Bytes the posted transfers carried."),
    Metric("posted_descriptors", "counter", "posted_descriptors", "Descriptors (rows of address, length, "
           "device) the posted transfers carried."),
    Metric("pages", "counter", "pages", "Pages (page indices, summed over pools) of requests that ended DONE."),
    Metric("page_bytes", "counter", "page_bytes", "Bytes of those pages in this side's buffers (decode: the "
           "bytes that landed and verified)."),
    Metric("verified_pages", "counter", "verified_pages", "Page digests that matched (decode; once per buffer "
           "and page; sampled mode checks a sample of the pages)."),
    Metric("digest_failed_pages", "counter", "digest_failed_pages", "Page digests that did not match: bytes "
           "that arrived but are not the bytes sent, by pool and buffer kind.", ("pool", "kind")),
    Metric("transfer_seconds", "histogram", "transfer_seconds", "Per posted transfer: from posting to its "
           "completion seen by the progress loop."),
    Metric("request_seconds", "histogram", "request_seconds", "Per request DONE: from when this side learned "
           "of it (announce, send) to DONE."),
    Metric("live_requests", "gauge", "live_requests", "Requests not yet ended."),
    Metric("peers", "gauge", "peers", "Peers connected (decode: prefill links; prefill: decode sessions)."),
    Metric("leases", "gauge", "leases", "Decode: leases held, including failed requests' awaiting settlement."),
    Metric("leased_pages", "gauge", "leased_pages", "Decode: pages leased, including quarantined ones."),
    Metric("quarantined_pages", "gauge", "quarantined_pages", "Decode: pages of failed requests that a write "
           "may still reach (reusable once their writer settled or is certainly gone)."),
    Metric("source_holds", "gauge", "source_holds", "Prefill, pull mode: requests whose source pages decode "
           "may still read."),
)


def samples(metric: Metric, stats: EndpointStats) -> Iterator[tuple[tuple[str, ...], int | float | Histogram]]:
    """``(label values after role, value)`` for ``metric`` in ``stats``. Every failure cause is listed,
    zero or not (a rate over a series that does not exist yet is no rate); a digest failure's pool and kind
    only once one happened."""
    value = getattr(stats, metric.field)
    if metric.labels == ("cause",):
        for cause in CAUSES:
            yield (cause,), value.get(cause, 0)
    elif metric.labels == ("pool", "kind"):
        yield from sorted(value.items())
    else:
        yield (), value
