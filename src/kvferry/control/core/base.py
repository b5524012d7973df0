"""What both sides' protocol cores share: request records, their states, and the actions a decision returns.

Part of the protocol core (no I/O), above ``states``, ``timers`` and ``options``, below ``core.prefill``. A
core is fed events by its endpoint (the shell: ``control.endpoints``), each carrying ``now``, and answers
with *actions*, which it queues and the shell carries out once the event is handled:

* ``outbox``: encoded messages per peer, sent as ``wire.Batch`` frames at the end of the iteration;
* ``transfers``: writes (prefill) or reads (decode, pull mode) decided on, posted between events, their
  outcome fed back as an event (``posted``, ``post_failed``, ``settled``);
* ``effects``: everything else that touches the world (``Effect`` subclasses below): send a peer's queue
  now, add or remove a transport peer, ask whether a process is gone.

The core never calls back into the shell: it has no lock, socket, thread, clock or random source (the
shell passes ``entropy``, a function returning n random bytes). ``changed`` says waiters may want to look
again; ``wake_wanted`` says a caller's command left work for the progress loop.
"""

from __future__ import annotations

import logging
from collections import OrderedDict, deque
from collections.abc import Callable, Mapping, Sized
from dataclasses import dataclass
from typing import Any

from kvferry.control.core.options import EndpointOptions
from kvferry.control.core.states import TERMINAL, RequestState, advance
from kvferry.control.core.write_batch import WriteBatches
from kvferry.errors import InternalError, KVFerryError

__all__ = ["MAX_FINISHED", "AddPeer", "CheckProcess", "CoreBase", "Effect", "FlushNow", "RemovePeer", "RequestRecord",
           "Transfer"]

log = logging.getLogger("kvferry.control")

# Terminal records kept so poll/wait can still answer after the fact; the oldest are forgotten first.
MAX_FINISHED = 1 << 16


@dataclass(frozen=True, slots=True)
class Transfer:
    """A transfer a decision queued, carried out between events: to which peer (prefill's session, decode's
    link), the chunks it carries (``write_batch.Queued``), and what counts it in flight (``posting``: the
    records, or the parts)."""

    peer: Any
    group: list[Any]
    holders: tuple[Any, ...]


class Effect:
    """An action other than a message or a transfer, carried out by the shell in the order queued."""

    __slots__ = ()


@dataclass(frozen=True, slots=True)
class FlushNow(Effect):
    """Send what is queued for ``peer`` now (not at the iteration's end), then ``raw`` alone if any (a
    Reject or a Bye that any protocol version must read)."""

    peer: Any
    raw: bytes = b""


@dataclass(frozen=True, slots=True)
class AddPeer(Effect):
    """Add the peer's transport agent (``meta``: its transport metadata from the handshake); the shell
    answers with the core's ``peer_added`` (the agent's name, or why not)."""

    peer: Any
    meta: bytes


@dataclass(frozen=True, slots=True)
class RemovePeer(Effect):
    """Forget a transport peer (no transfer to it is in flight)."""

    agent: str


@dataclass(frozen=True, slots=True)
class CheckProcess(Effect):
    """Ask whether ``process`` (a ``ProcessIdentity``) is certainly gone on this host; answer with the
    core's ``process_gone`` when it is."""

    process: Any


class RequestRecord:
    """Fields both sides keep per request. Mutated only by the core (under the shell's lock); the shell's
    ``poll`` and ``wait`` read single fields without it."""

    __slots__ = ("deadline", "ended_at", "error", "request_id", "started_at", "state")

    def __init__(self, request_id: str, state: RequestState, deadline: float, now: float) -> None:
        self.request_id = request_id
        self.state = state
        self.deadline = deadline
        self.error: KVFerryError | None = None
        self.started_at = now
        self.ended_at: float | None = None

    @property
    def is_live(self) -> bool:
        return self.state not in TERMINAL


