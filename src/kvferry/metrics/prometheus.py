"""kvferry's endpoint stats as Prometheus metrics (``prometheus_client``, the ``metrics`` extra, imported lazily).

Part of ``kvferry.metrics``, above ``table``. Two ways out, for the two ways processes are laid out:

* One process holds the endpoints and serves ``/metrics``: ``StatsCollector`` reads their snapshots at each
  scrape (nothing runs between scrapes) and ``serve(port, sources)`` starts the HTTP server.
* Several processes hold endpoints (engine workers, ``kvferry stress``'s two sides) and one serves: with
  ``PROMETHEUS_MULTIPROC_DIR`` set in every one before it imports ``prometheus_client``, each holder runs a
  ``Publisher`` (a thread applying what changed since its last publish to ``prometheus_client`` metrics,
  which that mode keeps in files in the folder) and the server reads them all (``serve(port)``, no
  sources). The endpoints' totals are monotone, so a publish is a difference of two snapshots
  (``EndpointStats.minus``) and never loses or repeats an event.

``StatsWriter`` applies such differences to metric objects of any class with ``prometheus_client``'s
interface; vLLM's stats path passes its own (``integrations.vllm.stats``).
"""

from __future__ import annotations

import os
import threading
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from typing import Any

from kvferry.control.stats import SECONDS_BUCKETS, EndpointStats, Histogram, merge
from kvferry.errors import UsageError
from kvferry.metrics.table import METRICS, Metric, samples

__all__ = ["PREFIX", "Publisher", "StatsCollector", "StatsWriter", "by_role", "serve"]

PREFIX = "kvferry_"

# Anything with ``stats()``: PrefillEndpoint, DecodeEndpoint. A callable: whatever endpoints exist now.
Sources = Callable[[], Iterable[Any]]


def by_role(snapshots: Iterable[EndpointStats]) -> dict[str, EndpointStats]:
    """Snapshots summed per role (``prefill``, ``decode``): the ``role`` label's values."""
    groups: dict[str, list[EndpointStats]] = {}
    for snap in snapshots:
        groups.setdefault(snap.role, []).append(snap)
    return {role: merge(snaps, role) for role, snaps in sorted(groups.items())}


def _require() -> Any:
    try:
        import prometheus_client
    except ImportError as exc:
        raise UsageError("Prometheus export needs prometheus_client: pip install 'kvferry[metrics]'") from exc
    return prometheus_client


class StatsCollector:
    """A ``prometheus_client`` collector: each scrape reads every source's ``stats()`` and yields one family
    per metric of ``METRICS``, labelled by ``role``. Register it once (``registry.register``)."""

    def __init__(self, sources: Sources, prefix: str = PREFIX) -> None:
        self._sources = sources
        self._prefix = prefix

    def collect(self) -> Iterator[Any]:
        from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily

        families = {"counter": CounterMetricFamily, "gauge": GaugeMetricFamily, "histogram": HistogramMetricFamily}
        totals = by_role(source.stats() for source in self._sources())
        for metric in METRICS:
            family = families[metric.kind](self._prefix + metric.name, metric.doc, labels=("role", *metric.labels))
            for role, stats in totals.items():
                for labels, value in samples(metric, stats):
                    if isinstance(value, Histogram):
                        family.add_metric([role, *labels], _cumulative(value), value.sum)
                    else:
                        family.add_metric([role, *labels], value)
            yield family


def _cumulative(hist: Histogram) -> list[tuple[str, float]]:
    buckets, seen = [], 0
    for bound, n in zip((*hist.bounds, float("inf")), hist.counts, strict=True):
        seen += n
        buckets.append(("+Inf" if bound == float("inf") else repr(float(bound)), seen))
    return buckets


