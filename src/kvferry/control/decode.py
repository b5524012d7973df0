"""The decode endpoint: leases its pages to requests and learns when prefill's writes have landed.

Part of the control plane (layer 5). Decode connects to one or more prefill endpoints (a ZMQ DEALER per
prefill), announces each request with its destination pages (a lease), and reports ``DONE`` only after
every chunk's transport notification arrived (the transport delivers it after the chunk's bytes) and its
digests verified. A lease ends only when no write to its pages can still land: the request completed,
prefill confirmed its writes settled (``Fail(settled=True)``), or prefill is known dead and
``options.lease_grace`` has passed since.
"""

from __future__ import annotations

import contextlib
import hmac
import itertools
import secrets
import time
from collections.abc import Mapping
from typing import Any

import numpy as np
import zmq

from ..errors import (
    HandshakeError,
    IncompatiblePeer,
    IntegrityError,
    KVFerryError,
    LayoutError,
    LeaseError,
    PeerLost,
    TransferTimeout,
    TransportError,
)
from ..layout import shape_difference
from ..memory import KVMemory
from ..transport import Transport
from . import wire
from .endpoints import EndpointBase, EndpointOptions, RequestRecord, as_secret, auth_mac, integrity_module
from .leases import LeaseTable
from .states import RequestState

__all__ = ["DecodeEndpoint"]

S = RequestState


class _Link:
    """One prefill this decode talks to. ``state``: connecting -> established -> dead (or failed)."""

    def __init__(self, address: str, deadline: float) -> None:
        self.address = address
        self.sock: Any = None
        self.state = "connecting"
        self.error: KVFerryError | None = None
        self.deadline = deadline
        self.session = secrets.token_hex(16)
        self.nonce = secrets.token_bytes(32)
        self.hello = b""
        self.server_nonce: bytes | None = None
        self.agent = ""
        self.digest_mode = "off"
        self.last_seen = self.last_sent = time.monotonic()


class _DReq(RequestRecord):
    __slots__ = ("chunks_seen", "generation", "link", "num_chunks", "pages", "release_at")

    def __init__(self, request_id: str, deadline: float, generation: int, link: _Link,
                 pages: dict[str, np.ndarray]) -> None:
        super().__init__(request_id, S.BOOTSTRAPPING, deadline)
        self.generation = generation
        self.link = link
        self.pages = pages
        self.chunks_seen: set[int] = set()
        self.num_chunks: int | None = None
        self.release_at: float | None = None   # set when the writer died: lease ends then


