"""Request, session and link states, and the transitions allowed between them.

Part of the protocol core (no I/O), below every other control module. Every state change of a request, a
prefill's session with a decode peer and a decode's link to a prefill goes through ``advance`` against its
table, so a request can never leave ``DONE`` or ``FAILED`` nor reach ``DONE`` without its bytes having
moved, and a dead session is never revived (a reconnecting peer gets a new one). A transition the table does
not allow is a kvferry bug: ``InternalError``, which the endpoints fail closed on and log at ERROR, never
counted as a peer's bad message. The tables are rendered into docs/protocol.md (``render_table``; a test
checks the page matches the code).
"""

from __future__ import annotations

from enum import Enum
from typing import TypeVar

from kvferry.errors import InternalError

__all__ = ["LINK_TRANSITIONS", "SESSION_TRANSITIONS", "TERMINAL", "TRANSITIONS", "LinkState", "RequestState",
           "SessionState", "advance", "can_advance", "check_transition", "render_table"]

S = TypeVar("S", bound=Enum)


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


class SessionState(Enum):
    """Prefill's session with one decode peer (keyed by its ZMQ identity).

    * ``CHALLENGED``: Hello received; with a secret, the Challenge sent and Auth awaited. A half-open
      session past the handshake deadline, or beyond ``MAX_HALF_OPEN``, is forgotten, not moved.
    * ``ESTABLISHED``: Welcome sent; announces, verdicts and heartbeats flow.
    * ``DEAD``: the peer left (Bye), went silent past ``peer_timeout``, or this process stalled so long that
      the peer has given up on it; or the endpoint's loop stopped. A reconnect is a new session. Terminal.
    """

    CHALLENGED = "challenged"
    ESTABLISHED = "established"
    DEAD = "dead"


class LinkState(Enum):
    """Decode's link to one prefill (one ZMQ DEALER socket).

    * ``CONNECTING``: Hello sent, Welcome (or Challenge, then Welcome) awaited until the handshake deadline.
    * ``ESTABLISHED``: announces, chunks, verdicts and heartbeats flow.
    * ``DEAD``: an established link lost (Bye, silence past ``peer_timeout``, a dropped connection, a tripped
      pull fence, or the endpoint's loop stopped). Terminal: a reconnect opens a new link.
    * ``FAILED``: the handshake failed (refused, no answer in time, superseded). Terminal.
    """

    CONNECTING = "connecting"
    ESTABLISHED = "established"
    DEAD = "dead"
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

SESSION_TRANSITIONS: dict[SessionState, frozenset[SessionState]] = {
    SessionState.CHALLENGED: frozenset({SessionState.ESTABLISHED, SessionState.DEAD}),
    SessionState.ESTABLISHED: frozenset({SessionState.DEAD}),
    SessionState.DEAD: frozenset(),
}

LINK_TRANSITIONS: dict[LinkState, frozenset[LinkState]] = {
    LinkState.CONNECTING: frozenset({LinkState.ESTABLISHED, LinkState.FAILED}),
    LinkState.ESTABLISHED: frozenset({LinkState.DEAD}),
    LinkState.DEAD: frozenset(),
    LinkState.FAILED: frozenset(),
}

TERMINAL = frozenset({RequestState.DONE, RequestState.FAILED})


def can_advance(current: RequestState, new: RequestState) -> bool:
    """True when ``current -> new`` is allowed (staying in the same non-terminal state is allowed)."""
    return new in TRANSITIONS[current] or (new == current and current not in TERMINAL)


def advance(current: RequestState, new: RequestState, request_id: str) -> RequestState:
    """Return ``new`` if the request may move there; ``InternalError`` (a kvferry bug) otherwise."""
    if not can_advance(current, new):
        raise InternalError(f"request {request_id!r}: illegal state transition {current.value} -> {new.value}")
    return new


def check_transition(table: dict[S, frozenset[S]], current: S, new: S, what: str) -> S:
    """Return ``new`` if ``table`` allows ``current -> new`` (a session's or a link's); ``InternalError``
    naming ``what`` and both states otherwise."""
    if new not in table[current]:
        raise InternalError(f"{what}: illegal state transition {current.value} -> {new.value}")
    return new


def render_table(table: dict[S, frozenset[S]]) -> str:
    """``table`` as a Markdown table (from, to), in declaration order: what docs/protocol.md shows."""
    lines = ["| from | may move to |", "|---|---|"]
    for state, targets in table.items():
        order = [s for s in type(state) if s in targets]
        lines.append(f"| `{state.value}` | {', '.join(f'`{s.value}`' for s in order) or '(terminal)'} |")
    return "\n".join(lines)
