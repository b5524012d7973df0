"""Decode's handshake: a link opened, its Hello answered, prefill's Welcome checked, and its recovery.

Part of ``core.decode`` (no I/O), above ``admission`` and ``links``. A link sends Hello (the shell opens its
socket: ``OpenLink``); a Challenge is answered with the secret's MAC; a Welcome is checked
(``admission.check_welcome``, the transfer mode) and prefill's transport agent added (``AddPeer``, answered
by ``DecodeCore.peer_added``). A link to a prefill this decode declared dead is re-opened while pages it
may still write stay quarantined (``recover``), and that prefill is asked to settle them (``resettle``).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from kvferry.control import wire
from kvferry.control.core.admission import auth_mac, check_welcome
from kvferry.control.core.base import AddPeer, FlushNow
from kvferry.control.core.decode_effects import CloseLink, OpenLink
from kvferry.control.core.links import Link
from kvferry.control.core.process import ProcessIdentity
from kvferry.control.core.pull_reads import welcome_pull
from kvferry.control.core.states import LinkState
from kvferry.control.core.timers import PeerClock
from kvferry.control.pull import is_mode_refusal
from kvferry.errors import (
    HandshakeError,
    IncompatiblePeer,
    KVFerryError,
    ModeMismatch,
    ProtocolError,
)
from kvferry.integrity import DigestMode

if TYPE_CHECKING:
    from kvferry.control.core.decode import DecodeCore

__all__ = ["Handshake"]


class Handshake:
    """The handshake's decisions, on ``core``'s links."""

    def __init__(self, core: DecodeCore) -> None:
        self.core = core

    def new_link(self, address: str, deadline: float) -> Link:
        core = self.core
        clock = PeerClock(core.now, core.options.heartbeat_interval, core.options.peer_timeout)
        return Link(address, deadline, clock, core.entropy(16).hex(), core.entropy(32))

    def open_link(self, link: Link) -> None:
        """Ask the shell to open ``link``'s socket and send its Hello."""
        core = self.core
        me, opts = core.setup.process, core.options
        hello = wire.Hello(link.session, core.memory.manifest(), core.setup.transport, core.setup.transport_metadata,
                           link.nonce, core.digest_mode, opts.heartbeat_interval, link.mode, opts.peer_timeout,
                           me.host, me.pid, me.started)
        link.hello = wire.encode(hello)
        core.effects.append(OpenLink(link, link.hello))

    def on_handshake(self, link: Link, msg: Any) -> None:
        if isinstance(msg, wire.Reject):
            error = ModeMismatch if is_mode_refusal(msg.reason) else IncompatiblePeer
            self.link_failed(link, error(f"prefill {link.address} refused: {msg.reason}"))
        elif isinstance(msg, wire.Bye):  # e.g. it dropped our half-open session: no use waiting
            self.link_failed(link, HandshakeError(f"prefill {link.address} ended the handshake: {msg.reason}"))
        elif isinstance(msg, wire.Challenge):
            self.answer_challenge(link, msg)
        elif isinstance(msg, wire.Welcome):
            self.accept_welcome(link, msg)
        else:
            raise ProtocolError(f"unexpected {type(msg).__name__} during the handshake")

    def answer_challenge(self, link: Link, msg: wire.Challenge) -> None:
        core = self.core
        secret = core.setup.secret
        if secret is None:
            self.link_failed(link, IncompatiblePeer(f"prefill {link.address} requires a shared secret and "
                                                    "none is configured here"))
            return
        link.server_nonce = msg.nonce
        core.send(link, wire.Auth(auth_mac(secret, b"decode", msg.nonce, link.nonce, link.hello)))

    def accept_welcome(self, link: Link, msg: wire.Welcome) -> None:
        core = self.core
        problem = check_welcome(core.memory, core.setup.secret, link, msg) or welcome_pull(core.options, link, msg)
        if problem is not None:
            self.link_failed(link, problem)
            return
        link.digest_mode = DigestMode.from_peer(msg.digest_mode)
        link.process = ProcessIdentity(msg.host, msg.pid, msg.started) if msg.pid else None
        core.adding[link] = []
        core.effects.append(AddPeer(link, msg.transport_meta))

    def resettle(self, link: Link) -> None:
        """``link`` reaches a prefill (same transport agent) this decode declared dead: ask it to settle
        every request of ours it may still be writing. The parts move to the new link, where the settled
        Fail arrives."""
        core = self.core
        for rec in core.by_gen.values():
            for old, part in list(rec.parts.items()):
                if part.settled or old is link or old.established or old.agent != link.agent:
                    continue
                del rec.parts[old]
                part.link, part.told = link, True
                rec.parts[link] = part
                core.send(link, wire.Abort(rec.request_id, rec.generation,
                                           "decode declared this prefill dead: settle this generation"))

    def link_failed(self, link: Link, error: KVFerryError) -> None:
        """A handshake failed: what was queued for it leaves, then a Bye saying why, then it closes."""
        if link.connecting:
            link.error = error
            link.move(LinkState.FAILED)
            self.core.effects.append(FlushNow(link, wire.encode(wire.Bye(str(error)[:wire.MAX_REASON_LEN]))))
            self.close_link(link)

    def close_link(self, link: Link) -> None:
        core = self.core
        core.effects.append(CloseLink(link))
        core.changed = True

    def recover(self, dead: Link, now: float) -> None:
        """Handshake again with the prefill behind ``dead`` (every ``peer_timeout`` while none is open): a
        stalled prefill that resumed then settles what decode quarantined (``resettle``), and serves
        again. Only an acknowledgement or a certain death frees pages a live writer may still reach."""
        core = self.core
        current = core.links.get(dead.address)
        if now < dead.retry_at or (current is not None and (current.connecting or current.established)):
            return
        dead.retry_at = now + core.options.peer_timeout
        link = self.new_link(dead.address, now + core.options.handshake_timeout)
        link.expect = (dead.rank, dead.tp_size)
        link.mode = dead.mode
        core.links[dead.address] = link
        self.open_link(link)