class DecodeEndpoint(EndpointBase):
    """Decode side of kvferry. Construct, ``connect`` to prefill, then ``announce`` requests and ``wait``.

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
        self._links: dict[str, _Link] = {}
        self._by_sock: dict[Any, _Link] = {}
        self._by_agent: dict[str, _Link] = {}
        self._by_gen: dict[int, _DReq] = {}
        self._generations = itertools.count(1)
        self._next_deadline_check = 0.0
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
            old = self._links.get(address)
            if old is not None and old.state == "established":
                return address
            link = _Link(address, time.monotonic() + timeout)
            self._links[address] = link
            self._call_soon(lambda: self._open_link(link))
            while link.state == "connecting":
                self._cond.wait(max(0.0, link.deadline - time.monotonic()) + 0.05)
            if link.state != "established":
                assert link.error is not None
                raise link.error
            return address

    def announce(self, request_id: str, pages: Mapping[str, Any], *, peer: str | None = None) -> None:
        """Non-blocking: lease ``pages`` (pool -> destination pages) to ``request_id`` and tell prefill.

        Raises ``LeaseError`` before anything moves when a page is out of range, repeated, or held by a
        live lease, or the id is already live; ``PeerLost`` when not connected. ``peer`` names the prefill
        (its address), needed only when connected to several.
        """
        with self._lock:
            self._check_open()
            link = self._pick_link(peer)
            old = self._records.get(request_id)
            if old is not None and old.is_live:
                raise LeaseError(f"request {request_id!r} is already live ({old.state.value})")
            gen = next(self._generations)
            leased = self._leases.acquire(gen, request_id, pages)
            rec = _DReq(request_id, time.monotonic() + self.options.request_timeout, gen, link, leased)
            self._remember(rec)
            self._by_gen[gen] = rec
            msg = wire.Announce(request_id, gen, wire.encode_pages(leased))
            self._call_soon(lambda: self._send(link, msg))

    def abort(self, request_id: str, reason: str = "aborted") -> None:
        """Non-blocking: fail the request now and tell prefill. Its pages stay leased until prefill
        confirms no write can land (or is known dead). No-op for a request already ended."""
        with self._lock:
            rec = self._record(request_id)
            assert isinstance(rec, _DReq)
            if self._fail(rec, KVFerryError(f"aborted by decode: {reason}")):
                msg = wire.Abort(request_id, rec.generation, reason[:wire.MAX_REASON_LEN])
                self._call_soon(lambda: self._send(rec.link, msg))

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

    # -- handshake (progress thread) -------------------------------------------------------------------
    def _open_link(self, link: _Link) -> None:
        link.sock = self._new_socket(zmq.DEALER)
        link.sock.connect(link.address)
        self._poller.register(link.sock, zmq.POLLIN)
        self._by_sock[link.sock] = link
        hello = wire.Hello(link.session, self.memory.manifest(), self.transport.name, self.transport_metadata,
                           link.nonce, self.digest_mode, self.options.heartbeat_interval)
        link.hello = wire.encode(hello)
        self._send_raw(link, link.hello)

    def _on_handshake(self, link: _Link, msg: Any) -> None:
        if isinstance(msg, wire.Reject):
            self._link_failed(link, IncompatiblePeer(f"prefill {link.address} refused: {msg.reason}"))
        elif isinstance(msg, wire.Challenge):
            self._answer_challenge(link, msg)
        elif isinstance(msg, wire.Welcome):
            self._accept_welcome(link, msg)
        else:
            raise wire.ProtocolError(f"unexpected {type(msg).__name__} during the handshake")

    def _answer_challenge(self, link: _Link, msg: wire.Challenge) -> None:
        if self._secret is None:
            self._link_failed(link, IncompatiblePeer(f"prefill {link.address} requires a shared secret and "
                                                     "none is configured here"))
            return
        link.server_nonce = msg.nonce
        self._send(link, wire.Auth(auth_mac(self._secret, b"decode", msg.nonce, link.nonce, link.hello)))

    def _accept_welcome(self, link: _Link, msg: wire.Welcome) -> None:
        problem = self._check_welcome(link, msg)
        if problem is not None:
            self._link_failed(link, problem)
            return
        try:
            link.agent = self.transport.add_peer(msg.transport_meta)
        except KVFerryError as exc:
            self._link_failed(link, HandshakeError(f"prefill {link.address}: bad transport metadata: {exc}"))
            return
        link.digest_mode = msg.digest_mode
        self._by_agent[link.agent] = link
        link.state = "established"
        self._changed = True

    def _check_welcome(self, link: _Link, msg: wire.Welcome) -> KVFerryError | None:
        if self._secret is not None:
            nonce = link.server_nonce
            want = auth_mac(self._secret, b"prefill", link.nonce, nonce or b"", link.hello)
            if nonce is None or not hmac.compare_digest(msg.proof, want):
                return IncompatiblePeer(f"prefill {link.address} did not prove the shared secret")
        try:
            remote = KVMemory.from_manifest(msg.manifest)
        except LayoutError as exc:
            return HandshakeError(f"prefill {link.address} sent a bad manifest: {exc}")
        diff = shape_difference(self.memory.layout, remote.layout)
        if diff is not None:
            return IncompatiblePeer(f"prefill {link.address} has an incompatible layout: {diff}")
        return None

    def _link_failed(self, link: _Link, error: KVFerryError) -> None:
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
            raise wire.ProtocolError(f"expected one frame, got {len(frames)}")
        try:
            msg = wire.decode(frames[0])
        except wire.ProtocolError as exc:
            if link.state == "connecting":  # e.g. another protocol version: refuse the peer, say why
                self._link_failed(link, IncompatiblePeer(f"prefill {link.address}: {exc}"))
            raise
        link.last_seen = time.monotonic()
        if link.state == "connecting":
            self._on_handshake(link, msg)
        elif link.state == "established":
            self._on_message(link, msg)

    def _on_message(self, link: _Link, msg: Any) -> None:
        if isinstance(msg, wire.Heartbeat):
            return
        if isinstance(msg, wire.Ack):
            rec = self._lookup(link, msg.request_id, msg.generation)
            if rec is not None and rec.state is S.BOOTSTRAPPING:
                self._set_state(rec, S.WAITING_FOR_INPUT)
        elif isinstance(msg, wire.Fail):
            self._on_fail(link, msg)
        elif isinstance(msg, wire.Bye):
            self._link_dead(link, PeerLost(f"prefill {link.address} left: {msg.reason}"))
        else:
            raise wire.ProtocolError(f"unexpected {type(msg).__name__} from prefill {link.address}")

    def _on_fail(self, link: _Link, msg: wire.Fail) -> None:
        rec = self._lookup(link, msg.request_id, msg.generation)
        if rec is None:
            return
        self._fail(rec, wire.error_from_wire(msg.error, msg.reason, f"prefill {link.address}"))
        if msg.settled:  # prefill has no write to these pages that can still land
            self._end_lease(rec)

    def _lookup(self, link: _Link, request_id: str, generation: int) -> _DReq | None:
        """The record a message from ``link`` is about, or None (an ended request: a late Ack or a
        repeated Fail is normal)."""
        rec = self._by_gen.get(generation)
        if rec is None or rec.link is not link or rec.request_id != request_id:
            return None
        return rec

    def _end_lease(self, rec: _DReq) -> None:
        self._leases.release(rec.generation)
        self._by_gen.pop(rec.generation, None)
        self._changed = True

    # -- chunk notifications (progress thread) ---------------------------------------------------------
    def _pump(self) -> None:
        for agent, data in self.transport.get_notifications():
            link = self._by_agent.get(agent)
            try:
                msg = wire.decode(data)
                if link is None or not isinstance(msg, wire.Chunk):
                    raise wire.ProtocolError(f"unexpected notification from {agent!r}")
            except wire.ProtocolError:
                self.num_bad_messages += 1
                continue
            self._on_chunk(link, msg)

    def _on_chunk(self, link: _Link, msg: wire.Chunk) -> None:
        rec = self._lookup(link, msg.request_id, msg.generation)
        if rec is None:
            # A write landed for no lease we hold: a prefill bug (or a forged notification). Counted,
            # since the leak checks must see it.
            self.num_stray_notifications += 1
            return
        if msg.chunk in rec.chunks_seen:
            return
        rec.chunks_seen.add(msg.chunk)
        if msg.last:
            rec.num_chunks = msg.num_chunks
        if not rec.is_live:
            return  # failed while writes were in flight: the lease waits for prefill's settled Fail
        error = self._verify(link, msg)
        if error is not None:
            self._fail(rec, error)
            self._send(link, wire.Result(rec.request_id, rec.generation, False, str(error)[:wire.MAX_REASON_LEN]))
            return
        if rec.state is not S.TRANSFERRING:
            self._set_state(rec, S.TRANSFERRING)
        if rec.num_chunks is not None and len(rec.chunks_seen) >= rec.num_chunks:
            self._complete(link, rec)

    def _verify(self, link: _Link, msg: wire.Chunk) -> KVFerryError | None:
        if not msg.digests:
            if self.digest_mode == "off":
                return None
            return IntegrityError(f"chunk {msg.chunk} from prefill {link.address} carried no digests; this "
                                  f"decode requires {self.digest_mode!r}")
        try:
            integrity = integrity_module()
            integrity.verify_digests(self.memory, integrity.PageDigests.from_bytes(msg.digests))
        except KVFerryError as exc:
            return exc if isinstance(exc, IntegrityError) else IntegrityError(str(exc))
        except ImportError as exc:
            return IntegrityError(f"cannot verify digests: {exc}")
        except Exception as exc:  # untrusted digest bytes must not kill the progress thread
            return IntegrityError(f"malformed digests from prefill {link.address}: {exc!r}")
        return None

    def _complete(self, link: _Link, rec: _DReq) -> None:
        assert rec.num_chunks is not None
        if max(rec.chunks_seen) >= rec.num_chunks:
            err = IntegrityError(f"prefill {link.address} sent chunk {max(rec.chunks_seen)} of "
                                 f"{rec.num_chunks} for request {rec.request_id!r}")
            self._fail(rec, err)
            self._send(link, wire.Result(rec.request_id, rec.generation, False, str(err)))
            return
        self._set_state(rec, S.DONE)
        self._end_lease(rec)  # every chunk's notification arrived, so every write has landed
        self._send(link, wire.Result(rec.request_id, rec.generation, True, ""))

    # -- timers (progress thread) ----------------------------------------------------------------------
    def _is_busy(self) -> bool:
        return any(r.is_live for r in self._by_gen.values())

    def _tick(self, now: float) -> None:
        for link in list(self._links.values()):
            self._tick_link(link, now)
        if now >= self._next_deadline_check:
            self._next_deadline_check = now + 0.01
            self._tick_requests(now)

    def _tick_link(self, link: _Link, now: float) -> None:
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
                self._fail(rec, TransferTimeout(f"request {rec.request_id!r} not done within "
                                                f"{self.options.request_timeout} s"))
                self._send(rec.link, wire.Abort(rec.request_id, rec.generation, "decode deadline passed"))
            elif rec.release_at is not None and now >= rec.release_at:
                self._end_lease(rec)

    def _link_dead(self, link: _Link, error: KVFerryError) -> None:
        """Fail the link's requests; keep their leases ``lease_grace`` longer (writes may be landing)."""
        if link.state != "established":
            return
        link.state = "dead"
        release_at = time.monotonic() + self.options.lease_grace
        for rec in self._by_gen.values():
            if rec.link is link:
                self._fail(rec, error)
                rec.release_at = release_at
        self._close_link(link)
        self._by_agent.pop(link.agent, None)
        with contextlib.suppress(TransportError):  # the peer is gone either way
            self.transport.remove_peer(link.agent)
        self._changed = True

    # -- sockets (progress thread) ---------------------------------------------------------------------
    def _pick_link(self, peer: str | None) -> _Link:
        live = [link for link in self._links.values() if link.state == "established"]
        if peer is None:
            if len(live) == 1:
                return live[0]
            if not live:
                raise PeerLost("decode is not connected to any prefill")
            raise ValueError(f"connected to {len(live)} prefills: pass peer= (one of {[x.address for x in live]})")
        link = self._links.get(peer)
        if link is None or link.state != "established":
            raise PeerLost(f"not connected to prefill {peer!r}")
        return link

    def _send(self, link: _Link, msg: Any) -> None:
        self._send_raw(link, wire.encode(msg))

    def _send_raw(self, link: _Link, data: bytes) -> None:
        if link.sock is None:
            return
        link.sock.send(data, zmq.NOBLOCK)
        link.last_sent = time.monotonic()

    def _close_link(self, link: _Link) -> None:
        if link.sock is not None:
            self._poller.unregister(link.sock)
            self._by_sock.pop(link.sock, None)
            link.sock.close(0)
            link.sock = None
        self._changed = True

    def _shutdown_step(self) -> bool:
        for rec in self._by_gen.values():
            if self._fail(rec, KVFerryError("decode endpoint closing")):
                self._send(rec.link, wire.Abort(rec.request_id, rec.generation, "decode closing"))
        waiting = any(r.link.state == "established" for r in self._by_gen.values())
        if waiting and time.monotonic() < self._close_deadline:
            return False
        for link in self._links.values():
            if link.state == "established":
                self._send(link, wire.Bye("decode closing"))
        return True

    def _close_sockets(self) -> None:
        for link in self._links.values():
            if link.sock is not None:
                link.sock.close(0)
                link.sock = None

