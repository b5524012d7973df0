"""The manifest's wire structs: a layout (and its memory binding) as versioned msgpack.

The bottom of the layout layer: ``spec`` and ``memory`` build and read these; nothing here knows a
``Layout``. Decoding (``kvferry.codec.decode_versioned``) treats the bytes as untrusted: msgspec checks
every field's type, and the layout's dataclasses re-validate every value.
"""

from __future__ import annotations

import msgspec

__all__ = ["MANIFEST_VERSION", "BufferMsg", "BufferMsgV2", "HeadsMsg", "HeadsMsgV2", "LayoutMsg", "MemoryMsg",
           "PoolMsg", "PoolMsgV2", "PoolMsgWindow", "RegionMsg", "StateSectionMsg"]

# Bump when the manifest's fields or their meaning change; decoders refuse other versions.
# 2: buffers carry optional head geometry; layouts carry tp_size and tp_rank. Pools' optional
# window_tokens came later without a bump: it is written only when set (see ``_pool_msg``), so manifests
# without windows are unchanged and older peers read them; a windowed one they refuse as malformed. Head
# geometries' parts came the same way (``HeadsMsg.parts``, written only when not the default), and buffers'
# optional state sections (``BufferMsgV2`` when unset, see ``spec._buffer_msg``), and pools' optional
# ``aliases`` (``PoolMsgV2`` or ``PoolMsgWindow`` when unset, see ``spec._pool_msg``).
MANIFEST_VERSION = 2


class HeadsMsg(msgspec.Struct, array_like=True, forbid_unknown_fields=True):
    num_heads: int
    head_bytes: int
    tokens_per_page: int
    major: str
    replicated: bool
    # (rows, unit bytes) per part of a head's block; None: not declared (see ``HeadGeometry.parts``)
    parts: tuple[tuple[int, int], ...] | None = ()


class HeadsMsgV2(msgspec.Struct, array_like=True):
    """A head geometry with default parts, encoded as version 2 first defined it (decoded as a ``HeadsMsg``)."""

    num_heads: int
    head_bytes: int
    tokens_per_page: int
    major: str
    replicated: bool


class StateSectionMsg(msgspec.Struct, array_like=True, forbid_unknown_fields=True):
    offset: int
    channels: int
    channel_bytes: int
    repeats: int
    stride: int
    sharded: bool


class BufferMsg(msgspec.Struct, array_like=True, forbid_unknown_fields=True):
    name: str
    page_bytes: int
    num_pages: int
    dtype: str
    kind: str
    layer: int | None
    heads: HeadsMsg | None = None
    state: list[StateSectionMsg] | None = None


class BufferMsgV2(msgspec.Struct, array_like=True):
    """A buffer without state sections, encoded as version 2 first defined it (decoded as a ``BufferMsg``)."""

    name: str
    page_bytes: int
    num_pages: int
    dtype: str
    kind: str
    layer: int | None
    heads: HeadsMsg | None = None


class PoolMsg(msgspec.Struct, array_like=True, forbid_unknown_fields=True):
    name: str
    tokens_per_page: int | None
    buffers: list[BufferMsg]
    window_tokens: int | None = None
    aliases: str | None = None   # the pool whose page space this one shares (``spec.Pool.aliases``)


class PoolMsgWindow(msgspec.Struct, array_like=True):
    """A windowed pool without an alias, encoded as before aliases came (decoded as a ``PoolMsg``)."""

    name: str
    tokens_per_page: int | None
    buffers: list[BufferMsg]
    window_tokens: int | None = None


class PoolMsgV2(msgspec.Struct, array_like=True):
    """A pool without a window, encoded as version 2 first defined it (decoded as a ``PoolMsg``)."""

    name: str
    tokens_per_page: int | None
    buffers: list[BufferMsg]


class LayoutMsg(msgspec.Struct, forbid_unknown_fields=True):
    version: int
    pools: list[PoolMsg]
    tp_size: int = 1
    tp_rank: int = 0


class RegionMsg(msgspec.Struct, array_like=True, forbid_unknown_fields=True):
    address: int
    nbytes: int
    device: str
    device_id: int


class MemoryMsg(msgspec.Struct, forbid_unknown_fields=True):
    version: int
    pools: list[PoolMsg]
    regions: list[RegionMsg]
    tp_size: int = 1
    tp_rank: int = 0
