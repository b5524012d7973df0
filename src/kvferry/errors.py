"""One exception tree for kvferry, the bottom layer of the package.

Every failure a caller can see is a ``KVFerryError``; backend errors (NIXL, ZMQ, OS) are translated into
it in one place per backend with ``raise ... from exc``, so callers catch kvferry's types only::

    KVFerryError
    ├── LayoutError            a layout or memory binding that cannot be right
    ├── PlanError              page lists that do not fit the layouts they address
    ├── HandshakeError         the peers could not agree to talk
    │   └── IncompatiblePeer   ... because their layouts, protocol or secret differ
    ├── LeaseError             destination pages already leased, out of range, duplicated
    ├── TransportError         moving bytes failed
    │   ├── TransferTimeout    ... a deadline passed first
    │   └── PeerLost           ... the peer died, left, or stopped answering
    ├── RequestFailed          a request ended failed or aborted (carries the reason)
    └── IntegrityError         bytes arrived but are not the bytes that were sent

Messages name the pool, buffer, page, peer, expected and actual values: the fault should be located from
the message alone.
"""

from __future__ import annotations

__all__ = [
    "HandshakeError",
    "IncompatiblePeer",
    "IntegrityError",
    "KVFerryError",
    "LayoutError",
    "LeaseError",
    "PeerLost",
    "PlanError",
    "RequestFailed",
    "TransferTimeout",
    "TransportError",
]


class KVFerryError(Exception):
    """Base of every error kvferry raises."""


class LayoutError(KVFerryError, ValueError):
    """A layout or a memory binding is invalid (sizes, names, regions)."""


class PlanError(KVFerryError, ValueError):
    """Page lists do not fit the layouts: lengths, duplicates, bounds or shapes."""


class HandshakeError(KVFerryError):
    """The two endpoints could not complete the handshake."""


class IncompatiblePeer(HandshakeError):
    """The peer's layout shape, protocol version or secret does not match ours."""


class LeaseError(KVFerryError, ValueError):
    """Destination pages cannot be leased: overlap with a live lease, out of range, duplicated."""


class TransportError(KVFerryError):
    """A transfer could not be posted or did not complete."""


class TransferTimeout(TransportError, TimeoutError):
    """A deadline expired before the transfer (or the wait) completed."""


class PeerLost(TransportError):
    """The peer died, disconnected, or stopped answering heartbeats."""


class RequestFailed(KVFerryError):
    """A request ended in the failed state; ``reason`` says why."""

    def __init__(self, request_id: str, reason: str) -> None:
        super().__init__(f"request {request_id!r} failed: {reason}")
        self.request_id = request_id
        self.reason = reason


class IntegrityError(KVFerryError):
    """Bytes arrived that differ from the bytes sent."""
