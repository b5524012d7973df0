"""The decode side of a workload run: the scheduler, and the one that checks every byte.

Part of the workload layer, above ``side``, below ``supervisor``. Decode admits a session's next turn when the
previous one finished and its pages fit, leases destination pages (``DecodeLink``: a ``DecodeEndpoint``),
tells prefill to start over the router pipe, and when the request completes checks every page of every buffer
against ``sim``'s expected pattern (independently of kvferry's digests), then frees the pages for reuse. Its
report (``DecodeStats.report``) is what ``runner`` turns into a ``WorkloadResult``.

With ``reuse_prefix`` decode is also a prefix cache (``reuse``): after a turn it keeps the session's whole
pages, announces the next turn with ``prefix=`` and only the pages it lacks, and checks the kept pages
again with the turn (they must still hold the earlier turns' bytes). When pages run short it evicts the
idle session whose next turn is furthest away (it knows the queue: the best choice for a cyclic,
turn-major load, where LRU would evict exactly the next sessions due), checking its pages first.
"""

from __future__ import annotations

import heapq
import re
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from multiprocessing.connection import Connection
from typing import Any

import numpy as np

from kvferry.errors import HandshakeError, IncompatiblePeer, RequestFailed, TransferTimeout
from kvferry.layout.memory import KVMemory
from kvferry.layout.spec import Layout
from kvferry.workload.config import WorkloadConfig
from kvferry.workload.reuse import Held, TurnTally, announce_prefix, kept_counts
from kvferry.workload.side import IDLE_S, PROGRESS_S, Live, Side, check_state, endpoint_options, recv_message
from kvferry.workload.sim import RequestSpec, check_pages, pages_needed


