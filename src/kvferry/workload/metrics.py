"""A workload side's endpoint stats: in its report (``--json``), and to a ``--metrics-port`` server.

Part of the workload layer, above ``kvferry.metrics``, below ``supervisor`` and ``chaos_sides`` (which run a
side inside ``side_metrics``). The two sides are processes (NIXL) or threads of the parent (local): the
parent serves ``/metrics`` in ``prometheus_client``'s multiprocess mode (``serve_metrics``, which sets
``PROMETHEUS_MULTIPROC_DIR`` before any side starts), and each side publishes its endpoint's figures there
(``kvferry.metrics.Publisher``). A killed side's totals stay in the folder, so a chaos run's counters
include every incarnation of each side.
"""

from __future__ import annotations

import os
import tempfile
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

__all__ = ["serve_metrics", "side_metrics"]

# How often a side publishes; a scrape sees figures at most this old.
PUBLISH_S = 0.5


def serve_metrics(port: int) -> Any:
    """Parent, before the sides start: a multiprocess folder of its own and ``/metrics`` on ``port``
    (127.0.0.1) serving whatever the sides publish there. Returns the server."""
    from kvferry.metrics import serve

    os.environ["PROMETHEUS_MULTIPROC_DIR"] = tempfile.mkdtemp(prefix="kvferry-metrics-")
    return serve(port)


@contextmanager
def side_metrics(endpoint: Callable[[], Any]) -> Iterator[None]:
    """Around a side's run: publish ``endpoint()``'s stats (the side's current endpoint) every
    ``PUBLISH_S`` while a ``serve_metrics`` folder is set, and once more at the end."""
    if not os.environ.get("PROMETHEUS_MULTIPROC_DIR"):
        yield
        return
    from kvferry.metrics import Publisher

    publisher = Publisher(lambda: [endpoint()], interval=PUBLISH_S).start()
    try:
        yield
    finally:
        publisher.close()