class StatsWriter:
    """``prometheus_client``-style metric objects for ``METRICS``, moved by differences of snapshots.

    ``metric_types`` maps ``prometheus_client``'s ``Counter``/``Gauge``/``Histogram`` to the classes to
    build (default: those themselves); ``labelnames`` come before ``role`` (vLLM: ``model_name``, ``engine``);
    ``options`` per kind are passed to the constructors (a gauge's ``multiprocess_mode``). Not thread-safe:
    one thread observes."""

    def __init__(self, prefix: str = PREFIX, labelnames: Sequence[str] = (),
                 metric_types: Mapping[type, type] | None = None,
                 options: Mapping[str, Mapping[str, Any]] | None = None) -> None:
        prom = _require()
        kinds = {"counter": prom.Counter, "gauge": prom.Gauge, "histogram": prom.Histogram}
        classes = {kind: (metric_types or {}).get(cls, cls) for kind, cls in kinds.items()}
        extra = dict(options or {})
        self._metrics: dict[Metric, Any] = {}
        for metric in METRICS:
            kwargs = dict(extra.get(metric.kind, {}))
            if metric.kind == "histogram":
                kwargs["buckets"] = list(SECONDS_BUCKETS)
            # Counters: prometheus_client adds _total itself.
            self._metrics[metric] = classes[metric.kind](name=prefix + metric.name, documentation=metric.doc,
                                                         labelnames=[*labelnames, "role", *metric.labels],
                                                         **kwargs)

    def collectors(self) -> list[Any]:
        """The metric objects, one per ``METRICS`` entry."""
        return list(self._metrics.values())

    def observe(self, delta: EndpointStats, labelvalues: Sequence[Any] = ()) -> None:
        """Apply what happened in ``delta`` (a ``minus`` of two snapshots of one role) and set its gauges."""
        for metric, prom in self._metrics.items():
            for labels, value in samples(metric, delta):
                child = prom.labels(*labelvalues, delta.role, *labels)
                if isinstance(value, Histogram):
                    for seconds, times in value.replay():   # one observe per request or transfer in delta
                        for _ in range(times):
                            child.observe(seconds)
                elif metric.kind == "gauge":
                    child.set(value)
                elif value:
                    child.inc(value)


class Publisher:
    """Multiprocess mode, in a process holding endpoints: every ``interval`` seconds (and on ``publish``,
    ``close``), what changed in ``sources``' stats goes to ``prometheus_client``'s files in
    ``PROMETHEUS_MULTIPROC_DIR``, where the serving process's ``serve(port)`` reads it.

    Gauges are summed over the live processes (``livesum``). ``sources`` may change over time (a side that
    reconnects builds a new endpoint): the difference is taken per role over all of them, so keep an
    ended endpoint among the sources (its totals stay) rather than drop it."""

    def __init__(self, sources: Sources, prefix: str = PREFIX, interval: float = 1.0) -> None:
        if not os.environ.get("PROMETHEUS_MULTIPROC_DIR"):
            raise UsageError("Publisher: set PROMETHEUS_MULTIPROC_DIR (before prometheus_client is imported) "
                             "to the folder the serving process reads")
        self._sources = sources
        self._writer = _process_writer(prefix)
        self._last: dict[str, EndpointStats] = {}
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._interval = interval
        self._thread = threading.Thread(target=self._run, name="kvferry-metrics", daemon=True)

    def start(self) -> Publisher:
        self._thread.start()
        return self

    def publish(self) -> None:
        with self._lock:
            for role, now in by_role(source.stats() for source in self._sources()).items():
                delta = now.minus(self._last.get(role, EndpointStats(role)))
                # A total went back: a source was replaced by a fresh endpoint (a side that rebuilt it),
                # whose totals count from zero.
                self._writer.observe(now if _went_back(delta) else delta)
                self._last[role] = now

    def close(self) -> None:
        """Publish a last time and stop the thread."""
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join(timeout=5.0)
        self.publish()

    def _run(self) -> None:
        while not self._stop.wait(self._interval):
            self.publish()


def _went_back(delta: EndpointStats) -> bool:
    scalars = (delta.requests_done, delta.num_failed, delta.transfers, delta.posted_bytes, delta.pages,
               delta.verified_pages, delta.request_seconds.count, delta.transfer_seconds.count)
    return min(scalars) < 0


# Publishers of one process share one set of metric objects: in multiprocess mode two objects with one name
# and label values would each write their own value to the process's file.
_WRITERS: dict[str, StatsWriter] = {}
_WRITERS_LOCK = threading.Lock()


def _process_writer(prefix: str) -> StatsWriter:
    with _WRITERS_LOCK:
        if prefix not in _WRITERS:
            unregistered = {"registry": None}   # the files are what a scrape reads, not this process's registry
            _WRITERS[prefix] = StatsWriter(prefix, options={"counter": unregistered, "histogram": unregistered,
                                                            "gauge": {**unregistered, "multiprocess_mode": "livesum"}})
        return _WRITERS[prefix]


def serve(port: int, sources: Sources | None = None, *, addr: str = "127.0.0.1") -> Any:
    """Serve ``/metrics`` on ``addr:port`` (port 0: any free one) from a daemon thread; returns the server
    (``server.server_port``, ``server.shutdown()``). With ``sources``: their stats, read at each scrape.
    Without: multiprocess mode, every process's publishes in ``PROMETHEUS_MULTIPROC_DIR``."""
    prom = _require()
    registry = prom.CollectorRegistry()
    if sources is not None:
        registry.register(StatsCollector(sources))
    else:
        from prometheus_client import multiprocess

        multiprocess.MultiProcessCollector(registry)
    server, _thread = prom.start_http_server(port, addr=addr, registry=registry)
    return server
