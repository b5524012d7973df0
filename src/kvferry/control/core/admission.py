"""Handshake admission: what each side checks of the other before a session is established.

Part of the control plane, between ``wire`` (the messages) and the endpoints (which run the
handshake). Prefill checks decode's Hello (``check_hello``), decode checks prefill's Welcome
(``check_welcome``). Both compare layouts the same way (``layout_difference``: the shapes at equal TP
sizes, the model across them) and both check that the decode rank needs that prefill rank; across TP each
side keeps what slicing heads needs (prefill a planner, decode the slices it verifies). The secret's MACs
are ``auth_mac``; comparing them, constant-time, happens here. Part of the protocol core (no I/O): adding
the peer's transport agent is the shell's (``core.prefill``'s ``AddPeer``, decode's Welcome handling).
"""

from __future__ import annotations

import hashlib
import hmac

from kvferry.control import wire
from kvferry.control.core.links import Link
from kvferry.control.core.sessions import Session
from kvferry.errors import HandshakeError, IncompatiblePeer, KVFerryError, LayoutError, UsageError
from kvferry.layout.compare import model_difference, shape_difference, translation_difference
from kvferry.layout.memory import KVMemory
from kvferry.layout.spec import Layout
from kvferry.plan.tokens import PageSizePlanner, moves_sections
from kvferry.plan.tp import TPPlanner, source_ranks

__all__ = ["as_secret", "auth_mac", "check_auth", "check_hello", "check_welcome", "layout_difference", "translates"]


def auth_mac(secret: bytes, role: bytes, nonce_a: bytes, nonce_b: bytes, hello: bytes) -> bytes:
    """HMAC-SHA256 binding a role, both nonces and the exact Hello bytes (so the manifest cannot be swapped)."""
    msg = b"kvferry-auth/" + role + b"\0" + nonce_a + nonce_b + hashlib.sha256(hello).digest()
    return hmac.new(secret, msg, hashlib.sha256).digest()


def as_secret(secret: str | bytes | None) -> bytes | None:
    if secret is None:
        return None
    out = secret.encode() if isinstance(secret, str) else bytes(secret)
    if not out:
        raise UsageError("an empty secret would authenticate anyone: pass None for no secret")
    return out


def layout_difference(local: Layout, other: Layout) -> str | None:
    """The first difference that forbids writing between the two layouts, or None: at equal TP sizes the
    shapes must match but for pools' page sizes, which are translated where every token's bytes match
    (``translation_difference``); across TP sizes the two must be one model (heads are sliced between them)
    with equal page sizes."""
    if local.tp_size != other.tp_size:
        for lp, rp in zip(local.pools, other.pools):
            if lp.name == rp.name and lp.tokens_per_page != rp.tokens_per_page:
                return (f"pool {lp.name!r}: tokens_per_page differs (local {lp.tokens_per_page}, remote "
                        f"{rp.tokens_per_page}) and tp_size differs (local {local.tp_size}, remote "
                        f"{other.tp_size}): page sizes are translated between equal TP sizes only")
        return model_difference(local, other)
    if shape_difference(local, other) is None:
        return None
    return translation_difference(local, other)


def translates(local: Layout, other: Layout) -> bool:
    """Whether plans between the two (admitted) layouts map token ranges rather than whole pages: a pool's
    page size differs, or a state page is padded (on either side), whose sections alone move: moving its
    padding too cost 3.3x the real state bytes on vLLM's hybrid Mamba2 pages (bench/RESULTS.md)."""
    return _first_translated(local, other) is not None


def _first_translated(local: Layout, other: Layout) -> str | None:
    """The first pool ``translates`` finds, named for messages, or None."""
    return next((lp.name for lp, rp in zip(local.pools, other.pools)
                 if lp.tokens_per_page != rp.tokens_per_page
                 or any(moves_sections(lb, rb) for lb, rb in zip(lp.buffers, rp.buffers))), None)


# -- prefill admits decode -------------------------------------------------------------------------------
def check_auth(secret: bytes, session: Session, mac: bytes) -> bool:
    """Prefill side: whether decode's Auth proves the shared secret for this session's Hello."""
    want = auth_mac(secret, b"decode", session.nonce, session.hello.nonce, session.hello_bytes)
    return hmac.compare_digest(mac, want)


