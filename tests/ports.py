"""Ports for servers the tests start, picked outside the kernel's ephemeral range.

A port found free by binding to 0 comes from the ephemeral range, the one the kernel also hands to every
outgoing connection. An engine server binds its port only after its imports (tens of seconds here), and
meanwhile any process's outgoing connection may be given that port: seen in a clean-clone run on
2026-12-03, SGLang's plain server failed with ``[Errno 98] ... address already in use`` and the whole
SGLang server suite errored. Below the ephemeral range only listeners that choose a port themselves can
take one, and each port is handed out once per test process.
"""

from __future__ import annotations

import random
import socket
from pathlib import Path

__all__ = ["server_port"]

_GIVEN: set[int] = set()
_RNG = random.SystemRandom()


def _ephemeral_start() -> int:
    try:
        return int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    except (OSError, ValueError, IndexError):
        return 32768   # Linux's default


def server_port(host: str = "127.0.0.1") -> int:
    """A port no one listens on now, below the ephemeral range, not given before in this process."""
    top = _ephemeral_start()
    low = max(1024, top - 12000)
    for _ in range(200):
        port = _RNG.randrange(low, top)
        if port in _GIVEN:
            continue
        with socket.socket() as sock:
            try:
                sock.bind((host, port))
            except OSError:
                continue
        _GIVEN.add(port)
        return port
    raise RuntimeError(f"no free port in {low}..{top - 1} on {host}")
