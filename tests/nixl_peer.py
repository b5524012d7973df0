"""A decode-side NIXL (or Mooncake) peer in its own OS process, driven over a ``multiprocessing`` pipe.

Used by ``tests/test_transport_nixl.py`` and ``bench/transport.py``. The peer owns its memory (built from a
layout manifest and filled from a seed), registers it with a ``NixlTransport``, and keeps driving progress
(``get_notifications``) between commands, as a decode worker's event loop would.

Start it with ``start_peer`` (spawn context: no forked NIXL/UCX state). Commands are ``(verb, *args)``
tuples; every command gets exactly one reply, an exception is replied as ``("error", repr)``.
"""

from __future__ import annotations

import contextlib
import multiprocessing as mp
import os
import sys
import time
from dataclasses import dataclass
from multiprocessing.connection import Connection
from typing import Any

import numpy as np


@dataclass
class PeerProcess:
    """The test side of a running peer: its process, its pipe, its agent name and metadata."""

    process: Any
    conn: Connection
    name: str
    metadata: bytes

    def call(self, verb: str, *args: Any, timeout: float = 30.0) -> Any:
        self.conn.send((verb, *args))
        if not self.conn.poll(timeout):
            raise TimeoutError(f"peer {self.name!r} did not answer {verb!r} within {timeout} s")
        reply = self.conn.recv()
        if isinstance(reply, tuple) and reply and reply[0] == "error":
            raise RuntimeError(f"peer {self.name!r} failed {verb!r}: {reply[1]}")
        return reply

    def stop(self) -> None:
        if self.process.is_alive():
            with contextlib.suppress(OSError):
                self.conn.send(("exit",))
            self.process.join(5)
        if self.process.is_alive():
            self.process.kill()
            self.process.join(5)


def start_peer(manifest: bytes, seed: int, *, pause_after_setup: float = 0.0,
               descriptors: str = "dlist", transport: str = "nixl") -> PeerProcess:
    """Spawn a peer holding ``Layout.from_manifest(manifest)`` filled from ``seed``; returns once registered.

    ``pause_after_setup`` makes the peer sleep that long *without driving progress* right after it sent its
    metadata (the deadline test's stalled receiver). ``transport``: ``"nixl"`` or ``"mooncake"``
    (``descriptors`` is NIXL's only).
    """
    ctx = mp.get_context("spawn")
    ours, theirs = ctx.Pipe()
    proc = ctx.Process(target=serve, args=(theirs, manifest, seed, pause_after_setup, descriptors, transport),
                       daemon=True)
    proc.start()
    if not ours.poll(60):
        proc.kill()
        raise TimeoutError(f"{transport} peer did not start within 60 s")
    name, metadata = ours.recv()
    return PeerProcess(proc, ours, name, metadata)


def serve(conn: Connection, manifest: bytes, seed: int, pause: float, descriptors: str, kind: str = "nixl") -> None:
    """Peer main loop: register, announce, then alternate between progress and commands until ``exit``."""
    sys.path.insert(0, os.path.dirname(__file__))
    from kvferry import KVMemory, Layout
    from kvferry.transport import make_transport

    memory = KVMemory.allocate(Layout.from_manifest(manifest))
    fill(memory, seed)
    transport = make_transport(kind, **({"descriptors": descriptors} if kind == "nixl" else {}))
    conn.send((transport.agent_name, transport.register(memory)))
    time.sleep(pause)
    inbox: list[tuple[str, bytes]] = []
    handlers = _handlers(transport, memory, inbox)
    while True:
        inbox.extend(transport.get_notifications())
        if not conn.poll(1e-4):
            continue
        verb, *args = conn.recv()
        if verb == "exit":
            transport.close()
            os._exit(0)
        try:
            conn.send(handlers[verb](*args))
        except Exception as exc:
            conn.send(("error", repr(exc)))


def _handlers(transport: Any, memory: Any, inbox: list[tuple[str, bytes]]) -> dict[str, Any]:
    def wait_notifs(messages: list[bytes], timeout: float) -> list[bytes]:
        """Drive progress until every message arrived (or timeout); return those still missing."""
        wanted = set(messages)
        deadline = time.monotonic() + timeout
        while True:
            inbox.extend(transport.get_notifications())
            wanted -= {m for _, m in inbox}
            if not wanted or time.monotonic() > deadline:
                return sorted(wanted)

    def arrival(message: bytes, timeout: float) -> float | None:
        """Busy-poll until ``message`` arrives; its arrival time (``time.perf_counter``, CLOCK_MONOTONIC,
        comparable across processes on one host), or None after ``timeout``."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            for peer, msg in transport.get_notifications():
                if msg == message:
                    return time.perf_counter()
                inbox.append((peer, msg))
        return None

    def pages(buffer: str, page_ids: list[int]) -> bytes:
        return memory.array(buffer)[page_ids].tobytes()

    def take_notifs() -> list[tuple[str, bytes]]:
        out = list(inbox)
        inbox.clear()
        return out

    def dump() -> dict[str, bytes]:
        return {b.name: memory.array(b.name).tobytes() for b in memory.layout.buffers}

    return {
        "add_peer": transport.add_peer,
        "remove_peer": transport.remove_peer,
        "wait_notifs": wait_notifs,
        "take_notifs": take_notifs,
        "dump": dump,
        "arrival": arrival,
        "pages": pages,
        "fill": lambda seed: fill(memory, seed),
        "send": transport.send_notification,
        "modules": lambda: sorted(m for m in ("torch", "nixl", "mooncake") if m in sys.modules),
        "pause": time.sleep,
    }


def fill(memory: Any, seed: int) -> None:
    """Deterministic bytes per buffer: the test side recomputes them to know what was there before."""
    for index, buf in enumerate(memory.layout.buffers):
        memory.array(buf.name)[...] = pattern(buf.num_pages, buf.page_bytes, seed, index)


def pattern(num_pages: int, page_bytes: int, seed: int, index: int) -> np.ndarray:
    """Random bytes for ``seed >= 0``; for ``seed < 0`` a cheap pattern (every byte of page p of buffer
    ``index`` is ``(7 p + 13 index - seed) % 251``), fast enough for GiB-sized benchmark memory."""
    if seed < 0:
        values = (np.arange(num_pages, dtype=np.int64) * 7 + 13 * index - seed) % 251
        return np.broadcast_to(values.astype(np.uint8)[:, None], (num_pages, page_bytes))
    rng = np.random.default_rng([seed, index])
    return rng.integers(0, 256, size=(num_pages, page_bytes), dtype=np.uint8)
