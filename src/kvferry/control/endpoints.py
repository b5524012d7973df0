"""What prefill and decode endpoints share: options, the progress thread, waiting, counters.

Part of the control plane, above ``states`` and the transports, below ``prefill`` and ``decode``. Each
endpoint runs exactly one progress thread. It alone touches the ZMQ sockets and the transport (neither is
thread-safe; NIXL also needs the receiving side to call ``get_notifications`` regularly, which this thread
does). Public methods may be called from any thread: they take the endpoint's lock, change request records,
queue what must be sent, and wake the thread. The thread holds that lock while it decides, and never lets it
go inside a decision: handling an event (a caller's call, a peer's frame, the batches of an iteration) only
*queues* the transfers it decides on (prefill's writes, decode's pull-mode reads), each record counting as
a transfer in flight from then on (``posting``). Between two events the thread carries them out
(``_between_events``) with the lock let go (on one host the transport copies inside the call, with the GIL
released, so callers proceed alongside it), then takes the lock again and feeds each outcome back: a handle
recorded, or the post's failure failing its records. Each queued transfer is checked again right before it
is posted (the request still live and current), since the lock was free meanwhile.

Blocking calls (``wait``, ``connect``, ``close``) are bounded by their own deadline whatever the thread does:
they wait on a separate, briefly held signal (not on the endpoint's lock, which a stalled thread may hold)
and take the endpoint's lock only with a timeout. The thread cannot die silently: a socket or transport
error is handled where it happens (a failed send fails that peer, not the loop), and if the loop still
stops, every request and every link fails at once with ``EndpointClosed``, the cause chained.

The thread polls ZMQ with a timeout when nothing is in flight, and spins with a short sleep while a
write or a notification is outstanding (NIXL notifications wake no file descriptor; a ZMQ message or a
caller's call ends the sleep at once). The sleep starts at
``busy_poll`` and doubles with each idle spin up to ``busy_poll_max``: most of a spinning thread's CPU
is the wake-up itself, and under load (many requests in flight, where latency is queueing) a spin that
finds several notifications at once costs less than several spins that find one each. From
``LAZY_WAKE_MIN`` requests in flight the loop is *under load*: it sleeps a quarter of ``busy_poll`` per
request in flight (up to ``busy_poll_max``) whether or not the last spin found work, and a caller's call
no longer wakes it (it comes round within that sleep). A request behind n others already waits about
n service times; the sleep adds a few per cent of that, and the wake-ups it saves were most of decode's
CPU (issue 13, bench/RESULTS.md, "sixth round").

Messages to a peer are queued during an iteration and leave at its end (``_flush``), before its
transfers for what its calls and the messages it read produced, and every 2 ms within a long run of
pull-mode reads (``_publish``, which also wakes the waiters then): several for one peer go as one
``wire.Batch``, so under load libzmq's I/O thread is woken once per iteration and peer, not once per
request. Each side's clocks of "what the peer heard from us" (heartbeats, prefill's check before a write,
decode's pull-mode fence) advance when a frame actually leaves, never when a message was queued. (Holding
decode's verdicts back for company, up to 500 us, was tried: it made p50 no better in
``bench/control.py`` and only delays prefill's DONE.)
"""

from __future__ import annotations

import contextlib
import logging
import os
import secrets
import select
import threading
import time
from collections.abc import Callable, Sequence
from typing import Any, TypeVar

import zmq

from kvferry.control import wire
from kvferry.control.core.base import CoreBase, Effect, FlushNow, RequestRecord, Transfer
from kvferry.control.core.options import EndpointOptions
from kvferry.control.core.states import RequestState
from kvferry.control.stats import EndpointStats, NullRecorder, StatsRecorder
from kvferry.errors import (
    EndpointClosed,
    InternalError,
    KVFerryError,
    RequestFailed,
    TransferTimeout,
    TransportError,
    UsageError,
)
from kvferry.integrity import DigestMode
from kvferry.layout.memory import KVMemory
from kvferry.transport import Transport, make_transport

__all__ = ["EndpointOptions"]

T = TypeVar("T")

# On close, queued control messages (a final Result, Fail or Bye) get this long to leave; without it a
# peer can lose the verdict of a request that this side had finished, and fail it.
FLUSH_MS = 500

log = logging.getLogger("kvferry.control")

# Requests in flight from which the progress loop is under load (see the module doc): it sleeps
# LOAD_POLL_SHARE of busy_poll per request in flight after every iteration, and a caller's call no longer
# wakes it. The call waits one such sleep at most, a few per cent of the latency of a request queued
# behind this many.
LAZY_WAKE_MIN = 8
LOAD_POLL_SHARE = 0.25


