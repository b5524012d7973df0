"""An endpoint's ZMQ context, poller and socket settings, and what its progress loop needs of its sockets.

Part of the control plane's shell, above ``control.core``, below ``router``
(prefill's one ROUTER) and ``dealers`` (decode's DEALER per prefill), which implement ``Port``, and below
``endpoints``, whose progress loop reads, sends and closes through a ``Port`` without knowing which side it
serves. Only the progress thread touches a socket (ZMQ sockets are not thread-safe); the constructor that
binds prefill's ROUTER runs before that thread starts.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from typing import Any

import zmq

from kvferry.control.core.options import EndpointOptions

__all__ = ["FLUSH_MS", "Port", "Sockets"]

# On close, queued control messages (a final Result, Fail or Bye) get this long to leave; without it a
# peer can lose the verdict of a request that this side had finished, and fail it.
FLUSH_MS = 500


class Sockets:
    """The ZMQ context and the progress loop's poller, and every control socket's options."""

    def __init__(self, options: EndpointOptions) -> None:
        self._options = options
        self.context = zmq.Context()
        self.poller = zmq.Poller()

    def new(self, kind: int) -> zmq.Socket:
        """A socket of ``kind`` with kvferry's settings (not yet registered with the poller)."""
        sock = self.context.socket(kind)
        sock.setsockopt(zmq.LINGER, 0)
        # libzmq enforces the cap before a byte of the message is buffered (receiving it first and
        # checking after would let any peer make us allocate what it likes), but it does so by dropping
        # the connection without a word; decode watches its connections (a socket monitor) and fails the
        # link at once with an error naming this limit as the likely cause.
        sock.setsockopt(zmq.MAXMSGSIZE, self._options.max_message_bytes)
        # No send high-water mark: control messages are small and must not be dropped; a dead peer's
        # queue is bounded by peer_timeout, after which its socket is closed.
        sock.setsockopt(zmq.SNDHWM, 0)
        if self._options.transport_liveness:
            # ZMTP PING/PONG, answered by libzmq's I/O thread (no GIL): a silent connection is dropped only
            # when the peer's process cannot answer at all (stopped, gone, cut off), never when it is slow.
            opts = self._options
            sock.setsockopt(zmq.HEARTBEAT_IVL, max(1, int(opts.heartbeat_interval * 1000)))
            sock.setsockopt(zmq.HEARTBEAT_TIMEOUT, max(1, int(opts.peer_timeout * 1000)))
            sock.setsockopt(zmq.HEARTBEAT_TTL, max(100, int(opts.peer_timeout * 1000)))
        return sock

    def term(self) -> None:
        """End the context (every socket closed first: the port's ``close``)."""
        self.context.term()


class Port(ABC):
    """One side's sockets as its progress loop sees them (progress thread, under the endpoint's lock).
    Each implementation feeds the core what its sockets bring (frames, dropped connections, a frame
    gone out), with ``now`` the shell's clock."""

    def recv(self, sock: Any) -> list[bytes]:
        """One message's frames from ``sock``, without blocking (``zmq.Again`` when none is waiting)."""
        return sock.recv_multipart(zmq.NOBLOCK, copy=True)

    @abstractmethod
    def on_frames(self, sock: Any, frames: list[bytes], now: float) -> None:
        """Frames read from ``sock``: fed to the core as an event (``now``: when the poll returned).
        Raises ``KVFerryError`` for a malformed message (the loop counts and drops it)."""

    @abstractmethod
    def failed(self, sock: Any, exc: zmq.ZMQError) -> None:
        """A receive on ``sock`` raised: fail what it serves (raising stops the loop)."""

    @abstractmethod
    def send(self, peer: Any, frame: bytes) -> None:
        """Send one frame (a message or a ``wire.Batch``) to ``peer`` now and tell the core it left;
        never raises."""

    @abstractmethod
    def send_raw(self, peer: Any, data: bytes) -> None:
        """Send ``data`` alone to ``peer`` now (a Reject, a Bye), outside any batch; never raises."""

    @abstractmethod
    def close(self) -> None:
        """Close every socket, letting the last messages leave for up to ``FLUSH_MS`` (progress thread,
        as it stops)."""
