"""Prefill's handshake: a decode's Hello checked, challenged, admitted, and its session established.

Part of ``core.prefill`` (no I/O), above ``admission`` and ``sessions``. A Hello opens a session (challenged);
with a secret, decode's Auth must prove it; then the layouts and the transfer mode must agree
(``admission.check_hello``), the shell adds decode's transport agent (``AddPeer``, answered by
``PrefillCore.peer_added``), and Welcome establishes the session. A refusal is a ``Reject`` naming why.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from kvferry.control import wire
from kvferry.control.core.admission import auth_mac, check_auth, check_hello
from kvferry.control.core.base import AddPeer, FlushNow
from kvferry.control.core.sessions import Session, drop_half_open
from kvferry.control.core.states import SessionState
from kvferry.control.core.timers import PeerClock
from kvferry.control.pull import mode_refusal
from kvferry.errors import PeerLost, ProtocolError
from kvferry.integrity import DigestMode

if TYPE_CHECKING:
    from kvferry.control.core.prefill import PrefillCore

__all__ = ["Handshake"]


class Handshake:
    """The handshake's decisions, on ``core``'s sessions."""

    def __init__(self, core: PrefillCore) -> None:
        self.core = core

    def on_hello(self, identity: bytes, session: Session | None, msg: wire.Hello, data: bytes) -> None:
        core = self.core
        if session is not None and session.established:
            raise ProtocolError(f"Hello on the established {session.label}")
        core.sessions.pop(identity, None)
        drop_half_open(core.sessions)
        now = core.now
        session = Session(identity, msg, bytes(data), now + core.options.handshake_timeout,
                          PeerClock(now, core.options.heartbeat_interval, core.options.peer_timeout),
                          core.entropy(32))
        core.sessions[identity] = session
        if core.setup.secret is not None:
            core.send_msg(session, wire.Challenge(session.nonce))
        else:
            self.admit(session)

    def on_auth(self, session: Session, msg: Any) -> None:
        secret = self.core.setup.secret
        if not isinstance(msg, wire.Auth) or secret is None:
            raise ProtocolError(f"expected Auth from {session.label}, got {type(msg).__name__}")
        if not check_auth(secret, session, msg.mac):
            self.reject(session.identity, "authentication failed: the shared secret does not match")
            return
        self.admit(session)

    def admit(self, session: Session) -> None:
        """The Hello (and the secret) checked out so far: check the layouts and the mode, then ask the
        shell to add decode's transport agent (``peer_added`` goes on)."""
        core = self.core
        setup = core.setup
        problem = (check_hello(core.memory, setup.transport, setup.descriptors, session)
                   or self.mode_problem(session))
        if problem is not None:
            self.reject(session.identity, problem)
            return
        core.effects.append(AddPeer(session.identity, session.hello.transport_meta))

    def establish(self, session: Session) -> None:
        core = self.core
        for other in list(core.sessions.values()):
            if other is not session and other.agent == session.agent and other.established:
                why = PeerLost(f"{other.label} replaced by a new session of the same agent")
                core.liveness.session_dead(other, why)
        session.digest_mode = DigestMode.from_peer(session.hello.digest_mode)
        session.move(SessionState.ESTABLISHED)
        self.note_sessions()
        secret = core.setup.secret
        proof = b"" if secret is None else auth_mac(secret, b"prefill", session.hello.nonce, session.nonce,
                                                   session.hello_bytes)
        me = core.setup.process
        core.send_msg(session, wire.Welcome(core.entropy(8).hex(), core.memory.manifest(),
                                            core.setup.transport_metadata, proof, core.options.heartbeat_interval,
                                            core.digest_mode.stronger(session.digest_mode), me.host, me.pid,
                                            me.started, session.mode, core.options.peer_timeout))

    def mode_problem(self, session: Session) -> str | None:
        """Why decode's transfer mode cannot be served, or None: refused before any byte moves."""
        core = self.core
        modes = core.setup.modes
        if session.mode not in modes:
            return mode_refusal(session.label, session.mode, modes)
        return None

    def reject(self, identity: bytes, reason: str) -> None:
        core = self.core
        core.sessions.pop(identity, None)
        core.effects.append(FlushNow(identity, wire.encode(wire.Reject(reason[:wire.MAX_REASON_LEN]))))

    def note_sessions(self) -> None:
        """After an established session came or went: whether ``send`` should hash source pages. Whole-page
        digests hashed in ``send`` serve only peers of equal TP and page sizes; when every connected peer is
        a cross-TP rank or translates page sizes they would be thrown away (its chunks get digests from the
        plan)."""
        core = self.core
        sessions = [s for s in core.sessions.values() if s.established]
        core.hash_in_send = not sessions or any(s.planner is None and s.translator is None for s in sessions)
