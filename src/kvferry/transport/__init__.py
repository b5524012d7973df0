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


def mooncake_available() -> bool:
    """Whether Mooncake's Transfer Engine is installed, without importing it."""
    return importlib.util.find_spec("mooncake") is not None


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
