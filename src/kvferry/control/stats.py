"""What an endpoint counts about its work, and the snapshot of it that monitoring reads (``stats()``).

Part of the control plane, above ``transport`` and ``integrity``, below ``endpoints`` (each endpoint owns one
``StatsRecorder``); exported by ``kvferry.metrics`` to Prometheus and to the engines' own monitoring.

The recorder is written only under the endpoint's lock (on its progress thread, or by a caller holding it),
so recording is a few integer adds and one bucket search, with no lock of its own. ``snapshot`` may run on
any thread without that lock (a stalled progress thread may hold it for long): it copies each counter in one
step under the GIL, so every figure is one the endpoint had; figures that one event moves together (a
request DONE, its pages) may be a moment apart in a snapshot taken mid-event, never in one taken at rest.

Nothing is ever reset: counters only grow, so several readers (a Prometheus scrape, vLLM's per-step stats,
a CLI report) each keep their last snapshot and take differences (``EndpointStats.minus``). Labels are
bounded: a failure cause out of ``CAUSES``, a (pool, buffer kind) out of the layout; never a page or a
request id.
"""

from __future__ import annotations

import time
from bisect import bisect_left
from collections.abc import Iterable, Mapping, Sequence, Sized
from dataclasses import dataclass, field, fields, replace
from typing import Any

from kvferry.errors import (
    EndpointClosed,
    HandshakeError,
    IntegrityError,
    KVFerryError,
    LayoutError,
    LeaseError,
    PeerLost,
    PlanError,
    RequestAborted,
    TransferTimeout,
    TransportError,
)
from kvferry.layout.spec import Layout
from kvferry.plan.contract import Plan
from kvferry.transport import TransferHandle

__all__ = ["CAUSES", "GAUGES", "SECONDS_BUCKETS", "EndpointStats", "Histogram", "NullRecorder", "StatsRecorder",
           "failure_cause", "merge"]

# Upper bounds (seconds) of the time histograms: 100 us (a small in-host write) to a minute (the default
# request deadline); above the last, the overflow bucket.
SECONDS_BUCKETS: tuple[float, ...] = (1e-4, 2.5e-4, 5e-4, 1e-3, 2.5e-3, 5e-3, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5,
                                      1.0, 2.5, 5.0, 10.0, 30.0, 60.0)

# Why a request failed, from the most specific exception class that applies (``failure_cause``). Fixed, so
# a label over it has at most this many values.
CAUSES: tuple[str, ...] = ("digest_mismatch", "deadline", "peer_lost", "transport", "refused_layout", "lease",
                           "aborted", "closed", "other")

_CAUSE_OF: tuple[tuple[type[KVFerryError], str], ...] = (
    (IntegrityError, "digest_mismatch"), (TransferTimeout, "deadline"), (PeerLost, "peer_lost"),
    (TransportError, "transport"), (HandshakeError, "refused_layout"), (LayoutError, "refused_layout"),
    (PlanError, "refused_layout"), (LeaseError, "lease"), (RequestAborted, "aborted"), (EndpointClosed, "closed"),
)


def failure_cause(error: BaseException | None) -> str:
    """The ``CAUSES`` entry for a request that failed with ``error`` (``"other"`` when none applies)."""
    for cls, cause in _CAUSE_OF:
        if isinstance(error, cls):
            return cause
    return "other"


