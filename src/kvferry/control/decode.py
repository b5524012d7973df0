"""The decode endpoint: leases its pages to requests and learns when prefill's writes have landed.

The top of the control plane (with ``prefill``), above every other control module. Decode connects to one or
more prefill endpoints (a ZMQ DEALER per prefill), announces each request with its destination pages (a
lease), and reports ``DONE`` only after every chunk's transport notification arrived (the transport delivers
it after the chunk's bytes) and its digests verified. A lease ends only when no write to its pages can still
land: the request completed, prefill confirmed its writes settled (``Fail(settled=True)``), or prefill
certainly cannot write any more (its process is gone on this host, or the transport says so) and
``options.lease_grace`` has passed since. Until then a failed request's pages are quarantined
(``quarantine``); a prefill declared dead is asked to settle them when decode reconnects to it.

This module runs the protocol; the parts it drives live beside it: ``links`` (the prefill peers, and
which of them a request needs), ``admission`` (what a Welcome must show), ``decode_requests`` (records,
one part per prefill rank, settling), ``leases`` (page ownership) and ``digests`` (checking each chunk).
"""

from __future__ import annotations

import contextlib
import itertools
import logging
import time
from collections.abc import Iterator, Mapping, Sequence
from typing import Any, cast

import zmq
import zmq.utils.monitor

from kvferry.control import wire
from kvferry.control.core.admission import as_secret, auth_mac, check_welcome
from kvferry.control.core.base import CoreBase, RequestRecord, Transfer
from kvferry.control.core.decode_requests import DecodeRequest, Part
from kvferry.control.core.digests import verify_chunk
from kvferry.control.core.links import Link, pick_links
from kvferry.control.core.states import LinkState, RequestState
from kvferry.control.core.timers import PeerClock
from kvferry.control.endpoints import FLUSH_MS, EndpointBase, EndpointOptions
from kvferry.control.leases import LeaseTable
from kvferry.control.liveness import ProcessIdentity, this_process
from kvferry.control.pull import DEFAULT_MODE, check_mode, check_pull_options, is_mode_refusal
from kvferry.control.pull_reader import PullReader
from kvferry.control.quarantine import Quarantine, writer_gone
from kvferry.errors import (
    HandshakeError,
    IncompatiblePeer,
    IntegrityError,
    KVFerryError,
    LeaseError,
    ModeMismatch,
    PeerLost,
    ProtocolError,
    RequestAborted,
    TransferTimeout,
    TransportError,
    UsageError,
)
from kvferry.integrity import DigestMode
from kvferry.integrity.binding import as_binding
from kvferry.layout.memory import KVMemory
from kvferry.plan.prefix import prefix_pages
from kvferry.plan.tp import source_ranks
from kvferry.transport import Transport

__all__ = ["RETRY_AFTER", "RETRY_MAX", "DecodeEndpoint"]

# connect_needed: a handshake that failed (not a refusal) is retried after RETRY_AFTER seconds, doubling with
# each failure in a row up to RETRY_MAX.
RETRY_AFTER = 1.0
RETRY_MAX = 30.0

log = logging.getLogger("kvferry.control")


