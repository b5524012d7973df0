"""What prefill and decode endpoints share: options, the progress thread, waiting, counters.

Part of the control plane, above ``states``, the transports and the shell's pieces (``pacing``, ``waiters``,
``sockets``, ``actions``), below ``prefill`` and ``decode``. Each endpoint runs exactly one progress thread.
It alone touches the ZMQ sockets and the transport (neither is thread-safe; NIXL also needs the receiving
side to call ``get_notifications`` regularly, which this thread does). Public methods may be called from any
thread: they take the endpoint's lock, change request records, queue what must be sent, and wake the thread.
The thread holds that lock while it decides, and never lets it go inside a decision: handling an event (a
caller's call, a peer's frame, the batches of an iteration) only *queues* the transfers it decides on
(prefill's writes, decode's pull-mode reads), each record counting as a transfer in flight from then on
(``posting``). Between two events the thread carries them out (``actions.ActionRunner.run``) with the lock
let go (on one host the transport copies inside the call, with the GIL released, so callers proceed
alongside it), then takes the lock again and feeds each outcome back: a handle recorded, or the post's
failure failing its records. Each queued transfer is checked again right before it is posted (the request
still live and current), since the lock was free meanwhile.

Blocking calls (``wait``, ``connect``, ``close``) are bounded by their own deadline whatever the thread does:
they wait on a separate, briefly held signal (``waiters``; not on the endpoint's lock, which a stalled
thread may hold) and take the endpoint's lock only with a timeout. The thread cannot die silently: a socket
or transport error is handled where it happens (a failed send fails that peer, not the loop), and if the
loop still stops, every request and every link fails at once with ``EndpointClosed``, the cause chained.

The thread polls ZMQ with a timeout when nothing is in flight, and spins with a short sleep while a
write or a notification is outstanding; how long it sleeps, and when a caller's call wakes it, is the
``pacing.Pacer``'s (its module doc says why).

Messages to a peer are queued during an iteration and leave at its end (``ActionRunner.flush``), before its
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
import secrets
import threading
import time
from typing import Any

import zmq

from kvferry.control.actions import ActionRunner
from kvferry.control.core.base import CoreBase, Effect, RequestRecord, Transfer
from kvferry.control.core.options import EndpointOptions
from kvferry.control.core.states import RequestState
from kvferry.control.pacing import Pacer
from kvferry.control.sockets import Port, Sockets
from kvferry.control.stats import EndpointStats, NullRecorder, StatsRecorder
from kvferry.control.waiters import Waiters
from kvferry.errors import EndpointClosed, InternalError, KVFerryError, RequestFailed, TransferTimeout, UsageError
from kvferry.integrity import DigestMode
from kvferry.layout.memory import KVMemory
from kvferry.transport import Transport, make_transport

__all__ = ["EndpointOptions"]

log = logging.getLogger("kvferry.control")


def entropy(n: int) -> bytes:
    """The cores' random source (session ids, nonces): the OS's."""
    return secrets.token_bytes(n)


def raise_if_failed(rec: RequestRecord) -> None:
    """``RequestFailed`` (its ``__cause__`` the record's error) when ``rec`` ended ``FAILED``."""
    if rec.state is RequestState.FAILED:
        err = rec.error
        raise RequestFailed(rec.request_id, str(err) if err is not None else "failed") from err


class EndpointBase:
    """The shell: progress thread, lock, transport, clock, ``wait``/``poll``. The protocol is the core's
    (``self.core``, a ``core.base.CoreBase``); subclasses connect the two. Its pieces: the loop's pacing
    (``self._pacer``), the waiters (``self._waiters``), the ZMQ context and poller (``self._sockets``), the
    side's sockets (``self._port``, made by ``_make_port``) and the between-events runner (``self._actions``)."""

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
        self._close_deadline = 0.0
        self._waiters = Waiters(self._role, self._lock)
        # When the current iteration's poll returned: what frames read in it are stamped with (see _step).
        self._recv_time = time.monotonic()
        self._published_at = self._recv_time   # when waiters last heard of this thread's news (_publish)
        self._sockets = Sockets(self.options)
        self._pacer = Pacer(self.options, self._sockets.poller, self.core.num_waiting)
        try:
            self._port: Port = self._make_port()
        except BaseException:
            self._release_resources()   # the thread never started: nothing else would close them
            raise
        self._actions = ActionRunner(self.core, self._lock, self._port, self._apply, self._carry_out)
        self._thread = threading.Thread(target=self._run, name=f"kvferry-{self._role}", daemon=True)

    def _make_core(self) -> CoreBase:
        raise NotImplementedError

    def _make_port(self) -> Port:
        """This side's sockets (constructor, before the thread starts; ``self.core`` exists)."""
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
            raise_if_failed(rec)
            return
        deadline = time.monotonic() + timeout
        seen: list[RequestRecord] = []

        def ended() -> bool:
            seen[:] = [self._record(request_id)]
            return not seen[0].is_live

        # Without the lock, as poll does (see above): a waiter woken by the progress thread need not then
        # queue behind that thread's next iteration to read one field.
        if not self._waiters.wait_for(ended, deadline, locked=False):
            state = seen[0].state.value if seen else "unknown"
            raise TransferTimeout(f"{self._role}: request {request_id!r} still {state} "
                                  f"after waiting {timeout:.3f} s")
        raise_if_failed(seen[0])

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
            self._waiters.wait_for(lambda: bool(queue), time.monotonic() + timeout, locked=False)
        out: list[str] = []
        with contextlib.suppress(IndexError):   # another caller took the last one meanwhile
            while queue:
                out.append(queue.popleft())
        return out

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
        self._pacer.wake(force=True)   # maybe without the lock: do not trust the flag
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
        self._sockets.term()
        self._pacer.close()

    def __enter__(self) -> Any:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # -- helpers for subclasses ------------------------------------------------------------------------
    def _done_with_call(self) -> None:
        """After a caller's command ran on the core (under the lock): wake the loop if it left work."""
        if self.core.wake_wanted:
            self.core.wake_wanted = False
            self._pacer.wake()

    def _record(self, request_id: str) -> RequestRecord:
        rec = self.core.records.get(request_id)
        if rec is None:
            raise UsageError(f"{self._role}: unknown request {request_id!r}")
        return rec

    def _check_open(self) -> None:
        self._waiters.raise_if_crashed()
        if self.core.closing:
            raise EndpointClosed(f"{self._role} endpoint is closed")

    def _publish(self) -> None:
        """Mid-iteration (progress thread, under the lock): send what is queued and wake the waiters now,
        rather than at the end of an iteration that still has copies to run."""
        self._published_at = time.monotonic()
        self._actions.flush()
        if self.core.changed:
            self.core.changed = False
            self._waiters.notify()

    # -- the progress thread ---------------------------------------------------------------------------
    def _run(self) -> None:
        try:
            while True:
                with self._lock:
                    if self.core.closing and self._shutdown_step():
                        self._actions.flush()
                        break
                self._step()
        except BaseException as exc:  # fail closed: a dead progress thread fails every request and link
            log.exception("%s progress loop stopped", self._role)
            self._crash(exc)
        finally:
            with contextlib.suppress(zmq.ZMQError, OSError):
                self._port.close()

    def _shutdown_step(self) -> bool:
        now = time.monotonic()
        done = self.core.shutdown_step(now, now >= self._close_deadline)
        self._actions.run()
        return done

    def _crash(self, exc: BaseException) -> None:
        error = EndpointClosed(f"{self._role} progress loop stopped: {exc!r}")
        error.__cause__ = exc
        with self._lock:
            self._waiters.crashed = exc
            self.core.crashed(time.monotonic(), error)
        self._waiters.notify()

    def _step(self) -> None:
        core, actions, pacer = self.core, self._actions, self._pacer
        with self._lock:
            busy = core.num_waiting() > 0 or bool(core.calls) or bool(core.outbox)
            pacer.spinning = busy
            timeout_ms = 0 if busy else pacer.idle_timeout_ms()
        events = dict(self._sockets.poller.poll(timeout_ms))
        with self._lock:
            # Frames read in this iteration are stamped with the time the poll returned (or, after a long
            # action mid-drain, when it ended: _restamp), and peers are checked before any is read: frames
            # that queued up while this process stalled must not make a peer that has declared us dead
            # look alive.
            self._stamp(time.monotonic())
            if events.pop(pacer.wake_r, None):
                pacer.drain()   # under the lock: a later wake writes again
            calls = core.run_calls(self._recv_time)
            for fn in calls:
                try:
                    fn()
                finally:
                    actions.run()
            core.post_queued()
            actions.run()
            actions.flush()   # what the calls queued (decode's Announces) leaves before the reads below run
            for sock in events:
                self._drain_socket(sock)
            core.post_queued()
            actions.run()
            # What the messages just read produced leaves before this iteration's transfers too: the peer
            # can start on it while they run.
            actions.flush()
            if self._pump() or events or calls:
                pacer.idle_spins = 0
            actions.run()
            core.batches.next_iteration()
            core.tick(time.monotonic())
            actions.run()
            actions.flush()
            self._published_at = time.monotonic()
            changed, core.changed = core.changed, False
            core.wake_wanted = False
        if changed:
            self._waiters.notify()
        if busy and not events:
            pacer.busy_wait()

    def _drain_socket(self, sock: Any) -> None:
        for _ in range(256):  # bounded, so one chatty peer cannot starve the rest of the loop
            if sock.closed:   # a message just handled closed it (a peer said Bye)
                return
            try:
                frames = self._port.recv(sock)
            except zmq.Again:
                return
            except zmq.ZMQError as exc:  # this socket is broken: its peer fails, the loop goes on
                self._port.failed(sock, exc)
                return
            try:
                self._port.on_frames(sock, frames, self._recv_time)
            except InternalError as exc:
                self.core.log_internal(exc)
            except KVFerryError as exc:
                self.core.num_bad_messages += 1
                log.debug("%s: dropped a message: %s", self._role, exc)
            self._actions.run()   # what the frame decided, even if a later message of it was bad
            self._restamp()

    def _restamp(self) -> None:
        """Mid-drain, after carrying out what a frame decided: when that took long (a transfer posted with
        the lock let go, or this process stopped inside it), what is still to be read may have arrived
        meanwhile, and stamped with the poll's time it would date from before the stall. A Hello read then
        opened a session that looked silent for the whole stall, which prefill ended at the next dropped
        connection (seen on Mooncake: decode's reconnect, ended right after it settled decode's quarantine).
        So, as after a poll (``_step``): our own silence is judged first, then what follows is stamped from
        now. Within a heartbeat interval the poll's stamp stands: the peers' clocks are that coarse anyway,
        and the check is not paid per frame."""
        now = time.monotonic()
        if now - self._recv_time > self.options.heartbeat_interval:
            self._stamp(now)

    def _stamp(self, now: float) -> None:
        """Frames read from here on are stamped ``now``; our own silence up to ``now`` is judged first."""
        self._recv_time = now
        self.core.check_silence(now)
        self._actions.run()

    # -- shell hooks (progress thread, under the lock) -------------------------------------------------
    def _apply(self, effect: Effect) -> None:
        """Carry out one of the core's effects other than ``FlushNow`` (``core.base``), between events."""
        raise InternalError(f"{self._role}: no shell for the effect {effect!r}")

    def _carry_out(self, transfer: Transfer) -> None:
        """Post one transfer the core queued, between events; feed back its outcome."""
        raise NotImplementedError

    def _pump(self) -> bool:
        """Drive the transport and feed what it brought to the core; True when there was news."""
        raise NotImplementedError
