"""Decode's protocol: links to prefills, leases, quarantine, chunk notifications, pull-mode reads decided.

Part of the protocol core (no I/O), above every other core module, below ``control.decode`` (its shell).
``DecodeCore`` is fed events, each with ``now``: the user's commands (``start_link``, ``give_up``,
``announce``, ``abort``, ``cancel``), a link's frame (``on_frame``), a link's connection dropped or its send
failed (``dropped``), a transport notification (``on_notification``), a transport peer added
(``peer_added``), a read's outcome (``start_read``, ``read_posted``, ``read_failed``, ``read_settled``), a
writer found gone or alive (``writer_checked``), the notifications drained (``notifications_taken``), frames
that left (``frame_sent``) and ticks (``tick``, ``check_silence``). It answers through ``core.base``'s
queues: messages, reads to post, and effects (``OpenLink``, ``CloseLink``, ``AddPeer``, ``RemovePeer``,
``CheckWriter``, ``TakeNotifications``, ``FlushNow``).

The protocol itself: decode connects to one or more prefills (a link each: Hello, an optional challenge,
Welcome), announces each request with its destination pages (a lease), and reports ``DONE`` only after
every chunk's transport notification arrived (the transport delivers it after the chunk's bytes) and its
digests verified. A lease ends only when no write to its pages can still land: the request completed,
prefill confirmed its writes settled (``Fail(settled=True)``), or prefill certainly cannot write any more
(the shell says so, answering ``CheckWriter``) and ``options.lease_grace`` has passed since. Until then a
failed request's pages are quarantined (``quarantine``); a prefill declared dead is asked to settle them
when decode reconnects to it (a recovery link: ``OpenLink``). In pull mode decode reads prefill's pages
itself (``pull_reads``): a read is accepted only while the link's fence holds, and a failed request's lease
ends once its own reads are terminal.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, cast

from kvferry.control import wire
from kvferry.control.core.admission import auth_mac, check_welcome
from kvferry.control.core.base import CoreBase, Effect, FlushNow, RemovePeer, RequestRecord, Transfer
from kvferry.control.core.decode_requests import DecodeRequest, Part
from kvferry.control.core.digests import verify_chunk
from kvferry.control.core.leases import LeaseTable
from kvferry.control.core.links import Link, pick_links
from kvferry.control.core.options import EndpointOptions
from kvferry.control.core.process import ProcessIdentity
from kvferry.control.core.pull_reads import Read, ReadJob, fenced, note_send, read_plan, welcome_pull
from kvferry.control.core.quarantine import Quarantine
from kvferry.control.core.states import LinkState, RequestState
from kvferry.control.core.timers import PeerClock
from kvferry.control.core.write_batch import Queued, group_cap, joinable, joined, write_groups
from kvferry.control.pull import is_mode_refusal
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
)
from kvferry.integrity import DigestMode
from kvferry.layout.memory import KVMemory

__all__ = ["RETRY_AFTER", "RETRY_MAX", "AddPeer", "CheckWriter", "CloseLink", "DecodeCore", "DecodeSetup",
           "OpenLink", "TakeNotifications"]

# connect_needed: a handshake that failed (not a refusal) is retried after RETRY_AFTER seconds, doubling with
# each failure in a row up to RETRY_MAX.
RETRY_AFTER = 1.0
RETRY_MAX = 30.0

DEADLINE_CHECK_S = 0.01     # how often request deadlines are looked at
QUARANTINE_CHECK_S = 0.05   # how often the writers of quarantined parts are asked about (/proc reads)


@dataclass(frozen=True, slots=True)
class OpenLink(Effect):
    """Open ``link``'s socket (a DEALER connected to ``link.address``, watched for drops) and send ``hello``
    on it as its first frame."""

    link: Link
    hello: bytes


@dataclass(frozen=True, slots=True)
class CloseLink(Effect):
    """Close ``link``'s socket now; what is still queued for it is dropped."""

    link: Link


@dataclass(frozen=True, slots=True)
class AddPeer(Effect):
    """Add prefill's transport agent (``meta``: its transport metadata from the Welcome); answer with
    ``DecodeCore.peer_added``."""

    link: Link
    meta: bytes


@dataclass(frozen=True, slots=True)
class CheckWriter(Effect):
    """Ask whether the prefill behind ``link`` certainly cannot write here any more (``link.agent``,
    ``link.process``); answer with ``DecodeCore.writer_checked``."""

    link: Link


@dataclass(frozen=True, slots=True)
class TakeNotifications(Effect):
    """Feed every transport notification already waiting (``on_notification``), then answer with
    ``DecodeCore.notifications_taken``: what a settled Fail waits for before it ends a lease."""


@dataclass(frozen=True, slots=True)
class DecodeSetup:
    """What the core must know of its shell: its transport and this process."""

    transport: str                 # the transport's name (prefill's must match)
    transport_metadata: bytes
    process: ProcessIdentity       # this process, reported in Hello
    secret: bytes | None


