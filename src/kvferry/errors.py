"""One exception tree for kvferry, the bottom layer of the package.

Every failure a caller can see is a ``KVFerryError``; backend errors (NIXL, ZMQ, OS) are translated into
it in one place per backend with ``raise ... from exc``, so callers catch kvferry's types only::

    KVFerryError
    ├── UsageError             a call that cannot be right: a bad option, an unknown request, a
    │   │                      request in the wrong state for the call
    │   └── UnknownRequest     ... an announce for a request id prefill never issued
    ├── EndpointClosed         the endpoint is closed, or its progress loop stopped (cause chained)
    ├── LayoutError            a layout or memory binding that cannot be right
    ├── PlanError              page lists that do not fit the layouts they address
    ├── HandshakeError         the peers could not agree to talk
    │   └── IncompatiblePeer   ... because their layouts, protocol or secret differ
    │       └── ModeMismatch   ... because they do not agree on a transfer mode (push or pull)
    ├── ProtocolError          a control message that cannot be decoded or breaks the flow, at any time
    ├── LeaseError             destination pages already leased, out of range, duplicated
    ├── OutOfPages             an allocator has fewer free pages than a request needs
    ├── TransportError         moving bytes failed
    │   ├── TransferTimeout    ... a deadline passed first
    │   └── PeerLost           ... the peer died, left, or stopped answering
    ├── RequestFailed          a request ended failed or aborted (carries the reason)
    ├── RequestAborted         a request was aborted, by this side's caller or by the peer
    ├── IntegrityError         bytes arrived but are not the bytes that were sent
    │   ├── PageMismatchError  ... naming every page whose digest differs
    │   └── BindingMismatch    ... or would be another prompt's: the two sides' token bindings differ
    ├── FaultSpecError         a fault-injection spec that cannot be parsed
    └── InternalError          a kvferry bug caught in the act (an illegal state transition): the
                               requests it touches fail closed, and it is logged at ERROR

Every module of kvferry raises these and no others on its public paths (no ``ValueError``, no
``assert``). The bottom of the package: it imports nothing of kvferry's.

Messages name the pool, buffer, page, peer, expected and actual values: the fault should be located from
the message alone.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

__all__ = ["BindingMismatch", "EndpointClosed", "FaultSpecError", "HandshakeError", "IncompatiblePeer",
           "IntegrityError", "InternalError", "KVFerryError", "LayoutError", "LeaseError", "ModeMismatch",
           "OutOfPages", "PageMismatchError", "PeerLost", "PlanError", "ProtocolError", "RequestAborted",
           "RequestFailed", "TransferTimeout", "TransportError", "UnknownRequest", "UsageError"]


class KVFerryError(Exception):
    """Base of every error kvferry raises."""


class UsageError(KVFerryError, ValueError):
    """A call that cannot be right: an invalid option or argument (digest mode, deadlines, an empty
    secret), a request id the endpoint does not know, or a request in the wrong state for the call."""


class UnknownRequest(UsageError):
    """Decode announced a request id this prefill never issued (and, by the engine's order, never will):
    refused at once rather than at ``request_timeout`` (``EndpointOptions.refuse_unissued``)."""


class EndpointClosed(KVFerryError, RuntimeError):
    """The endpoint is closed, or its progress loop stopped; the cause, if any, is chained."""


class LayoutError(KVFerryError, ValueError):
    """A layout or a memory binding is invalid (sizes, names, regions)."""


class PlanError(KVFerryError, ValueError):
    """Page lists do not fit the layouts: lengths, duplicates, bounds or shapes."""


class HandshakeError(KVFerryError):
    """The two endpoints could not complete the handshake."""


class IncompatiblePeer(HandshakeError):
    """The peer's layout shape, protocol version or secret does not match ours."""


class ModeMismatch(IncompatiblePeer):
    """The peers do not agree on a transfer mode: one pushes (prefill writes), the other pulls (decode reads)."""


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


class RequestAborted(KVFerryError):
    """A request was aborted (``abort``), by this side's caller or by the peer's; what a failed request's
    ``failure()`` is then."""


class IntegrityError(KVFerryError):
    """Bytes arrived that differ from the bytes sent."""


class PageMismatchError(IntegrityError):
    """Pages differ from what was sent. ``mismatches`` lists every one; the message names the first."""

    def __init__(self, mismatches: Sequence[Any], num_checked: int, mode: str) -> None:
        # ``kvferry.integrity.PageMismatch`` objects (typed loosely: this module imports nothing of kvferry's)
        self.mismatches: tuple[Any, ...] = tuple(mismatches)
        self.num_checked = num_checked
        counts: dict[str, int] = {}
        for m in self.mismatches:
            counts[m.buffer] = counts.get(m.buffer, 0) + 1
        hit = ", ".join(f"{name} x{n}" for name, n in list(counts.items())[:8])
        more = f" and {len(counts) - 8} more" if len(counts) > 8 else ""
        super().__init__(f"{len(self.mismatches)} of {num_checked} pages checked ({mode} digests) "
                         f"differ from what was sent; first: {self.mismatches[0]}; buffers hit: {hit}{more}")


class BindingMismatch(IntegrityError):
    """The tokens decode announced a request for are not the tokens prefill computed its KV from: the
    hand-off would serve another prompt's context. Refused before any byte moves; the message names both
    sides' request ids and the first block that differs."""


class ProtocolError(KVFerryError):
    """A control message that cannot be decoded, has the wrong version, is too large, or breaks the flow."""


class OutOfPages(KVFerryError):
    """An allocator has fewer free pages than asked for (callers check ``can_allocate`` first)."""


class FaultSpecError(KVFerryError, ValueError):
    """A fault specification string that cannot be parsed (a ValueError, so argparse reports it)."""


class InternalError(KVFerryError, RuntimeError):
    """A kvferry bug caught in the act, e.g. an illegal state transition: never a peer's bad message. The
    endpoints fail the requests it touches closed and log it at ERROR, naming the request and both states."""
