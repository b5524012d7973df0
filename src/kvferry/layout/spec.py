"""Typed KV layouts: buffers, pools and the layout that orders them.

The core of the layout layer, above its wire structs (``manifest``), below ``compare`` and ``memory``. A
layout says *what* memory holds, never *where*: addresses belong to ``memory.KVMemory``. Every buffer owns
its geometry (``page_bytes``) and its index space (``num_pages``); nothing here, or above, derives one
buffer's slot count from another's.

The manifest is the layout's wire form. It is versioned, and decoding treats its bytes as untrusted: every
field is type-checked by ``msgspec`` and every value re-validated by the dataclasses below.
"""

from __future__ import annotations

import hashlib
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from functools import cached_property

from kvferry.codec import decode_versioned, encode
from kvferry.errors import LayoutError
from kvferry.layout.manifest import (
    MANIFEST_VERSION,
    BufferMsg,
    BufferMsgV2,
    HeadsMsg,
    HeadsMsgV2,
    LayoutMsg,
    PoolMsg,
    PoolMsgV2,
    PoolMsgWindow,
    StateSectionMsg,
)
from kvferry.layout.state import StateGeometry, StateSection

__all__ = ["Buffer", "HeadGeometry", "Layout", "Pool", "StateGeometry", "StateSection"]


# Generous caps on untrusted manifests: far above any real model, far below what exhausts memory.
MAX_POOLS = 1024
MAX_BUFFERS = 1 << 16
MAX_PAGE_BYTES = 1 << 40
MAX_PAGES = 1 << 40
MAX_NAME_LEN = 256
MAX_TP_SIZE = 1 << 16
MAX_HEAD_PARTS = 64
MAX_HEAD_PIECES = 1 << 20   # heads x rows per head: what a page-size translation plans per entry, bounded
HEAD_MAJORS = ("head", "token")
MAX_STATE_ROWS = 1 << 20   # state section rows over a whole manifest


def _check_name(what: str, name: object) -> None:
    if not isinstance(name, str) or not name or len(name) > MAX_NAME_LEN:
        raise LayoutError(f"{what} name must be a non-empty string of at most {MAX_NAME_LEN} chars, got {name!r}")


def _check_count(where: str, what: str, value: object, upper: int) -> None:
    # bool is an int subclass; a True page size is always a bug upstream.
    if isinstance(value, bool) or not isinstance(value, int):
        raise LayoutError(f"{where}: {what} must be an int, got {type(value).__name__} {value!r}")
    if not 0 < value <= upper:
        raise LayoutError(f"{where}: {what} must be in 1..{upper}, got {value}")


