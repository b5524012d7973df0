"""A TCP byte relay on loopback that can cut every connection it carries: the chaos run's 'network'.

Part of the workload layer, beside ``sim`` (it imports nothing of kvferry's above ``errors``), below
``chaos``. Decode's control connection (ZMQ over TCP) goes through it to prefill, so a chaos run can cut
control connections without netem: ``cut()`` closes both ends of every connection at once, and the peers
meet what they would meet when a switch reboots. ``set_upstream`` points new connections at a restarted
prefill.

One selector thread relays; commands from other threads go through a queue and a wake-up socket. Bounded:
each direction buffers at most ``MAX_BUFFERED`` bytes (it stops reading until the other end drains), and
it listens on 127.0.0.1 only.
"""

from __future__ import annotations

import contextlib
import queue
import selectors
import socket
import struct
import threading
from collections.abc import Callable
from dataclasses import dataclass, field

from kvferry.errors import UsageError

__all__ = ["Relay"]

MAX_BUFFERED = 1 << 20   # per direction: a stalled reader costs at most this much memory here
CHUNK = 64 << 10
TICK_S = 0.05            # the selector's longest sleep: how soon close() is noticed without a wake-up


@dataclass(eq=False)
class _End:
    """One socket of a relayed pair, and the bytes waiting to be written to it."""

    sock: socket.socket
    out: bytearray = field(default_factory=bytearray)
    peer: _End | None = None
    events: int = 0     # what the selector watches for on it now (0: unregistered, its peer is backed up)


class Relay:
    """Listen on ``127.0.0.1``, connect each client to ``upstream`` (``(host, port)``), relay both ways.

    ``address`` is ``tcp://127.0.0.1:PORT`` (what ``DecodeEndpoint.connect`` takes). Use as a context
    manager, or call ``start`` and ``close``. ``cuts`` and ``connections`` count what it did.
    """

    def __init__(self, upstream: tuple[str, int] | None = None) -> None:
        self._upstream = upstream
        self._listener = socket.create_server(("127.0.0.1", 0))
        self._listener.setblocking(False)
        self.port: int = self._listener.getsockname()[1]
        self.address = f"tcp://127.0.0.1:{self.port}"
        self._sel = selectors.DefaultSelector()
        self._wake_r, self._wake_w = socket.socketpair()
        self._wake_r.setblocking(False)
        self._commands: queue.Queue[Callable[[], None]] = queue.Queue()
        self._ends: set[_End] = set()
        self._closing = False
        self.cuts = 0
        self.connections = 0
        self._thread = threading.Thread(target=self._run, name="kvferry-relay", daemon=True)

    # -- any thread ------------------------------------------------------------------------------------
    def start(self) -> Relay:
        self._sel.register(self._listener, selectors.EVENT_READ, "accept")
        self._sel.register(self._wake_r, selectors.EVENT_READ, "wake")
        self._thread.start()
        return self

    def set_upstream(self, upstream: tuple[str, int]) -> None:
        """Where new connections go (a restarted prefill listens on another port); open ones stay."""
        self._command(lambda: setattr(self, "_upstream", upstream))

    def cut(self, timeout: float = 5.0) -> int:
        """Close both ends of every open connection now; returns how many pairs were cut."""
        done = threading.Event()
        counted: list[int] = []

        def run() -> None:
            counted.append(self._cut_all())
            done.set()

        self._command(run)
        if not done.wait(timeout):
            raise UsageError(f"the relay did not cut its connections within {timeout:g} s")
        return counted[0]

    @property
    def num_open(self) -> int:
        """Relayed pairs open now."""
        return len(self._ends) // 2

    def close(self) -> None:
        """Cut everything, stop the thread, close the listener. Idempotent, bounded."""
        if self._closing:
            return
        self._closing = True
        self._wake()
        if self._thread.is_alive():
            self._thread.join(2.0)
        for end in list(self._ends):
            self._drop(end)
        for sock in (self._listener, self._wake_r, self._wake_w):
            sock.close()
        self._sel.close()

    def __enter__(self) -> Relay:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _command(self, fn: Callable[[], None]) -> None:
        self._commands.put(fn)
        self._wake()

    def _wake(self) -> None:
        with contextlib.suppress(OSError):  # a full buffer wakes the thread anyway; closed: shutting down
            self._wake_w.send(b"x")

    # -- the relay thread --------------------------------------------------------------------------------
    def _run(self) -> None:
        while not self._closing:
            for key, mask in self._sel.select(TICK_S):
                if key.data == "accept":
                    self._accept()
                elif key.data == "wake":
                    self._drain_wake()
                elif key.data in self._ends:
                    try:
                        self._service(key.data, mask)
                    except (OSError, ValueError, KeyError):  # one broken pair must not stop the relay
                        self._drop(key.data)
            while not self._commands.empty():
                self._commands.get_nowait()()

    def _drain_wake(self) -> None:
        with contextlib.suppress(BlockingIOError):
            while self._wake_r.recv(4096):
                pass

    def _accept(self) -> None:
        try:
            client, _ = self._listener.accept()
        except BlockingIOError:
            return
        if self._upstream is None:
            client.close()  # nowhere to go yet: the client sees a refused connection and retries
            return
        try:
            server = socket.create_connection(self._upstream, timeout=1.0)
        except OSError:
            client.close()
            return
        self.connections += 1
        a, b = _End(client), _End(server)
        a.peer, b.peer = b, a
        for end in (a, b):
            end.sock.setblocking(False)
            end.sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            self._ends.add(end)
            self._update(end)

    def _service(self, end: _End, mask: int) -> None:
        if mask & selectors.EVENT_WRITE:
            self._flush(end)
        if mask & selectors.EVENT_READ and end in self._ends:
            self._read(end)

    def _read(self, end: _End) -> None:
        peer = end.peer
        assert peer is not None
        try:
            data = end.sock.recv(CHUNK)
        except (BlockingIOError, InterruptedError):
            return
        except OSError:
            data = b""
        if not data:  # this end closed: close the pair (a half-open control connection helps nobody)
            self._drop(end)
            return
        peer.out += data
        self._flush(peer)

    def _flush(self, end: _End) -> None:
        if end.out:
            try:
                sent = end.sock.send(end.out)
            except (BlockingIOError, InterruptedError):
                sent = 0
            except OSError:
                self._drop(end)
                return
            del end.out[:sent]
        self._update(end)
        if end.peer is not None:
            self._update(end.peer)

    def _update(self, end: _End) -> None:
        """Read from ``end`` only while its peer's backlog is under the bound; write while it has one."""
        if end not in self._ends:
            return
        peer_full = end.peer is not None and len(end.peer.out) >= MAX_BUFFERED
        events = (0 if peer_full else selectors.EVENT_READ) | (selectors.EVENT_WRITE if end.out else 0)
        if events == end.events:
            return
        if end.events == 0:
            self._sel.register(end.sock, events, end)
        elif events == 0:
            self._sel.unregister(end.sock)
        else:
            self._sel.modify(end.sock, events, end)
        end.events = events

    def _cut_all(self) -> int:
        pairs = self.num_open
        for end in list(self._ends):
            self._drop(end)
        self.cuts += 1
        return pairs

    def _drop(self, end: _End) -> None:
        """Close ``end`` and its peer (abortively: an RST, as a broken path would look)."""
        for one in (end, end.peer):
            if one is None or one not in self._ends:
                continue
            self._ends.discard(one)
            if one.events:
                with contextlib.suppress(KeyError, ValueError):  # already closed under us
                    self._sel.unregister(one.sock)
                one.events = 0
            with contextlib.suppress(OSError):
                one.sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
            one.sock.close()
