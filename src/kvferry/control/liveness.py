"""Whether a writer process can still write: the identity prefill reports at the handshake, checked here.

Part of the control plane, above ``errors`` only, below ``decode`` and ``prefill``. A one-sided write
(NIXL over UCX cma, RDMA) needs no help from the process it writes into, so decode's timers cannot fence
it: a quarantined page is reusable only once the writer acknowledged (see ``decode``) or *cannot* write
any more. This module answers the second question, and only where the answer is certain: the writer runs
on this host (same boot, same PID namespace) and its process is gone (no such PID, a zombie, or the PID
now belongs to a process that started at another time). On another host it answers ``None``: unknown.
"""

from __future__ import annotations

import os
import socket
from functools import cache

from kvferry.control.core.process import ProcessIdentity

__all__ = ["ProcessIdentity", "is_gone", "this_process"]


@cache
def _host_key() -> str:
    parts = [socket.gethostname()]
    try:
        with open("/proc/sys/kernel/random/boot_id") as f:
            parts.append(f.read().strip())
        parts.append(str(os.stat("/proc/self/ns/pid").st_ino))
    except OSError:  # no /proc (not Linux): the hostname alone, and is_gone falls back to kill(pid, 0)
        pass
    return "/".join(parts)


def _stat(pid: int) -> tuple[str, int] | None:
    """(state letter, start time) of ``pid`` from /proc, or None when /proc does not say."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            text = f.read()
    except FileNotFoundError:
        return ("X", -1)  # no such process
    except OSError:
        return None
    # The command name (field 2) may hold spaces and parentheses: split after its last ')'.
    fields = text[text.rindex(")") + 2:].split()
    return fields[0], int(fields[19])


def this_process() -> ProcessIdentity:
    """This process, as prefill reports itself to decode in its Welcome."""
    pid = os.getpid()
    stat = _stat(pid)
    return ProcessIdentity(_host_key(), pid, stat[1] if stat is not None else 0)


def is_gone(ident: ProcessIdentity) -> bool | None:
    """True when ``ident``'s process certainly no longer exists (so it cannot write); False when it may;
    None when this host cannot tell (another host, or no PID reported)."""
    if ident.pid <= 0 or ident.host != _host_key():
        return None
    stat = _stat(ident.pid)
    if stat is not None:
        state, started = stat
        # Zombie or dead: its memory and its connections are gone. Another start time: the PID was reused.
        return state in ("Z", "X") or (ident.started > 0 and started != ident.started)
    try:
        os.kill(ident.pid, 0)
    except ProcessLookupError:
        return True
    except PermissionError:  # exists, owned by someone else
        return False
    return False