@dataclass(frozen=True, slots=True)
class HeadGeometry:
    """How one page of a buffer is cut into attention heads, on this tensor-parallel rank.

    A page holds ``tokens_per_page`` token rows (entries, for compressed pools) of ``num_heads`` heads of
    ``head_bytes`` bytes each. ``major="head"`` stores it as ``[head][token][bytes]`` (each head's tokens
    contiguous), ``major="token"`` as ``[token][head][bytes]``. A *sharded* buffer holds ``num_heads`` of
    the model's ``num_heads x tp_size`` heads: rank ``r`` holds heads ``[r * num_heads, (r+1) * num_heads)``.
    A *replicated* buffer (MLA latent, indexer keys, state slots) holds the same bytes on every rank.

    ``parts`` says where a token's bytes lie inside a head's block of a head-major page, which an attention
    kernel may order its own way. ``()`` (the default): ``[token][head_bytes]``. Otherwise the block is the
    parts one after another, part ``(rows, unit)`` holding ``[rows][token][unit bytes]``, and a token's
    ``head_bytes`` are its ``unit`` bytes of every row of every part (``sum(rows x unit) == head_bytes``).
    vLLM's CPU kernel, head size ``d`` of ``e``-byte elements: ``((d, e), (1, d x e))``, K stored
    ``[dim][token]`` then V ``[token][dim]``. ``None``: the kernel's order inside a head is not known;
    whole heads still cut (TP), a page size cannot be translated. Parts do not depend on tokens per page,
    so one kernel's pages of any size share them.
    """

    num_heads: int
    head_bytes: int
    tokens_per_page: int
    major: str = "head"
    replicated: bool = False
    parts: tuple[tuple[int, int], ...] | None = ()

    def __post_init__(self) -> None:
        where = "head geometry"
        _check_count(where, "num_heads", self.num_heads, 1 << 20)
        _check_count(where, "head_bytes", self.head_bytes, MAX_PAGE_BYTES)
        _check_count(where, "tokens_per_page", self.tokens_per_page, 1 << 30)
        if self.major not in HEAD_MAJORS:
            raise LayoutError(f"{where}: major must be one of {HEAD_MAJORS}, got {self.major!r}")
        if not isinstance(self.replicated, bool):
            raise LayoutError(f"{where}: replicated must be a bool, got {self.replicated!r}")
        if self.parts is not None:
            object.__setattr__(self, "parts", _checked_parts(where, self))

    @classmethod
    def whole_page(cls, page_bytes: int) -> HeadGeometry:
        """A replicated page with no head structure (state slots, aux buffers): always moved whole."""
        return cls(1, page_bytes, 1, "head", True)

    @property
    def page_bytes(self) -> int:
        return self.num_heads * self.head_bytes * self.tokens_per_page

    @property
    def rows_per_head(self) -> int:
        """Pieces of one token's bytes in a head's block: the parts' rows (1 without parts)."""
        return sum(rows for rows, _ in self.parts) if self.parts else 1

    def key(self) -> tuple[object, ...]:
        return (self.num_heads, self.head_bytes, self.tokens_per_page, self.major, self.replicated,
                *self._parts_key())

    def model_key(self, tp_size: int) -> tuple[object, ...]:
        """What must match across TP sizes: total heads when sharded, the rank's own heads when replicated."""
        heads = self.num_heads if self.replicated else self.num_heads * tp_size
        return (heads, self.head_bytes, self.tokens_per_page, self.major, self.replicated, *self._parts_key())

    def _parts_key(self) -> tuple[object, ...]:
        # Appended only when not the default, so geometries without parts keep their fingerprints.
        return () if self.parts == () else (("parts", self.parts),)


def _checked_parts(where: str, geometry: HeadGeometry) -> tuple[tuple[int, int], ...]:
    """``geometry.parts`` as a tuple of (rows, unit) int pairs, or ``LayoutError`` naming what is wrong."""
    parts = geometry.parts
    if not isinstance(parts, (tuple, list)) or len(parts) > MAX_HEAD_PARTS:
        raise LayoutError(f"{where}: parts must be None or a sequence of at most {MAX_HEAD_PARTS} (rows, unit "
                          f"bytes) pairs, got {parts!r}")
    pairs = []
    for i, part in enumerate(parts):
        if not isinstance(part, (tuple, list)) or len(part) != 2:
            raise LayoutError(f"{where}: part {i} must be a (rows, unit bytes) pair, got {part!r}")
        _check_count(f"{where}, part {i}", "rows", part[0], MAX_PAGE_BYTES)
        _check_count(f"{where}, part {i}", "unit bytes", part[1], MAX_PAGE_BYTES)
        pairs.append((part[0], part[1]))
    if not pairs:
        return ()
    if geometry.major != "head":
        raise LayoutError(f"{where}: parts describe a head's block of a head-major page, major is {geometry.major!r}")
    total = sum(rows * unit for rows, unit in pairs)
    if total != geometry.head_bytes:
        raise LayoutError(f"{where}: parts {pairs} hold {total} bytes per token, head_bytes is {geometry.head_bytes}")
    pieces = geometry.num_heads * sum(rows for rows, _ in pairs)
    if pieces > MAX_HEAD_PIECES:
        raise LayoutError(f"{where}: {geometry.num_heads} heads x {pieces // geometry.num_heads} rows = {pieces} "
                          f"pieces per token, more than the limit {MAX_HEAD_PIECES}")
    return tuple(pairs)