class DecodeSide(Side):
    """The scheduler: admits turns, leases pages, verifies every received byte, frees pages for reuse."""

    role = "decode"
    seed_salt = 1

    def __init__(self, config: WorkloadConfig, router: Connection, parent: Connection) -> None:
        # The run's deadline as this side counts it: from its own start, never before the parent's.
        self.deadline = time.monotonic() + config.timeout_s
        super().__init__(config, router, parent)
        self.link = DecodeLink(config, self.memory)
        by_session: dict[int, list[RequestSpec]] = {}
        for spec in self.schedule:
            by_session.setdefault(spec.session, []).append(spec)
        self.turns = by_session
        # Sessions whose next turn may start, keyed by that turn's schedule index (admission order).
        self.ready = [(turns[0].index, s) for s, turns in by_session.items()]
        heapq.heapify(self.ready)
        self.stats = DecodeStats()
        self.quarantine: list[Live] = []
        self.last_progress = 0.0
        self.reuse = config.reuse_prefix
        self.held: dict[int, Held] = {}  # idle sessions' kept pages (reuse_prefix)

    def close(self) -> None:
        self.link.close()

    def run(self) -> dict[str, Any]:
        address = recv_message(self.router, "hello", self.config.timeout_s)
        self._connect(address[0])
        total = len(self.schedule)
        self.stats.first = time.monotonic()
        while self.stats.finished < total and not self.stopped:
            progressed = self._release_quarantine() + self._admit() + self._poll()
            self._report_progress(total)
            self._check_stop()
            if not progressed:
                time.sleep(IDLE_S)
        self.router.send(("stop",))
        order = {b.name: i for i, b in enumerate(self.layout.buffers)}
        self.stats.corrupted = dict(sorted(self.stats.corrupted.items(), key=lambda kv: order[kv[0]]))
        return self.stats.report()

    def _connect(self, address: str) -> None:
        """Connect to prefill by the run's deadline too: no "stop" is read while connecting, and a prefill
        that saw one as it started (the deadline passed) closes without answering, which would otherwise hold
        this side for the whole handshake timeout, past the parent's grace."""
        left = self.deadline - time.monotonic()
        if left > 0:
            try:
                self.link.connect(address, timeout=min(self.link.endpoint.options.handshake_timeout, left))
                return
            except HandshakeError as exc:
                if isinstance(exc, IncompatiblePeer) or time.monotonic() < self.deadline:
                    raise
        raise TransferTimeout(f"the run's {self.config.timeout_s:g} s deadline passed before decode had "
                              f"connected to prefill at {address}")

    def _admit(self) -> int:
        admitted = 0
        while self.ready:
            _, session = self.ready[0]
            spec = self.turns[session][0]
            held = self.held.get(session, Held())
            new = self._allocate_evicting(spec, held)
            if new is None:
                break  # first come, first served: a large turn is not overtaken by smaller ones
            heapq.heappop(self.ready)
            self.turns[session].pop(0)
            self.held.pop(session, None)
            pages, writers = held.joined(new, spec.index)
            started = time.monotonic()
            prefix = self._announce(spec, new, held)
            self.router.send(("start", spec.index, prefix) if self.reuse else ("start", spec.index))
            self.live[spec.request_id] = Live(spec, pages, started, held.counts, writers if held.pages else None)
            admitted += 1
        return admitted

    def _announce(self, spec: RequestSpec, new: dict[str, np.ndarray], held: Held) -> dict[str, int]:
        """Lease the pages decode lacks; the kept ones are named by count only (``prefix=``). Returns the
        prefix announced, pages per pool (what prefill's "start" says)."""
        self.link.announce(spec.request_id, new, prefix=announce_prefix(self.layout, held.counts))
        return held.counts

    def _allocate_evicting(self, spec: RequestSpec, held: Held) -> dict[str, np.ndarray] | None:
        """The pages ``spec`` lacks, evicting other idle sessions' kept pages while they do not fit; None
        (nothing evicted) when even evicting all of them would not make room: live requests must end first."""
        if (new := self._allocate(spec, held.counts)) is not None or not self._evictable_fits(spec, held):
            return new
        while (new := self._allocate(spec, held.counts)) is None:
            self._evict(spec.session)
        return new

    def _evictable_fits(self, spec: RequestSpec, held: Held) -> bool:
        """Whether the pages free plus those other idle sessions keep cover what ``spec`` lacks, per pool."""
        need = pages_needed(self.layout, spec.num_tokens)
        for pool, n in need.items():
            kept = sum(len(h.pages.get(pool, ())) for s, h in self.held.items() if s != spec.session)
            if n - held.counts.get(pool, 0) > self.allocators[pool].num_free + kept:
                return False
        return True

    def _evict(self, keep: int) -> None:
        """Free the kept pages of the idle session (not ``keep``) whose next turn comes last, checked first."""
        victim = max((s for s in self.held if s != keep), key=lambda s: self.turns[s][0].index)
        held = self.held.pop(victim)
        spec = self.turns[victim][0]
        self.stats.rechecked += self._check(spec, held.pages, held.writers, reported_done=True)
        self._free(held.pages)
        self.stats.evictions += 1

    def _poll(self) -> int:
        return poll_live(self.link, self.live, self.config.request_timeout_s, self._finish)

    def _finish(self, live: Live, failure: str | None) -> None:
        elapsed = time.monotonic() - live.started
        del self.live[live.spec.request_id]
        self._verify(live, failure is None)
        new = live.new_pages()
        if failure is None:
            self._keep(live)
        else:
            self._free({p: ids[:live.prefix.get(p, 0)] for p, ids in live.pages.items()})  # never leased
            if self.link.lease_held(live.spec.request_id):
                self.quarantine.append(Live(live.spec, new, live.started))  # a write may still land there
            else:
                self._free(new)
        self.stats.record(live, elapsed, failure, self._nbytes(new))
        if failure is None:
            self.stats.tally(live, self._nbytes(new), self._nbytes(live.pages))
        following = self.turns[live.spec.session]
        if following:
            heapq.heappush(self.ready, (following[0].index, live.spec.session))

    def _keep(self, live: Live) -> None:
        """Keep the session's whole pages for its next turn (reuse_prefix, a next turn due); free the rest."""
        counts = kept_counts(self.layout, live.spec.num_tokens) if self.reuse else {}
        if not self.turns[live.spec.session]:
            counts = {}  # the session ended: its pages go back
        if counts:
            writers = live.writers or {p: np.full(len(ids), live.spec.index, dtype=np.int64)
                                       for p, ids in live.pages.items()}
            self.held[live.spec.session] = Held({p: live.pages[p][:n] for p, n in counts.items()},
                                                {p: writers[p][:n] for p, n in counts.items()})
        self._free({p: ids[counts.get(p, 0):] for p, ids in live.pages.items()})

    def _release_quarantine(self) -> int:
        return release_ended(self.link, self.quarantine, self._free)

    def _verify(self, live: Live, reported_done: bool) -> None:
        """Every page of every buffer against the pattern prefill wrote (kept prefix pages: the earlier
        turn's that wrote them); counts per buffer."""
        self.stats.pages_verified += self._check(live.spec, live.pages, live.writers, reported_done)

    def _check(self, spec: RequestSpec, pages: dict[str, np.ndarray], writers: dict[str, np.ndarray] | None,
               reported_done: bool) -> int:
        """Check ``pages`` (their bytes written by ``writers``, default ``spec``); returns buffer pages
        checked and counts the corrupted ones."""
        checked = 0
        for name, ids, keys in self._buffers(spec, pages, writers=writers):
            bad = int(check_pages(self.views[name], ids, keys).sum())
            checked += len(ids)
            if bad:
                self.stats.corrupted[name] = self.stats.corrupted.get(name, 0) + bad
                self.stats.silent += bad if reported_done else 0
        return checked

    def _nbytes(self, pages: dict[str, np.ndarray]) -> int:
        return request_bytes(self.layout, pages)

    def _report_progress(self, total: int) -> None:
        now = time.monotonic()
        if now - self.last_progress >= PROGRESS_S or self.stats.finished == total:
            self.last_progress = now
            self.parent.send(("progress", self.stats.finished, total))


