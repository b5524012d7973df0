"""Prefill's view of its decode peers: one ``Session`` per decode rank that said Hello.

Part of the control plane, above ``wire``, below ``prefill``. A session is keyed by the decode's ZMQ identity
and goes challenged -> established -> dead. What a session must show to be established is
``admission``'s; what travels over it is ``prefill``'s. Mutated only under the endpoint's lock.
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING

import numpy as np

from kvferry.control import wire
from kvferry.control.core.process import ProcessIdentity
from kvferry.control.core.states import SESSION_TRANSITIONS, SessionState, check_transition
from kvferry.control.core.timers import PeerClock
from kvferry.integrity import DigestMode
from kvferry.layout.memory import KVMemory
from kvferry.layout.spec import Pool
from kvferry.plan.tokens import PageSizePlanner
from kvferry.plan.tp import TPPlanner

if TYPE_CHECKING:
    from kvferry.control.core.base import Transfer

__all__ = ["MAX_HALF_OPEN", "Session", "drop_half_open"]

MAX_HALF_OPEN = 256   # handshakes in progress; more are dropped (oldest first) so a flood cannot grow memory


class Session:
    """One decode peer, keyed by its ZMQ identity. ``state``: challenged -> established -> dead
    (``SessionState``; ``move`` checks each step against its table)."""

    def __init__(self, identity: bytes, hello: wire.Hello, hello_bytes: bytes, deadline: float,
                 clock: PeerClock, nonce: bytes) -> None:
        self.identity = identity
        self.hello = hello
        self.hello_bytes = hello_bytes
        self.nonce = nonce   # random, chosen by the caller (the core has no random source)
        self.state = SessionState.CHALLENGED
        self.deadline = deadline
        self.remote: KVMemory | None = None
        self.agent = ""
        self.digest_mode = DigestMode.OFF
        # Set at the handshake when decode runs another TP size: plans (and digests) are per head slice.
        self.planner: TPPlanner | None = None
        # Set at the handshake when a pool's page size differs on decode (equal TP): chunks map token ranges.
        self.translator: PageSizePlanner | None = None
        self._writes: dict[str, np.ndarray] = {}
        self.clock = clock   # when we last heard from this decode, and it from us (core.timers)
        # Set when this process sent it nothing for longer than peer_timeout (a stall, or a starved thread):
        # decode may have declared us dead. ``probe`` is the number we asked decode to echo (0: not asking);
        # until the echo, nothing is posted for the session (``parked``: transfers decided before the
        # stall, posted once it comes), and at ``probe_deadline`` without one the session ends.
        self.probe = 0
        self.probe_deadline = 0.0
        self.parked: list[Transfer] = []
        # The transfer mode agreed at the handshake, decode's peer_timeout and process (pull mode's
        # source hold ends early once that process is certainly gone).
        self.mode = hello.mode
        self.peer_timeout = hello.peer_timeout
        self.process = ProcessIdentity(hello.host, hello.pid, hello.started) if hello.pid else None
        # Pull mode: until decode's first verdict, prefill drives its transport's progress (busy): the first
        # read of a connection needs this side's answer to wire up (NIXL over UCX), and a progress thread
        # blocked in its idle poll would hold it up to a quarter heartbeat.
        self.read_once = False
        # The highest generation this decode announced here: its generations rise with each announce and a
        # connection keeps order, so one not above it is a copy (a replay, a duplicate), never a new hand-off.
        self.last_generation = 0
        # When the shell said this session's own connection dropped (transport_liveness): from then on,
        # until decode is heard again, silence decides (``Liveness.connected_for``).
        self.dropped_at = -math.inf

    def move(self, new: SessionState) -> None:
        """Move to ``new``; ``InternalError`` when the table does not allow it (a kvferry bug)."""
        self.state = check_transition(SESSION_TRANSITIONS, self.state, new, self.label)

    @property
    def established(self) -> bool:
        return self.state is SessionState.ESTABLISHED

    @property
    def label(self) -> str:
        return f"decode {self.hello.session[:12]}"

    @property
    def decode_rank(self) -> int:
        return 0 if self.remote is None else self.remote.layout.tp_rank

    def writes(self, pool: Pool) -> np.ndarray:
        """Bool per buffer of ``pool``: whether this prefill rank writes it to this decode rank (all, at
        equal TP; across TP a rank skips replicated buffers another rank sends)."""
        if self.planner is None:
            return np.ones(len(pool.buffers), dtype=bool)
        mask = self._writes.get(pool.name)
        if mask is None:  # once per pool and session: no per-buffer Python work per chunk
            mask = self._writes[pool.name] = np.array([b.name in self.planner.slices for b in pool.buffers])
        return mask


def drop_half_open(sessions: dict[bytes, Session]) -> None:
    """Make room for one more handshake: forget the oldest half-open sessions beyond ``MAX_HALF_OPEN - 1``."""
    half = [k for k, s in sessions.items() if s.state is SessionState.CHALLENGED]
    for key in half[:max(0, len(half) - MAX_HALF_OPEN + 1)]:
        del sessions[key]