@dataclass(frozen=True, slots=True)
class Buffer:
    """One registered memory region of ``num_pages`` pages of ``page_bytes`` bytes each.

    ``kind`` is a role tag (``kv``, ``k``, ``v``, ``index_k``, ``state``, ``aux``...), ``dtype`` the element
    type as a string (``bf16``, ``fp8_e4m3``...). Both are compared at handshake: a decode side that reads
    the bytes as another dtype must be refused before a byte moves. ``heads`` (optional) says how a page is
    cut into attention heads; it is what lets ``kvferry.plan.tp`` move KV between different TP sizes, and when
    given, ``page_bytes`` must equal ``heads.page_bytes``. ``state`` (optional, never beside ``heads``) says
    how a per-request state page (Mamba conv/SSM, GDN) is cut into channel sections across TP ranks
    (``layout.state``); its sections must lie inside the page.
    """

    name: str
    page_bytes: int
    num_pages: int
    dtype: str = "uint8"
    kind: str = "kv"
    layer: int | None = None
    heads: HeadGeometry | None = None
    state: StateGeometry | None = None

    def __post_init__(self) -> None:
        _check_name("buffer", self.name)
        where = f"buffer {self.name!r}"
        _check_count(where, "page_bytes", self.page_bytes, MAX_PAGE_BYTES)
        _check_count(where, "num_pages", self.num_pages, MAX_PAGES)
        for attr in ("dtype", "kind"):
            value = getattr(self, attr)
            if not isinstance(value, str) or not value or len(value) > MAX_NAME_LEN:
                raise LayoutError(f"{where}: {attr} must be a non-empty string, got {value!r}")
        if self.layer is not None and (isinstance(self.layer, bool) or not isinstance(self.layer, int)
                                       or self.layer < 0):
            raise LayoutError(f"{where}: layer must be None or an int >= 0, got {self.layer!r}")
        self._check_heads(where)
        self._check_state(where)

    def _check_state(self, where: str) -> None:
        if self.state is None:
            return
        if not isinstance(self.state, StateGeometry):
            raise LayoutError(f"{where}: state must be a StateGeometry or None, got {type(self.state).__name__}")
        if self.heads is not None:
            raise LayoutError(f"{where}: declares both head geometry and state geometry; a buffer is cut one way")
        if self.state.extent > self.page_bytes:
            raise LayoutError(f"{where}: state sections end at byte {self.state.extent}, past the page of "
                              f"{self.page_bytes} bytes")

    def _check_heads(self, where: str) -> None:
        if self.heads is None:
            return
        if not isinstance(self.heads, HeadGeometry):
            raise LayoutError(f"{where}: heads must be a HeadGeometry or None, got {type(self.heads).__name__}")
        if self.heads.page_bytes != self.page_bytes:
            h = self.heads
            raise LayoutError(f"{where}: page_bytes {self.page_bytes} != {h.num_heads} heads x {h.head_bytes} B "
                              f"x {h.tokens_per_page} tokens = {h.page_bytes} declared by its head geometry")

    @property
    def nbytes(self) -> int:
        return self.page_bytes * self.num_pages

    @property
    def padded_state(self) -> bool:
        """A state page whose sections leave bytes of it uncovered (vLLM pads a Mamba page to its attention
        page): only the sections are moved and hashed (``plan.tokens``), never the padding."""
        return self.state is not None and self.state.nbytes < self.page_bytes

    def shape_key(self) -> tuple[object, ...]:
        """Fields that must be equal on both sides of a transfer (capacity excluded)."""
        base = (self.name, self.page_bytes, self.dtype, self.kind, self.layer)
        # Appended only when declared, so layouts without head or state geometry keep their fingerprints.
        if self.state is not None:
            return (*base, ("state", self.state.key()))
        return base if self.heads is None else (*base, self.heads.key())

    def model_key(self, tp_size: int) -> tuple[object, ...]:
        """Fields that must be equal between two TP sizes of one model (page_bytes of sharded buffers,
        which scale with 1 / tp_size, excluded)."""
        if self.state is not None:   # page sizes scale with the sharded sections: left out
            return (self.name, None, self.dtype, self.kind, self.layer, ("state", self.state.model_key(tp_size)))
        if self.heads is None:
            return (self.name, self.page_bytes, self.dtype, self.kind, self.layer, None)
        page = self.page_bytes if self.heads.replicated else None
        return (self.name, page, self.dtype, self.kind, self.layer, self.heads.model_key(tp_size))


