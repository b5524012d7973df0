"""The decode endpoint: leases its pages to requests and learns when prefill's writes have landed.

The top of the control plane (with ``prefill``), above every other control module. Decode connects to one or
more prefill endpoints (a ZMQ DEALER per prefill), announces each request with its destination pages (a
lease), and reports ``DONE`` only after every chunk's transport notification arrived (the transport delivers
it after the chunk's bytes) and its digests verified. A lease ends only when no write to its pages can still
land: the request completed, prefill confirmed its writes settled (``Fail(settled=True)``), or prefill is
known dead and ``options.lease_grace`` has passed since.

This module runs the protocol; the parts it drives live beside it: ``links`` (the prefill peers, and
which of them a request needs), ``admission`` (what a Welcome must show), ``decode_requests`` (records,
one part per prefill rank, settling), ``leases`` (page ownership) and ``digests`` (checking each chunk).
"""

from __future__ import annotations

import contextlib
import itertools
import time
from collections.abc import Mapping, Sequence
from typing import Any

import zmq

from kvferry.control import wire
from kvferry.control.admission import check_welcome
from kvferry.control.decode_requests import DecodeRequest, Part
from kvferry.control.digests import verify_chunk
from kvferry.control.endpoints import FLUSH_MS, EndpointBase, EndpointOptions, RequestRecord, as_secret, auth_mac
from kvferry.control.leases import LeaseTable
from kvferry.control.links import Link, pick_links
from kvferry.control.states import RequestState
from kvferry.errors import (
    HandshakeError,
    IncompatiblePeer,
    IntegrityError,
    KVFerryError,
    LeaseError,
    PeerLost,
    ProtocolError,
    TransferTimeout,
    TransportError,
    UsageError,
)
from kvferry.integrity import DigestMode
from kvferry.layout.memory import KVMemory
from kvferry.plan.tp import source_ranks
from kvferry.transport import Transport

__all__ = ["DecodeEndpoint"]


