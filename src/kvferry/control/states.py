"""Request states and the transitions allowed between them, shared by both endpoints.

The bottom of the control plane, below every other control module. Every state change of a request goes through
``advance``, so a request can never leave ``DONE`` or ``FAILED`` and never jump from bootstrapping to done
without its bytes having moved: the bugs where a failed transfer finished as success start with a state
machine that allowed it.
"""

from __future__ import annotations

from enum import Enum

from kvferry.errors import ProtocolError

__all__ = ["TERMINAL", "TRANSITIONS", "RequestState", "advance", "can_advance"]


class RequestState(str, Enum):
    """Where one request stands, on either side.

    * ``BOOTSTRAPPING``: known on this side only; the peer has not confirmed it (decode: announce not yet
      acknowledged; prefill: ``send`` called, decode's announcement not yet received).
    * ``WAITING_FOR_INPUT``: both sides know it; no write posted or landed yet (the KV is not ready).
    * ``TRANSFERRING``: at least one write posted (prefill) or landed (decode), the last not yet done.
    * ``DONE``: every write landed and was verified. Terminal.
    * ``FAILED``: aborted, timed out, refused, peer lost, or bytes did not verify. Terminal.
    """

    BOOTSTRAPPING = "bootstrapping"
    WAITING_FOR_INPUT = "waiting_for_input"
    TRANSFERRING = "transferring"
    DONE = "done"
    FAILED = "failed"


TRANSITIONS: dict[RequestState, frozenset[RequestState]] = {
    # Prefill goes straight to TRANSFERRING when decode announces after the KV was already handed over.
    RequestState.BOOTSTRAPPING: frozenset({RequestState.WAITING_FOR_INPUT, RequestState.TRANSFERRING,
                                           RequestState.FAILED}),
    RequestState.WAITING_FOR_INPUT: frozenset({RequestState.TRANSFERRING, RequestState.FAILED}),
    # DONE only from TRANSFERRING: success needs a write that landed.
    RequestState.TRANSFERRING: frozenset({RequestState.DONE, RequestState.FAILED}),
    RequestState.DONE: frozenset(),
    RequestState.FAILED: frozenset(),
}

TERMINAL = frozenset({RequestState.DONE, RequestState.FAILED})


def can_advance(current: RequestState, new: RequestState) -> bool:
    """True when ``current -> new`` is allowed (staying in the same non-terminal state is allowed)."""
    return new in TRANSITIONS[current] or (new == current and current not in TERMINAL)


def advance(current: RequestState, new: RequestState, request_id: str) -> RequestState:
    """Return ``new`` if the transition is allowed; raise ``RuntimeError`` (a kvferry bug) otherwise."""
    if not can_advance(current, new):
        raise ProtocolError(f"request {request_id!r}: illegal state transition {current.value} -> {new.value}")
    return new
