"""Prefill's sockets: one ZMQ ROUTER that every decode connects to, and (``transport_liveness``) its monitor.

Part of the control plane's shell, above ``sockets`` and ``core.prefill``, below ``prefill``. Bound in
``PrefillEndpoint``'s constructor, before its progress thread starts; read, sent on and closed only by that
thread from then on.

Which decode a dropped connection served: libzmq's monitor names the connection's descriptor, not its peer
(``ROUTER_NOTIFY``, which would, is a draft API), and every frame read says which descriptor it came on
(``ZMQ_SRCFD``). So the port remembers, per descriptor, the identities whose frames it carried, and tells
the core whose connection dropped; only a drop on a descriptor that carried no frame is left unnamed (the
core then suspects every session not heard from since, as before issue 49, when any drop did that and one
decode's drop under load ended another decode's session). The ROUTER is registered with the poller before
the monitor, so the frames a connection sent before it dropped are read, and attributed, before its drop.
A descriptor reused by a new connection before the drop is read names both identities: the new one,
heard just now, is merely judged by silence until its next frame.
"""

from __future__ import annotations

import contextlib
import time
from typing import Any

import zmq
import zmq.utils.monitor

from kvferry.control.core.prefill import PrefillCore
from kvferry.control.sockets import FLUSH_MS, Port, Sockets
from kvferry.errors import EndpointClosed, ProtocolError

__all__ = ["RouterPort"]


class RouterPort(Port):
    """The ROUTER bound at ``tcp://host:port`` (port 0: ephemeral; ``address`` says which), registered with
    the loop's poller. ``EndpointClosed`` when it cannot bind (nothing is left open then)."""

    def __init__(self, sockets: Sockets, core: PrefillCore, host: str, port: int) -> None:
        self._core = core
        self._sock = sockets.new(zmq.ROUTER)
        try:
            self._sock.bind(f"tcp://{host}:{port}")
        except zmq.ZMQError as exc:
            self._sock.close(0)
            raise EndpointClosed(f"prefill: cannot listen on tcp://{host}:{port}: {exc}") from exc
        self.address: str = self._sock.getsockopt_string(zmq.LAST_ENDPOINT)
        sockets.poller.register(self._sock, zmq.POLLIN)
        # transport_liveness: libzmq's monitor says a connection dropped (a reset, or ZMTP heartbeats
        # unanswered for peer_timeout), by its descriptor; the sessions whose frames it carried fall back to
        # the silence rule (core.connected_for). Registered after the ROUTER: see the module's doc.
        self._monitor: Any = None
        self._by_fd: dict[int, set[bytes]] = {}   # a connection's descriptor -> the identities it carried
        self._fd_of: dict[bytes, int] = {}        # and back, for each identity heard (until its drop)
        if core.options.transport_liveness:
            try:
                self._monitor = self._sock.get_monitor_socket(zmq.EVENT_DISCONNECTED)
            except BaseException:
                self._sock.close(0)   # else the constructor's cleanup would wait on it to end the context
                raise
            sockets.poller.register(self._monitor, zmq.POLLIN)

    def recv(self, sock: Any) -> list[bytes]:
        if sock is not self._sock or self._monitor is None:
            return sock.recv_multipart(zmq.NOBLOCK, copy=True)
        # The routing id libzmq prepends, as a Frame: it says which descriptor the message came on. Only the
        # first message of each identity asks (an identity is one connection for its whole life), and the
        # rest is read copied: no dearer than recv_multipart (2.5 against 2.7 us for a 200-byte message,
        # medians of 40 x 500 on 2 shared cores, 2026-12-05).
        head = sock.recv(zmq.NOBLOCK, copy=False)
        frames = [head.bytes]
        more = head.more
        while more:   # the parts of one message arrive together: no wait
            frames.append(sock.recv(copy=True))
            more = sock.getsockopt(zmq.RCVMORE)
        identity = frames[0]
        if identity not in self._fd_of:
            fd = head.get(zmq.SRCFD)
            if fd >= 0:   # -1: libzmq cannot say (a drop on it then goes unnamed)
                self._fd_of[identity] = fd
                self._by_fd.setdefault(fd, set()).add(identity)
        return frames

    def on_frames(self, sock: Any, frames: list[bytes], now: float) -> None:
        if sock is self._monitor:
            self._on_monitor(frames, now)
            return
        if len(frames) != 2:
            raise ProtocolError(f"expected identity and one frame, got {len(frames)} frames")
        identity, data = frames
        self._core.on_frame(now, identity, data)

    def _on_monitor(self, frames: list[bytes], now: float) -> None:
        try:
            fd = int(zmq.utils.monitor.parse_monitor_message(frames)["value"])
        except Exception:   # pyzmq's own format: unreadable is a bug, but the drop is real; leave it unnamed
            fd = -1
        identities = self._by_fd.pop(fd, None)
        for identity in identities or ():
            self._fd_of.pop(identity, None)
        self._core.connection_dropped(now, identities)

    def failed(self, sock: Any, exc: zmq.ZMQError) -> None:
        # The one ROUTER serves every decode: without it this endpoint cannot go on. Stop the loop, which
        # fails every request and session with the cause.
        raise EndpointClosed(f"prefill: receiving on {self.address} failed: {exc}") from exc

    def send(self, identity: bytes, frame: bytes) -> None:
        self.send_raw(identity, frame)
        self._core.frame_sent(time.monotonic(), identity)

    def send_raw(self, identity: bytes, data: bytes) -> None:
        with contextlib.suppress(zmq.ZMQError):  # a vanished peer: heartbeats will notice
            self._sock.send_multipart([identity, data], zmq.NOBLOCK)

    def close(self) -> None:
        if self._monitor is not None:
            with contextlib.suppress(zmq.ZMQError):
                self._sock.disable_monitor()
            self._monitor.close(0)
        self._sock.close(FLUSH_MS)  # let the last Fail and Bye leave; bounded if the peer is gone
