"""Transports: move a plan's rows into a peer's memory. ``nixl`` and ``mooncake`` are imported only when used."""

from __future__ import annotations

import importlib.util
from typing import Any

from kvferry.errors import UsageError
from kvferry.transport.base import (
    RowBuffer,
    TransferHandle,
    Transport,
    check_plan_in_regions,
    check_rows_in_regions,
)
from kvferry.transport.local import LocalTransport

__all__ = ["TRANSPORTS", "LocalTransport", "RowBuffer", "TransferHandle", "Transport", "check_plan_in_regions",
           "check_rows_in_regions", "make_transport", "mooncake_available", "nixl_available"]


def nixl_available() -> bool:
    """Whether a NIXL build is installed (the ``nixl`` meta package or one of its backends), without
    importing it: the import costs a second and, for ``nixl`` itself, torch."""
    return any(importlib.util.find_spec(name) is not None for name in ("nixl", "nixl_cu13", "nixl_cu12"))


# System libraries the Mooncake wheel links and does not bundle (Debian: libibverbs1, librdmacm1, libnuma1,
# libcurl4): without one of them ``import mooncake.engine`` fails.
MOONCAKE_SYSTEM_LIBS = ("ibverbs", "rdmacm", "numa", "curl")


def mooncake_available() -> bool:
    """Whether Mooncake's Transfer Engine is installed and its system libraries are present, without importing
    it (scripts/setup.sh installs both where it can)."""
    if importlib.util.find_spec("mooncake") is None:
        return False
    import ctypes.util

    return all(ctypes.util.find_library(name) for name in MOONCAKE_SYSTEM_LIBS)


TRANSPORTS = ("local", "nixl", "mooncake")


def make_transport(kind: str, **kwargs: Any) -> Transport:
    """``"local"``, ``"nixl"`` or ``"mooncake"``; keyword arguments go to the transport's constructor."""
    if kind == "local":
        return LocalTransport(**kwargs)
    if kind == "nixl":
        from kvferry.transport.nixl import NixlTransport

        return NixlTransport(**kwargs)
    if kind == "mooncake":
        from kvferry.transport.mooncake import MooncakeTransport

        return MooncakeTransport(**kwargs)
    raise UsageError(f"unknown transport {kind!r} (expected one of {', '.join(map(repr, TRANSPORTS))})")