@dataclass(frozen=True, slots=True)
class Histogram:
    """Observations in fixed buckets: ``counts[i]`` fell at or below ``bounds[i]`` and above the bound
    before (the last entry: above every bound), and ``sums[i]`` is their total. Per bucket, not cumulative,
    so that two snapshots subtract bucket by bucket."""

    bounds: tuple[float, ...] = SECONDS_BUCKETS
    counts: tuple[int, ...] = (0,) * (len(SECONDS_BUCKETS) + 1)
    sums: tuple[float, ...] = (0.0,) * (len(SECONDS_BUCKETS) + 1)

    @property
    def count(self) -> int:
        return sum(self.counts)

    @property
    def sum(self) -> float:
        return sum(self.sums)

    def minus(self, older: Histogram) -> Histogram:
        return replace(self, counts=tuple(a - b for a, b in zip(self.counts, older.counts, strict=True)),
                       sums=tuple(a - b for a, b in zip(self.sums, older.sums, strict=True)))

    def plus(self, other: Histogram) -> Histogram:
        return replace(self, counts=tuple(a + b for a, b in zip(self.counts, other.counts, strict=True)),
                       sums=tuple(a + b for a, b in zip(self.sums, other.sums, strict=True)))

    def quantile(self, q: float) -> float:
        """The upper bound of the bucket holding the ``q`` quantile (0.0 when empty; the last bound when it
        falls in the overflow bucket): what a log line can say from buckets alone."""
        total = self.count
        if not total:
            return 0.0
        seen = 0
        for bound, n in zip(self.bounds, self.counts):
            seen += n
            if seen >= q * total:
                return bound
        return self.bounds[-1]

    def replay(self) -> Iterable[tuple[float, int]]:
        """``(value, times)`` per non-empty bucket: observing each ``value`` ``times`` times reproduces these
        bucket counts and this sum exactly (the value is the bucket's mean, which lies inside the bucket).
        How deltas reach histogram APIs that only take single observations (prometheus_client's)."""
        for n, total in zip(self.counts, self.sums):
            if n > 0:
                yield total / n, n

    def to_dict(self) -> dict[str, Any]:
        return {"bounds": list(self.bounds), "counts": list(self.counts), "sums": list(self.sums)}

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> Histogram:
        return cls(tuple(data["bounds"]), tuple(data["counts"]), tuple(data["sums"]))


# Figures that are current values rather than running totals: ``minus`` keeps the newer one.
GAUGES: tuple[str, ...] = ("live_requests", "peers", "leases", "leased_pages", "quarantined_pages", "source_holds")