@dataclass(frozen=True, slots=True)
class Pool:
    """A page-index space: page ``i`` of the pool is page ``i`` of every buffer in it.

    Buffers of one pool may differ in ``page_bytes`` and in ``num_pages``; a page index must be valid in
    each of them. ``tokens_per_page`` is None for per-request state slots (Mamba state, for example).
    ``window_tokens`` marks a sliding-window pool: a request keeps only the pages under its last
    ``window_tokens`` tokens (``sim.pages_needed`` counts them). Both are part of the shape.

    ``aliases`` names another pool of the layout whose page space this one shares: an engine that overlays
    two kinds of page on the same bytes (vLLM's Mamba state blocks over its attention blocks, told apart by
    which group owns the block id) declares the second as an alias of the first. ``KVMemory`` then accepts
    a buffer of this pool whose region *equals* one of that pool's (and no other overlap), and the lease
    table treats both as one page space: a page leased in either is taken in both.
    """

    name: str
    buffers: tuple[Buffer, ...]
    tokens_per_page: int | None = None
    window_tokens: int | None = None
    aliases: str | None = None
    _min_pages: int = field(default=0, init=False, repr=False, compare=False)

    def __init__(self, name: str, buffers: Sequence[Buffer], tokens_per_page: int | None = None,
                 window_tokens: int | None = None, aliases: str | None = None) -> None:
        object.__setattr__(self, "name", name)
        object.__setattr__(self, "buffers", tuple(buffers))
        object.__setattr__(self, "tokens_per_page", tokens_per_page)
        object.__setattr__(self, "window_tokens", window_tokens)
        object.__setattr__(self, "aliases", aliases)
        self._validate()
        # Read on every send and announce (the page validator's bound): computed once, not per call.
        object.__setattr__(self, "_min_pages", min(b.num_pages for b in self.buffers))

    def _validate(self) -> None:
        _check_name("pool", self.name)
        if not self.buffers:
            raise LayoutError(f"pool {self.name!r} has no buffers")
        for buf in self.buffers:
            if not isinstance(buf, Buffer):
                raise LayoutError(f"pool {self.name!r}: expected Buffer, got {type(buf).__name__}")
        if self.tokens_per_page is not None:
            _check_count(f"pool {self.name!r}", "tokens_per_page", self.tokens_per_page, 1 << 30)
        if self.window_tokens is not None:
            _check_count(f"pool {self.name!r}", "window_tokens", self.window_tokens, 1 << 40)
            if self.tokens_per_page is None:
                raise LayoutError(f"pool {self.name!r}: a state pool (tokens_per_page None) has no window")
        if self.aliases is not None:
            _check_name(f"pool {self.name!r}: aliased pool", self.aliases)
            if self.aliases == self.name:
                raise LayoutError(f"pool {self.name!r} cannot alias itself")

    @property
    def min_pages(self) -> int:
        """Pages valid in every buffer of the pool: the bound a page index must stay under."""
        return self._min_pages

    @property
    def uniform_pages(self) -> bool:
        return len({b.num_pages for b in self.buffers}) == 1

    def key(self, buffer_keys: tuple[object, ...]) -> tuple[object, ...]:
        """The pool's part of a fingerprint, around its buffers' keys."""
        base = (self.name, self.tokens_per_page, buffer_keys)
        # Appended only when set, so layouts without windows or aliases keep their fingerprints.
        if self.window_tokens is not None:
            base = (*base, ("window_tokens", self.window_tokens))
        return base if self.aliases is None else (*base, ("aliases", self.aliases))

    def with_buffers(self, buffers: Sequence[Buffer]) -> Pool:
        """The same pool (name, token granularity, window, alias) holding ``buffers`` instead."""
        return Pool(self.name, buffers, self.tokens_per_page, self.window_tokens, self.aliases)