class DecodeEndpoint(EndpointBase):
    """Decode side of kvferry. Construct, ``connect`` to prefill (``connect_all`` to the ranks of a prefill
    TP group when this side runs another TP size), then ``announce`` requests and ``wait``.

    ``transport`` is ``"nixl"``, ``"local"`` or a ``Transport`` (registered here with ``memory``; closed on
    ``close`` only when created here). ``secret`` (optional) must match prefill's. ``digest_mode``
    (``"off"``, ``"sampled"``, ``"full"``) is the least this side accepts.
    """

    _role = "decode"

    def __init__(self, memory: KVMemory, transport: str | Transport = "nixl", *,
                 secret: str | bytes | None = None, digest_mode: Any = "sampled",
                 options: EndpointOptions | None = None) -> None:
        super().__init__(memory, transport, digest_mode=digest_mode, options=options)
        self._secret = as_secret(secret)
        self._leases = LeaseTable(memory.layout)
        self._links: dict[str, Link] = {}
        self._by_sock: dict[Any, Link] = {}
        self._by_agent: dict[str, Link] = {}
        self._by_gen: dict[int, DecodeRequest] = {}
        self._generations = itertools.count(1)
        self._next_deadline_check = 0.0
        self._num_live = 0   # live records, kept by announce and _set_state: the busy test is O(1)
        self.num_stray_notifications = 0
        self._thread.start()

    # -- public API: any thread ------------------------------------------------------------------------
    def connect(self, address: str, timeout: float | None = None) -> str:
        """Blocking: connect to a prefill endpoint and complete the handshake; returns the peer id.

        Raises ``IncompatiblePeer`` (layout, protocol version, transport or secret differ, with the
        difference spelled out) or ``HandshakeError`` (no answer within ``timeout``). Reconnecting to an
        address whose previous peer died starts a fresh session.
        """
        timeout = self.options.handshake_timeout if timeout is None else timeout
        with self._cond:
            self._check_open()
            self._await_links([self._start_link(address, timeout, None)])
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
        with self._cond:
            self._check_open()
            self._await_links([self._start_link(addresses[r], timeout, (r, len(addresses))) for r in need])
        return chosen

    def announce(self, request_id: str, pages: Mapping[str, Any], *,
                 peer: str | Sequence[str] | None = None) -> None:
        """Non-blocking: lease ``pages`` (pool -> destination pages) to ``request_id`` and tell prefill.

        Raises ``LeaseError`` before anything moves when a page is out of range, repeated, or held by a
        live lease, or the id is already live; ``PeerLost`` when not connected to every prefill rank the
        request needs. ``peer`` names the prefill (its address), or across TP sizes the prefill ranks (as
        ``connect_all`` returned them); needed only when connected to more than that. The request is DONE
        only when every one of those ranks' writes landed and verified.
        """
        with self._lock:
            self._check_open()
            links = pick_links(self._links, peer, self.memory.layout)
            old = self._records.get(request_id)
            if old is not None and old.is_live:
                raise LeaseError(f"request {request_id!r} is already live ({old.state.value})")
            gen = next(self._generations)
            leased = self._leases.acquire(gen, request_id, pages)
            rec = DecodeRequest(request_id, time.monotonic() + self.options.request_timeout, gen, links)
            self._remember(rec)
            self._by_gen[gen] = rec
            self._num_live += 1
            msg = wire.Announce(request_id, gen, wire.encode_pages(leased))
            self._call_soon(lambda: self._send_each(links, msg))

    def abort(self, request_id: str, reason: str = "aborted") -> None:
        """Non-blocking: fail the request now and tell every prefill rank writing it. Its pages stay leased
        until each confirms no write can land (or is known dead). No-op for a request already ended."""
        with self._lock:
            rec = self._record(request_id)
            assert isinstance(rec, DecodeRequest)
            if self._fail(rec, KVFerryError(f"aborted by decode: {reason}")):
                self._call_soon(lambda: self._abort_parts(rec, reason))

    @property
    def peers(self) -> list[str]:
        """Addresses of the prefills this decode is connected to."""
        with self._lock:
            return [a for a, link in self._links.items() if link.state == "established"]

    @property
    def num_live_leases(self) -> int:
        """Leases held, including those of failed requests waiting for their writes to settle."""
        with self._lock:
            return self._leases.num_leases

    def holds_lease(self, request_id: str) -> bool:
        """Whether ``request_id``'s destination pages are still leased: while True, a write may still land
        in them and the caller must not hand them to another request (a failed request keeps its lease
        until the writer confirms its handles settled, or the peer is dead and the grace period passed)."""
        with self._lock:
            rec = self._records.get(request_id)
            return rec is not None and self._leases.holds(rec.generation)

    @property
    def num_leased_pages(self) -> int:
        with self._lock:
            return self._leases.num_leased_pages

    def counters(self) -> dict[str, int]:
        """Leak-check figures: all zero on an idle endpoint (except bad/stray message counts)."""
        with self._lock:
            return {"live_requests": sum(r.is_live for r in self._by_gen.values()),
                    "live_leases": self._leases.num_leases, "leased_pages": self._leases.num_leased_pages,
                    "live_handles": 0, "peers": len(self.peers), "bad_messages": self.num_bad_messages,
                    "stray_notifications": self.num_stray_notifications}

    # -- connecting (caller's thread, under the lock) ---------------------------------------------------
    def _start_link(self, address: str, timeout: float, expect: tuple[int, int] | None) -> Link:
        """The established link to ``address``, or a fresh one whose handshake the progress thread starts."""
        old = self._links.get(address)
        if old is not None and old.state == "established":
            if expect is not None and (old.rank, old.tp_size) != expect:
                raise IncompatiblePeer(f"prefill {address} is rank {old.rank} of TP {old.tp_size}, "
                                       f"expected rank {expect[0]} of TP {expect[1]}")
            return old
        link = Link(address, time.monotonic() + timeout)
        link.expect = expect
        self._links[address] = link
        self._call_soon(lambda: self._open_link(link))
        return link

    def _await_links(self, links: list[Link]) -> None:
        """Wait (releasing the lock) until every handshake ended; raise the first failure."""
        for link in links:
            while link.state == "connecting":
                self._cond.wait(max(0.0, link.deadline - time.monotonic()) + 0.05)
        for link in links:
            if link.state != "established":
                raise link.error or PeerLost(f"prefill {link.address} went away during the handshake")

    # -- handshake (progress thread) -------------------------------------------------------------------
    def _open_link(self, link: Link) -> None:
        link.sock = self._new_socket(zmq.DEALER)
        link.sock.connect(link.address)
        self._poller.register(link.sock, zmq.POLLIN)
        self._by_sock[link.sock] = link
        hello = wire.Hello(link.session, self.memory.manifest(), self.transport.name, self.transport_metadata,
                           link.nonce, self.digest_mode, self.options.heartbeat_interval)
        link.hello = wire.encode(hello)
        self._send_raw(link, link.hello)

    def _on_handshake(self, link: Link, msg: Any) -> None:
        if isinstance(msg, wire.Reject):
            self._link_failed(link, IncompatiblePeer(f"prefill {link.address} refused: {msg.reason}"))
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
        problem = check_welcome(self.memory, self._secret, link, msg)
        if problem is not None:
            self._link_failed(link, problem)
            return
        try:
            link.agent = self.transport.add_peer(msg.transport_meta)
        except KVFerryError as exc:
            self._link_failed(link, HandshakeError(f"prefill {link.address}: bad transport metadata: {exc}"))
            return
        link.digest_mode = DigestMode.from_peer(msg.digest_mode)
        self._by_agent[link.agent] = link
        link.state = "established"
        self._changed = True

    def _link_failed(self, link: Link, error: KVFerryError) -> None:
        if link.state == "connecting":
            self._send(link, wire.Bye(str(error)[:wire.MAX_REASON_LEN]))
            link.error = error
            link.state = "failed"
            self._close_link(link)

    # -- messages (progress thread) --------------------------------------------------------------------
    def _on_frames(self, sock: Any, frames: list[bytes]) -> None:
        link = self._by_sock.get(sock)
        if link is None:
            return
        if len(frames) != 1:
            raise ProtocolError(f"expected one frame, got {len(frames)}")
        try:
            msg = wire.decode(frames[0])
        except ProtocolError as exc:
            if link.state == "connecting":  # e.g. another protocol version: refuse the peer, say why
                self._link_failed(link, IncompatiblePeer(f"prefill {link.address}: {exc}"))
            raise
        link.last_seen = time.monotonic()
        if link.state == "connecting":
            self._on_handshake(link, msg)
        elif link.state == "established":
            self._on_message(link, msg)

    def _on_message(self, link: Link, msg: Any) -> None:
        if isinstance(msg, wire.Heartbeat):
            return
        if isinstance(msg, wire.Ack):
            rec = self._lookup(link, msg.request_id, msg.generation)
            if rec is not None and rec.state is RequestState.BOOTSTRAPPING:
                self._set_state(rec, RequestState.WAITING_FOR_INPUT)
        elif isinstance(msg, wire.Fail):
            self._on_fail(link, msg)
        elif isinstance(msg, wire.Bye):
            self._link_dead(link, PeerLost(f"prefill {link.address} left: {msg.reason}"))
        else:
            raise ProtocolError(f"unexpected {type(msg).__name__} from prefill {link.address}")

    def _on_fail(self, link: Link, msg: wire.Fail) -> None:
        rec = self._lookup(link, msg.request_id, msg.generation)
        if rec is None:
            return
        part = rec.parts[link]
        part.told = True  # it failed the request itself: no Abort owed
        self._fail_req(rec, wire.error_from_wire(msg.error, msg.reason, f"prefill {link.address}"),
                       f"prefill rank {link.rank} ({link.address}) failed it")
        if msg.settled:  # this prefill has no write to these pages that can still land
            # Its chunk notifications sent before this message may still wait in the transport (ZMQ is
            # read first): take them now, or they would count as writes landing with no lease.
            self._pump()
            self._settle(rec, part)

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
        if self._fail(rec, error):
            self._abort_parts(rec, reason)

    def _abort_parts(self, rec: DecodeRequest, reason: str) -> None:
        msg = wire.Abort(rec.request_id, rec.generation, reason[:wire.MAX_REASON_LEN])
        for part in rec.parts.values():
            # A rank whose part completed is told too: it waits for our verdict, and would time out.
            if not part.told and part.link.state == "established":
                part.told = True
                self._send(part.link, msg)

    def _settle(self, rec: DecodeRequest, part: Part) -> None:
        """``part`` can write no more; the lease ends once every part of the request is settled."""
        if rec.settle(part):
            self._end_lease(rec)

    def _end_lease(self, rec: DecodeRequest) -> None:
        self._leases.release(rec.generation)
        self._by_gen.pop(rec.generation, None)
        self._changed = True

    # -- chunk notifications (progress thread) ---------------------------------------------------------
    def _pump(self) -> bool:
        notifications = self.transport.get_notifications()
        for agent, data in notifications:
            link = self._by_agent.get(agent)
            try:
                msg = wire.decode(data)
                if link is None or not isinstance(msg, wire.Chunk):
                    raise ProtocolError(f"unexpected notification from {agent!r}")
            except ProtocolError:
                self.num_bad_messages += 1
                continue
            self._on_chunk(link, msg)
        return bool(notifications)

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
        error = verify_chunk(self.memory, self.digest_mode, link, msg)
        if error is not None:
            self._reject_part(rec, part, error)
            return
        if rec.state is not RequestState.TRANSFERRING:
            self._set_state(rec, RequestState.TRANSFERRING)
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
        self._set_state(rec, RequestState.DONE)
        self._end_lease(rec)  # every chunk's notification arrived, so every write has landed
        for p in rec.parts.values():
            self._send(p.link, wire.Result(rec.request_id, rec.generation, True, ""))

    # -- timers (progress thread) ----------------------------------------------------------------------
    def _is_busy(self) -> bool:
        # Live requests wait for chunk notifications, which only polling the transport brings in.
        return self._num_live > 0

    def _set_state(self, rec: RequestRecord, state: RequestState) -> None:
        was_live = rec.is_live
        super()._set_state(rec, state)
        if was_live and not rec.is_live:
            self._num_live -= 1

    def _tick(self, now: float) -> None:
        for link in list(self._links.values()):
            self._tick_link(link, now)
        if now >= self._next_deadline_check:
            self._next_deadline_check = now + 0.01
            self._tick_requests(now)

    def _tick_link(self, link: Link, now: float) -> None:
        if link.state == "connecting" and now > link.deadline:
            self._link_failed(link, HandshakeError(f"no handshake answer from prefill {link.address} "
                                                   f"within the deadline"))
        elif link.state == "established":
            if now - link.last_seen > self.options.peer_timeout:
                self._link_dead(link, PeerLost(f"prefill {link.address} silent for "
                                               f"{now - link.last_seen:.2f} s (peer_timeout "
                                               f"{self.options.peer_timeout} s)"))
            elif now - link.last_sent >= self.options.heartbeat_interval:
                self._send(link, wire.Heartbeat())

    def _tick_requests(self, now: float) -> None:
        for rec in list(self._by_gen.values()):
            if rec.is_live and now > rec.deadline:
                self._fail_req(rec, TransferTimeout(f"request {rec.request_id!r} not done within "
                                                    f"{self.options.request_timeout} s"), "decode deadline passed")
            for part in list(rec.parts.values()):
                if not part.settled and part.release_at is not None and now >= part.release_at:
                    self._settle(rec, part)

    def _link_dead(self, link: Link, error: KVFerryError) -> None:
        """Fail the requests the link writes (and abort them on the other ranks writing them); keep each
        one's lease ``lease_grace`` longer (a write of the dead rank may still be landing)."""
        if link.state != "established":
            return
        link.state = "dead"
        release_at = time.monotonic() + self.options.lease_grace
        for rec in list(self._by_gen.values()):
            part = rec.parts.get(link)
            if part is not None and not part.settled:
                self._fail_req(rec, error, f"prefill rank {link.rank} ({link.address}) is lost")
                part.release_at = release_at
        self._close_link(link)
        self._by_agent.pop(link.agent, None)
        with contextlib.suppress(TransportError):  # the peer is gone either way
            self.transport.remove_peer(link.agent)
        self._changed = True

    # -- sockets (progress thread) ---------------------------------------------------------------------
    def _send_each(self, links: list[Link], msg: Any) -> None:
        for link in links:
            self._send(link, msg)

    def _send(self, link: Link, msg: Any) -> None:
        self._send_raw(link, wire.encode(msg))

    def _send_raw(self, link: Link, data: bytes) -> None:
        if link.sock is None:
            return
        link.sock.send(data, zmq.NOBLOCK)
        link.last_sent = time.monotonic()

    def _close_link(self, link: Link) -> None:
        if link.sock is not None:
            self._poller.unregister(link.sock)
            self._by_sock.pop(link.sock, None)
            link.sock.close(0)
            link.sock = None
        self._changed = True

    def _shutdown_step(self) -> bool:
        for rec in self._by_gen.values():
            self._fail_req(rec, KVFerryError("decode endpoint closing"), "decode closing")
        waiting = any(p.link.state == "established" and not p.settled
                      for r in self._by_gen.values() for p in r.parts.values())
        if waiting and time.monotonic() < self._close_deadline:
            return False
        for link in self._links.values():
            if link.state == "established":
                self._send(link, wire.Bye("decode closing"))
        return True

    def _close_sockets(self) -> None:
        for link in self._links.values():
            if link.sock is not None:
                link.sock.close(FLUSH_MS)  # let the last Result and Bye leave; bounded if the peer is gone
                link.sock = None