@dataclass(frozen=True, slots=True)
class EndpointStats:
    """One endpoint's figures at one moment (``PrefillEndpoint.stats()``, ``DecodeEndpoint.stats()``).

    Running totals, since the endpoint started (never reset):

    * ``requests_done``; ``requests_failed``: cause (``CAUSES``) -> requests that ended failed here.
    * ``transfers``, ``transfers_failed``: transfers this side posted (prefill's writes in push mode,
      decode's reads in pull mode; one transfer may carry several requests' chunks), and those whose handle
      reported an error. ``posted_bytes``, ``posted_descriptors``: what those transfers carried.
    * ``pages``, ``page_bytes``: the pages (page indices per pool, summed over pools) of requests that
      ended DONE here, and their bytes in this side's buffers (decode: what landed and verified).
    * ``verified_pages``: page digests that matched on this side (decode; a page counts once per buffer;
      sampled mode checks a sample). ``digest_failed_pages``: ``(pool, buffer kind)`` -> page digests
      that did not match.
    * ``transfer_seconds``: per posted transfer, post to completion seen by the progress loop.
      ``request_seconds``: per request DONE here, from when this side learned of it to DONE.

    Current values (``GAUGES``): ``live_requests``, ``peers``, ``leases`` and ``leased_pages`` (decode,
    including ``quarantined_pages``: pages of failed requests a write may still reach), ``source_holds``
    (prefill in pull mode: requests whose source pages decode may still read).
    """

    role: str
    requests_done: int = 0
    requests_failed: Mapping[str, int] = field(default_factory=dict)
    transfers: int = 0
    transfers_failed: int = 0
    posted_bytes: int = 0
    posted_descriptors: int = 0
    pages: int = 0
    page_bytes: int = 0
    verified_pages: int = 0
    digest_failed_pages: Mapping[tuple[str, str], int] = field(default_factory=dict)
    transfer_seconds: Histogram = Histogram()
    request_seconds: Histogram = Histogram()
    live_requests: int = 0
    peers: int = 0
    leases: int = 0
    leased_pages: int = 0
    quarantined_pages: int = 0
    source_holds: int = 0

    @property
    def num_failed(self) -> int:
        return sum(self.requests_failed.values())

    def minus(self, older: EndpointStats) -> EndpointStats:
        """What happened since ``older`` (an earlier snapshot of the same endpoints): totals differenced,
        current values kept."""
        return self._combine(older, lambda a, b: a - b, keep_gauges=True)

    def plus(self, other: EndpointStats) -> EndpointStats:
        """Both together (two endpoints, two workers, two intervals): everything summed."""
        return self._combine(other, lambda a, b: a + b, keep_gauges=False)

    def is_empty(self) -> bool:
        """No running total is above zero (a ``minus`` in which nothing happened)."""
        return not any(_total(getattr(self, f.name)) for f in fields(self) if f.name not in (*GAUGES, "role"))

    def to_dict(self) -> dict[str, Any]:
        """Plain JSON-able data (``--json`` reports, vLLM's stats payload); ``from_dict`` reads it back."""
        out: dict[str, Any] = {}
        for f in fields(self):
            value = getattr(self, f.name)
            if isinstance(value, Histogram):
                value = value.to_dict()
            elif f.name == "digest_failed_pages":
                value = [[pool, kind, n] for (pool, kind), n in sorted(value.items())]
            elif isinstance(value, Mapping):
                value = dict(sorted(value.items()))
            out[f.name] = value
        return out

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> EndpointStats:
        values = dict(data)
        for name in ("transfer_seconds", "request_seconds"):
            values[name] = Histogram.from_dict(values[name])
        values["digest_failed_pages"] = {(pool, kind): n for pool, kind, n in values["digest_failed_pages"]}
        values["requests_failed"] = dict(values["requests_failed"])
        return cls(**values)

    def _combine(self, other: EndpointStats, op: Any, *, keep_gauges: bool) -> EndpointStats:
        values: dict[str, Any] = {}
        for f in fields(self):
            a, b = getattr(self, f.name), getattr(other, f.name)
            if f.name == "role":
                values[f.name] = a if a == b else "mixed"
            elif f.name in GAUGES:
                values[f.name] = a if keep_gauges else a + b
            elif isinstance(a, Histogram):
                values[f.name] = a.minus(b) if keep_gauges else a.plus(b)
            elif isinstance(a, Mapping):
                keys = sorted(set(a) | set(b))
                values[f.name] = {k: n for k in keys if (n := op(a.get(k, 0), b.get(k, 0)))}
            else:
                values[f.name] = op(a, b)
        return EndpointStats(**values)


def merge(snapshots: Sequence[EndpointStats], role: str) -> EndpointStats:
    """The sum of ``snapshots`` (an empty one of ``role`` when there are none)."""
    total = EndpointStats(role)
    for snap in snapshots:
        total = total.plus(snap)
    return total


def _total(value: Any) -> bool:
    if isinstance(value, Histogram):
        return value.count > 0
    if isinstance(value, Mapping):
        return any(value.values())
    return bool(value)