class DecodeEndpoint(EndpointBase, PullReader, CoreBase):
    """Decode side of kvferry. Construct, ``connect`` to prefill (``connect_all`` to the ranks of a prefill
    TP group when this side runs another TP size), then ``announce`` requests and ``wait``.

    ``transport`` is ``"nixl"``, ``"local"`` or a ``Transport`` (registered here with ``memory``; closed on
    ``close`` only when created here). ``secret`` (optional) must match prefill's. ``digest_mode``
    (``"off"``, ``"sampled"``, ``"full"``) is the least this side accepts. ``mode`` is the transfer mode
    asked of every prefill (``connect(mode=...)`` chooses per prefill): ``"push"`` (prefill writes into the
    leased pages) or ``"pull"`` (this side reads prefill's pages; see ``pull`` and docs/fencing.md).
    """

    _role = "decode"
    role = "decode"

    def __init__(self, memory: KVMemory, transport: str | Transport = "nixl", *,
                 secret: str | bytes | None = None, digest_mode: Any = "sampled",
                 options: EndpointOptions | None = None, mode: str = DEFAULT_MODE) -> None:
        if check_mode(mode) == "pull":
            opts = options or EndpointOptions()
            check_pull_options(opts.peer_timeout, opts.heartbeat_interval)
        super().__init__(memory, transport, digest_mode=digest_mode, options=options)
        self.mode = mode
        self._reading: set[DecodeRequest] = set()   # pull mode: requests with reads in flight
        try:
            self._secret = as_secret(secret)
        except BaseException:
            self._release_resources()   # the thread never started: nothing else would close them
            raise
        self._leases = LeaseTable(memory.layout)
        self._links: dict[str, Link] = {}
        self._by_sock: dict[Any, Link] = {}
        self._monitors: dict[Any, Link] = {}
        self._quarantine = Quarantine()
        self._next_quarantine_check = 0.0
        self._by_agent: dict[str, Link] = {}
        self._by_gen: dict[int, DecodeRequest] = {}
        self._generations = itertools.count(1)
        self._next_deadline_check = 0.0
        self._num_live = 0   # live records, kept by announce and set_state: the busy test is O(1)
        self.num_stray_notifications = 0
        # connect_needed's memory of failed handshakes: addresses -> (retry at, the error, the back-off).
        self._refused: dict[tuple[str, ...], tuple[float, KVFerryError, float]] = {}
        self._thread.start()

    def _make_core(self) -> CoreBase:
        # Not yet split (issue 29): decode's protocol still runs in the endpoint itself, on the same core
        # base as prefill's (records, states, action queues), so the shell drives both sides alike.
        CoreBase.__init__(self, self.options, self._stats, self._entropy)
        return self

    def _connected(self) -> bool | None:
        """What ``PeerClock.peer_lost`` is told of an established link's connection: True with
        ``transport_liveness`` (a connection still standing has answered libzmq's heartbeats within
        ``peer_timeout``; a dropped one has already ended the link), None without (silence decides)."""
        return True if self.options.transport_liveness else None

    def call_soon(self, fn: Any) -> None:
        super().call_soon(fn)
        self._wake()

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
        mode = self.mode if mode is None else check_mode(mode)
        if mode == "pull":
            check_pull_options(self.options.peer_timeout, self.options.heartbeat_interval)
        deadline = time.monotonic() + timeout
        with self._bounded_lock(deadline, address):
            self._check_open()
            link = self._start_link(address, timeout, None, mode)
        self._await_links([link], deadline)
        return address

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
            links = [self._start_link(addresses[r], timeout, (r, len(addresses)), self.mode) for r in need]
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
            if all(a in self._links and self._links[a].established for a in need):
                return need[0] if single else need
            refused = self._refused.get(key)
            if refused is not None and (isinstance(refused[1], IncompatiblePeer) or time.monotonic() < refused[0]):
                raise refused[1]
        try:
            if exact or single:
                connected = [self.connect(a, timeout) for a in need]
            else:
                connected = self.connect_all(addresses, timeout)
        except HandshakeError as exc:
            with self._lock:
                wait = min(RETRY_MAX, retry_after if refused is None else 2 * refused[2])
                self._refused[key] = (time.monotonic() + wait, exc, wait)
            raise
        with self._lock:
            self._refused.pop(key, None)
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
            links = pick_links(self._links, peer, self.memory.layout)
            old = self.records.get(request_id)
            if old is not None and old.is_live:
                raise LeaseError(f"request {request_id!r} is already live ({old.state.value})")
            gen = next(self._generations)
            leased = self._leases.acquire(gen, request_id, pages)
            self.now = now = time.monotonic()
            rec = DecodeRequest(request_id, now + self.options.request_timeout, gen, links,
                                self.options.lease_grace, now)
            self.remember(rec)
            self._by_gen[gen] = rec
            self._num_live += 1
            # Queued here, sent by the progress thread at the end of its next iteration (with the others
            # of that iteration: see endpoints' _flush).
            data = wire.encode(wire.Announce(request_id, gen, wire.encode_pages(leased), held, *bound))
            for link in links:
                self.queue_out(link, data)
            self._wake()

    def abort(self, request_id: str, reason: str = "aborted") -> None:
        """Non-blocking: fail the request now and tell every prefill rank writing it. Its pages stay leased
        (quarantined) until each confirms no write can land, or is certainly gone. No-op for a request
        already ended."""
        with self._lock:
            rec = cast(DecodeRequest, self._record(request_id))
            if self.fail(rec, RequestAborted(f"aborted by decode: {reason}")):
                self.call_soon(lambda: self._abort_parts(rec, reason))

    def cancel(self, request_id: str, reason: str, *, peer: str | Sequence[str] | None = None) -> None:
        """Non-blocking: tell prefill that this decode will never announce ``request_id`` (the engine failed
        it before leasing pages: a refused hand-off, no room, a bad address), so prefill fails it now rather
        than at its ``request_timeout``, and frees what it held for it. Nothing is leased, so nothing
        settles. ``peer`` as for ``announce``. Raises ``LeaseError`` for a request this endpoint announced
        and still runs (``abort`` ends that one), ``PeerLost`` when not connected to the prefill."""
        with self._lock:
            self._check_open()
            links = pick_links(self._links, peer, self.memory.layout)
            old = self.records.get(request_id)
            if old is not None and old.is_live:
                raise LeaseError(f"request {request_id!r} is live here ({old.state.value}): abort it instead")
            data = wire.encode(wire.Cancel(request_id, reason[:wire.MAX_REASON_LEN]))
            for link in links:
                self.queue_out(link, data)
            self._wake()

    @property
    def peers(self) -> list[str]:
        """Addresses of the prefills this decode is connected to."""
        with self._lock:
            return [a for a, link in self._links.items() if link.established]

    @property
    def num_live_leases(self) -> int:
        """Leases held, including those of failed requests waiting for their writes to settle."""
        with self._lock:
            return self._leases.num_leases

    def holds_lease(self, request_id: str) -> bool:
        """Whether ``request_id``'s destination pages are still leased: while True, a write may still land
        in them and the caller must not hand them to another request (a failed request keeps its lease,
        quarantined, until the writer confirms its handles settled, or is certainly gone and
        ``lease_grace`` passed since)."""
        with self._lock:
            rec = self.records.get(request_id)
            return rec is not None and self._leases.holds(rec.generation)

    @property
    def num_leased_pages(self) -> int:
        with self._lock:
            return self._leases.num_leased_pages

    @property
    def num_quarantined_pages(self) -> int:
        """Pages of failed requests still leased because a write to them may land (part of
        ``num_leased_pages``): reusable once each writer acknowledged or is certainly gone."""
        with self._lock:
            return self._quarantine.num_pages

    @property
    def peak_quarantined_pages(self) -> int:
        """The most pages ever quarantined at once (what a soak reports as the cost of fencing)."""
        with self._lock:
            return self._quarantine.peak_pages

    def counters(self) -> dict[str, int]:
        """Leak-check figures: all zero on an idle endpoint (except bad/stray message counts and the
        quarantine's peak)."""
        with self._lock:
            return {"live_requests": sum(r.is_live for r in self._by_gen.values()),
                    "live_leases": self._leases.num_leases, "leased_pages": self._leases.num_leased_pages,
                    "live_handles": self._num_reads(), "peers": sum(x.established for x in self._links.values()),
                    "bad_messages": self.num_bad_messages,
                    "stray_notifications": self.num_stray_notifications,
                    "quarantined_leases": self._quarantine.num_leases,
                    "quarantined_pages": self._quarantine.num_pages,
                    "peak_quarantined_pages": self._quarantine.peak_pages}

    # -- connecting (caller's thread, under the lock) ---------------------------------------------------
    def _start_link(self, address: str, timeout: float, expect: tuple[int, int] | None, mode: str) -> Link:
        """The established link to ``address``, or a fresh one whose handshake the progress thread starts."""
        old = self._links.get(address)
        if old is not None and old.established and old.mode != mode:
            raise ModeMismatch(f"prefill {address} is connected in transfer mode {old.mode!r}, asked for {mode!r}")
        if old is not None and old.established:
            if expect is not None and (old.rank, old.tp_size) != expect:
                raise IncompatiblePeer(f"prefill {address} is rank {old.rank} of TP {old.tp_size}, "
                                       f"expected rank {expect[0]} of TP {expect[1]}")
            return old
        if old is not None and old.connecting:  # e.g. a recovery handshake: this one replaces it
            self.call_soon(lambda: self._link_failed(old, HandshakeError(f"prefill {address}: handshake "
                                                                          "superseded by a newer connect")))
        now = time.monotonic()
        link = Link(address, now + timeout, self._peer_clock(now), self._entropy(16).hex(), self._entropy(32))
        link.expect, link.mode = expect, mode
        self._links[address] = link
        self.call_soon(lambda: self._open_link(link))
        return link

    def _peer_clock(self, now: float) -> PeerClock:
        return PeerClock(now, self.options.heartbeat_interval, self.options.peer_timeout)

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
        if not self._wait_for(lambda: all(not x.connecting for x in links), deadline + 0.05):
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
            for link in links:
                if link.connecting:
                    link.move(LinkState.FAILED)
                    link.error = error
                    self.call_soon(lambda x=link: self._close_link(x))
        finally:
            self._lock.release()

    # -- handshake (progress thread) -------------------------------------------------------------------
    def _open_link(self, link: Link) -> None:
        link.sock = self._new_socket(zmq.DEALER)
        # libzmq drops a connection that sends more than max_message_bytes without telling the socket;
        # its monitor does tell, so a dropped connection fails the link now rather than at a deadline.
        link.monitor = link.sock.get_monitor_socket(zmq.EVENT_DISCONNECTED)
        link.sock.connect(link.address)
        self._poller.register(link.sock, zmq.POLLIN)
        self._poller.register(link.monitor, zmq.POLLIN)
        self._by_sock[link.sock] = link
        self._monitors[link.monitor] = link
        me = this_process()
        hello = wire.Hello(link.session, self.memory.manifest(), self.transport.name, self.transport_metadata,
                           link.nonce, self.digest_mode, self.options.heartbeat_interval, link.mode,
                           self.options.peer_timeout, me.host, me.pid, me.started)
        link.hello = wire.encode(hello)
        self._send_raw(link, link.hello)

    def _on_handshake(self, link: Link, msg: Any) -> None:
        if isinstance(msg, wire.Reject):
            error = ModeMismatch if is_mode_refusal(msg.reason) else IncompatiblePeer
            self._link_failed(link, error(f"prefill {link.address} refused: {msg.reason}"))
        elif isinstance(msg, wire.Bye):  # e.g. it dropped our half-open session: no use waiting
            self._link_failed(link, HandshakeError(f"prefill {link.address} ended the handshake: {msg.reason}"))
        elif isinstance(msg, wire.Challenge):
            self._answer_challenge(link, msg)
        elif isinstance(msg, wire.Welcome):
            self._accept_welcome(link, msg)
        else:
            raise ProtocolError(f"unexpected {type(msg).__name__} during the handshake")

    def _answer_challenge(self, link: Link, msg: wire.Challenge) -> None:
        if self._secret is None:
            self._link_failed(link, IncompatiblePeer(f"prefill {link.address} requires a shared secret and "
                                                     "none is configured here"))
            return
        link.server_nonce = msg.nonce
        self._send(link, wire.Auth(auth_mac(self._secret, b"decode", msg.nonce, link.nonce, link.hello)))

    def _accept_welcome(self, link: Link, msg: wire.Welcome) -> None:
        problem = check_welcome(self.memory, self._secret, link, msg) or self._welcome_pull(link, msg)
        if problem is not None:
            self._link_failed(link, problem)
            return
        try:
            link.agent = self.transport.add_peer(msg.transport_meta)
        except KVFerryError as exc:
            self._link_failed(link, HandshakeError(f"prefill {link.address}: bad transport metadata: {exc}"))
            return
        link.digest_mode = DigestMode.from_peer(msg.digest_mode)
        link.process = ProcessIdentity(msg.host, msg.pid, msg.started) if msg.pid else None
        self._by_agent[link.agent] = link
        link.move(LinkState.ESTABLISHED)
        self.changed = True
        self._resettle(link)

    def _resettle(self, link: Link) -> None:
        """``link`` reaches a prefill (same transport agent) this decode declared dead: ask it to settle
        every request of ours it may still be writing. The parts move to the new link, where the settled
        Fail arrives."""
        for rec in self._by_gen.values():
            for old, part in list(rec.parts.items()):
                if part.settled or old is link or old.established or old.agent != link.agent:
                    continue
                del rec.parts[old]
                part.link, part.told = link, True
                rec.parts[link] = part
                self._send(link, wire.Abort(rec.request_id, rec.generation,
                                            "decode declared this prefill dead: settle this generation"))

    def _link_failed(self, link: Link, error: KVFerryError) -> None:
        if link.connecting:
            link.error = error
            link.move(LinkState.FAILED)
            with contextlib.suppress(zmq.ZMQError):  # best effort: the connection may be what failed
                for frame in wire.batches(self.take_out(link)):  # what was queued goes first
                    self._send_raw(link, frame, quiet=False)
                self._send_raw(link, wire.encode(wire.Bye(str(error)[:wire.MAX_REASON_LEN])), quiet=False)
            self._close_link(link)

    def _dropped(self, link: Link, why: str) -> None:
        """libzmq dropped ``link``'s connection, or a send on it failed: fail the link, naming the cause."""
        text = (f"prefill {link.address}: connection dropped ({why}): the prefill closed or crashed, or sent a "
                f"message above max_message_bytes={self.options.max_message_bytes} (libzmq drops such a "
                "connection without a word)")
        if link.connecting:
            self._link_failed(link, HandshakeError(f"{text}, during the handshake"))
        else:
            self._link_dead(link, PeerLost(text))

    def _socket_failed(self, sock: Any, exc: zmq.ZMQError) -> None:
        link = self._by_sock.get(sock) or self._monitors.get(sock)
        if link is not None:
            self._dropped(link, f"receive failed: {exc}")

    def fail_peers(self, error: KVFerryError) -> None:
        for link in self._links.values():
            if link.state in (LinkState.CONNECTING, LinkState.ESTABLISHED):
                link.move(LinkState.FAILED if link.connecting else LinkState.DEAD)
                link.error = error

    # -- messages (progress thread) --------------------------------------------------------------------
    def _on_frames(self, sock: Any, frames: list[bytes]) -> None:
        if sock in self._monitors:
            self._on_monitor(self._monitors[sock], frames)
            return
        link = self._by_sock.get(sock)
        if link is None:
            return
        if len(frames) != 1:
            raise ProtocolError(f"expected one frame, got {len(frames)}")
        try:
            msg = wire.decode(frames[0])
        except ProtocolError as exc:
            if link.connecting:  # e.g. another protocol version: refuse the peer, say why
                self._link_failed(link, IncompatiblePeer(f"prefill {link.address}: {exc}"))
            raise
        link.clock.heard(self._recv_time)
        if isinstance(msg, wire.Batch):
            self.on_batch(wire.unbatch(msg), lambda m: self._on_link_msg(link, m))
        else:
            self._on_link_msg(link, msg)

    def _on_link_msg(self, link: Link, msg: Any) -> None:
        """One message from ``link``, alone or out of a Batch (in order, each as if it had come alone: a
        link that failed or died earlier in the batch hears no more)."""
        if link.connecting:
            self._on_handshake(link, msg)
        elif link.established:
            self._on_message(link, msg)

    def _on_monitor(self, link: Link, frames: list[bytes]) -> None:
        try:
            event = zmq.utils.monitor.parse_monitor_message(frames)["event"]
        except Exception as exc:  # a malformed event frame: pyzmq's own format, so a bug; name it
            raise ProtocolError(f"unreadable socket event for prefill {link.address}: {exc!r}") from exc
        if event == zmq.EVENT_DISCONNECTED and link.state in (LinkState.CONNECTING, LinkState.ESTABLISHED):
            self._dropped(link, "libzmq reported the disconnect")

    def _on_message(self, link: Link, msg: Any) -> None:
        if isinstance(msg, wire.Heartbeat):
            return
        if isinstance(msg, wire.Ack):
            rec = self._lookup(link, msg.request_id, msg.generation)
            if rec is not None and rec.state is RequestState.BOOTSTRAPPING:
                self.set_state(rec, RequestState.WAITING_FOR_INPUT)
        elif isinstance(msg, wire.Ready):
            self._on_ready(link, msg)
        elif isinstance(msg, wire.Fail):
            self._on_fail(link, msg)
        elif isinstance(msg, wire.Cancel):
            self._on_cancel(link, msg)
        elif isinstance(msg, wire.Bye):
            self._link_dead(link, PeerLost(f"prefill {link.address} left: {msg.reason}"))
        else:
            raise ProtocolError(f"unexpected {type(msg).__name__} from prefill {link.address}")

    def _on_fail(self, link: Link, msg: wire.Fail) -> None:
        rec = self._lookup(link, msg.request_id, msg.generation)
        if rec is None:
            return
        part = rec.parts[link]
        if link.mode == "pull":
            # Prefill failed it; our Abort (sent by _fail_req) tells it we read no more, so it may release
            # its source pages. The lease ends once our own reads of it are terminal.
            self._fail_req(rec, wire.error_from_wire(msg.error, msg.reason, f"prefill {link.address}"),
                           f"prefill rank {link.rank} ({link.address}) failed it")
            return
        part.told = True  # it failed the request itself: no Abort owed
        self._fail_req(rec, wire.error_from_wire(msg.error, msg.reason, f"prefill {link.address}"),
                       f"prefill rank {link.rank} ({link.address}) failed it")
        if msg.settled:  # this prefill has no write to these pages that can still land
            # Its chunk notifications sent before this message may still wait in the transport (ZMQ is
            # read first): take them now, or they would count as writes landing with no lease.
            self._pump()
            self._settle(rec, part)

    def _on_cancel(self, link: Link, msg: wire.Cancel) -> None:
        """Prefill failed a request before any decode announced it: keep it FAILED here so ``poll`` says so
        now (nothing is leased for it). A request this decode already knows is left alone: one announced and
        live hears from prefill itself (its announce is refused), one ended ended on its own."""
        if msg.request_id in self.records:
            return
        rec = RequestRecord(msg.request_id, RequestState.BOOTSTRAPPING, self.now, self.now)
        self.remember(rec)
        self._num_live += 1   # set_state counts it out as it fails, as for an announced request
        self.fail(rec, RequestAborted(f"prefill {link.address}: {msg.reason}"))

    def _lookup(self, link: Link, request_id: str, generation: int) -> DecodeRequest | None:
        """The record a message from ``link`` is about, or None (an ended request: a late Ack or a
        repeated Fail is normal)."""
        rec = self._by_gen.get(generation)
        if rec is None or link not in rec.parts or rec.request_id != request_id:
            return None
        return rec

    def _fail_req(self, rec: DecodeRequest, error: KVFerryError, reason: str) -> None:
        """Fail a live request and tell every prefill rank writing it that does not know yet to stop
        (each answers with a settled Fail, which ends its part of the lease)."""
        if self.fail(rec, error):
            self._abort_parts(rec, reason)

    def fail_closed(self, rec: RequestRecord, error: KVFerryError) -> None:
        if isinstance(rec, DecodeRequest):
            self._fail_req(rec, error, "decode internal error")
        else:   # a cancelled id's record: nothing leased, nobody to tell
            self.fail(rec, error)

    def _abort_parts(self, rec: DecodeRequest, reason: str) -> None:
        msg = wire.Abort(rec.request_id, rec.generation, reason[:wire.MAX_REASON_LEN])
        for part in rec.parts.values():
            # A rank whose part completed is told too: it waits for our verdict, and would time out.
            if not part.told and part.link.established:
                part.told = True
                self._send(part.link, msg)

    def _settle(self, rec: DecodeRequest, part: Part) -> None:
        """``part`` can write no more; the lease ends once every part of the request is settled."""
        if rec.settle(part):
            self._end_lease(rec)

    def _end_lease(self, rec: DecodeRequest) -> None:
        self._quarantine.remove(rec.generation)
        self._leases.release(rec.generation)
        self._by_gen.pop(rec.generation, None)
        self.changed = True

    # -- chunk notifications (progress thread) ---------------------------------------------------------
    def post_queued(self) -> None:
        if self.batches:   # pull mode: reads queued by the Readys just read (pull_reader)
            self._post_reads()

    def _carry_out(self, transfer: Transfer) -> None:
        self._carry_out_read(transfer)   # decode's only transfers: pull mode's reads

    def _pump(self) -> bool:
        news = self._pump_reads() if self._reading else False
        try:
            notifications = self.transport.get_notifications()
        except KVFerryError as exc:  # the transport's trouble fails requests by their deadlines, not the loop
            self.num_bad_messages += 1
            log.warning("decode: reading notifications failed: %s", exc)
            return news
        for agent, data in notifications:
            link = self._by_agent.get(agent)
            try:
                msg = wire.decode(data)
                if link is None or not isinstance(msg, (wire.Chunk, wire.Batch)):
                    raise ProtocolError(f"unexpected notification from {agent!r}")
            except ProtocolError:
                self.num_bad_messages += 1
                continue
            if isinstance(msg, wire.Batch):   # one write carried several chunks (prefill's write_batch)
                self.on_batch(wire.unbatch(msg), lambda m, link=link: self._on_batched_chunk(link, m))
            else:
                self._on_chunk(link, msg)
        return news or bool(notifications)

    def _on_batched_chunk(self, link: Link, msg: Any) -> None:
        if not isinstance(msg, wire.Chunk):
            raise ProtocolError(f"{type(msg).__name__} in the notification of a write from prefill {link.address}")
        self._on_chunk(link, msg)

    def _on_chunk(self, link: Link, msg: wire.Chunk) -> None:
        rec = self._lookup(link, msg.request_id, msg.generation)
        if rec is None:
            # A write landed for no lease we hold: a prefill bug (or a forged notification). Counted,
            # since the leak checks must see it.
            self.num_stray_notifications += 1
            return
        part = rec.parts[link]
        if not part.see(msg):
            return
        if not rec.is_live:
            # Failed while writes were in flight: this rank's part of the lease waits for its settled
            # Fail, or for its last notification (then every write of it has landed).
            if part.is_complete and max(part.chunks_seen) < (part.num_chunks or 0):
                self._settle(rec, part)
            return
        error = verify_chunk(self.memory, self.digest_mode, link, msg, self._stats)
        if error is not None:
            self._reject_part(rec, part, error)
            return
        if rec.state is not RequestState.TRANSFERRING:
            self.set_state(rec, RequestState.TRANSFERRING)
        if part.is_complete:
            self._part_complete(rec, part)

    def _reject_part(self, rec: DecodeRequest, part: Part, error: KVFerryError) -> None:
        """This rank's bytes did not check out: fail the request, tell it (Result), abort the others."""
        part.told = True
        self._fail_req(rec, error, f"prefill rank {part.link.rank} ({part.link.address}) sent bad bytes")
        self._send(part.link, wire.Result(rec.request_id, rec.generation, False, str(error)[:wire.MAX_REASON_LEN]))

    def _part_complete(self, rec: DecodeRequest, part: Part) -> None:
        """Every chunk of one rank arrived and verified; the request is DONE once every rank's has."""
        assert part.num_chunks is not None
        if max(part.chunks_seen) >= part.num_chunks:
            self._reject_part(rec, part, IntegrityError(
                f"prefill {part.link.address} sent chunk {max(part.chunks_seen)} of {part.num_chunks} for "
                f"request {rec.request_id!r}"))
            return
        part.settled = True  # every write of this rank has landed
        if not all(p.is_complete for p in rec.parts.values()):
            return
        self.set_state(rec, RequestState.DONE)
        self._end_lease(rec)  # every chunk's notification arrived, so every write has landed
        for p in rec.parts.values():
            self._send(p.link, wire.Result(rec.request_id, rec.generation, True, ""))

    # -- timers (progress thread) ----------------------------------------------------------------------
    def num_waiting(self) -> int:
        # Live requests wait for chunk notifications, which only polling the transport brings in.
        return self._num_live + len(self._reading)

    def done_pages(self, rec: RequestRecord) -> Mapping[str, Any]:
        # Called as the request turns DONE, before its lease ends: the leased pages are what moved.
        return self._leases.pages(cast(DecodeRequest, rec).generation)

    def gauges(self) -> dict[str, int]:
        return {"live_requests": self._num_live, "leases": self._leases.num_leases,
                "leased_pages": self._leases.num_leased_pages, "quarantined_pages": self._quarantine.num_pages,
                "peers": sum(link.established for link in list(self._links.values()))}

    def set_state(self, rec: RequestRecord, state: RequestState) -> None:
        was_live = rec.is_live
        super().set_state(rec, state)
        if was_live and not rec.is_live:
            self._num_live -= 1
            if state is RequestState.FAILED and isinstance(rec, DecodeRequest):
                if any(p.link.mode == "pull" for p in rec.parts.values()):
                    self._pull_failed(rec)  # nobody else writes these pages: no quarantine
                    return
                # Failed with its lease held: a writer may still write it, so its pages are quarantined.
                pages = self._leases.num_pages(rec.generation)
                if pages:
                    self._quarantine.add(rec.generation, pages)

    def tick(self, now: float) -> None:
        for link in list(self._links.values()):
            self._tick_link(link, now)
        if now >= self._next_deadline_check:
            self._next_deadline_check = now + 0.01
            self._tick_requests(now)

    def _tick_link(self, link: Link, now: float) -> None:
        if link.connecting and now > link.deadline:
            self._link_failed(link, HandshakeError(
                f"no handshake answer from prefill {link.address} within the deadline (if something answers "
                f"at that address, its answer may exceed max_message_bytes={self.options.max_message_bytes})"))
        elif not link.established:
            return
        elif link.clock.peer_lost(now, self._connected()):
            self._link_dead(link, PeerLost(f"prefill {link.address} silent for {link.clock.silent_for(now):.2f} s "
                                           f"(peer_timeout {self.options.peer_timeout} s)"))
        elif link.clock.heartbeat_due(now):
            self._send(link, wire.Heartbeat())

    def check_silence(self, now: float) -> None:
        """Push mode: nothing before reading (decode posts no writes, so frames queued during its own stall
        can only make it talk to a prefill that dropped it, which answers with Bye). Pull mode: a link whose
        fence tripped (this process stalled) dies before frames queued meanwhile can start reads on it."""
        self._check_pull_links(list(self._links.values()), now)

    def _tick_requests(self, now: float) -> None:
        for rec in list(self._by_gen.values()):
            if rec.is_live and now > rec.deadline:
                self._fail_req(rec, TransferTimeout(f"request {rec.request_id!r} not done within "
                                                    f"{self.options.request_timeout} s"), "decode deadline passed")
        if self._quarantine.num_leases and now >= self._next_quarantine_check:
            self._next_quarantine_check = now + 0.05   # /proc reads: a few per dead link, 20 times a second
            self._check_quarantine(now)

    def _check_quarantine(self, now: float) -> None:
        """A part whose link is gone leaves quarantine ``lease_grace`` after its writer is certainly gone;
        while it may still write, decode keeps reconnecting to it to ask for its acknowledgement."""
        gone: dict[Link, bool] = {}
        for rec in list(self._by_gen.values()):
            for part in list(rec.parts.values()):
                link = part.link
                if part.settled or link.established:
                    continue
                if part.grace.needs_check:
                    if link not in gone:
                        gone[link] = writer_gone(self.transport, link)
                    if gone[link]:
                        part.grace.writer_gone(now)
                elif part.grace.due(now):
                    self._settle(rec, part)
        for link, is_gone in gone.items():
            if not is_gone and not self.closing:
                self._recover(link, now)

    def _recover(self, dead: Link, now: float) -> None:
        """Handshake again with the prefill behind ``dead`` (every ``peer_timeout`` while none is open): a
        stalled prefill that resumed then settles what decode quarantined (``_resettle``), and serves
        again. Only an acknowledgement or a certain death frees pages a live writer may still reach."""
        current = self._links.get(dead.address)
        if now < dead.retry_at or (current is not None and (current.connecting or current.established)):
            return
        dead.retry_at = now + self.options.peer_timeout
        link = Link(dead.address, now + self.options.handshake_timeout, self._peer_clock(now), self._entropy(16).hex(),
                    self._entropy(32))
        link.expect = (dead.rank, dead.tp_size)
        self._links[dead.address] = link
        self._open_link(link)

    def _link_dead(self, link: Link, error: KVFerryError) -> None:
        """Fail the requests the link writes (and abort them on the other ranks writing them). Their
        pages stay quarantined until that prefill settles them (after a reconnect) or is certainly gone."""
        if not link.established:
            return
        link.move(LinkState.DEAD)
        link.error = error
        for rec in list(self._by_gen.values()):
            part = rec.parts.get(link)
            if part is not None and not part.settled:
                self._fail_req(rec, error, f"prefill rank {link.rank} ({link.address}) is lost")
        self._close_link(link)
        if self._by_agent.get(link.agent) is link:
            self._by_agent.pop(link.agent)
        with contextlib.suppress(TransportError):  # the peer is gone either way
            self.transport.remove_peer(link.agent)
        self.changed = True

    # -- sockets (progress thread) ---------------------------------------------------------------------
    def _send(self, link: Link, msg: Any) -> None:
        """Queue ``msg`` for ``link``; it leaves with this iteration's next ``_flush``."""
        self.queue_out(link, wire.encode(msg))

    def _send_frame(self, link: Link, frame: bytes) -> None:
        self._send_raw(link, frame)

    def _send_raw(self, link: Link, data: bytes, *, quiet: bool = True) -> None:
        """Send without blocking. A failed send (``zmq.Again``: the connection is gone and no message
        can queue; any other ZMQ error) fails this link, never the loop; ``quiet=False`` raises instead."""
        if link.sock is None:
            return
        now = time.monotonic()
        self._note_send(link, now)  # pull mode: a long pause in our messages trips the link's fence first
        try:
            link.sock.send(data, zmq.NOBLOCK)
        except zmq.ZMQError as exc:
            if not quiet:
                raise
            self._dropped(link, f"send failed: {exc}")
            return
        link.clock.sent(now)

    def _close_link(self, link: Link) -> None:
        self.take_out(link)   # closed with linger 0: what it had not sent is dropped, as before
        if link.monitor is not None:
            self._poller.unregister(link.monitor)
            self._monitors.pop(link.monitor, None)
            with contextlib.suppress(zmq.ZMQError):
                if link.sock is not None:
                    link.sock.disable_monitor()
                link.monitor.close(0)
            link.monitor = None
        if link.sock is not None:
            self._poller.unregister(link.sock)
            self._by_sock.pop(link.sock, None)
            link.sock.close(0)
            link.sock = None
        self.changed = True

    def shutdown_step(self, now: float, give_up: bool) -> bool:
        self.now = now
        for rec in list(self._by_gen.values()):  # a pull request's lease may end as it fails
            self._fail_req(rec, KVFerryError("decode endpoint closing"), "decode closing")
        waiting = any(p.link.established and not p.settled
                      for r in self._by_gen.values() for p in r.parts.values())
        if waiting and not give_up:
            return False
        for link in self._links.values():
            if link.established:
                self._send(link, wire.Bye("decode closing"))
        return True

    def _close_sockets(self) -> None:
        for link in self._links.values():
            if link.monitor is not None:
                link.monitor.close(0)
                link.monitor = None
            if link.sock is not None:
                link.sock.close(FLUSH_MS)  # let the last Result and Bye leave; bounded if the peer is gone
                link.sock = None

