"""In-process transport: the reference every other transport is compared against.

Part of the transport layer, above ``base``, beside ``nixl``. Peers are other ``LocalTransport`` objects in
the same process, found by name in a process-wide registry. A write checks every row against both sides'
registered regions, then copies the rows with ``memmove`` and queues the notification on the peer: completion
is synchronous, as with NIXL's cma path on one machine. A read (pull mode) checks the same way and copies
from the peer's memory into this side's, on the reader's thread; the peer hears nothing. Nothing here aims
at speed; it aims at being obviously right.
"""

from __future__ import annotations

import ctypes
import itertools
import threading
import weakref
from collections import deque

import msgspec

from kvferry.codec import decode_versioned, encode
from kvferry.errors import PeerLost, TransportError
from kvferry.layout.memory import KVMemory
from kvferry.plan.contract import Plan
from kvferry.transport.base import TransferHandle, Transport, check_plan_in_regions

__all__ = ["LocalTransport"]

_REGISTRY: weakref.WeakValueDictionary[str, LocalTransport] = weakref.WeakValueDictionary()
_REGISTRY_LOCK = threading.Lock()
_COUNTER = itertools.count()


# Bump when _Metadata's fields or their meaning change.
METADATA_VERSION = 1


class _Metadata(msgspec.Struct, forbid_unknown_fields=True):
    version: int
    agent: str
    manifest: bytes


class LocalHandle(TransferHandle):
    """A write that completed inside ``LocalTransport.write``: every byte landed before it returned."""

    def __init__(self, peer: str, label: str) -> None:
        self.peer = peer
        self.label = label

    def poll(self) -> bool:
        return True

    def release(self) -> None:
        """Nothing to free: the copy finished inside ``write``."""


class LocalTransport(Transport):
    """Same contract as ``NixlTransport``, in one process. Thread-safe enough for two endpoints in two
    threads of one process: each side only appends to the other's inbox."""

    name = "local"

    def __init__(self, agent_name: str | None = None) -> None:
        self._name = agent_name or f"local-{next(_COUNTER)}"
        self._memory: KVMemory | None = None
        self._peers: dict[str, KVMemory] = {}
        self._inbox: deque[tuple[str, bytes]] = deque()
        self._closed = False
        with _REGISTRY_LOCK:
            if self._name in _REGISTRY:
                raise TransportError(f"local agent name {self._name!r} is already in use")
            _REGISTRY[self._name] = self

    @property
    def agent_name(self) -> str:
        return self._name

    def register(self, memory: KVMemory) -> bytes:
        if memory.remote:
            raise TransportError("cannot register a peer's (remote) memory binding")
        self._memory = memory
        return encode(_Metadata(METADATA_VERSION, self._name, memory.manifest()))

    def add_peer(self, metadata: bytes) -> str:
        meta = decode_versioned(metadata, _Metadata, version=METADATA_VERSION, what="local peer metadata",
                                error=TransportError)
        self._peers[meta.agent] = KVMemory.from_manifest(meta.manifest)
        return meta.agent

    def remove_peer(self, peer: str) -> None:
        self._peers.pop(peer, None)

    def write(self, plan: Plan, peer: str, notif: bytes, label: str = "") -> LocalHandle:
        target = self._live_peer(peer)
        self._check(plan, peer, label)
        self._copy(plan)
        target._inbox.append((self._name, bytes(notif)))
        return LocalHandle(peer, label)

    @staticmethod
    def _copy(plan: Plan) -> None:
        # One memmove per coalesced row: rows are few (runs x buffers), and a plain loop keeps the
        # reference implementation free of cleverness the tests would then have to trust.
        for (src_addr, nbytes, _), (dst_addr, _, _) in zip(plan.src_descs.tolist(), plan.dst_descs.tolist()):
            ctypes.memmove(dst_addr, src_addr, nbytes)

    def read(self, plan: Plan, peer: str, label: str = "") -> LocalHandle:
        """Copy the plan's rows from ``peer``'s registered memory into this side's, on the caller's thread
        (the reader's): every byte has landed when this returns. The peer is not told."""
        source = self._live_peer(peer)
        if self._memory is None:
            raise TransportError("register memory before reading")
        if plan.dst_memory.binding_fingerprint != self._memory.binding_fingerprint:
            raise TransportError(f"read {label!r}: the plan's destination is not this transport's memory")
        live = source._memory
        if live is None:
            raise TransportError(f"peer {peer!r} has no registered memory")
        # Source rows against the peer's live registration, destination rows against ours.
        check_plan_in_regions(plan, live, self._memory, peer, label)
        self._copy(plan)
        return LocalHandle(peer, label)

    def send_notification(self, peer: str, message: bytes) -> None:
        self._live_peer(peer)._inbox.append((self._name, bytes(message)))

    def get_notifications(self) -> list[tuple[str, bytes]]:
        out = []
        while self._inbox:
            out.append(self._inbox.popleft())
        return out

    def peer_may_write(self, peer: str) -> bool:
        """A local peer writes here only through ``write``, which needs it open and holding this agent as a
        peer (``add_peer``): closed, collected, or without that entry, it cannot write."""
        with _REGISTRY_LOCK:
            writer = _REGISTRY.get(peer)
        return writer is not None and not writer._closed and self._name in writer._peers

    def close(self) -> None:
        self._closed = True
        self._peers.clear()
        with _REGISTRY_LOCK:
            if _REGISTRY.get(self._name) is self:
                del _REGISTRY[self._name]

    # -- helpers ---------------------------------------------------------------------------------------
    def _live_peer(self, peer: str) -> LocalTransport:
        if self._closed:
            raise TransportError(f"transport {self._name!r} is closed")
        if peer not in self._peers:
            raise TransportError(f"unknown peer {peer!r} (add_peer first)")
        target = _REGISTRY.get(peer)
        if target is None or target._closed:
            raise PeerLost(f"peer {peer!r} is gone")
        return target

    def _check(self, plan: Plan, peer: str, label: str) -> None:
        if self._memory is None:
            raise TransportError("register memory before writing")
        if plan.src_memory.binding_fingerprint != self._memory.binding_fingerprint:
            raise TransportError(f"write {label!r}: the plan's source is not this transport's memory")
        # Against the peer's live registration (what is true), not its manifest (what we were told): a
        # row inside the manifest but outside live memory is refused all the same.
        live = _REGISTRY[peer]._memory
        if live is None:
            raise TransportError(f"peer {peer!r} has no registered memory")
        check_plan_in_regions(plan, self._memory, live, peer, label)