class StatsRecorder:
    """An endpoint's running totals. Every method but ``snapshot`` is called under the endpoint's lock."""

    __slots__ = ("_digest_failed", "_failed", "_kinds", "_pool_bytes", "_request", "_transfer", "done", "page_bytes",
                 "pages",
                 "posted_bytes", "posted_descriptors", "role", "transfers", "transfers_failed", "verified_pages")

    def __init__(self, role: str, layout: Layout) -> None:
        self.role = role
        self._kinds = {b.name: b.kind for b in layout.buffers}
        self._pool_bytes = {p.name: sum(b.page_bytes for b in p.buffers) for p in layout.pools}
        self.done = self.pages = self.page_bytes = self.verified_pages = 0
        self.transfers = self.transfers_failed = self.posted_bytes = self.posted_descriptors = 0
        self._failed: dict[str, int] = {}
        self._digest_failed: dict[tuple[str, str], int] = {}
        self._transfer = _Buckets()
        self._request = _Buckets()

    def request_done(self, seconds: float, pages: Mapping[str, Sized]) -> None:
        """A request DONE after ``seconds``, with ``pages`` (pool -> page array) in this side's memory."""
        self.done += 1
        pool_bytes = self._pool_bytes
        for pool, arr in pages.items():   # per pool: a few at most
            n = len(arr)
            self.pages += n
            self.page_bytes += n * pool_bytes[pool]
        self._request.observe(seconds)

    def request_failed(self, error: BaseException | None) -> None:
        cause = failure_cause(error)
        self._failed[cause] = self._failed.get(cause, 0) + 1

    def posted(self, plan: Plan, handle: TransferHandle) -> TransferHandle:
        """Count a transfer just posted; the handle returned (use it in place of ``handle``) times it."""
        self.transfers += 1
        self.posted_bytes += plan.nbytes
        self.posted_descriptors += plan.num_descriptors
        return _Timed(handle, self)

    def verified(self, num_pages: int) -> None:
        self.verified_pages += num_pages

    def digest_failed(self, mismatches: Iterable[Any]) -> None:
        """``kvferry.integrity.PageMismatch`` entries of one failed check, counted by pool and buffer kind."""
        for m in mismatches:   # only pages that failed: none on a healthy run
            key = (m.pool, self._kinds.get(m.buffer, "?"))
            self._digest_failed[key] = self._digest_failed.get(key, 0) + 1

    def snapshot(self, **gauges: int) -> EndpointStats:
        """Any thread, without the endpoint's lock (see the module doc)."""
        return EndpointStats(
            self.role, self.done, dict(self._failed), self.transfers, self.transfers_failed, self.posted_bytes,
            self.posted_descriptors, self.pages, self.page_bytes, self.verified_pages, dict(self._digest_failed),
            self._transfer.snapshot(), self._request.snapshot(), **gauges)


class NullRecorder(StatsRecorder):
    """``EndpointOptions(stats=False)``: records nothing (the baseline ``bench/control.py --stats`` compares)."""

    __slots__ = ()

    def request_done(self, seconds: float, pages: Mapping[str, Sized]) -> None:
        return

    def request_failed(self, error: BaseException | None) -> None:
        return

    def posted(self, plan: Plan, handle: TransferHandle) -> TransferHandle:
        return handle

    def verified(self, num_pages: int) -> None:
        return

    def digest_failed(self, mismatches: Iterable[Any]) -> None:
        return


class _Buckets:
    """A histogram being filled: Python lists (an add into a list is cheaper than into a numpy array)."""

    __slots__ = ("counts", "sums")

    def __init__(self) -> None:
        self.counts = [0] * (len(SECONDS_BUCKETS) + 1)
        self.sums = [0.0] * (len(SECONDS_BUCKETS) + 1)

    def observe(self, value: float) -> None:
        i = bisect_left(SECONDS_BUCKETS, value)
        self.counts[i] += 1
        self.sums[i] += value

    def snapshot(self) -> Histogram:
        return Histogram(SECONDS_BUCKETS, tuple(self.counts), tuple(self.sums))


class _Timed(TransferHandle):
    """A posted transfer's handle that records, once, how long it took or that it failed."""

    __slots__ = ("_inner", "_recorder", "_started", "label", "peer")

    def __init__(self, inner: TransferHandle, recorder: StatsRecorder) -> None:
        self._inner, self._recorder, self._started = inner, recorder, time.monotonic()
        self.peer, self.label = inner.peer, inner.label

    def poll(self) -> bool:
        try:
            done = self._inner.poll()
        except TransportError:
            self._finish(failed=True)
            raise
        if done:
            self._finish(failed=False)
        return done

    def release(self) -> None:
        self._inner.release()

    def _finish(self, *, failed: bool) -> None:
        recorder, self._recorder = self._recorder, None
        if recorder is None:   # polled again after it finished (shared by several records)
            return
        if failed:
            recorder.transfers_failed += 1
        else:
            recorder._transfer.observe(time.monotonic() - self._started)