class CoreBase:
    """Records, their states and the action queues. Subclasses implement the protocol."""

    role = "endpoint"

    def __init__(self, options: EndpointOptions, stats: Any, entropy: Callable[[int], bytes]) -> None:
        self.options = options
        self.recorder = stats       # control.stats' recorder (an observer: it decides nothing)
        self.entropy = entropy
        self.now = 0.0              # the time of the event being handled
        self.records: OrderedDict[str, RequestRecord] = OrderedDict()   # newest incarnation per id
        # Ids that ended, in order, for the shell's ``ended``; bounded as the records are (MAX_FINISHED).
        self.ended_ids: deque[str] = deque()
        self.calls: list[Callable[[], None]] = []      # decisions deferred to the loop's next iteration
        self.outbox: dict[Any, list[bytes]] = {}       # peer -> encoded messages
        self.transfers: deque[Transfer] = deque()
        self.effects: deque[Effect] = deque()
        # Chunks ready in this iteration, posted together (write_batch); the loop moves it on.
        self.batches = WriteBatches()
        self.changed = False
        self.wake_wanted = False
        self.closing = False
        self.num_bad_messages = 0
        self.num_internal_errors = 0   # kvferry bugs caught in the act (InternalError): 0 unless one is

    # -- records -----------------------------------------------------------------------------------------
    def remember(self, rec: RequestRecord) -> None:
        self.records[rec.request_id] = rec
        self.records.move_to_end(rec.request_id)
        while len(self.records) > MAX_FINISHED:
            oldest = next(iter(self.records.values()))
            if oldest.is_live:
                break
            self.records.popitem(last=False)

    def set_state(self, rec: RequestRecord, state: RequestState) -> None:
        try:
            rec.state = advance(rec.state, state, rec.request_id)
        except InternalError as exc:
            self.internal_error(rec, exc)
            raise
        if state in TERMINAL:  # only endings wake waiters: waking them on every step costs the GIL
            rec.ended_at = self.now
            if state is RequestState.DONE:
                self.recorder.request_done(rec.ended_at - rec.started_at, self.done_pages(rec))
            else:
                self.recorder.request_failed(rec.error)
            self.changed = True
            if self.records.get(rec.request_id) is rec:   # the record poll/wait see
                self.ended_ids.append(rec.request_id)
                if len(self.ended_ids) > MAX_FINISHED:
                    self.ended_ids.popleft()

    def internal_error(self, rec: RequestRecord, error: InternalError) -> None:
        """A kvferry bug caught in the act (``error``: an illegal transition of ``rec``): fail ``rec`` closed
        (with ``error`` as its reason) and say so at ERROR; the caller re-raises, so the decision that asked
        for the transition goes no further."""
        self.num_internal_errors += 1
        log.error("%s: internal error on request %r (state %s): %s", self.role, rec.request_id,
                  rec.state.value, error)
        if rec.is_live:
            self.fail_closed(rec, error)

    def fail_closed(self, rec: RequestRecord, error: KVFerryError) -> None:
        """Fail ``rec`` the way this side fails a request on its own (telling the peer what it must know)."""
        self.fail(rec, error)

    def fail(self, rec: RequestRecord, error: KVFerryError) -> bool:
        """Fail a live request (first reason wins); False when it had already ended."""
        if not rec.is_live:
            return False
        rec.error = error
        self.set_state(rec, RequestState.FAILED)
        return True

    # -- actions -----------------------------------------------------------------------------------------
    def call_soon(self, fn: Callable[[], None]) -> None:
        """Decide ``fn`` on the loop's next iteration (``run_calls``), not inside the caller's command."""
        self.calls.append(fn)
        self.wake_wanted = True

    def run_calls(self, now: float) -> list[Callable[[], None]]:
        """The deferred decisions, taken off the queue: the shell runs each as an event of its own."""
        self.now = now
        calls, self.calls = self.calls, []
        return calls

    def queue_out(self, peer: Any, data: bytes) -> None:
        """Queue an encoded message for ``peer``; it leaves with the shell's next flush."""
        out = self.outbox.get(peer)
        if out is None:
            self.outbox[peer] = [data]
        else:
            out.append(data)

    def take_out(self, peer: Any) -> list[bytes]:
        """Everything queued for ``peer``, taken off the queue (to be sent at once, or dropped)."""
        return self.outbox.pop(peer, [])

    def queue_transfer(self, peer: Any, group: list[Any], holders: tuple[Any, ...] | list[Any]) -> None:
        """A decision's transfer, carried out once the event is handled. ``posting`` is True from now on
        each of ``holders`` (the records or parts it carries): what would end a lease or a hold counts it as
        a transfer in flight."""
        for holder in holders:
            holder.posting = True
        self.transfers.append(Transfer(peer, group, tuple(holders)))

    def on_batch(self, messages: list[Any], handle: Callable[[Any], None]) -> None:
        """``handle`` each message of one frame in order; a bad one is counted and dropped, not the rest."""
        for msg in messages:
            try:
                if isinstance(msg, KVFerryError):
                    raise msg
                handle(msg)
            except InternalError as exc:   # our bug, not the peer's: loud, and the loop goes on
                self.log_internal(exc)
            except KVFerryError as exc:
                self.num_bad_messages += 1
                log.debug("%s: dropped a message: %s", self.role, exc)

    def log_internal(self, error: InternalError) -> None:
        """An ``InternalError`` reached the message loop: the records it touched already failed closed
        (``internal_error``); it is never counted as the peer's bad message."""
        log.error("%s: internal error while handling a message (the requests it touched failed): %s",
                  self.role, error)

    # -- protocol hooks ----------------------------------------------------------------------------------
    def num_waiting(self) -> int:
        """How many requests the loop polls for: while any, it spins rather than block in its idle poll."""
        raise NotImplementedError

    def done_pages(self, rec: RequestRecord) -> Mapping[str, Sized]:
        """A request turning DONE: the pages it moved here (pool -> page array), for ``stats``."""
        return {}

    def gauges(self) -> dict[str, int]:
        """``EndpointStats``' current figures. Any thread, without the lock: reads only values a single
        load gives (lengths, plain ints), never iterates a container the progress thread changes."""
        return {}

    def post_queued(self) -> None:
        """Queue the transfers batched by what just ran (the calls, or the messages read): the chunks ready
        for one peer go together (``write_batch``)."""
        if self.batches:
            self.post_batches()

    def post_batches(self) -> None:
        raise NotImplementedError

    def tick(self, now: float) -> None:
        raise NotImplementedError

    def check_silence(self, now: float) -> None:
        """Before this iteration reads: judge the peers that must have declared us dead (our own stall)."""
        raise NotImplementedError

    def fail_peers(self, error: KVFerryError) -> None:
        """The loop stopped: every peer (link, session) fails with ``error``; nothing is sent."""
        raise NotImplementedError

    def crashed(self, now: float, error: KVFerryError) -> None:
        """The loop stopped: nothing queued will be carried out; every request and peer fails."""
        self.now = now
        for transfer in self.transfers:   # never posted: nothing of them is in flight
            for holder in transfer.holders:
                holder.posting = False
        self.transfers.clear()
        for rec in list(self.records.values()):
            self.fail(rec, error)
        self.fail_peers(error)

    def shutdown_step(self, now: float, give_up: bool) -> bool:
        """Advance shutdown; True once the loop may exit (``give_up``: the close deadline passed)."""
        raise NotImplementedError
