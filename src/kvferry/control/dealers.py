"""Decode's sockets: a ZMQ DEALER per prefill link, each with a monitor that reports a dropped connection.

Part of the control plane's shell, above ``sockets`` and ``core.decode``, below ``decode``. The core decides
when a link opens and closes (``OpenLink``, ``CloseLink``); this opens and closes its sockets, sends on them,
and feeds the core what they bring. Progress thread only.
"""

from __future__ import annotations

import contextlib
import time
from typing import Any

import zmq
import zmq.utils.monitor

from kvferry.control.core.decode import DecodeCore
from kvferry.control.core.links import Link
from kvferry.control.core.states import LinkState
from kvferry.control.sockets import FLUSH_MS, Port, Sockets
from kvferry.errors import ProtocolError

__all__ = ["DealerPorts"]


class DealerPorts(Port):
    """Each open link's socket and monitor, registered with the loop's poller while the link is open."""

    def __init__(self, sockets: Sockets, core: DecodeCore) -> None:
        self._sockets = sockets
        self._core = core
        self._socks: dict[Link, tuple[Any, Any]] = {}
        self._by_sock: dict[Any, Link] = {}
        self._monitors: dict[Any, Link] = {}

    def open(self, link: Link, hello: bytes) -> None:
        """``OpenLink``: connect a DEALER to ``link.address`` and send ``hello`` on it."""
        sock = self._sockets.new(zmq.DEALER)
        # libzmq drops a connection that sends more than max_message_bytes without telling the socket;
        # its monitor does tell, so a dropped connection fails the link now rather than at a deadline.
        monitor = sock.get_monitor_socket(zmq.EVENT_DISCONNECTED)
        sock.connect(link.address)
        poller = self._sockets.poller
        poller.register(sock, zmq.POLLIN)
        poller.register(monitor, zmq.POLLIN)
        self._socks[link] = (sock, monitor)
        self._by_sock[sock] = link
        self._monitors[monitor] = link
        self.send(link, hello)

    def close_link(self, link: Link) -> None:
        """``CloseLink``: drop what the link had not sent, close its socket and monitor."""
        self._core.take_out(link)   # closed with linger 0: what it had not sent is dropped
        socks = self._socks.pop(link, None)
        if socks is None:
            return
        sock, monitor = socks
        poller = self._sockets.poller
        poller.unregister(monitor)
        self._monitors.pop(monitor, None)
        with contextlib.suppress(zmq.ZMQError):
            sock.disable_monitor()
            monitor.close(0)
        poller.unregister(sock)
        self._by_sock.pop(sock, None)
        sock.close(0)

    def on_frames(self, sock: Any, frames: list[bytes], now: float) -> None:
        link = self._monitors.get(sock)
        if link is not None:
            self._on_monitor(link, frames, now)
            return
        link = self._by_sock.get(sock)
        if link is None:
            return
        if len(frames) != 1:
            raise ProtocolError(f"expected one frame, got {len(frames)}")
        self._core.on_frame(now, link, frames[0])

    def _on_monitor(self, link: Link, frames: list[bytes], now: float) -> None:
        try:
            event = zmq.utils.monitor.parse_monitor_message(frames)["event"]
        except Exception as exc:  # a malformed event frame: pyzmq's own format, so a bug; name it
            raise ProtocolError(f"unreadable socket event for prefill {link.address}: {exc!r}") from exc
        if event == zmq.EVENT_DISCONNECTED and link.state in (LinkState.CONNECTING, LinkState.ESTABLISHED):
            self._core.dropped(now, link, "libzmq reported the disconnect")

    def failed(self, sock: Any, exc: zmq.ZMQError) -> None:
        link = self._by_sock.get(sock) or self._monitors.get(sock)
        if link is not None:
            self._core.dropped(time.monotonic(), link, f"receive failed: {exc}")

    def send(self, link: Link, frame: bytes) -> None:
        """Send without blocking; the core hears that it left (``frame_sent``: pull mode's fence is judged
        first). A failed send (``zmq.Again``: the connection is gone and no message can queue; any other
        ZMQ error) fails this link, never the loop."""
        socks = self._socks.get(link)
        if socks is None:
            return
        now = time.monotonic()
        try:
            socks[0].send(frame, zmq.NOBLOCK)
        except zmq.ZMQError as exc:
            self._core.dropped(now, link, f"send failed: {exc}")
            return
        self._core.frame_sent(now, link)

    def send_raw(self, link: Link, data: bytes) -> None:
        self.send(link, data)

    def close(self) -> None:
        for sock, monitor in self._socks.values():
            monitor.close(0)
            sock.close(FLUSH_MS)  # let the last Result and Bye leave; bounded if the peer is gone
        self._socks.clear()
