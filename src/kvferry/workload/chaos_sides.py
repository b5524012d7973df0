"""The two sides of a chaos run: decode (scheduler and byte oracle) and prefill, each a restartable process.

Part of the workload layer, above ``side``, ``decode``, ``prefill`` and ``chaos_plan``, below ``chaos`` (the
supervisor that stops, kills and restarts these processes). They reuse the stress run's pieces: page
allocators, page contents (``sim``), the endpoint links; what is new is that either side may vanish or
freeze at any moment, so decode reconnects whenever it has no live peer, and reports every request to the
parent as it ends (a SIGKILL must not lose the tally).

The oracle is independent of kvferry's digests: every page of a request decode saw DONE must hold the
pattern of (seed, request, buffer, page), when the request completes, again when the page is next
allocated, and at the end of the run if never reused. ``PageLedger`` remembers each page's last DONE owner.
"""

from __future__ import annotations

import contextlib
import heapq
import os
import time
import traceback
from dataclasses import dataclass
from multiprocessing.connection import Connection
from typing import Any

import numpy as np

from kvferry.errors import KVFerryError, LeaseError, PeerLost
from kvferry.workload.chaos_plan import ChaosConfig, RequestStream
from kvferry.workload.decode import DecodeLink, failure_kind, poll_live, release_ended, request_bytes
from kvferry.workload.metrics import side_metrics
from kvferry.workload.prefill import PrefillSide
from kvferry.workload.side import IDLE_S, PROGRESS_S, Live, Side
from kvferry.workload.sim import RequestSpec, page_keys, wrong_bytes

__all__ = ["ChaosDecodeSide", "ChaosPrefillSide", "Check", "PageLedger", "chaos_side_main"]

CONNECT_TIMEOUT_S = 2.0   # one handshake attempt; a stopped prefill is retried after RETRY_S
RETRY_S = 0.2


@dataclass
class Check:
    """What one verification found: buffer pages checked, bytes and pages wrong among them."""

    pages: int = 0
    wrong_bytes: int = 0
    wrong_pages: int = 0

    def add(self, per_page_wrong: np.ndarray) -> None:
        self.pages += len(per_page_wrong)
        self.wrong_bytes += int(per_page_wrong.sum())
        self.wrong_pages += int(np.count_nonzero(per_page_wrong))

    def merge(self, other: Check) -> None:
        self.pages += other.pages
        self.wrong_bytes += other.wrong_bytes
        self.wrong_pages += other.wrong_pages


class PageLedger:
    """Per pool and page, the global index of the DONE request whose bytes it holds (-1: none, or
    undefined bytes) and the page's position in that request's page list (which selects its key)."""

    def __init__(self, pool_pages: dict[str, int]) -> None:
        self.owner = {pool: np.full(n, -1, dtype=np.int64) for pool, n in pool_pages.items()}
        self.position = {pool: np.zeros(n, dtype=np.int64) for pool, n in pool_pages.items()}

    def own(self, index: int, pages: dict[str, np.ndarray]) -> None:
        for pool, ids in pages.items():
            self.owner[pool][ids] = index
            self.position[pool][ids] = np.arange(len(ids))

    def forget(self, pages: dict[str, np.ndarray]) -> None:
        for pool, ids in pages.items():
            self.owner[pool][ids] = -1

    def holders(self, pool: str, ids: np.ndarray) -> dict[int, tuple[np.ndarray, np.ndarray]]:
        """Owner -> (its pages among ``ids``, their positions), for the pages of ``ids`` that have one."""
        ids = np.asarray(ids, dtype=np.int64)
        owners = self.owner[pool][ids]
        out: dict[int, tuple[np.ndarray, np.ndarray]] = {}
        for owner in np.unique(owners[owners >= 0]).tolist():
            mine = ids[owners == owner]
            out[owner] = (mine, self.position[pool][mine])
        return out

    def all_owned(self) -> dict[str, np.ndarray]:
        return {pool: np.flatnonzero(owner >= 0) for pool, owner in self.owner.items()}


