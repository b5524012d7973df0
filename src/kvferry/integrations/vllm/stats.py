"""kvferry's endpoint stats through vLLM's KV-connector stats path: ``/metrics`` and the periodic log line.

Part of ``kvferry.integrations.vllm``, beside ``connector`` (which forwards vLLM's three stats hooks here),
above ``kvferry.metrics``. Imports vLLM. vLLM's contract (``kv_connector/v1/metrics.py``): each worker's
``get_kv_connector_stats()`` returns what it observed since its last call (or None); vLLM sums those over
workers and over steps (``aggregate``) and ships their ``data`` (plain, serialisable) to the process that
logs and serves metrics, where ``build_kv_connector_stats(data)`` rebuilds them, the logger prints
``reduce()`` ("KV Transfer metrics: ...") and the ``KVConnectorPromMetrics`` from ``build_prom_metrics``
records them in Prometheus metrics made with vLLM's classes and labels (``model_name``, ``engine``).

kvferry's endpoints keep monotone totals (``control.stats``), so a worker's stats are the difference of
two snapshots (``StatsTaker``): nothing is reset, and a reader other than vLLM's (a debugger, a test)
still sees the whole totals in ``stats()``.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

from vllm.distributed.kv_transfer.kv_connector.v1.metrics import KVConnectorPromMetrics, KVConnectorStats

from kvferry.control.stats import GAUGES, EndpointStats
from kvferry.metrics import StatsWriter, by_role

__all__ = ["PREFIX", "KVFerryConnectorStats", "KVFerryPromMetrics", "StatsTaker"]

# vLLM's metric names start "vllm:"; NixlConnector's are vllm:nixl_*. Counters get _total from prometheus_client.
PREFIX = "vllm:kvferry_"


@dataclass
class KVFerryConnectorStats(KVConnectorStats):
    """``data``: role (``prefill``, ``decode``) -> ``EndpointStats.to_dict()`` of what happened in an
    interval (its gauges: current values at its end)."""

    def reset(self) -> None:
        self.data = {}

    def roles(self) -> dict[str, EndpointStats]:
        return {role: EndpointStats.from_dict(d) for role, d in self.data.items()}

    def aggregate(self, other: KVConnectorStats) -> KVConnectorStats:
        """Sum per role: another worker's figures of one step, or a later step's (vLLM's log interval)."""
        mine = self.roles()
        for role, theirs in KVFerryConnectorStats(dict(other.data)).roles().items():
            mine[role] = mine[role].plus(theirs) if role in mine else theirs
        self.data = {role: stats.to_dict() for role, stats in mine.items()}
        return self

    def reduce(self) -> dict[str, int | float]:
        """The log line's figures, per role: requests done and failed, decode's page digests verified and
        failed, the bytes of the pages moved, and the median request time (from buckets: an upper bound)."""
        out: dict[str, int | float] = {}
        for role, stats in sorted(self.roles().items()):
            out[f"kvferry {role} done"] = stats.requests_done
            out[f"{role} failed"] = stats.num_failed
            if role == "decode":
                out["pages verified"] = stats.verified_pages
                out["pages bad"] = sum(stats.digest_failed_pages.values())
            out[f"{role} MB"] = round(stats.page_bytes / 2**20, 3)
            out[f"{role} p50 request ms"] = round(stats.request_seconds.quantile(0.5) * 1e3, 3)
        return out

    def is_empty(self) -> bool:
        return all(stats.is_empty() for stats in self.roles().values())


class KVFerryPromMetrics(KVConnectorPromMetrics):
    """kvferry's metrics (``kvferry.metrics.METRICS``) as ``vllm:kvferry_*``, labelled ``model_name``,
    ``engine`` (vLLM's) and ``role``, made with the metric classes vLLM passes (its multiprocess set-up
    applies); ``observe`` is called with each step's ``KVFerryConnectorStats.data``."""

    def __init__(self, vllm_config: Any, metric_types: dict[type, type], labelnames: list[str],
                 per_engine_labelvalues: dict[int, list[object]]) -> None:
        super().__init__(vllm_config, metric_types, labelnames, per_engine_labelvalues)
        self._writer = _shared_writer(metric_types, tuple(labelnames))

    def observe(self, transfer_stats_data: dict[str, Any], engine_idx: int = 0) -> None:
        labelvalues = self.per_engine_labelvalues[engine_idx]
        for stats in KVFerryConnectorStats(dict(transfer_stats_data)).roles().values():
            self._writer.observe(stats, labelvalues)


# One writer per process and label set: vLLM unregisters every "vllm:" collector whenever it builds another
# engine's Prometheus logger (several LLM instances in one process, as in tests), which would leave the
# earlier engines' kvferry figures in metrics no scrape reads. Shared, they stay in one registered set,
# told apart by their labels (engine, role).
_WRITERS: dict[tuple[Any, ...], StatsWriter] = {}


def _shared_writer(metric_types: dict[type, type], labelnames: tuple[str, ...]) -> StatsWriter:
    from prometheus_client import REGISTRY

    key = (tuple(sorted(metric_types.items(), key=lambda kv: kv[0].__name__)), labelnames)
    writer = _WRITERS.get(key)
    if writer is None:
        # "mostrecent", as vLLM's own gauges: one engine's value, whichever API server process records it.
        writer = _WRITERS[key] = StatsWriter(PREFIX, labelnames, metric_types,
                                             {"gauge": {"multiprocess_mode": "mostrecent"}})
        return writer
    for metric in writer.collectors():
        with contextlib.suppress(ValueError):   # still registered: nothing to do
            REGISTRY.register(metric)
    return writer


class StatsTaker:
    """Worker side: the difference of the endpoints' stats since the last ``take``, for vLLM. One caller
    (the worker's step)."""

    def __init__(self) -> None:
        self._last: dict[str, EndpointStats] = {}

    def take(self, endpoints: Iterable[Any]) -> KVFerryConnectorStats | None:
        """None when no total moved and no current figure changed since the last call (vLLM then ships
        nothing this step); a gauge change alone is news (quarantined pages draining to zero)."""
        now = by_role(endpoint.stats() for endpoint in endpoints)
        delta = {role: stats.minus(self._last.get(role, EndpointStats(role))) for role, stats in now.items()}
        if all(d.is_empty() and _same_gauges(d, self._last.get(role)) for role, d in delta.items()):
            return None
        self._last = now
        return KVFerryConnectorStats({role: d.to_dict() for role, d in delta.items()})


def _same_gauges(delta: EndpointStats, last: EndpointStats | None) -> bool:
    return last is not None and all(getattr(delta, name) == getattr(last, name) for name in GAUGES)