def check_hello(memory: KVMemory, transport: str, descriptors: str, session: Session) -> str | None:
    """Prefill side: why decode's Hello cannot be admitted, or None. ``transport``: this side's transport
    name; ``descriptors``: how it posts plans (NIXL's ``descriptors`` option; "dlist" for others). On
    success the session knows the remote memory and its TP planner (across TP)."""
    hello = session.hello
    if hello.transport != transport:
        return f"transport differs: prefill uses {transport!r}, decode {hello.transport!r}"
    try:
        session.remote = KVMemory.from_manifest(hello.manifest)
    except LayoutError as exc:
        return f"malformed manifest: {exc}"
    return _check_decode_rank(memory, descriptors, session, session.remote)


def _check_decode_rank(memory: KVMemory, descriptors: str, session: Session, remote: KVMemory) -> str | None:
    """Equal TP sizes: the shapes must match. Different: one model, and the session gets a planner
    that writes this rank's head slices. Either way decode's rank must need this prefill rank."""
    local, other = memory.layout, remote.layout
    diff = layout_difference(local, other)
    if diff is not None:
        return f"layouts differ (local: prefill, remote: decode): {diff}"
    need = source_ranks(other.tp_rank, local.tp_size, other.tp_size)
    if local.tp_rank not in need:
        return (f"decode rank {other.tp_rank} of TP {other.tp_size} needs prefill ranks {list(need)} of TP "
                f"{local.tp_size}; this prefill is rank {local.tp_rank}")
    if local.tp_size != other.tp_size:
        if descriptors == "prepped":  # "auto" posts TP plans as rows
            return "cross-TP writes move slices of pages: the transport must use descriptors='dlist' or 'auto'"
        session.planner = TPPlanner(memory, remote)  # slices derived once per session
    elif (pool := _first_translated(local, other)) is not None:
        if descriptors == "prepped":
            return (f"pool {pool!r}: writes between page sizes, or of a padded state page's sections, move pieces "
                    "of pages: the transport must use descriptors='dlist' or 'auto'")
        session.translator = PageSizePlanner(memory, remote)  # per-buffer vectors built once per session
    return None


# -- decode admits prefill -------------------------------------------------------------------------------
def check_welcome(memory: KVMemory, secret: bytes | None, link: Link, msg: wire.Welcome) -> KVFerryError | None:
    """Decode side: why prefill's Welcome cannot be accepted (``IncompatiblePeer``, ``HandshakeError``), or
    None. On success the link knows prefill's rank and TP size, and across TP the slices it writes here."""
    if secret is not None:
        nonce = link.server_nonce
        want = auth_mac(secret, b"prefill", link.nonce, nonce or b"", link.hello)
        if nonce is None or not hmac.compare_digest(msg.proof, want):
            return IncompatiblePeer(f"prefill {link.address} did not prove the shared secret")
    try:
        remote = KVMemory.from_manifest(msg.manifest)
    except LayoutError as exc:
        return HandshakeError(f"prefill {link.address} sent a bad manifest: {exc}")
    problem = _check_prefill_rank(memory, link, remote)
    if problem is not None:
        return IncompatiblePeer(f"prefill {link.address} has an incompatible layout: {problem}")
    return None


def _check_prefill_rank(memory: KVMemory, link: Link, remote: KVMemory) -> str | None:
    """Equal TP sizes: the shapes must match; different: one model (the link then keeps the slices that
    prefill rank writes here, to check its digests). Either way this rank must need that prefill rank."""
    local, other = memory.layout, remote.layout
    diff = layout_difference(local, other)
    if diff is not None:
        return diff
    if link.expect is not None and (other.tp_rank, other.tp_size) != link.expect:
        return (f"it is rank {other.tp_rank} of TP {other.tp_size}, expected rank {link.expect[0]} of TP "
                f"{link.expect[1]} (is the address list in rank order, and complete?)")
    need = source_ranks(local.tp_rank, other.tp_size, local.tp_size)
    if other.tp_rank not in need:
        return (f"decode rank {local.tp_rank} of TP {local.tp_size} needs prefill ranks {list(need)} of TP "
                f"{other.tp_size}, not rank {other.tp_rank}")
    link.rank, link.tp_size = other.tp_rank, other.tp_size
    link.planner = TPPlanner(remote, memory) if local.tp_size != other.tp_size else None
    link.translator = PageSizePlanner(remote, memory) if link.planner is None and translates(local, other) else None
    return None