@dataclass
class DecodeStats:
    """Decode's tallies; ``report`` turns them into the plain dict the parent receives."""

    first: float = 0.0
    last: float = 0.0
    finished: int = 0
    done: int = 0
    nbytes: int = 0
    pages_verified: int = 0
    silent: int = 0
    corrupted: dict[str, int] = field(default_factory=dict)
    failures: dict[str, int] = field(default_factory=dict)
    first_failure: str | None = None
    latencies: list[float] = field(default_factory=list)
    turns: dict[int, TurnTally] = field(default_factory=dict)
    evictions: int = 0
    rechecked: int = 0

    def record(self, live: Live, elapsed: float, failure: str | None, nbytes: int) -> None:
        self.finished += 1
        self.last = time.monotonic()
        if failure is None:
            self.done += 1
            self.nbytes += nbytes
            self.latencies.append(elapsed)
            return
        key = failure_kind(failure)
        self.failures[key] = self.failures.get(key, 0) + 1
        self.first_failure = self.first_failure or f"{live.spec.request_id}: {failure}"

    def tally(self, live: Live, bytes_moved: int, bytes_whole: int) -> None:
        """A done request's pages and bytes moved against its whole prompt's, under its turn."""
        whole = sum(len(ids) for ids in live.pages.values())
        kept = sum(live.prefix.values())
        turn = self.turns.setdefault(live.spec.turn, TurnTally())
        turn.add(kept > 0, whole - kept, whole, bytes_moved, bytes_whole)

    def report(self) -> dict[str, Any]:
        lat = np.asarray(self.latencies) * 1e3
        return {
            "requests": self.finished, "failed_requests": self.finished - self.done, "bytes": self.nbytes,
            "seconds": max(0.0, self.last - self.first), "pages_verified": self.pages_verified,
            "corrupted_pages": sum(self.corrupted.values()), "silent_corruptions": self.silent,
            "corrupted_by_buffer": self.corrupted, "failures": dict(self.failures),
            "first_failure": self.first_failure,
            "p50_ms": float(np.percentile(lat, 50)) if len(lat) else 0.0,
            "p99_ms": float(np.percentile(lat, 99)) if len(lat) else 0.0,
            "latencies_ms": lat.tolist(),
            "per_turn": [self.turns[t].row(t) for t in sorted(self.turns)],
            "evictions": self.evictions, "pages_rechecked": self.rechecked,
        }