@dataclass(frozen=True)
class Layout:
    """The ordered pools of one worker's KV cache.

    ``shape_fingerprint`` covers what must match between prefill and decode (pool names, token
    granularity and windows, buffer names, order, kinds, dtypes, layers, page sizes) and not what may
    differ (capacities, addresses).

    ``tp_size``/``tp_rank`` place the layout in a tensor-parallel group (defaults: no TP). The shape
    fingerprint is per rank: it includes ``tp_size`` and the per-rank head geometry, so equal shapes can be
    copied rank to rank by ``plan_transfer``. ``model_fingerprint`` leaves TP out (it counts a sharded
    buffer's heads over all ranks): equal model fingerprints mean ``kvferry.plan.tp`` can plan between them.
    """

    pools: tuple[Pool, ...]
    tp_size: int
    tp_rank: int
    _by_buffer: dict[str, Buffer] = field(init=False, repr=False, compare=False)
    _by_pool: dict[str, Pool] = field(init=False, repr=False, compare=False)

    def __init__(self, pools: Sequence[Pool], tp_size: int = 1, tp_rank: int = 0) -> None:
        object.__setattr__(self, "pools", tuple(pools))
        object.__setattr__(self, "tp_size", tp_size)
        object.__setattr__(self, "tp_rank", tp_rank)
        _check_count("layout", "tp_size", tp_size, MAX_TP_SIZE)
        if isinstance(tp_rank, bool) or not isinstance(tp_rank, int) or not 0 <= tp_rank < tp_size:
            raise LayoutError(f"layout: tp_rank must be an int in 0..{tp_size - 1}, got {tp_rank!r}")
        if not self.pools:
            raise LayoutError("layout has no pools")
        if len(self.pools) > MAX_POOLS:
            raise LayoutError(f"layout has {len(self.pools)} pools, more than the limit {MAX_POOLS}")
        by_pool: dict[str, Pool] = {}
        by_buffer: dict[str, Buffer] = {}
        for pool in self.pools:
            if not isinstance(pool, Pool):
                raise LayoutError(f"expected Pool, got {type(pool).__name__}")
            if pool.name in by_pool:
                raise LayoutError(f"duplicate pool name {pool.name!r}")
            by_pool[pool.name] = pool
            for buf in pool.buffers:
                if buf.name in by_buffer:
                    raise LayoutError(f"duplicate buffer name {buf.name!r} (in pool {pool.name!r})")
                by_buffer[buf.name] = buf
        if len(by_buffer) > MAX_BUFFERS:
            raise LayoutError(f"layout has {len(by_buffer)} buffers, more than the limit {MAX_BUFFERS}")
        for pool in self.pools:
            if pool.aliases is None:
                continue
            target = by_pool.get(pool.aliases)
            if target is None:
                raise LayoutError(f"pool {pool.name!r} aliases pool {pool.aliases!r}, which the layout does not have")
            if target.aliases is not None:   # one level: every aliased pool names the page space's owner
                raise LayoutError(f"pool {pool.name!r} aliases pool {target.name!r}, which itself aliases "
                                  f"{target.aliases!r}: name the pool that owns the page space")
        object.__setattr__(self, "_by_pool", by_pool)
        object.__setattr__(self, "_by_buffer", by_buffer)

    # -- lookups ---------------------------------------------------------------------------------------
    @cached_property
    def buffers(self) -> tuple[Buffer, ...]:
        """All buffers, pool by pool, in declaration order (the order of flat per-page lists)."""
        return tuple(b for p in self.pools for b in p.buffers)

    @cached_property
    def pool_of(self) -> dict[str, str]:
        """Buffer name -> its pool's name."""
        return {b.name: p.name for p in self.pools for b in p.buffers}

    def pool(self, name: str) -> Pool:
        try:
            return self._by_pool[name]
        except KeyError:
            raise LayoutError(f"no pool {name!r} in layout (pools: {sorted(self._by_pool)})") from None

    def buffer(self, name: str) -> Buffer:
        try:
            return self._by_buffer[name]
        except KeyError:
            raise LayoutError(f"no buffer {name!r} in layout ({len(self._by_buffer)} buffers)") from None

    def __iter__(self) -> Iterator[Pool]:
        return iter(self.pools)

    @property
    def nbytes(self) -> int:
        return sum(b.nbytes for b in self.buffers)

    # -- fingerprints ----------------------------------------------------------------------------------
    def shape_key(self) -> tuple[object, ...]:
        pools = tuple(p.key(tuple(b.shape_key() for b in p.buffers)) for p in self.pools)
        # tp_size only when set, so layouts without TP keep their fingerprints; tp_rank never (any two
        # ranks of one TP group have one shape).
        return pools if self.tp_size == 1 else (("tp_size", self.tp_size), *pools)

    def model_key(self) -> tuple[object, ...]:
        return tuple(p.key(tuple(b.model_key(self.tp_size) for b in p.buffers)) for p in self.pools)

    @cached_property
    def model_fingerprint(self) -> str:
        """Hex digest of the model's shape independent of TP size: equal for any two TP layouts of one
        model whose KV ``kvferry.plan.tp`` can move (see ``model_difference``)."""
        return _digest(("model", self.model_key()))

    @cached_property
    def shape_fingerprint(self) -> str:
        """Hex digest of the shape: equal for two layouts that may exchange KV."""
        return _digest(self.shape_key())

    @cached_property
    def instance_fingerprint(self) -> str:
        """Hex digest of shape plus capacities: equal only for identically sized layouts."""
        caps = tuple(b.num_pages for b in self.buffers)
        return _digest((self.shape_key(), caps))

    # -- derived layouts -------------------------------------------------------------------------------
    def with_capacities(self, num_pages: dict[str, int]) -> Layout:
        """The same shape with some buffers' ``num_pages`` replaced (e.g. read off engine regions)."""
        unknown = set(num_pages) - set(self._by_buffer)
        if unknown:
            raise LayoutError(f"with_capacities: no buffers named {sorted(unknown)}")
        return Layout([p.with_buffers([_replace_pages(b, num_pages.get(b.name, b.num_pages)) for b in p.buffers])
                       for p in self.pools], self.tp_size, self.tp_rank)

    # -- manifest --------------------------------------------------------------------------------------
    def to_manifest(self) -> bytes:
        """Versioned, self-describing bytes; ``Layout.from_manifest`` round-trips them exactly."""
        return encode(LayoutMsg(version=MANIFEST_VERSION, pools=self.to_wire(), tp_size=self.tp_size,
                                 tp_rank=self.tp_rank))

    @classmethod
    def from_manifest(cls, data: bytes) -> Layout:
        """Decode untrusted manifest bytes; raises LayoutError on anything malformed or out of range."""
        msg = decode_versioned(data, LayoutMsg, version=MANIFEST_VERSION, what="manifest", error=LayoutError)
        return cls.from_wire(msg.pools, msg.tp_size, msg.tp_rank)

    def to_wire(self) -> list[PoolMsg | PoolMsgV2 | PoolMsgWindow]:
        return [
            _pool_msg(p, [_buffer_msg(b) for b in p.buffers])
            for p in self.pools
        ]

    @classmethod
    def from_wire(cls, pools: list[PoolMsg], tp_size: int = 1, tp_rank: int = 0) -> Layout:
        if len(pools) > MAX_POOLS or sum(len(p.buffers) for p in pools) > MAX_BUFFERS:
            raise LayoutError("manifest: too many pools or buffers")
        # State sections are expanded row by row to check them (``StateGeometry``): bounded over the manifest
        # before any is built, so an untrusted one cannot make that cost large.
        rows = sum(max(0, int(m.repeats)) for p in pools for b in p.buffers if getattr(b, "state", None)
                   for m in b.state)
        if rows > MAX_STATE_ROWS:
            raise LayoutError(f"manifest: {rows} state section rows, more than the limit {MAX_STATE_ROWS}")
        return cls([
            Pool(p.name, [Buffer(b.name, b.page_bytes, b.num_pages, b.dtype, b.kind, b.layer, _heads_of(b.heads),
                                 _state_of(b.state))
                          for b in p.buffers],
                 p.tokens_per_page, p.window_tokens, p.aliases)
            for p in pools
        ], tp_size, tp_rank)


