"""Decode's own effects: what its core asks of the shell beyond the base's (``core.base``).

Part of ``core.decode`` (no I/O), at its bottom.
"""

from __future__ import annotations

from dataclasses import dataclass

from kvferry.control.core.base import Effect
from kvferry.control.core.links import Link

__all__ = ["QUARANTINE_CHECK_S", "CheckWriter", "CloseLink", "OpenLink", "TakeNotifications"]

QUARANTINE_CHECK_S = 0.05   # how often the writers of quarantined parts are asked about (/proc reads)


@dataclass(frozen=True, slots=True)
class OpenLink(Effect):
    """Open ``link``'s socket (a DEALER connected to ``link.address``, watched for drops) and send ``hello``
    on it as its first frame."""

    link: Link
    hello: bytes


@dataclass(frozen=True, slots=True)
class CloseLink(Effect):
    """Close ``link``'s socket now; what is still queued for it is dropped."""

    link: Link


@dataclass(frozen=True, slots=True)
class CheckWriter(Effect):
    """Ask whether the prefill behind ``link`` certainly cannot write here any more (``link.agent``,
    ``link.process``); answer with ``DecodeCore.writer_checked``."""

    link: Link


@dataclass(frozen=True, slots=True)
class TakeNotifications(Effect):
    """Feed every transport notification already waiting (``on_notification``), then answer with
    ``DecodeCore.notifications_taken``: what a settled Fail waits for before it ends a lease."""
