"""The decode endpoint: the shell around ``core.decode.DecodeCore``.

The top of the control plane (with ``prefill``). Decode connects to one or more prefill endpoints (a ZMQ
DEALER per prefill), announces each request with its destination pages (a lease), and reports ``DONE`` only
after every chunk's transport notification arrived and its digests verified; a failed request's pages stay
quarantined until no write to them can land (docs/fencing.md). What to do about each of those is
``DecodeCore``'s decision (the protocol, in ``control.core``); this module does what the core cannot: it
owns the sockets and their monitors (``dealers.DealerPorts``), the progress thread, the clock, the transport
and the read handles (``inflight.InFlight``).
It feeds the core events (the caller's commands, frames, dropped connections, transport notifications,
reads posted and settled, a transport peer added, a writer found gone or not, ticks) and carries out the
actions the core queues (messages, pull-mode reads, ``OpenLink``, ``CloseLink``, ``AddPeer``,
``RemovePeer``, ``CheckWriter``, ``TakeNotifications``, ``FlushNow``).
"""

from __future__ import annotations

import contextlib
import logging
import time
from collections.abc import Iterator, Mapping, Sequence
from typing import Any

from kvferry.control import wire
from kvferry.control.core.admission import as_secret
from kvferry.control.core.backoff import RETRY_AFTER, RETRY_MAX
from kvferry.control.core.base import AddPeer, Effect, RemovePeer, Transfer
from kvferry.control.core.decode import (
    CheckWriter,
    CloseLink,
    DecodeCore,
    DecodeSetup,
    OpenLink,
    TakeNotifications,
)
from kvferry.control.core.decode_requests import DecodeRequest
from kvferry.control.core.links import Link
from kvferry.control.dealers import DealerPorts
from kvferry.control.endpoints import EndpointBase, EndpointOptions, entropy
from kvferry.control.inflight import InFlight
from kvferry.control.liveness import this_process
from kvferry.control.pull import DEFAULT_MODE, check_decode_mode, check_pull_options, mode_for
from kvferry.control.quarantine import writer_gone
from kvferry.errors import HandshakeError, KVFerryError, PeerLost, TransportError, UsageError
from kvferry.integrity.binding import as_binding
from kvferry.layout.memory import KVMemory
from kvferry.plan.prefix import prefix_pages
from kvferry.plan.tp import source_ranks
from kvferry.transport import Transport

__all__ = ["RETRY_AFTER", "RETRY_MAX", "DecodeEndpoint"]

log = logging.getLogger("kvferry.control")

# Within a run of reads, finished ones are concluded (Results sent, waiters woken) at most this often.
PUBLISH_S = 2e-3


