"""Transfer modes, and what both sides of pull mode share: the mode handshake and the timing rules.

Part of the control plane, above ``wire`` and ``links``, below ``core.pull_reads`` (decode) and ``pull_source``
(prefill). In **push** mode prefill writes into decode's leased pages (one-sided writes, fenced by decode's
quarantine). In **pull** mode decode reads prefill's source pages into its own leased pages: only decode ever
writes decode's memory, so its lease ends as soon as its own reads are terminal, and prefill instead holds
its *source* pages until decode is done with them (docs/fencing.md has the argument).

The mode is chosen per endpoint pair: decode's Hello names the mode it asks for, prefill refuses (a Reject
whose reason starts with ``MODE_REFUSAL``) a mode it does not accept, and decode refuses a Welcome naming
another mode. Both raise ``ModeMismatch`` on decode's side, before any byte moves.
"""

from __future__ import annotations

from collections.abc import Iterable

from kvferry.errors import ModeMismatch, UsageError

__all__ = ["ACCEPTED_BY_DEFAULT", "DECODE_MODES", "DEFAULT_MODE", "MODES", "MODE_REFUSAL", "accepted_modes",
           "check_decode_mode", "check_mode", "check_pull_options", "fence_s", "is_mode_refusal", "mode_for",
           "mode_refusal", "source_hold_s"]

MODES = ("push", "pull")
# What a decode may ask for: a mode, or "auto", which picks one per prefill address (``mode_for``).
DECODE_MODES = ("auto", *MODES)
# Decode's default: push to a prefill on this host, pull to one elsewhere. Push needs no source hold on
# prefill and one message fewer per chunk; but on another host no certain death exists, so a prefill that
# dies there would leave push mode's quarantined pages held until it came back: pull holds nothing forever.
DEFAULT_MODE = "auto"
# A prefill accepts both unless told otherwise: decode chooses.
ACCEPTED_BY_DEFAULT = MODES
# Prefill's Reject reasons about the mode start with this, so decode can raise ModeMismatch for them.
MODE_REFUSAL = "transfer mode"


def check_mode(mode: str) -> str:
    """``mode`` if it is ``"push"`` or ``"pull"``, else ``UsageError``."""
    if mode not in MODES:
        raise UsageError(f"transfer mode must be one of {list(MODES)}, got {mode!r}")
    return mode


def check_decode_mode(mode: str) -> str:
    """``mode`` if it is ``"auto"``, ``"push"`` or ``"pull"``, else ``UsageError``."""
    if mode not in DECODE_MODES:
        raise UsageError(f"transfer mode must be one of {list(DECODE_MODES)}, got {mode!r}")
    return mode


def mode_for(mode: str, address: str) -> str:
    """The mode decode asks of the prefill at ``address``: ``mode`` itself, or for ``"auto"`` push when the
    address is a loopback one (the prefill runs on this host, where its death is certain once its process is
    gone: docs/fencing.md) and pull otherwise (another host, or this host's address on a network: nothing then
    waits on a prefill that may never come back)."""
    if mode != "auto":
        return mode
    return "push" if _loopback(address) else "pull"


def _loopback(address: str) -> bool:
    import ipaddress
    from urllib.parse import urlsplit

    try:
        host = urlsplit(address).hostname or ""
    except ValueError:
        return False
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False   # a name: it may resolve anywhere, so it is treated as another host


def check_pull_options(peer_timeout: float, heartbeat_interval: float) -> None:
    """Pull mode's fence is ``peer_timeout - heartbeat_interval`` of silence from decode; heartbeats must fit
    in it with room to spare, or a healthy link trips it. ``UsageError`` otherwise."""
    if peer_timeout < 3 * heartbeat_interval:
        raise UsageError(f"pull mode needs peer_timeout >= 3 x heartbeat_interval (its fence is peer_timeout - "
                         f"heartbeat_interval), got peer_timeout {peer_timeout:g} s, heartbeat_interval "
                         f"{heartbeat_interval:g} s")


def accepted_modes(modes: str | Iterable[str]) -> frozenset[str]:
    """Prefill's accepted modes from one mode or several (each checked); never empty."""
    chosen = frozenset(check_mode(m) for m in ([modes] if isinstance(modes, str) else modes))
    if not chosen:
        raise UsageError(f"a prefill must accept at least one transfer mode of {list(MODES)}")
    return chosen


def mode_refusal(decode: str, asked: str, accepted: frozenset[str]) -> str:
    """Prefill's Reject reason: names the decode, the mode it asked for and the modes accepted here."""
    return (f"{MODE_REFUSAL} differs: {decode} asked for {asked!r}, this prefill accepts "
            f"{sorted(accepted)} (choose the mode with DecodeEndpoint(mode=...) or connect(mode=...))")


def is_mode_refusal(reason: str) -> bool:
    return reason.startswith(MODE_REFUSAL)


def welcome_mismatch(address: str, asked: str, agreed: str) -> ModeMismatch:
    """Decode's error for a Welcome that names another mode than the one decode asked for."""
    return ModeMismatch(f"prefill {address} welcomed us in transfer mode {agreed!r}, expected {asked!r}")


def fence_s(own_peer_timeout: float, peer_peer_timeout: float, heartbeat_interval: float) -> float:
    """Decode's pull-mode fence: the longest gap between two of its own messages to prefill after which it
    accepts no more reads on that link. Below either side's ``peer_timeout`` by a heartbeat interval, so a
    decode that stalls long enough for prefill to declare it dead always notices first."""
    return max(heartbeat_interval, min(own_peer_timeout, peer_peer_timeout) - heartbeat_interval)


def source_hold_s(own_peer_timeout: float, peer_peer_timeout: float, lease_grace: float) -> float:
    """How long after declaring a pull session dead prefill still holds its source pages for decode: two
    ``peer_timeout`` (decode's own silence check, plus how late a frame it reads may be stamped) and
    ``lease_grace`` (bytes still on the wire). docs/fencing.md derives it."""
    return 2 * max(own_peer_timeout, peer_peer_timeout) + lease_grace