def _pool_msg(pool: Pool, buffers: list[BufferMsg]) -> PoolMsg | PoolMsgV2 | PoolMsgWindow:
    if pool.aliases is not None:
        return PoolMsg(pool.name, pool.tokens_per_page, buffers, pool.window_tokens, pool.aliases)
    if pool.window_tokens is None:  # the three elements every version-2 decoder expects
        return PoolMsgV2(pool.name, pool.tokens_per_page, buffers)
    return PoolMsgWindow(pool.name, pool.tokens_per_page, buffers, pool.window_tokens)


def _replace_pages(buf: Buffer, num_pages: int) -> Buffer:
    return Buffer(buf.name, buf.page_bytes, num_pages, buf.dtype, buf.kind, buf.layer, buf.heads, buf.state)


def _buffer_msg(b: Buffer) -> BufferMsg | BufferMsgV2:
    if b.state is None:   # the seven elements every version-2 decoder expects
        return BufferMsgV2(b.name, b.page_bytes, b.num_pages, b.dtype, b.kind, b.layer, _heads_msg(b.heads))
    sections = [StateSectionMsg(s.offset, s.channels, s.channel_bytes, s.repeats, s.stride, s.sharded)
                for s in b.state.sections]
    return BufferMsg(b.name, b.page_bytes, b.num_pages, b.dtype, b.kind, b.layer, _heads_msg(b.heads), sections)


def _state_of(msg: list[StateSectionMsg] | None) -> StateGeometry | None:
    if msg is None:
        return None
    return StateGeometry(tuple(StateSection(m.offset, m.channels, m.channel_bytes, m.repeats, m.stride, m.sharded)
                               for m in msg))


def _heads_msg(heads: HeadGeometry | None) -> HeadsMsg | HeadsMsgV2 | None:
    if heads is None:
        return None
    if heads.parts == ():   # the five elements every version-2 decoder expects
        return HeadsMsgV2(heads.num_heads, heads.head_bytes, heads.tokens_per_page, heads.major, heads.replicated)
    return HeadsMsg(heads.num_heads, heads.head_bytes, heads.tokens_per_page, heads.major, heads.replicated,
                    heads.parts)


def _heads_of(msg: HeadsMsg | None) -> HeadGeometry | None:
    if msg is None:
        return None
    return HeadGeometry(msg.num_heads, msg.head_bytes, msg.tokens_per_page, msg.major, msg.replicated, msg.parts)


def _digest(key: object) -> str:
    # blake2b from the standard library: fingerprints are computed once per handshake, not per page.
    return hashlib.blake2b(repr(key).encode(), digest_size=16).hexdigest()


