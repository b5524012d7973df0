"""Whether a quarantined part's writer can still write: the shell's answer to ``DecodeCore``'s ``CheckWriter``.

Part of the control plane's shell, above ``core.links``, ``liveness`` and the transports, below ``decode``.
The quarantine itself (which pages, until when) is the core's (``core.quarantine``, ``core.decode``); this
asks the world: the transport (a closed local peer, or one that dropped us) and the process table.
"""

from __future__ import annotations

from kvferry.control.core.links import Link
from kvferry.control.liveness import is_gone
from kvferry.transport import Transport

__all__ = ["writer_gone"]


def writer_gone(transport: Transport, link: Link) -> bool:
    """True only when the prefill behind ``link`` certainly cannot write here any more: the transport
    guarantees it (a closed local peer, or one that dropped us), or its process is gone on this host."""
    if link.agent and not transport.peer_may_write(link.agent):
        return True
    return link.process is not None and is_gone(link.process) is True