class EndpointBase:
    """The shell: progress thread, lock, sockets, transport, clock, ``wait``/``poll``. The protocol is the
    core's (``self.core``, a ``core.base.CoreBase``); subclasses connect the two."""

    _role = "endpoint"

    def __init__(self, memory: KVMemory, transport: str | Transport, *, digest_mode: Any,
                 options: EndpointOptions | None) -> None:
        if memory.remote:
            raise UsageError("an endpoint needs this process's own memory, not a peer's manifest")
        self.memory = memory
        self.options = options or EndpointOptions()
        self.digest_mode = DigestMode.parse(digest_mode)
        self._owns_transport = isinstance(transport, str)
        self.transport: Transport = make_transport(transport) if isinstance(transport, str) else transport
        self.transport_metadata = self.transport.register(memory)
        # Re-entrant only so that a test may hold it across public calls (to queue work while the progress
        # thread waits); no public method calls another under it.
        self._lock = threading.RLock()
        self._stats = (StatsRecorder if self.options.stats else NullRecorder)(self._role, memory.layout)
        self.core: CoreBase = self._make_core()
        self._wake_pending = False   # a byte is in the wake pipe that the thread has not drained yet
        self._close_deadline = 0.0
        self._crashed: BaseException | None = None
        # Waiters sleep on this, not on a condition of the endpoint's lock: re-acquiring it after a wake-up would
        # block for as long as a stalled progress thread holds it. ``_version`` counts the thread's news.
        self._signal = threading.Condition(threading.Lock())
        self._version = 0
        # When the current iteration's poll returned: what frames read in it are stamped with (see _step).
        self._recv_time = time.monotonic()
        self._published_at = self._recv_time   # when waiters last heard of this thread's news (_publish)
        self._ctx = zmq.Context()
        self._poller = zmq.Poller()
        self._wake_r, self._wake_w = os.pipe()
        os.set_blocking(self._wake_r, False)
        os.set_blocking(self._wake_w, False)
        self._poller.register(self._wake_r, zmq.POLLIN)
        # The last iteration found work in flight: the next comes within busy_poll_max (see _wake).
        self._spinning = False
        self._idle_spins = 0   # busy iterations in a row that found nothing to do (sets the sleep)
        self._thread = threading.Thread(target=self._run, name=f"kvferry-{self._role}", daemon=True)

    def _make_core(self) -> CoreBase:
        raise NotImplementedError

    @property
    def num_bad_messages(self) -> int:
        """Frames (and, on decode, notifications) dropped as malformed or unexpected: the peer's fault."""
        return self.core.num_bad_messages

    @property
    def num_internal_errors(self) -> int:
        """kvferry bugs caught in the act (``InternalError``): 0 unless one is."""
        return self.core.num_internal_errors

    # -- public: any thread ----------------------------------------------------------------------------
    # poll, timing, failure and wait's answer for a request that has ended read the record without the
    # endpoint's lock. The progress thread holds that lock for a whole iteration (all but its copies: see
    # PrefillEndpoint._carry_out, DecodeEndpoint._carry_out), so a caller asking about many requests
    # would block behind it once per question. Each field is one attribute the core assigns in a single
    # store (the error before the state, the state before the end time), so an unlocked read sees a value
    # the record had, never a torn one; a state read a moment stale is what a locked read returns a moment later too.
    def poll(self, request_id: str) -> RequestState:
        """Non-blocking, lock-free: the request's state. ``UsageError`` for an id this endpoint does not know."""
        return self._record(request_id).state

    def timing(self, request_id: str) -> tuple[float, float | None]:
        """Non-blocking, lock-free: ``time.monotonic()`` when this side learned of the request and when it
        ended (None while live; set after the state turned terminal). For latency metrics."""
        rec = self._record(request_id)
        return rec.started_at, rec.ended_at

    def stats(self) -> EndpointStats:
        """Non-blocking, lock-free, any thread: this endpoint's running totals and current figures since it
        started (``control.stats``: never reset; take differences of two snapshots for an interval)."""
        return self._stats.snapshot(**self.core.gauges())

    def failure(self, request_id: str) -> KVFerryError | None:
        """Non-blocking, lock-free: why the request failed (None unless it is ``FAILED``)."""
        return self._record(request_id).error

    def wait(self, request_id: str, timeout: float) -> None:
        """Block until the request is ``DONE`` (returns) or ``FAILED`` (raises ``RequestFailed``, its
        ``__cause__`` the specific error: ``PeerLost``, ``TransferTimeout``, ``IntegrityError``...).

        Raises ``TransferTimeout`` when ``timeout`` seconds pass first; the request itself goes on (its own
        deadline is ``options.request_timeout``). ``UsageError`` for an unknown id. Reads the record without
        the endpoint's lock (see above), so it never queues behind the progress thread's iteration.
        """
        rec = self._record(request_id)
        if not rec.is_live:
            self._raise_if_failed(rec)
            return
        deadline = time.monotonic() + timeout
        seen: list[RequestRecord] = []

        def ended() -> bool:
            seen[:] = [self._record(request_id)]
            return not seen[0].is_live

        # Without the lock, as poll does (see above): a waiter woken by the progress thread need not then
        # queue behind that thread's next iteration to read one field.
        if not self._wait_for(ended, deadline, locked=False):
            state = seen[0].state.value if seen else "unknown"
            raise TransferTimeout(f"{self._role}: request {request_id!r} still {state} "
                                  f"after waiting {timeout:.3f} s")
        self._raise_if_failed(seen[0])

    def ended(self, timeout: float = 0.0) -> list[str]:
        """Ids of the requests that ended (DONE or FAILED) since the previous call, in the order they
        ended; waits up to ``timeout`` seconds while there is none (returns ``[]`` then).

        For an engine's step loop: one call per step, rather than one ``poll`` per live request, and one
        wake-up however many ended. The record starts with the endpoint (the first call lists every request
        that ended before it). Each id is returned once, to whichever caller takes it;
        at most ``MAX_FINISHED`` (65,536) wait to be taken, the oldest dropped first, as the records
        themselves are forgotten. Lock-free, as ``poll``; raises ``EndpointClosed`` when the progress
        thread has died.
        """
        queue = self.core.ended_ids
        if not queue and timeout > 0:
            self._wait_for(lambda: bool(queue), time.monotonic() + timeout, locked=False)
        out: list[str] = []
        with contextlib.suppress(IndexError):   # another caller took the last one meanwhile
            while queue:
                out.append(queue.popleft())
        return out

    @staticmethod
    def _raise_if_failed(rec: RequestRecord) -> None:
        if rec.state is RequestState.FAILED:
            err = rec.error
            raise RequestFailed(rec.request_id, str(err) if err is not None else "failed") from err

    @property
    def num_live_requests(self) -> int:
        """Requests not yet DONE or FAILED on this side (a leak check: 0 when idle)."""
        with self._lock:
            return sum(1 for r in self.core.records.values() if r.is_live)

    def close(self, timeout: float = 5.0) -> None:
        """Fail what is live, let the peer settle, say goodbye, stop the thread. Idempotent, blocking:
        returns within ``timeout`` plus 2 s (the last messages' flush) whatever the thread does."""
        # Bounded even when a stalled progress thread holds the lock: then the flag is set without it
        # (a plain store; the thread reads it on its next iteration).
        got = self._lock.acquire(timeout=timeout)
        try:
            if self.core.closing:
                return
            self.core.closing = True
            self._close_deadline = time.monotonic() + timeout
        finally:
            if got:
                self._lock.release()
        self._wake(force=True)   # maybe without the lock: do not trust the flag
        self._thread.join(timeout + 2.0)
        if self._thread.is_alive():
            # Stuck (a stalled backend call): closing the transport or terminating the ZMQ context under
            # it could crash or block without bound. Leave them to the process; the thread is a daemon.
            log.warning("%s: progress thread still running after close(timeout=%s); resources left open",
                        self._role, timeout)
            return
        self._release_resources()

    def _release_resources(self) -> None:
        """Close what the constructor opened: the transport (if created here), the ZMQ context, the wake
        pipe. After the thread stopped, or from a constructor that failed before starting it."""
        if self._owns_transport:
            self.transport.close()
        self._ctx.term()
        os.close(self._wake_r)
        os.close(self._wake_w)

    def __enter__(self) -> Any:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # -- helpers for subclasses ------------------------------------------------------------------------
    @staticmethod
    def _entropy(n: int) -> bytes:
        """The core's random source (session ids, nonces): the OS's."""
        return secrets.token_bytes(n)

    def _done_with_call(self) -> None:
        """After a caller's command ran on the core (under the lock): wake the loop if it left work."""
        if self.core.wake_wanted:
            self.core.wake_wanted = False
            self._wake()

    def _wait_for(self, done: Callable[[], bool], deadline: float, *, locked: bool = True) -> bool:
        """Block until ``done()`` (run under the lock, or without it when ``locked`` is False: a ``done``
        that reads single fields, as ``wait`` does) is true: True; or until ``deadline``: False.

        Bounded by ``deadline`` alone: the lock is taken with a timeout, the sleep is on ``_signal``.
        Raises ``EndpointClosed`` (cause chained) once the progress thread has died, and whatever
        ``done`` raises. No wake-up is lost either way: the version is read before ``done`` looks, and the
        thread bumps it after every change it reports (``_notify``)."""
        while True:
            with self._signal:
                version = self._version
            if locked and not self._lock.acquire(timeout=max(0.0, deadline - time.monotonic())):
                return False
            try:
                if done():  # first: a crash failed every record and link, each with its own answer
                    return True
                self._raise_if_crashed()
            finally:
                if locked:
                    self._lock.release()
            with self._signal:
                while self._version == version:
                    left = deadline - time.monotonic()
                    if left <= 0:
                        return False
                    self._signal.wait(left)

    def _notify(self) -> None:
        """Wake every waiter (``_wait_for``): something they may be waiting for changed."""
        with self._signal:
            self._version += 1
            self._signal.notify_all()

    def _raise_if_crashed(self) -> None:
        if self._crashed is not None:
            raise EndpointClosed(f"{self._role} progress loop stopped: {self._crashed!r}") from self._crashed

    def _record(self, request_id: str) -> RequestRecord:
        rec = self.core.records.get(request_id)
        if rec is None:
            raise UsageError(f"{self._role}: unknown request {request_id!r}")
        return rec

    def _check_open(self) -> None:
        self._raise_if_crashed()
        if self.core.closing:
            raise EndpointClosed(f"{self._role} endpoint is closed")

    def _wake(self, *, force: bool = False) -> None:
        # One byte until the thread drains the pipe: more would wake it no sooner (callers hold the lock,
        # and the thread clears the flag under it). A full pipe means the thread wakes anyway; a closed
        # one means we are shutting down.
        if self._wake_pending and not force:
            return
        # Under load the thread is spinning and comes round within its busy sleep anyway; a wake per
        # request would cost a context switch and an iteration each (issue 13: most of decode's CPU).
        if not force and self._spinning and self.core.num_waiting() >= LAZY_WAKE_MIN:
            return
        self._wake_pending = True
        with contextlib.suppress(BlockingIOError, OSError):
            os.write(self._wake_w, b"x")

    def _flush(self) -> None:
        """Send every message the core queued, per peer in order, several as ``wire.Batch`` frames."""
        outbox = self.core.outbox
        if not outbox:
            return
        for peer in list(outbox):
            for frame in wire.batches(self.core.take_out(peer)):
                self._send_frame(peer, frame)

    def _flush_peer(self, peer: Any, raw: bytes = b"") -> None:
        """``FlushNow``: what is queued for ``peer`` leaves now, then ``raw`` alone (if any)."""
        for frame in wire.batches(self.core.take_out(peer)):
            self._send_frame(peer, frame)
        if raw:
            self._send_raw_frame(peer, raw)

    def _between_events(self) -> None:
        """Carry out what the last event decided, in order (progress thread, holding the lock once: the
        iteration's): its effects, then its transfers. ``_carry_out`` posts each with the lock let go
        (``_unlocked``) and feeds the outcome back to the core."""
        core = self.core
        while core.effects or core.transfers:
            while core.effects:
                self._apply(core.effects.popleft())
            if core.transfers:
                self._carry_out(core.transfers.popleft())

    def _apply(self, effect: Effect) -> None:
        """Carry out one of the core's effects (``core.base``)."""
        if isinstance(effect, FlushNow):
            self._flush_peer(effect.peer, effect.raw)
        else:
            raise InternalError(f"{self._role}: no shell for the effect {effect!r}")

    def _settle_handles(self, handles: dict[Any, Any], settled: Callable[[float, Any, KVFerryError | None], None]
                        ) -> bool:
        """Poll each transfer in ``handles`` (the shell's; the core knows each by its handle as a ticket);
        release each that ended and tell the core (``settled(now, handle, error)``). True when one ended."""
        now = time.monotonic()
        news = False
        for handle in list(handles):
            error: KVFerryError | None = None
            try:
                if not handle.poll():
                    continue
            except TransportError as exc:
                error = exc
            handle.release()
            del handles[handle]
            news = True
            settled(now, handle, error)
        return news

    def _unlocked(self, holders: Sequence[Any], post: Callable[[], T]) -> T:
        """Run ``post`` (a transport call that may copy for hundreds of microseconds with the GIL released)
        with the endpoint's lock let go, so that callers proceed alongside it; ``posting`` stays True on
        ``holders`` until the lock is back. Only from ``_carry_out``, between events: no decision is in
        progress, so nothing a caller changes meanwhile is half-decided."""
        self._lock.release()
        try:
            return post()
        finally:
            self._lock.acquire()
            for holder in holders:
                holder.posting = False

    def _publish(self) -> None:
        """Mid-iteration (progress thread, under the lock): send what is queued and wake the waiters now,
        rather than at the end of an iteration that still has copies to run."""
        self._published_at = time.monotonic()
        self._flush()
        if self.core.changed:
            self.core.changed = False
            self._notify()

    def _new_socket(self, kind: int) -> zmq.Socket:
        sock = self._ctx.socket(kind)
        sock.setsockopt(zmq.LINGER, 0)
        # libzmq enforces the cap before a byte of the message is buffered (receiving it first and
        # checking after would let any peer make us allocate what it likes), but it does so by dropping
        # the connection without a word; decode watches its connections (a socket monitor) and fails the
        # link at once with an error naming this limit as the likely cause.
        sock.setsockopt(zmq.MAXMSGSIZE, self.options.max_message_bytes)
        # No send high-water mark: control messages are small and must not be dropped; a dead peer's
        # queue is bounded by peer_timeout, after which its socket is closed.
        sock.setsockopt(zmq.SNDHWM, 0)
        if self.options.transport_liveness:
            # ZMTP PING/PONG, answered by libzmq's I/O thread (no GIL): a silent connection is dropped only
            # when the peer's process cannot answer at all (stopped, gone, cut off), never when it is slow.
            opts = self.options
            sock.setsockopt(zmq.HEARTBEAT_IVL, max(1, int(opts.heartbeat_interval * 1000)))
            sock.setsockopt(zmq.HEARTBEAT_TIMEOUT, max(1, int(opts.peer_timeout * 1000)))
            sock.setsockopt(zmq.HEARTBEAT_TTL, max(100, int(opts.peer_timeout * 1000)))
        return sock

    # -- the progress thread ---------------------------------------------------------------------------
    def _run(self) -> None:
        try:
            while True:
                with self._lock:
                    if self.core.closing and self._shutdown_step():
                        self._flush()
                        break
                self._step()
        except BaseException as exc:  # fail closed: a dead progress thread fails every request and link
            log.exception("%s progress loop stopped", self._role)
            self._crash(exc)
        finally:
            with contextlib.suppress(zmq.ZMQError, OSError):
                self._close_sockets()

    def _shutdown_step(self) -> bool:
        now = time.monotonic()
        done = self.core.shutdown_step(now, now >= self._close_deadline)
        self._between_events()
        return done

    def _crash(self, exc: BaseException) -> None:
        error = EndpointClosed(f"{self._role} progress loop stopped: {exc!r}")
        error.__cause__ = exc
        with self._lock:
            self._crashed = exc
            self.core.crashed(time.monotonic(), error)
        self._notify()

    def _step(self) -> None:
        core = self.core
        with self._lock:
            busy = core.num_waiting() > 0 or bool(core.calls) or bool(core.outbox)
            self._spinning = busy
            timeout_ms = 0 if busy else self._idle_timeout_ms()
        events = dict(self._poller.poll(timeout_ms))
        with self._lock:
            # Frames read in this iteration are stamped with the time the poll returned, and peers are
            # checked before any is read: frames that queued up while this process stalled must not make
            # a peer that has declared us dead look alive.
            self._recv_time = time.monotonic()
            core.check_silence(self._recv_time)
            self._between_events()
            if events.pop(self._wake_r, None):
                self._wake_pending = False   # under the lock, before draining: a later _wake writes again
                self._drain_wake()
            calls = core.run_calls(self._recv_time)
            for fn in calls:
                try:
                    fn()
                finally:
                    self._between_events()
            core.post_queued()
            self._between_events()
            self._flush()   # what the calls queued (decode's Announces) leaves before the reads below run
            for sock in events:
                self._drain_socket(sock)
            core.post_queued()
            self._between_events()
            # What the messages just read produced leaves before this iteration's transfers too: the peer
            # can start on it while they run.
            self._flush()
            if self._pump() or events or calls:
                self._idle_spins = 0
            self._between_events()
            core.batches.next_iteration()
            core.tick(time.monotonic())
            self._between_events()
            self._flush()
            self._published_at = time.monotonic()
            changed, core.changed = core.changed, False
            core.wake_wanted = False
        if changed:
            self._notify()
        if busy and not events:
            self._busy_wait()

    def _busy_wait(self) -> None:
        """Sleep between busy iterations: ``busy_poll`` after one that found work, doubling while idle up
        to ``busy_poll_max``. A caller's call (the wake pipe) or a ZMQ message ends it early.

        ``zmq_poll`` counts its timeout in whole milliseconds, too coarse here, so this sleeps in
        ``select`` on each socket's ``zmq.FD`` beside the wake pipe. That descriptor is edge-triggered (it
        signals a change, not "a message is waiting"), so a socket whose ``zmq.EVENTS`` already shows one
        is not slept on at all: the next iteration reads it."""
        opts = self.options
        # A lone request is polled every busy_poll (its latency is the whole cost); many share longer
        # sleeps, each wake finding several of them (their CPU is the cost, and their latency is queueing).
        waiting = self.core.num_waiting()
        if waiting >= LAZY_WAKE_MIN:
            delay = min(opts.busy_poll_max, opts.busy_poll * LOAD_POLL_SHARE * waiting)
        else:
            cap = min(opts.busy_poll_max, opts.busy_poll * waiting)
            delay = min(opts.busy_poll * (1 << self._idle_spins), max(opts.busy_poll, cap))
        self._idle_spins = min(self._idle_spins + 1, 16)
        fds = [self._wake_r]
        try:
            for sock, _ in self._poller.sockets:
                if isinstance(sock, zmq.Socket):
                    if sock.getsockopt(zmq.EVENTS) & zmq.POLLIN:
                        return
                    fds.append(sock.getsockopt(zmq.FD))
        except zmq.ZMQError:   # a socket closed under us: the next iteration deals with it
            return
        with contextlib.suppress(OSError, ValueError):  # the pipe closed under us: we are shutting down
            select.select(fds, [], [], delay)

    def _drain_wake(self) -> None:
        try:
            while os.read(self._wake_r, 4096):
                pass
        except BlockingIOError:
            pass

    def _drain_socket(self, sock: Any) -> None:
        for _ in range(256):  # bounded, so one chatty peer cannot starve the rest of the loop
            if sock.closed:   # a message just handled closed it (a peer said Bye)
                return
            try:
                frames = sock.recv_multipart(zmq.NOBLOCK, copy=True)
            except zmq.Again:
                return
            except zmq.ZMQError as exc:  # this socket is broken: its peer fails, the loop goes on
                self._socket_failed(sock, exc)
                return
            try:
                self._on_frames(sock, frames)
            except InternalError as exc:
                self.core.log_internal(exc)
            except KVFerryError as exc:
                self.core.num_bad_messages += 1
                log.debug("%s: dropped a message: %s", self._role, exc)
            self._between_events()   # what the frame decided, even if a later message of it was bad

    def _idle_timeout_ms(self) -> int:
        # Wake often enough for heartbeats and deadlines; never sleep past half a heartbeat.
        return max(1, int(self.options.heartbeat_interval * 1000 / 4))

    # -- shell hooks (progress thread, under the lock) -------------------------------------------------
    def _on_frames(self, sock: Any, frames: list[bytes]) -> None:
        """Frames read from ``sock``: fed to the core as an event (``self._recv_time`` its ``now``)."""
        raise NotImplementedError

    def _carry_out(self, transfer: Transfer) -> None:
        """Post one transfer the core queued, between events; feed back its outcome."""
        raise NotImplementedError

    def _pump(self) -> bool:
        """Drive the transport and feed what it brought to the core; True when there was news."""
        raise NotImplementedError

    def _socket_failed(self, sock: Any, exc: zmq.ZMQError) -> None:
        """A receive on ``sock`` raised: fail what it serves."""
        raise NotImplementedError

    def _send_frame(self, peer: Any, frame: bytes) -> None:
        """Send one frame (a message or a Batch) to ``peer`` now, as ``_flush`` does; never raises."""
        raise NotImplementedError

    def _send_raw_frame(self, peer: Any, data: bytes) -> None:
        """Send ``data`` alone to ``peer`` now (a Reject, a Bye), outside any batch; never raises."""
        raise NotImplementedError

    def _close_sockets(self) -> None:
        raise NotImplementedError