class ChaosDecodeSide(Side):
    """Admits session turns while connected, verifies every DONE request's bytes, reports each ending."""

    role = "decode"
    seed_salt = 1

    def __init__(self, config: ChaosConfig, router: Connection, parent: Connection, relay: str,
                 resume: dict[int, int]) -> None:
        super().__init__(config.workload, router, parent)
        self.chaos = config
        self.relay = relay
        self.link = DecodeLink(config.workload, self.memory)
        self.stream = RequestStream(config.workload)
        self.ready = [(self.stream.index(s, resume.get(s, 0)), s, resume.get(s, 0)) for s in self.stream.sessions]
        heapq.heapify(self.ready)
        self.ledger = PageLedger({p.name: p.min_pages for p in self.layout.pools})
        self.quarantine: list[Live] = []
        self.draining = False
        self.drain_deadline = float("inf")
        self.next_connect = 0.0
        self.last_gauge = 0.0
        self.scribble_pending = False

    def close(self) -> None:
        self.link.close()

    # -- the loop --------------------------------------------------------------------------------------
    def run(self) -> dict[str, Any]:
        while not self.stopped and not (self.draining and not self.live and not self.quarantine):
            if time.monotonic() > self.drain_deadline:
                break  # what is still live or quarantined now is reported, not waited for
            progressed = self._release_quarantine() + self._poll()
            if not self.draining:
                self._connect()
                progressed += self._admit()
            self._gauge()
            self._read_parent()
            if self.scribble_pending:
                self.scribble_pending = not self._scribble()
            if not progressed:
                time.sleep(IDLE_S)
        return self._final()

    def _read_parent(self) -> None:
        while self.parent.poll():
            kind = self.parent.recv()[0]
            self.stopped |= kind == "stop"
            # Kept pending until a DONE request has left a page: on a loaded machine none may have yet.
            self.scribble_pending |= kind == "scribble"
            if kind == "drain" and not self.draining:
                self.draining = True
                # A live request ends by its deadline; a failed one's lease by peer_timeout + lease_grace.
                self.drain_deadline = (time.monotonic() + self.config.request_timeout_s + self.chaos.stall_floor_s
                                       + 2.0)

    def _connect(self) -> None:
        now = time.monotonic()
        if self.link.endpoint.peers or now < self.next_connect:
            return
        try:
            self.link.endpoint.connect(self.relay, timeout=CONNECT_TIMEOUT_S)
        except KVFerryError:
            self.next_connect = time.monotonic() + RETRY_S  # prefill is stopped, restarting, or cut off

    def _admit(self) -> int:
        admitted = 0
        while self.ready and self.link.endpoint.peers:
            g, session, k = self.ready[0]
            spec = self.stream.spec(g)
            pages = self._allocate(spec)
            if pages is None:
                break  # first come, first served: a large turn is not overtaken by smaller ones
            try:
                self.link.announce(spec.request_id, pages)
            except PeerLost:
                self._free(pages)
                break  # the link died since we looked: reconnect first
            except LeaseError as exc:  # our allocator gave a page the endpoint still leases: a bug, counted
                self._free(pages)
                self._report(spec, f"LeaseError: {exc}", Check(), 0.0)
                self._advance(session, k)
                continue
            # Safe after the announce: prefill writes nothing of this request before our "start" below.
            self._recheck(pages)
            heapq.heappop(self.ready)
            self.parent.send(("start", g))
            self.live[spec.request_id] = Live(spec, pages, time.monotonic())
            admitted += 1
        return admitted

    def _advance(self, session: int, k: int) -> None:
        heapq.heappop(self.ready)
        heapq.heappush(self.ready, (self.stream.index(session, k + 1), session, k + 1))

    def _poll(self) -> int:
        return poll_live(self.link, self.live, self.config.request_timeout_s, self._finish)

    def _finish(self, live: Live, failure: str | None) -> None:
        spec = live.spec
        del self.live[spec.request_id]
        check, nbytes = Check(), 0
        if failure is None:
            check = self._verify(spec.index, live.pages, None)
            self.ledger.own(spec.index, live.pages)
            nbytes = request_bytes(self.layout, live.pages)
        if failure is not None and self.link.lease_held(spec.request_id):
            self.quarantine.append(live)  # a write may still land there: reuse only once the lease ends
        else:
            self._free(live.pages)
        self._report(spec, failure, check, time.monotonic() - live.started, nbytes)
        if not self.draining:  # the session's next request (its k-th request has turn k: see RequestStream)
            k = spec.turn + 1
            heapq.heappush(self.ready, (self.stream.index(spec.session, k), spec.session, k))

    def _report(self, spec: RequestSpec, failure: str | None, check: Check, elapsed: float,
                nbytes: int = 0) -> None:
        kind = None if failure is None else failure_kind(failure)
        self.parent.send(("finished", spec.index, kind, failure and f"{spec.request_id}: {failure}",
                          check.pages, check.wrong_bytes, check.wrong_pages, nbytes, elapsed))

    def _release_quarantine(self) -> int:
        return release_ended(self.link, self.quarantine, self._free)

    # -- the oracle ------------------------------------------------------------------------------------
    def _verify(self, index: int, pages: dict[str, np.ndarray], positions: dict[str, np.ndarray] | None
                ) -> Check:
        """Request ``index``'s ``pages`` (at ``positions`` in its page lists; all, in order, when None)."""
        check = Check()
        for pool, ids in pages.items():
            pos = np.arange(len(ids)) if positions is None else positions[pool]
            keys = page_keys(self.config.workload.seed, index, self.pool_buffer_ids[pool], int(pos.max()) + 1)
            for name, row in zip((b.name for b in self.layout.pool(pool).buffers), keys):
                check.add(wrong_bytes(self.views[name], ids, row[pos]))
        return check

    def _recheck(self, pages: dict[str, np.ndarray]) -> None:
        """Before pages are reused: they must still hold their last DONE owner's bytes (a late write from a
        stalled or failed writer would show here); then they hold nothing anyone checks."""
        check = self._check_owned(pages)
        self.ledger.forget(pages)
        if check.pages:
            self.parent.send(("recheck", check.pages, check.wrong_bytes, check.wrong_pages))

    def _check_owned(self, pages: dict[str, np.ndarray]) -> Check:
        check = Check()
        for pool, ids in pages.items():
            for owner, (mine, pos) in self.ledger.holders(pool, ids).items():
                check.merge(self._verify(owner, {pool: mine}, {pool: pos}))
        return check

    def _scribble(self) -> bool:
        """The oracle's self-test: change one byte of one free page a DONE request left, as a late write
        into a finished request's page would (all its 8 bits, so the byte count is exact). False when no
        such page exists yet."""
        for pool, ids in self.ledger.all_owned().items():
            if len(ids):
                self.views[self.layout.pool(pool).buffers[0].name][ids[0], 0] ^= 0xFF
                return True
        return False

    # -- gauges and the end ----------------------------------------------------------------------------
    def _gauge(self) -> None:
        now = time.monotonic()
        if now - self.last_gauge < PROGRESS_S:
            return
        self.last_gauge = now
        quarantined = sum(len(ids) for q in self.quarantine for ids in q.pages.values())
        endpoint_q = self.link.endpoint.num_quarantined_pages
        self.parent.send(("gauge", quarantined, endpoint_q, self.link.endpoint.num_live_leases))

    def _final(self) -> dict[str, Any]:
        """After the drain: wait (bounded) for leases to end, sweep every page still holding a DONE
        request's bytes, report what leaked."""
        deadline = time.monotonic() + self.chaos.stall_floor_s + 2.0
        while self.link.endpoint.num_live_leases and time.monotonic() < deadline:
            time.sleep(0.02)
        check = self._check_owned(self.ledger.all_owned())
        endpoint = self.link.endpoint
        return {"rechecked": check.pages, "wrong_bytes": check.wrong_bytes, "wrong_pages": check.wrong_pages,
                "live_leases": endpoint.num_live_leases,
                "leased_pages": endpoint.num_leased_pages, "live_requests": len(self.live),
                "quarantined": len(self.quarantine),
                "quarantined_pages": int(getattr(endpoint, "num_quarantined_pages", 0)),  # see _gauge
                "stray_notifications": endpoint.num_stray_notifications}