class DecodeCore(CoreBase):
    """Decode's side of the protocol. Mutated only by its shell, under the shell's lock."""

    role = "decode"

    def __init__(self, memory: KVMemory, setup: DecodeSetup, options: EndpointOptions, digest_mode: DigestMode,
                 stats: Any, entropy: Callable[[int], bytes]) -> None:
        super().__init__(options, stats, entropy)
        self.memory = memory
        self.setup = setup
        self.digest_mode = digest_mode
        self.leases = LeaseTable(memory.layout)
        self.links: dict[str, Link] = {}
        self.by_agent: dict[str, Link] = {}
        self.by_gen: dict[int, DecodeRequest] = {}
        self.quarantine = Quarantine()
        self.next_quarantine_check = 0.0
        self.generations = itertools.count(1)
        self.next_deadline_check = 0.0
        self.num_live = 0   # live records, kept by announce and set_state: the busy test is O(1)
        self.num_stray_notifications = 0
        self.reading: set[DecodeRequest] = set()   # pull mode: requests with reads in flight
        self.reads: dict[Any, list[tuple[DecodeRequest, Part, Read]]] = {}   # a posted read's ticket -> its parts
        self.to_settle: list[tuple[DecodeRequest, Part]] = []   # settled Fails waiting for the notifications
        # Links welcomed whose transport peer the shell is adding (AddPeer): the messages that came after
        # the Welcome in the same frame, handled once it is added (as if the link had been established).
        self.adding: dict[Link, list[Any]] = {}
        # connect_needed's memory of failed handshakes: addresses -> (retry at, the error, the back-off).
        self.refused: dict[tuple[str, ...], tuple[float, KVFerryError, float]] = {}

    # -- the user's commands -----------------------------------------------------------------------------
    def start_link(self, now: float, address: str, timeout: float, expect: tuple[int, int] | None,
                   mode: str) -> Link:
        """The established link to ``address``, or a fresh one whose handshake the next iteration starts."""
        self.now = now
        old = self.links.get(address)
        if old is not None and old.established and old.mode != mode:
            raise ModeMismatch(f"prefill {address} is connected in transfer mode {old.mode!r}, asked for {mode!r}")
        if old is not None and old.established:
            if expect is not None and (old.rank, old.tp_size) != expect:
                raise IncompatiblePeer(f"prefill {address} is rank {old.rank} of TP {old.tp_size}, "
                                       f"expected rank {expect[0]} of TP {expect[1]}")
            return old
        if old is not None and old.connecting:  # e.g. a recovery handshake: this one replaces it
            self.call_soon(lambda: self.link_failed(old, HandshakeError(f"prefill {address}: handshake "
                                                                         "superseded by a newer connect")))
        link = self.new_link(address, now + timeout)
        link.expect, link.mode = expect, mode
        self.links[address] = link
        self.call_soon(lambda: self.open_link(link))
        return link

    def new_link(self, address: str, deadline: float) -> Link:
        clock = PeerClock(self.now, self.options.heartbeat_interval, self.options.peer_timeout)
        return Link(address, deadline, clock, self.entropy(16).hex(), self.entropy(32))

    def give_up(self, now: float, links: list[Link], error: KVFerryError) -> None:
        """The caller's deadline passed with handshakes still open: fail them now, close them later."""
        self.now = now
        for link in links:
            if link.connecting:
                link.move(LinkState.FAILED)
                link.error = error
                self.call_soon(lambda x=link: self.close_link(x))

    @staticmethod
    def backoff_error(now: float, refused: tuple[float, KVFerryError, float] | None) -> KVFerryError | None:
        """``connect_needed``: the remembered failure (``refused``, from ``self.refused``) to raise again at
        once: a refusal always, another failure until its back-off passed; None to try again."""
        if refused is not None and (isinstance(refused[1], IncompatiblePeer) or now < refused[0]):
            return refused[1]
        return None

    def handshake_failed(self, now: float, key: tuple[str, ...], error: KVFerryError, retry_after: float,
                         before: tuple[float, KVFerryError, float] | None) -> None:
        """``connect_needed`` failed (not a refusal): raised again at once for a back-off, doubling."""
        wait = min(RETRY_MAX, retry_after if before is None else 2 * before[2])
        self.refused[key] = (now + wait, error, wait)

    def announce(self, now: float, request_id: str, pages: Mapping[str, Any], peer: str | Sequence[str] | None,
                 held: Any, bound: Sequence[Any]) -> None:
        """``DecodeEndpoint.announce`` past its checks: lease the pages and queue the Announce."""
        self.now = now
        links = pick_links(self.links, peer, self.memory.layout)
        old = self.records.get(request_id)
        if old is not None and old.is_live:
            raise LeaseError(f"request {request_id!r} is already live ({old.state.value})")
        gen = next(self.generations)
        leased = self.leases.acquire(gen, request_id, pages)
        rec = DecodeRequest(request_id, now + self.options.request_timeout, gen, links, self.options.lease_grace, now)
        self.remember(rec)
        self.by_gen[gen] = rec
        self.num_live += 1
        # Sent by the progress thread at the end of its next iteration (with the others of that iteration).
        data = wire.encode(wire.Announce(request_id, gen, wire.encode_pages(leased), held, *bound))
        for link in links:
            self.queue_out(link, data)
        self.wake_wanted = True

    def abort(self, now: float, request_id: str, reason: str) -> None:
        """Fail the request now; every prefill rank writing it is told on the next iteration."""
        self.now = now
        rec = cast(DecodeRequest, self.records[request_id])
        if self.fail(rec, RequestAborted(f"aborted by decode: {reason}")):
            self.call_soon(lambda: self.abort_parts(rec, reason))

    def cancel(self, now: float, request_id: str, reason: str, peer: str | Sequence[str] | None) -> None:
        """Tell prefill that this decode will never announce ``request_id``."""
        self.now = now
        links = pick_links(self.links, peer, self.memory.layout)
        old = self.records.get(request_id)
        if old is not None and old.is_live:
            raise LeaseError(f"request {request_id!r} is live here ({old.state.value}): abort it instead")
        data = wire.encode(wire.Cancel(request_id, reason[:wire.MAX_REASON_LEN]))
        for link in links:
            self.queue_out(link, data)
        self.wake_wanted = True

    # -- handshake -----------------------------------------------------------------------------------------
    def open_link(self, link: Link) -> None:
        """Ask the shell to open ``link``'s socket and send its Hello."""
        me, opts = self.setup.process, self.options
        hello = wire.Hello(link.session, self.memory.manifest(), self.setup.transport, self.setup.transport_metadata,
                           link.nonce, self.digest_mode, opts.heartbeat_interval, link.mode, opts.peer_timeout,
                           me.host, me.pid, me.started)
        link.hello = wire.encode(hello)
        self.effects.append(OpenLink(link, link.hello))

    def on_handshake(self, link: Link, msg: Any) -> None:
        if isinstance(msg, wire.Reject):
            error = ModeMismatch if is_mode_refusal(msg.reason) else IncompatiblePeer
            self.link_failed(link, error(f"prefill {link.address} refused: {msg.reason}"))
        elif isinstance(msg, wire.Bye):  # e.g. it dropped our half-open session: no use waiting
            self.link_failed(link, HandshakeError(f"prefill {link.address} ended the handshake: {msg.reason}"))
        elif isinstance(msg, wire.Challenge):
            self.answer_challenge(link, msg)
        elif isinstance(msg, wire.Welcome):
            self.accept_welcome(link, msg)
        else:
            raise ProtocolError(f"unexpected {type(msg).__name__} during the handshake")

    def answer_challenge(self, link: Link, msg: wire.Challenge) -> None:
        secret = self.setup.secret
        if secret is None:
            self.link_failed(link, IncompatiblePeer(f"prefill {link.address} requires a shared secret and "
                                                    "none is configured here"))
            return
        link.server_nonce = msg.nonce
        self.send(link, wire.Auth(auth_mac(secret, b"decode", msg.nonce, link.nonce, link.hello)))

    def accept_welcome(self, link: Link, msg: wire.Welcome) -> None:
        problem = check_welcome(self.memory, self.setup.secret, link, msg) or welcome_pull(self.options, link, msg)
        if problem is not None:
            self.link_failed(link, problem)
            return
        link.digest_mode = DigestMode.from_peer(msg.digest_mode)
        link.process = ProcessIdentity(msg.host, msg.pid, msg.started) if msg.pid else None
        self.adding[link] = []
        self.effects.append(AddPeer(link, msg.transport_meta))

    def peer_added(self, now: float, link: Link, agent: str | None, error: str | None) -> None:
        """The shell added prefill's transport agent (``agent``), or could not (``error``)."""
        self.now = now
        later = self.adding.pop(link, [])
        if agent is None:
            self.link_failed(link, HandshakeError(f"prefill {link.address}: bad transport metadata: {error}"))
            return
        if not link.connecting:   # failed meanwhile: nothing will use the agent
            self.effects.append(RemovePeer(agent))
            return
        link.agent = agent
        self.by_agent[agent] = link
        link.move(LinkState.ESTABLISHED)
        self.changed = True
        self.resettle(link)
        if later:
            self.on_batch(later, lambda m: self.on_link_msg(link, m))

    def resettle(self, link: Link) -> None:
        """``link`` reaches a prefill (same transport agent) this decode declared dead: ask it to settle
        every request of ours it may still be writing. The parts move to the new link, where the settled
        Fail arrives."""
        for rec in self.by_gen.values():
            for old, part in list(rec.parts.items()):
                if part.settled or old is link or old.established or old.agent != link.agent:
                    continue
                del rec.parts[old]
                part.link, part.told = link, True
                rec.parts[link] = part
                self.send(link, wire.Abort(rec.request_id, rec.generation,
                                           "decode declared this prefill dead: settle this generation"))

    def link_failed(self, link: Link, error: KVFerryError) -> None:
        """A handshake failed: what was queued for it leaves, then a Bye saying why, then it closes."""
        if link.connecting:
            link.error = error
            link.move(LinkState.FAILED)
            self.effects.append(FlushNow(link, wire.encode(wire.Bye(str(error)[:wire.MAX_REASON_LEN]))))
            self.close_link(link)

    def dropped(self, now: float, link: Link, why: str) -> None:
        """``link``'s connection dropped (the shell's monitor said so), or a send or receive on it failed."""
        self.now = now
        text = (f"prefill {link.address}: connection dropped ({why}): the prefill closed or crashed, or sent a "
                f"message above max_message_bytes={self.options.max_message_bytes} (libzmq drops such a "
                "connection without a word)")
        if link.connecting:
            self.link_failed(link, HandshakeError(f"{text}, during the handshake"))
        else:
            self.link_dead(link, PeerLost(text))

    def close_link(self, link: Link) -> None:
        self.effects.append(CloseLink(link))
        self.changed = True

    def fail_peers(self, error: KVFerryError) -> None:
        for link in self.links.values():
            if link.state in (LinkState.CONNECTING, LinkState.ESTABLISHED):
                link.move(LinkState.FAILED if link.connecting else LinkState.DEAD)
                link.error = error

    # -- frames --------------------------------------------------------------------------------------------
    def on_frame(self, now: float, link: Link, data: bytes) -> None:
        """One frame from ``link`` (``now``: when the poll that found it returned)."""
        self.now = now
        try:
            msg = wire.decode(data)
        except ProtocolError as exc:
            if link.connecting:  # e.g. another protocol version: refuse the peer, say why
                self.link_failed(link, IncompatiblePeer(f"prefill {link.address}: {exc}"))
            raise
        link.clock.heard(now)
        if isinstance(msg, wire.Batch):
            self.on_batch(wire.unbatch(msg), lambda m: self.on_link_msg(link, m))
        else:
            self.on_link_msg(link, msg)

    def on_link_msg(self, link: Link, msg: Any) -> None:
        """One message from ``link``, alone or out of a Batch (in order, each as if it had come alone: a
        link that failed or died earlier in the batch hears no more)."""
        later = self.adding.get(link)
        if later is not None:
            later.append(msg)
        elif link.connecting:
            self.on_handshake(link, msg)
        elif link.established:
            self.on_message(link, msg)

    def on_message(self, link: Link, msg: Any) -> None:
        if isinstance(msg, wire.Heartbeat):
            return
        if isinstance(msg, wire.Ack):
            rec = self.lookup(link, msg.request_id, msg.generation)
            if rec is not None and rec.state is RequestState.BOOTSTRAPPING:
                self.set_state(rec, RequestState.WAITING_FOR_INPUT)
        elif isinstance(msg, wire.Ready):
            self.on_ready(link, msg)
        elif isinstance(msg, wire.Fail):
            self.on_fail(link, msg)
        elif isinstance(msg, wire.Cancel):
            self.on_cancel(link, msg)
        elif isinstance(msg, wire.Bye):
            self.link_dead(link, PeerLost(f"prefill {link.address} left: {msg.reason}"))
        else:
            raise ProtocolError(f"unexpected {type(msg).__name__} from prefill {link.address}")

    def on_fail(self, link: Link, msg: wire.Fail) -> None:
        rec = self.lookup(link, msg.request_id, msg.generation)
        if rec is None:
            return
        part = rec.parts[link]
        error = wire.error_from_wire(msg.error, msg.reason, f"prefill {link.address}")
        reason = f"prefill rank {link.rank} ({link.address}) failed it"
        if link.mode == "pull":
            # Prefill failed it; our Abort (sent by fail_req) tells it we read no more, so it may release
            # its source pages. The lease ends once our own reads of it are terminal.
            self.fail_req(rec, error, reason)
            return
        part.told = True  # it failed the request itself: no Abort owed
        self.fail_req(rec, error, reason)
        if msg.settled:  # this prefill has no write to these pages that can still land
            # Its chunk notifications sent before this message may still wait in the transport (ZMQ is
            # read first): they are taken first, or they would count as writes landing with no lease.
            self.to_settle.append((rec, part))
            self.effects.append(TakeNotifications())

    def notifications_taken(self, now: float) -> None:
        """The notifications waiting when the settled Fails came are in: their parts settle now."""
        self.now = now
        to_settle, self.to_settle = self.to_settle, []
        for rec, part in to_settle:
            self.settle(rec, part)

    def on_cancel(self, link: Link, msg: wire.Cancel) -> None:
        """Prefill failed a request before any decode announced it: keep it FAILED here so ``poll`` says so
        now (nothing is leased for it). A request this decode already knows is left alone: one announced and
        live hears from prefill itself (its announce is refused), one ended ended on its own."""
        if msg.request_id in self.records:
            return
        rec = RequestRecord(msg.request_id, RequestState.BOOTSTRAPPING, self.now, self.now)
        self.remember(rec)
        self.num_live += 1   # set_state counts it out as it fails, as for an announced request
        self.fail(rec, RequestAborted(f"prefill {link.address}: {msg.reason}"))

    def lookup(self, link: Link, request_id: str, generation: int) -> DecodeRequest | None:
        """The record a message from ``link`` is about, or None (an ended request: a late Ack or a
        repeated Fail is normal)."""
        rec = self.by_gen.get(generation)
        if rec is None or link not in rec.parts or rec.request_id != request_id:
            return None
        return rec

    def send(self, link: Link, msg: Any) -> None:
        """Queue ``msg`` for ``link``; it leaves with this iteration's next flush."""
        self.queue_out(link, wire.encode(msg))

    def frame_sent(self, now: float, link: Link) -> None:
        """A frame of ours left for ``link`` at ``now``. In pull mode a pause in our messages beyond the
        fence (since the previous one) trips the link's fence first; then its clock advances."""
        note_send(link, now)
        link.clock.sent(now)

    # -- failing and settling --------------------------------------------------------------------------------
    def fail_req(self, rec: DecodeRequest, error: KVFerryError, reason: str) -> None:
        """Fail a live request and tell every prefill rank writing it that does not know yet to stop
        (each answers with a settled Fail, which ends its part of the lease)."""
        if self.fail(rec, error):
            self.abort_parts(rec, reason)

    def fail_closed(self, rec: RequestRecord, error: KVFerryError) -> None:
        if isinstance(rec, DecodeRequest):
            self.fail_req(rec, error, "decode internal error")
        else:   # a cancelled id's record: nothing leased, nobody to tell
            self.fail(rec, error)

    def abort_parts(self, rec: DecodeRequest, reason: str) -> None:
        msg = wire.Abort(rec.request_id, rec.generation, reason[:wire.MAX_REASON_LEN])
        for part in rec.parts.values():
            # A rank whose part completed is told too: it waits for our verdict, and would time out.
            if not part.told and part.link.established:
                part.told = True
                self.send(part.link, msg)

    def settle(self, rec: DecodeRequest, part: Part) -> None:
        """``part`` can write no more; the lease ends once every part of the request is settled."""
        if rec.settle(part):
            self.end_lease(rec)

    def end_lease(self, rec: DecodeRequest) -> None:
        self.quarantine.remove(rec.generation)
        self.leases.release(rec.generation)
        self.by_gen.pop(rec.generation, None)
        self.changed = True

    def set_state(self, rec: RequestRecord, state: RequestState) -> None:
        was_live = rec.is_live
        super().set_state(rec, state)
        if was_live and not rec.is_live:
            self.num_live -= 1
            if state is RequestState.FAILED and isinstance(rec, DecodeRequest):
                if any(p.link.mode == "pull" for p in rec.parts.values()):
                    self.pull_failed(rec)  # nobody else writes these pages: no quarantine
                    return
                # Failed with its lease held: a writer may still write it, so its pages are quarantined.
                pages = self.leases.num_pages(rec.generation)
                if pages:
                    self.quarantine.add(rec.generation, pages)

    # -- chunk notifications (push mode) -------------------------------------------------------------------
    def on_notification(self, now: float, agent: str, data: bytes) -> None:
        """A transport notification from ``agent``: a write's chunk (or a Batch of them) landed."""
        self.now = now
        link = self.by_agent.get(agent)
        try:
            msg = wire.decode(data)
            if link is None or not isinstance(msg, (wire.Chunk, wire.Batch)):
                raise ProtocolError(f"unexpected notification from {agent!r}")
        except ProtocolError:
            self.num_bad_messages += 1
            return
        if isinstance(msg, wire.Batch):   # one write carried several chunks (prefill's write_batch)
            self.on_batch(wire.unbatch(msg), lambda m: self.on_batched_chunk(link, m))
        else:
            self.on_chunk(link, msg)

    def on_batched_chunk(self, link: Link, msg: Any) -> None:
        if not isinstance(msg, wire.Chunk):
            raise ProtocolError(f"{type(msg).__name__} in the notification of a write from prefill {link.address}")
        self.on_chunk(link, msg)

    def on_chunk(self, link: Link, msg: wire.Chunk) -> None:
        rec = self.lookup(link, msg.request_id, msg.generation)
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
                self.settle(rec, part)
            return
        error = verify_chunk(self.memory, self.digest_mode, link, msg, self.recorder)
        if error is not None:
            self.reject_part(rec, part, error)
            return
        if rec.state is not RequestState.TRANSFERRING:
            self.set_state(rec, RequestState.TRANSFERRING)
        if part.is_complete:
            self.part_complete(rec, part)

    def reject_part(self, rec: DecodeRequest, part: Part, error: KVFerryError) -> None:
        """This rank's bytes did not check out: fail the request, tell it (Result), abort the others."""
        part.told = True
        self.fail_req(rec, error, f"prefill rank {part.link.rank} ({part.link.address}) sent bad bytes")
        self.send(part.link, wire.Result(rec.request_id, rec.generation, False, str(error)[:wire.MAX_REASON_LEN]))

    def part_complete(self, rec: DecodeRequest, part: Part) -> None:
        """Every chunk of one rank arrived and verified; the request is DONE once every rank's has."""
        assert part.num_chunks is not None
        if max(part.chunks_seen) >= part.num_chunks:
            self.reject_part(rec, part, IntegrityError(
                f"prefill {part.link.address} sent chunk {max(part.chunks_seen)} of {part.num_chunks} for "
                f"request {rec.request_id!r}"))
            return
        part.settled = True  # every write of this rank has landed
        if not all(p.is_complete for p in rec.parts.values()):
            return
        self.set_state(rec, RequestState.DONE)
        self.end_lease(rec)  # every chunk's notification arrived, so every write has landed
        for p in rec.parts.values():
            self.send(p.link, wire.Result(rec.request_id, rec.generation, True, ""))

    # -- pull mode: Ready -> read (pull_reads) ---------------------------------------------------------------
    def on_ready(self, link: Link, msg: wire.Ready) -> None:
        if link.mode != "pull":
            raise ProtocolError(f"Ready from prefill {link.address} on a push-mode link")
        rec = self.lookup(link, msg.request_id, msg.generation)
        if rec is None or not rec.is_live:
            return  # ended: prefill was answered (Result or Abort), or will release on the session's death
        part = rec.parts[link]
        if msg.chunk in part.chunks_seen or any(r.chunk.chunk == msg.chunk for r in part.reads):
            return
        if any(q.part is part and q.chunk.chunk == msg.chunk for q in self.batches.queued(link)):
            return
        if any(q.part is part and q.chunk.chunk == msg.chunk for t in self.transfers for q in t.group):
            return   # a repeat within one frame: its read is decided, not yet posted
        chunk = wire.Chunk(msg.request_id, msg.generation, msg.chunk, msg.last, msg.num_chunks, msg.digests)
        label = f"{rec.request_id}#{msg.chunk}"
        try:
            plan = read_plan(self.memory, self.leases, rec, link, msg)
            self.check_fence(rec, link)
        except KVFerryError as exc:
            self.read_refused(rec, part, exc)
            return
        queued = Queued(rec, plan, b"", label, part, chunk)
        if self.batches.wanted() and self.options.batch_chunks > 1 and joinable(plan):
            # Read once the messages of this iteration were read: with what else is ready from this prefill.
            part.posting = True
            self.batches.add(link, queued)
            return
        self.queue_transfer(link, [queued], [part])

    def check_fence(self, rec: DecodeRequest, link: Link) -> None:
        why = fenced(link, self.now)
        if why is not None:
            raise PeerLost(f"not reading request {rec.request_id!r}: {why}")

    def read_refused(self, rec: DecodeRequest, part: Part, exc: KVFerryError) -> None:
        self.reject_part(rec, part, exc)
        self.pull_failed(rec)   # again, harmlessly: an abort() during the failed post left the lease

    def post_batches(self) -> None:
        """Queue the reads batched in this iteration (``write_batch``): per prefill, those ready go as few
        reads as the caps allow (each checked again right before it is posted, ``start_read``)."""
        cap = group_cap(self.options.batch_chunks, self.num_live)
        for link, queued in self.batches.take():
            for group in write_groups(queued, cap, self.options.batch_bytes):
                self.queue_transfer(link, group, [q.part for q in group])

    def still_reading(self, q: Queued, link: Link) -> bool:
        rec, part = q.rec, q.part
        part.posting = False
        if not rec.is_live:
            self.pull_failed(rec)   # its lease ends once no read of it is in flight
            return False
        try:
            self.check_fence(rec, link)
        except KVFerryError as exc:
            self.read_refused(rec, part, exc)
            return False
        part.posting = True
        return True

    def start_read(self, now: float, transfer: Transfer) -> ReadJob | None:
        """The shell is about to post ``transfer``: check each part again (the lock was free since the
        decision: a request that failed, or a link whose fence tripped, is not read) and say what to post,
        or None. ``posting`` stays True on the parts in the job until the shell has posted it."""
        self.now = now
        link: Link = transfer.peer
        group = [q for q in transfer.group if self.still_reading(q, link)]
        if not group:
            return None
        plan, label = joined(group)
        return ReadJob(plan, link.agent, label, group, [q.part for q in group])

    def read_posted(self, job: ReadJob, ticket: Any) -> None:
        """The read is in flight: ``ticket`` names it until ``read_settled``."""
        entries = self.reads.setdefault(ticket, [])
        for q in job.group:
            read = Read(ticket, q.chunk)
            q.part.reads.append(read)
            entries.append((q.rec, q.part, read))
            self.reading.add(q.rec)

    def read_failed(self, now: float, job: ReadJob, error: KVFerryError) -> None:
        """The read could not be posted: every request in it fails (nothing of it is in flight)."""
        self.now = now
        for q in job.group:
            self.read_refused(q.rec, q.part, error)

    def read_settled(self, now: float, ticket: Any, error: KVFerryError | None) -> None:
        """The read ``ticket`` completed (``error`` None) or failed: accept its chunks (if the fence still
        holds at ``now``), and end the leases of failed requests with no read left in flight."""
        self.now = now
        recs: dict[DecodeRequest, None] = {}
        for rec, part, read in self.reads.pop(ticket, ()):
            part.reads.remove(read)
            recs[rec] = None
            if rec.is_live:
                self.read_done(rec, part, read.chunk, error)
        for rec in recs:
            if not any(p.reads for p in rec.parts.values()):
                self.reading.discard(rec)
                if not rec.is_live:
                    self.end_lease(rec)  # its own reads are terminal: nothing else writes these pages

    def read_done(self, rec: DecodeRequest, part: Part, chunk: wire.Chunk, error: KVFerryError | None) -> None:
        link = part.link
        why = fenced(link, self.now)
        if error is None and why is not None:
            self.fail_req(rec, PeerLost(f"read of request {rec.request_id!r} not accepted: {why}"),
                          f"prefill rank {link.rank} ({link.address}): read not accepted")
            return
        if error is None:
            error = verify_chunk(self.memory, self.digest_mode, link, chunk, self.recorder)
        if error is not None:
            self.reject_part(rec, part, error)
            return
        part.see(chunk)
        if rec.state is not RequestState.TRANSFERRING:
            self.set_state(rec, RequestState.TRANSFERRING)
        if part.is_complete:
            self.part_complete(rec, part)

    def pull_failed(self, rec: DecodeRequest) -> None:
        """A pull request failed: no writer but us, so every part is settled, and the lease ends once our
        own reads of it are terminal (now, when none is in flight)."""
        for part in rec.parts.values():
            part.settled = True
        if not any(p.reads or p.posting for p in rec.parts.values()):
            self.end_lease(rec)

    def num_reads(self) -> int:
        """Reads in flight, one per part in each (a leak check: 0 when idle)."""
        return sum(len(p.reads) for rec in self.reading for p in rec.parts.values())

    def check_pull_links(self, now: float) -> None:
        """Before an iteration reads anything: a pull link whose fence tripped (our own stall) dies now,
        so that frames queued meanwhile cannot start reads on it."""
        for link in list(self.links.values()):
            if link.mode == "pull" and link.established:
                why = fenced(link, now)
                if why is not None and link.expired:
                    self.link_dead(link, PeerLost(why))

    # -- timers --------------------------------------------------------------------------------------------
    def num_waiting(self) -> int:
        # Live requests wait for chunk notifications, which only polling the transport brings in.
        return self.num_live + len(self.reading)

    def connected(self) -> bool | None:
        """What ``PeerClock.peer_lost`` is told of an established link's connection: True with
        ``transport_liveness`` (a connection still standing has answered libzmq's heartbeats within
        ``peer_timeout``; a dropped one has already ended the link), None without (silence decides)."""
        return True if self.options.transport_liveness else None

    def tick(self, now: float) -> None:
        self.now = now
        for link in list(self.links.values()):
            self.tick_link(link, now)
        if now >= self.next_deadline_check:
            self.next_deadline_check = now + DEADLINE_CHECK_S
            self.tick_requests(now)

    def tick_link(self, link: Link, now: float) -> None:
        if link.connecting and now > link.deadline:
            self.link_failed(link, HandshakeError(
                f"no handshake answer from prefill {link.address} within the deadline (if something answers "
                f"at that address, its answer may exceed max_message_bytes={self.options.max_message_bytes})"))
        elif not link.established:
            return
        elif link.clock.peer_lost(now, self.connected()):
            self.link_dead(link, PeerLost(f"prefill {link.address} silent for {link.clock.silent_for(now):.2f} s "
                                          f"(peer_timeout {self.options.peer_timeout} s)"))
        elif link.clock.heartbeat_due(now):
            self.send(link, wire.Heartbeat())

    def check_silence(self, now: float) -> None:
        """Push mode: nothing before reading (decode posts no writes, so frames queued during its own stall
        can only make it talk to a prefill that dropped it, which answers with Bye). Pull mode: a link whose
        fence tripped (this process stalled) dies before frames queued meanwhile can start reads on it."""
        self.now = now
        self.check_pull_links(now)

    def tick_requests(self, now: float) -> None:
        for rec in list(self.by_gen.values()):
            if rec.is_live and now > rec.deadline:
                self.fail_req(rec, TransferTimeout(f"request {rec.request_id!r} not done within "
                                                   f"{self.options.request_timeout} s"), "decode deadline passed")
        if self.quarantine.num_leases and now >= self.next_quarantine_check:
            self.next_quarantine_check = now + QUARANTINE_CHECK_S
            self.check_quarantine(now)

    def check_quarantine(self, now: float) -> None:
        """A part whose link is gone leaves quarantine ``lease_grace`` after its writer is certainly gone
        (the shell answers ``CheckWriter``); while it may still write, decode keeps reconnecting to it to ask
        for its acknowledgement (``writer_checked``)."""
        ask: dict[Link, None] = {}
        for rec in list(self.by_gen.values()):
            for part in list(rec.parts.values()):
                link = part.link
                if part.settled or link.established:
                    continue
                if part.grace.needs_check:
                    ask[link] = None
                elif part.grace.due(now):
                    self.settle(rec, part)
        self.effects.extend(CheckWriter(link) for link in ask)

    def writer_checked(self, now: float, link: Link, gone: bool) -> None:
        """The shell's answer to ``CheckWriter``: whether the prefill behind ``link`` certainly cannot write
        any more. Gone: its quarantined parts leave ``lease_grace`` from now. Otherwise decode reconnects to
        it (``recover``) to ask for its acknowledgement."""
        self.now = now
        if not gone:
            if not self.closing:
                self.recover(link, now)
            return
        for rec in list(self.by_gen.values()):
            part = rec.parts.get(link)
            if part is not None and not part.settled and not link.established:
                part.grace.writer_gone(now)

    def recover(self, dead: Link, now: float) -> None:
        """Handshake again with the prefill behind ``dead`` (every ``peer_timeout`` while none is open): a
        stalled prefill that resumed then settles what decode quarantined (``resettle``), and serves
        again. Only an acknowledgement or a certain death frees pages a live writer may still reach."""
        current = self.links.get(dead.address)
        if now < dead.retry_at or (current is not None and (current.connecting or current.established)):
            return
        dead.retry_at = now + self.options.peer_timeout
        link = self.new_link(dead.address, now + self.options.handshake_timeout)
        link.expect = (dead.rank, dead.tp_size)
        link.mode = dead.mode
        self.links[dead.address] = link
        self.open_link(link)

    def next_deadline(self) -> float:
        """The earliest ``now`` at which ``tick`` may decide something with no other event in between."""
        times = []
        for link in self.links.values():
            if link.connecting:
                times.append(math.nextafter(link.deadline, math.inf))
            elif link.established:
                times.append(link.clock.next_deadline(self.now))
        live = [rec.deadline for rec in self.by_gen.values() if rec.is_live]
        if live:
            times.append(max(min(live), self.next_deadline_check))
        if self.quarantine.num_leases:   # looked at with the request deadlines (tick_requests)
            times.append(max(self.next_quarantine_check, self.next_deadline_check))
        return min(times, default=math.inf)

    def link_dead(self, link: Link, error: KVFerryError) -> None:
        """Fail the requests the link writes (and abort them on the other ranks writing them). Their
        pages stay quarantined until that prefill settles them (after a reconnect) or is certainly gone."""
        if not link.established:
            return
        link.move(LinkState.DEAD)
        link.error = error
        for rec in list(self.by_gen.values()):
            part = rec.parts.get(link)
            if part is not None and not part.settled:
                self.fail_req(rec, error, f"prefill rank {link.rank} ({link.address}) is lost")
        self.close_link(link)
        if self.by_agent.get(link.agent) is link:
            self.by_agent.pop(link.agent)
        self.effects.append(RemovePeer(link.agent))   # the peer is gone either way
        self.changed = True

    def shutdown_step(self, now: float, give_up: bool) -> bool:
        self.now = now
        for rec in list(self.by_gen.values()):  # a pull request's lease may end as it fails
            self.fail_req(rec, KVFerryError("decode endpoint closing"), "decode closing")
        waiting = any(p.link.established and not p.settled
                      for r in self.by_gen.values() for p in r.parts.values())
        if waiting and not give_up:
            return False
        for link in self.links.values():
            if link.established:
                self.send(link, wire.Bye("decode closing"))
        return True

    # -- what the shell's queries read ---------------------------------------------------------------------
    def done_pages(self, rec: RequestRecord) -> Mapping[str, Any]:
        # Called as the request turns DONE, before its lease ends: the leased pages are what moved.
        return self.leases.pages(cast(DecodeRequest, rec).generation)

    def gauges(self) -> dict[str, int]:
        return {"live_requests": self.num_live, "leases": self.leases.num_leases,
                "leased_pages": self.leases.num_leased_pages, "quarantined_pages": self.quarantine.num_pages,
                "peers": sum(link.established for link in list(self.links.values()))}
