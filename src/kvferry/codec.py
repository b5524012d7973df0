"""Versioned msgpack payloads: one way to decode untrusted bytes, and to refuse another version by name.

Beside ``arrays``, just above ``errors``: every layer that puts a struct on the wire (the layout
manifest, the memory binding, page digests, transport metadata, the control protocol) decodes it here.
A payload is a ``msgspec.Struct`` whose first field is an int ``version``. Decoding takes two steps: the
version alone first (so a peer on another version is told "version 3 is not supported", not "malformed"),
then the whole struct, whose field types and bounds msgspec checks. Every failure raises the caller's
error type, naming what was decoded.
"""

from __future__ import annotations

import functools
from typing import Any, TypeVar

import msgspec

from kvferry.errors import KVFerryError

__all__ = ["check_version", "decode_struct", "decode_versioned", "encode"]

T = TypeVar("T")

_ENCODER = msgspec.msgpack.Encoder()


class _MapVersion(msgspec.Struct):
    version: int


class _ArrayVersion(msgspec.Struct, array_like=True):
    version: int


@functools.cache
def _decoder(typ: Any) -> msgspec.msgpack.Decoder:
    return msgspec.msgpack.Decoder(typ)


def encode(msg: object) -> bytes:
    """msgpack bytes of ``msg`` (a struct, or anything msgspec encodes)."""
    return _ENCODER.encode(msg)


def decode_struct(data: object, typ: type[T], *, what: str, error: type[KVFerryError]) -> T:
    """``data`` decoded as ``typ``; ``error`` when it is not bytes or does not decode (types, bounds)."""
    if not isinstance(data, (bytes, bytearray, memoryview, msgspec.Raw)):
        raise error(f"{what} must be bytes, got {type(data).__name__}")
    try:
        return _decoder(typ).decode(data)
    except (msgspec.DecodeError, msgspec.ValidationError) as exc:
        raise error(f"malformed {what}: {exc}") from exc


def check_version(found: int, expected: int, *, what: str, error: type[KVFerryError]) -> None:
    """Refuse a payload of another version, naming both."""
    if found != expected:
        raise error(f"{what} version {found} is not supported (this side speaks version {expected})")


def decode_versioned(data: object, typ: type[T], *, version: int, what: str, error: type[KVFerryError]) -> T:
    """Decode ``data`` as ``typ`` after checking its ``version`` field equals ``version``."""
    array_like = typ.__struct_config__.array_like  # type: ignore[attr-defined]
    peek = decode_struct(data, _ArrayVersion if array_like else _MapVersion, what=what, error=error)
    check_version(peek.version, version, what=what, error=error)
    return decode_struct(data, typ, what=what, error=error)