# -- what the stress and chaos decode sides share ---------------------------------------------------------
def poll_live(link: DecodeLink, live: dict[str, Live], timeout_s: float,
              finish: Callable[[Live, str | None], None]) -> int:
    """Poll every live request; ``finish(live, None)`` when DONE, ``finish(live, reason)`` when it failed or
    ran past ``timeout_s`` (then it is aborted first). Returns how many finished."""
    finished = 0
    now = time.monotonic()
    for rid, one in list(live.items()):
        try:
            if not link.poll(rid):
                if now - one.started < timeout_s:
                    continue
                link.abort(rid, "runner deadline")
                raise RequestFailed(rid, f"not done after {timeout_s:g} s (runner)")
            finish(one, None)
        except RequestFailed as exc:
            finish(one, exc.reason)
        finished += 1
    return finished


def release_ended(link: DecodeLink, quarantine: list[Live], free: Callable[[dict[str, np.ndarray]], None]) -> int:
    """Free the pages of quarantined (failed) requests whose lease has ended; returns how many."""
    ended = [q for q in quarantine if not link.lease_held(q.spec.request_id)]
    for one in ended:
        quarantine.remove(one)
        free(one.pages)
    return len(ended)


def request_bytes(layout: Layout, pages: dict[str, np.ndarray]) -> int:
    """Bytes a request's pages hold across every buffer of their pools."""
    return sum(len(ids) * sum(b.page_bytes for b in layout.pool(p).buffers) for p, ids in pages.items())


def failure_kind(reason: str) -> str:
    """A short class for a failure reason: the exception name it carries, or its first words."""
    match = re.search(r"\b([A-Z][A-Za-z]+(?:Error|Lost|Timeout|Failed|Aborted))\b", reason)
    return match.group(1) if match else " ".join(reason.split()[:4])


class DecodeLink:
    """A ``DecodeEndpoint``: announce leases the pages, poll reports DONE once digests verified."""

    def __init__(self, config: WorkloadConfig, memory: KVMemory) -> None:
        from kvferry.control import DecodeEndpoint

        self.endpoint = DecodeEndpoint(memory, config.transport, digest_mode=config.digest_mode,
                                       options=endpoint_options(config), mode=config.mode)

    def connect(self, address: str, timeout: float | None = None) -> None:
        self.endpoint.connect(address, timeout)

    def announce(self, request_id: str, pages: dict[str, np.ndarray], *,
                 prefix: int | dict[str, int] | None = None) -> None:
        if prefix is None:  # keep the plain call where nothing is kept (any endpoint version takes it)
            self.endpoint.announce(request_id, pages)
        else:
            self.endpoint.announce(request_id, pages, prefix=prefix)

    def poll(self, request_id: str) -> bool:
        return check_state(self.endpoint, request_id)

    def abort(self, request_id: str, reason: str) -> None:
        self.endpoint.abort(request_id, reason)

    def lease_held(self, request_id: str) -> bool:
        """Whether decode still leases the request's pages (a failed request's writes may be landing)."""
        return self.endpoint.holds_lease(request_id)

    def close(self) -> None:
        self.endpoint.close()
