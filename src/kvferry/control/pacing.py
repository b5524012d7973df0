"""How often an endpoint's progress loop comes round: its wake pipe, its busy sleep and its idle timeout.

Part of the control plane's shell, beside ``sockets`` and ``waiters``, below ``endpoints`` (each endpoint's
progress loop owns one ``Pacer``). The loop polls ZMQ with a timeout when nothing is in flight
(``idle_timeout_ms``), and spins with a short sleep while a write or a notification is outstanding (NIXL
notifications wake no file descriptor; a ZMQ message or a caller's call ends the sleep at once:
``busy_wait``). The sleep starts at ``busy_poll`` and doubles with each idle spin up to ``busy_poll_max``:
most of a spinning thread's CPU is the wake-up itself, and under load (many requests in flight, where
latency is queueing) a spin that finds several notifications at once costs less than several spins that
find one each. From ``LAZY_WAKE_MIN`` requests in flight the loop is *under load*: it sleeps a quarter of
``busy_poll`` per request in flight (up to ``busy_poll_max``) whether or not the last spin found work, and a
caller's call no longer wakes it (``wake``: it comes round within that sleep). A request behind n others
already waits about n service times; the sleep adds a few per cent of that, and the wake-ups it saves were
most of decode's CPU (issue 13, bench/RESULTS.md, "sixth round").
"""

from __future__ import annotations

import contextlib
import os
import select
from collections.abc import Callable

import zmq

from kvferry.control.core.options import EndpointOptions

__all__ = ["LAZY_WAKE_MIN", "LOAD_POLL_SHARE", "Pacer"]

# Requests in flight from which the progress loop is under load (see the module doc): it sleeps
# LOAD_POLL_SHARE of busy_poll per request in flight after every iteration, and a caller's call no longer
# wakes it. The call waits one such sleep at most, a few per cent of the latency of a request queued
# behind this many.
LAZY_WAKE_MIN = 8
LOAD_POLL_SHARE = 0.25


class Pacer:
    """One progress loop's pacing. ``wake`` may be called from any thread holding the endpoint's lock (or,
    with ``force``, without it: ``close``); everything else only from the progress thread.

    ``num_waiting`` is the core's count of requests in flight (``CoreBase.num_waiting``), read when a
    caller's wake-up or a busy sleep needs it. ``poller`` is the loop's: the wake pipe's read end is
    registered with it here (``wake_r``), and ``busy_wait`` sleeps on the sockets registered with it."""

    def __init__(self, options: EndpointOptions, poller: zmq.Poller, num_waiting: Callable[[], int]) -> None:
        self._options = options
        self._poller = poller
        self._num_waiting = num_waiting
        self.wake_r, self.wake_w = os.pipe()
        os.set_blocking(self.wake_r, False)
        os.set_blocking(self.wake_w, False)
        poller.register(self.wake_r, zmq.POLLIN)
        self.pending = False   # a byte is in the wake pipe that the thread has not drained yet
        # The last iteration found work in flight: the next comes within busy_poll_max (see wake).
        self.spinning = False
        self.idle_spins = 0   # busy iterations in a row that found nothing to do (sets the sleep)

    def wake(self, *, force: bool = False) -> None:
        """Make the loop come round now (a caller queued work). Never blocks, never raises."""
        # One byte until the thread drains the pipe: more would wake it no sooner (callers hold the lock,
        # and the thread clears the flag under it). A full pipe means the thread wakes anyway; a closed
        # one means we are shutting down.
        if self.pending and not force:
            return
        # Under load the thread is spinning and comes round within its busy sleep anyway; a wake per
        # request would cost a context switch and an iteration each (issue 13: most of decode's CPU).
        if not force and self.spinning and self._num_waiting() >= LAZY_WAKE_MIN:
            return
        self.pending = True
        with contextlib.suppress(BlockingIOError, OSError):
            os.write(self.wake_w, b"x")

    def drain(self) -> None:
        """The poll saw the wake pipe (progress thread, under the lock): empty it. The flag is cleared
        first, so a ``wake`` after this writes again."""
        self.pending = False
        try:
            while os.read(self.wake_r, 4096):
                pass
        except BlockingIOError:
            pass

    def idle_timeout_ms(self) -> int:
        """The poll's timeout when nothing is in flight: often enough for heartbeats and deadlines."""
        # Never sleep past half a heartbeat.
        return max(1, int(self._options.heartbeat_interval * 1000 / 4))

    def busy_wait(self) -> None:
        """Sleep between busy iterations: ``busy_poll`` after one that found work, doubling while idle up
        to ``busy_poll_max``. A caller's call (the wake pipe) or a ZMQ message ends it early.

        ``zmq_poll`` counts its timeout in whole milliseconds, too coarse here, so this sleeps in
        ``select`` on each socket's ``zmq.FD`` beside the wake pipe. That descriptor is edge-triggered (it
        signals a change, not "a message is waiting"), so a socket whose ``zmq.EVENTS`` already shows one
        is not slept on at all: the next iteration reads it."""
        opts = self._options
        # A lone request is polled every busy_poll (its latency is the whole cost); many share longer
        # sleeps, each wake finding several of them (their CPU is the cost, and their latency is queueing).
        waiting = self._num_waiting()
        if waiting >= LAZY_WAKE_MIN:
            delay = min(opts.busy_poll_max, opts.busy_poll * LOAD_POLL_SHARE * waiting)
        else:
            cap = min(opts.busy_poll_max, opts.busy_poll * waiting)
            delay = min(opts.busy_poll * (1 << self.idle_spins), max(opts.busy_poll, cap))
        self.idle_spins = min(self.idle_spins + 1, 16)
        fds = [self.wake_r]
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

    def close(self) -> None:
        """Close the wake pipe (after the progress thread stopped, or from a constructor that failed)."""
        os.close(self.wake_r)
        os.close(self.wake_w)
