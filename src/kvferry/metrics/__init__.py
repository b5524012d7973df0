"""kvferry's endpoint stats where operators look: one metric table, Prometheus export, engine adapters' source.

Above ``control`` (it reads ``PrefillEndpoint.stats()`` / ``DecodeEndpoint.stats()``, ``control.stats``),
below ``workload``, ``integrations`` and ``cli``. ``table`` names every metric once; ``prometheus`` exports
them with ``prometheus_client`` (the ``metrics`` extra, imported only when used). docs/metrics.md lists them.
"""

from __future__ import annotations

from kvferry.metrics.prometheus import PREFIX, Publisher, StatsCollector, StatsWriter, by_role, serve
from kvferry.metrics.table import METRICS, Metric, samples

__all__ = ["METRICS", "PREFIX", "Metric", "Publisher", "StatsCollector", "StatsWriter", "by_role", "samples",
           "serve"]