class ChaosPrefillSide(PrefillSide):
    """Starts what the parent relays from decode until told to stop; a failed send is counted, not fatal."""

    tolerate_failed_sends = True

    def __init__(self, config: ChaosConfig, router: Connection, parent: Connection) -> None:
        super().__init__(config.workload, router, parent)
        self.stream = RequestStream(config.workload)
        self.last_gauge = 0.0

    def _poll(self) -> int:
        finished = super()._poll()
        now = time.monotonic()
        if now - self.last_gauge >= PROGRESS_S:  # the parent's leak check of source holds (pull mode)
            self.last_gauge = now
            self.parent.send(("holds", self.link.endpoint.counters()["source_holds"], len(self.holding)))
        return finished

    def _spec(self, index: int) -> RequestSpec:
        return self.stream.spec(index)  # requests replay the seed's sessions in rounds, with fresh ids


def chaos_side_main(side: str, config: ChaosConfig, router: Connection, parent: Connection, own_process: bool,
                    relay: str, resume: dict[int, int]) -> None:
    """Entry point of one chaos side process: run it; send ("result", report) or ("error", text)."""
    if own_process:
        os.dup2(2, 1)  # keep stdout for the parent's --json
    try:
        if side == "decode":
            runner: Side = ChaosDecodeSide(config, router, parent, relay, resume)
        else:
            runner = ChaosPrefillSide(config, router, parent)
        # The runner's link may be rebuilt after a cut: publish whichever endpoint is current.
        with runner, side_metrics(lambda: runner.link.endpoint):
            report = runner.run()
            report["stats"] = runner.link.endpoint.stats().to_dict()
        parent.send(("result", report))
    except BaseException as exc:  # report everything, then let the process end
        detail = traceback.format_exc(limit=6) if not isinstance(exc, KVFerryError) else ""
        with contextlib.suppress(OSError, ValueError):
            parent.send(("error", f"{side}: {type(exc).__name__}: {exc}", detail))
    finally:
        router.close()