class DecodeEndpoint(EndpointBase):
    """Decode side of kvferry. Construct, ``connect`` to prefill (``connect_all`` to the ranks of a prefill
    TP group when this side runs another TP size), then ``announce`` requests and ``wait``.

    ``transport`` is ``"nixl"``, ``"local"`` or a ``Transport`` (registered here with ``memory``; closed on
    ``close`` only when created here). ``secret`` (optional) must match prefill's. ``digest_mode``
    (``"off"``, ``"sampled"``, ``"full"``) is the least this side accepts. ``mode`` is the transfer mode
    asked of every prefill (``connect(mode=...)`` chooses per prefill): ``"push"`` (prefill writes into the
    leased pages), ``"pull"`` (this side reads prefill's pages; see ``pull`` and docs/fencing.md) or
    ``"auto"`` (the default: push to a prefill on a loopback address, pull to any other, so that a prefill
    dying on another host leaves nothing of this side held).
    """

    _role = "decode"
    core: DecodeCore
    _port: DealerPorts

    def __init__(self, memory: KVMemory, transport: str | Transport = "nixl", *,
                 secret: str | bytes | None = None, digest_mode: Any = "sampled",
                 options: EndpointOptions | None = None, mode: str = DEFAULT_MODE) -> None:
        if check_decode_mode(mode) == "pull":
            opts = options or EndpointOptions()
            check_pull_options(opts.peer_timeout, opts.heartbeat_interval)
        self._secret = as_secret(secret)
        super().__init__(memory, transport, digest_mode=digest_mode, options=options)
        self.mode = mode
        self._reads = InFlight()   # pull-mode reads posted (the handle is the core's ticket)
        self._thread.start()

    def _make_core(self) -> DecodeCore:
        setup = DecodeSetup(self.transport.name, self.transport_metadata, this_process(), self._secret)
        return DecodeCore(self.memory, setup, self.options, self.digest_mode, self._stats, entropy)

    def _make_port(self) -> DealerPorts:
        return DealerPorts(self._sockets, self.core)

    @property
    def num_stray_notifications(self) -> int:
        """Chunk notifications for no lease held here (a prefill bug, or a forged notification)."""
        return self.core.num_stray_notifications

    # -- public API: any thread ------------------------------------------------------------------------
    def connect(self, address: str, timeout: float | None = None, *, mode: str | None = None) -> str:
        """Blocking: connect to a prefill endpoint and complete the handshake; returns the peer id.

        Raises ``IncompatiblePeer`` (layout, protocol version, transport or secret differ, with the
        difference spelled out) or ``HandshakeError`` (no answer within ``timeout``, or the connection
        dropped, e.g. an answer above ``max_message_bytes``), by ``timeout`` whatever the progress thread
        does. Reconnecting to an address whose previous peer died starts a fresh session; when it is the
        same prefill process, decode asks it to settle the requests it quarantined (docs/fencing.md).
        ``mode`` (default: this endpoint's) is the transfer mode asked of this prefill; ``ModeMismatch``
        (an ``IncompatiblePeer``) when it does not accept it.
        """
        timeout = self.options.handshake_timeout if timeout is None else timeout
        mode = self._mode_for(address, mode)
        deadline = time.monotonic() + timeout
        with self._bounded_lock(deadline, address):
            self._check_open()
            link = self.core.start_link(time.monotonic(), address, timeout, None, mode)
            self._done_with_call()
        self._await_links([link], deadline)
        return address

    def _mode_for(self, address: str, mode: str | None = None) -> str:
        """The mode asked of the prefill at ``address`` (``pull.mode_for``: ``"auto"`` is push on loopback,
        pull to another host); pull's timing rule checked when it is chosen."""
        chosen = mode_for(self.mode if mode is None else check_decode_mode(mode), address)
        if chosen == "pull":
            check_pull_options(self.options.peer_timeout, self.options.heartbeat_interval)
        return chosen

    def connect_all(self, addresses: Sequence[str], timeout: float | None = None) -> list[str]:
        """Blocking: connect to the prefill ranks this decode rank needs, out of a whole prefill TP group.

        ``addresses[r]`` is prefill rank ``r``'s address, for all ``P`` ranks. Handshakes (in parallel)
        only with ``source_ranks(this rank, P, this TP size)`` and returns their addresses in rank order:
        announce with ``peer=`` that list (or no ``peer`` when connected to this group only). Each peer
        must say it is rank ``r`` of ``P``, else ``IncompatiblePeer``; errors as for ``connect`` (the first
        failure is raised; ranks already connected stay connected).
        """
        timeout = self.options.handshake_timeout if timeout is None else timeout
        local = self.memory.layout
        need = source_ranks(local.tp_rank, len(addresses), local.tp_size)
        chosen = [addresses[r] for r in need]
        if len(set(addresses)) != len(addresses):
            raise UsageError(f"prefill addresses repeat: {list(addresses)} (one per rank, in rank order)")
        deadline = time.monotonic() + timeout
        with self._bounded_lock(deadline, ", ".join(chosen)):
            self._check_open()
            now = time.monotonic()
            links = [self.core.start_link(now, addresses[r], timeout, (r, len(addresses)),
                                          self._mode_for(addresses[r])) for r in need]
            self._done_with_call()
        self._await_links(links, deadline)
        return chosen

    def connect_needed(self, addresses: Sequence[str], timeout: float | None = None, *,
                       retry_after: float = RETRY_AFTER, exact: bool = False) -> str | list[str]:
        """Blocking: be connected to what this decode rank needs of one prefill TP group, and return what
        ``announce`` and ``cancel`` take as ``peer``. For an engine adapter that learns prefill's addresses
        per request: call it before each announce; once connected it returns at once.

        ``addresses[r]`` is prefill rank ``r``'s address (one address: a prefill of TP 1). Returns that
        address when this side runs TP 1 too, else the addresses of the ranks holding this rank's heads
        (``connect_all``), in rank order. A refusal (``IncompatiblePeer``: layouts, versions, secret or mode
        differ) is remembered and raised again at once, never retried: the peer will not change its mind. A
        handshake that failed otherwise (``HandshakeError``: no answer, the prefill is down) is raised again
        at once for ``retry_after`` seconds, doubling with each failure in a row up to ``RETRY_MAX``, so a
        prefill that is down costs each request nothing, not a handshake timeout.

        ``exact=True``: the engine chose the prefill ranks itself (SGLang's bootstrap names the ranks each
        decode rank reads from): ``addresses`` are connected one by one (``connect``), none chosen, and
        returned as given (one address: that address)."""
        local = self.memory.layout
        if not addresses:
            raise UsageError("connect_needed: no prefill address given")
        single = len(addresses) == 1 and (exact or local.tp_size == 1)
        if exact or single:
            need = list(addresses)
        else:
            need = [addresses[r] for r in source_ranks(local.tp_rank, len(addresses), local.tp_size)]
        key = tuple(addresses)
        with self._lock:
            self._check_open()
            links = self.core.links
            if all(a in links and links[a].established for a in need):
                return need[0] if single else need
            error = self.core.backoff.error(time.monotonic(), key)
            if error is not None:
                raise error
        try:
            if exact or single:
                connected = [self.connect(a, timeout) for a in need]
            else:
                connected = self.connect_all(addresses, timeout)
        except HandshakeError as exc:
            with self._lock:
                self.core.backoff.failed(time.monotonic(), key, exc, retry_after)
            raise
        with self._lock:
            self.core.backoff.succeeded(key)
        return connected[0] if single else connected

    def announce(self, request_id: str, pages: Mapping[str, Any], *,
                 peer: str | Sequence[str] | None = None, prefix: int | Mapping[str, int] | None = None,
                 binding: Any = None) -> None:
        """Non-blocking: lease ``pages`` (pool -> destination pages) to ``request_id`` and tell prefill.

        Raises ``LeaseError`` before anything moves when a page is out of range, repeated, or held by a
        live lease, or the id is already live; ``PeerLost`` when not connected to every prefill rank the
        request needs. ``peer`` names the prefill (its address), or across TP sizes the prefill ranks (as
        ``connect_all`` returned them); needed only when connected to more than that. The request is DONE
        only when every one of those ranks' writes landed and verified.

        ``prefix``: what decode already holds of the request (its prefix cache), so that only the rest
        moves. Tokens (an int: each announced pool with ``tokens_per_page`` holds that many tokens' pages,
        and a count that is not whole pages there is a ``UsageError`` naming the pool; state-slot pools
        move whole) or leading pages per pool. ``pages`` are then the destination pages of the rest only:
        page ``i`` of ``pages[pool]`` receives the request's page ``prefix[pool] + i``. The prefix pages
        are not leased, and nothing writes them.

        ``binding``: the tokens this request is (``integrity.binding``: a ``Binding``, or per-block entries).
        Prefill compares it with the binding its ``send`` stated and refuses a difference before any byte
        moves (``BindingMismatch`` on both sides, naming both requests and the first block that differs).
        Without one on either side, the transfer is not bound: another request's KV would be accepted.
        """
        held = prefix_pages(self.memory.layout, pages, prefix)
        bound = wire.binding_fields(as_binding(binding))
        with self._lock:
            self._check_open()
            self.core.announce(time.monotonic(), request_id, pages, peer, held, bound)
            self._done_with_call()

    def abort(self, request_id: str, reason: str = "aborted") -> None:
        """Non-blocking: fail the request now and tell every prefill rank writing it. Its pages stay leased
        (quarantined) until each confirms no write can land, or is certainly gone. No-op for a request
        already ended."""
        with self._lock:
            self._record(request_id)
            self.core.abort(time.monotonic(), request_id, reason)
            self._done_with_call()

    def cancel(self, request_id: str, reason: str, *, peer: str | Sequence[str] | None = None) -> None:
        """Non-blocking: tell prefill that this decode will never announce ``request_id`` (the engine failed
        it before leasing pages: a refused hand-off, no room, a bad address), so prefill fails it now rather
        than at its ``request_timeout``, and frees what it held for it. Nothing is leased, so nothing
        settles. ``peer`` as for ``announce``. Raises ``LeaseError`` for a request this endpoint announced
        and still runs (``abort`` ends that one), ``PeerLost`` when not connected to the prefill."""
        with self._lock:
            self._check_open()
            self.core.cancel(time.monotonic(), request_id, reason, peer)
            self._done_with_call()

    @property
    def peers(self) -> list[str]:
        """Addresses of the prefills this decode is connected to."""
        with self._lock:
            return [a for a, link in self.core.links.items() if link.established]

    @property
    def num_live_leases(self) -> int:
        """Leases held, including those of failed requests waiting for their writes to settle."""
        with self._lock:
            return self.core.leases.num_leases

    def holds_lease(self, request_id: str) -> bool:
        """Whether ``request_id``'s destination pages are still leased: while True, a write may still land
        in them and the caller must not hand them to another request (a failed request keeps its lease,
        quarantined, until the writer confirms its handles settled, or is certainly gone and
        ``lease_grace`` passed since)."""
        with self._lock:
            rec = self.core.records.get(request_id)
            return isinstance(rec, DecodeRequest) and self.core.leases.holds(rec.generation)

    @property
    def num_leased_pages(self) -> int:
        with self._lock:
            return self.core.leases.num_leased_pages

    @property
    def num_quarantined_pages(self) -> int:
        """Pages of failed requests still leased because a write to them may land (part of
        ``num_leased_pages``): reusable once each writer acknowledged or is certainly gone."""
        with self._lock:
            return self.core.quarantine.num_pages

    @property
    def peak_quarantined_pages(self) -> int:
        """The most pages ever quarantined at once (what a soak reports as the cost of fencing)."""
        with self._lock:
            return self.core.quarantine.peak_pages

    def counters(self) -> dict[str, int]:
        """Leak-check figures: all zero on an idle endpoint (except bad/stray message counts and the
        quarantine's peak)."""
        with self._lock:
            core = self.core
            return {"live_requests": sum(r.is_live for r in core.by_gen.values()),
                    "live_leases": core.leases.num_leases, "leased_pages": core.leases.num_leased_pages,
                    "live_handles": core.num_reads(), "peers": sum(x.established for x in core.links.values()),
                    "bad_messages": core.num_bad_messages,
                    "stray_notifications": core.num_stray_notifications,
                    "quarantined_leases": core.quarantine.num_leases,
                    "quarantined_pages": core.quarantine.num_pages,
                    "peak_quarantined_pages": core.quarantine.peak_pages}

    # -- connecting (caller's thread) -------------------------------------------------------------------
    @contextlib.contextmanager
    def _bounded_lock(self, deadline: float, what: str) -> Iterator[None]:
        """The endpoint's lock, or ``HandshakeError`` at ``deadline`` (a stalled progress thread holds it)."""
        if not self._lock.acquire(timeout=max(0.0, deadline - time.monotonic())):
            raise HandshakeError(f"no handshake answer from prefill {what} within the deadline (decode's "
                                 "progress thread held the endpoint's lock all along)")
        try:
            yield
        finally:
            self._lock.release()

    def _await_links(self, links: list[Link], deadline: float) -> None:
        """Wait until every handshake ended, or until ``deadline`` whatever the progress thread does (a
        short grace first lets its own deadline, with its own reason, win); raise the first failure."""
        if not self._waiters.wait_for(lambda: all(not x.connecting for x in links), deadline + 0.05):
            self._give_up(links)
        for link in links:
            if not link.established:
                raise link.error or PeerLost(f"prefill {link.address} went away during the handshake")

    def _give_up(self, links: list[Link]) -> None:
        """The caller's deadline passed with handshakes still open: fail them here, close them later."""
        error = HandshakeError(f"no handshake answer from prefill {', '.join(x.address for x in links)} "
                               "within the deadline (decode's progress loop did not finish it in time)")
        if not self._lock.acquire(timeout=0.05):
            raise error
        try:
            self.core.give_up(time.monotonic(), links, error)
            self._done_with_call()
        finally:
            self._lock.release()

    # -- carrying out the core's actions (progress thread, under the lock) ------------------------------
    def _apply(self, effect: Effect) -> None:
        core = self.core
        if isinstance(effect, OpenLink):
            self._port.open(effect.link, effect.hello)
        elif isinstance(effect, CloseLink):
            self._port.close_link(effect.link)
        elif isinstance(effect, AddPeer):
            try:
                agent = self.transport.add_peer(effect.meta)
            except KVFerryError as exc:
                core.peer_added(time.monotonic(), effect.peer, None, str(exc))
            else:
                core.peer_added(time.monotonic(), effect.peer, agent, None)
        elif isinstance(effect, RemovePeer):
            with contextlib.suppress(TransportError):  # the peer is gone either way
                self.transport.remove_peer(effect.agent)
        elif isinstance(effect, CheckWriter):
            core.writer_checked(time.monotonic(), effect.link, writer_gone(self.transport, effect.link))
        elif isinstance(effect, TakeNotifications):
            self._take_notifications()
            core.notifications_taken(time.monotonic())
        else:
            super()._apply(effect)

    def _carry_out(self, transfer: Transfer) -> None:
        """Post one pull-mode read the core decided (decode's only transfers), between events, with the
        endpoint's lock let go (``ActionRunner.unlocked``): on one host (cma) the copy runs inside this
        call, with the GIL released, and callers (``announce`` above all) proceed alongside it rather than
        queue behind the whole iteration. The core checks each part again first (``start_read``: the
        request still live, the fence still holding). Only this thread posts and settles reads; an
        ``abort`` meanwhile fails the request, but its lease cannot end under the read (``posting`` counts
        as a read in flight). A read that fails to post fails every request in it."""
        job = self.core.start_read(time.monotonic(), transfer)
        if job is None:
            return
        try:
            handle = self._actions.unlocked(job.parts,
                                            lambda: self.transport.read(job.plan, job.agent, label=job.label))
        except KVFerryError as exc:
            self.core.read_failed(time.monotonic(), job, exc)
            return
        handle = self._stats.posted(job.plan, handle)
        self._reads.add(handle)
        self.core.read_posted(job, handle)
        if time.monotonic() - self._published_at >= PUBLISH_S:
            # A long run of reads (one frame can carry dozens of Readys): conclude the finished ones now
            # and let their Results and waiters go, so that prefill and the engine work on the next
            # requests while this thread reads on. Not after every read: several Results share a frame.
            self._pump_reads()
            self._publish()

    def _pump(self) -> bool:
        news = self._pump_reads() if self._reads else False
        return self._take_notifications() or news

    def _pump_reads(self) -> bool:
        """Poll every read in flight; feed each that ended to the core. True when one did."""
        return self._reads.settle(time.monotonic(), self.core.read_settled)

    def _take_notifications(self) -> bool:
        """Feed the transport's notifications to the core; True when there was one."""
        try:
            notifications = self.transport.get_notifications()
        except KVFerryError as exc:  # the transport's trouble fails requests by their deadlines, not the loop
            self.core.num_bad_messages += 1
            log.warning("decode: reading notifications failed: %s", exc)
            return False
        if notifications:
            now = time.monotonic()
            for agent, data in notifications:
                self.core.on_notification(now, agent, data)
        return bool(notifications)
