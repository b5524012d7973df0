"""Planning between different page sizes: token ranges mapped, never page indices.

Part of the plan layer, above ``plan.pages`` and ``plan.contract``, below the transports. Prefill and decode
may choose their pools' ``tokens_per_page`` apart (prefill large blocks for its kernels, decode small ones
for memory). Then page ``j`` of one side is not page ``j`` of the other: token ``t`` of a request lies in
source page ``src_pages[(t - src_first) // Ts]`` and destination page ``dst_pages[(t - dst_first) // Td]``.
A planner that paired page indices would write prefill's 64-token page over decode's 32-token one and
spill into the next: the motivating bug's class, a geometry assumed alike.

The request's token range is cut at every page boundary of *either* side into segments that lie inside one
source page and one destination page. A buffer's head geometry says where a segment's bytes lie in a page:
head-major pages (``[head][entry][bytes]``) give one row per (segment, head), token-major pages
(``[entry][head][bytes]``) one row per segment. Rows adjacent on both sides are then merged, so equal page
sizes come out as whole-page runs and token-major pages as runs across consecutive pages. Compressed pools
(an entry per 4 or 128 tokens) map entries the same way: the pool's ``tokens_per_page`` over the buffer's
entries per page is the tokens per entry, equal on both sides (``translation_difference``).

Everything per page, segment, head and buffer is numpy; the per-buffer vectors are built once per
(source memory, destination memory) pair by ``TokenPlanner``.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from kvferry.arrays import readonly
from kvferry.errors import PlanError
from kvferry.layout.compare import translation_difference
from kvferry.layout.memory import KVMemory
from kvferry.layout.spec import Buffer, HeadGeometry, Pool
from kvferry.layout.state import StateGeometry
from kvferry.plan.contract import RowsPlan
from kvferry.plan.pages import as_pages, check_pages
from kvferry.plan.planner import select_buffers

__all__ = ["PageSizePlanner", "Segments", "TokenPlan", "TokenPlanner", "TokenSpan", "chunk_span", "entry_pieces",
           "moves_sections", "plan_token_transfer", "state_pieces"]

_U64 = np.uint64


@dataclass(frozen=True, slots=True)
class TokenSpan:
    """One pool's part of a request on both sides, in tokens.

    ``src_pages``/``dst_pages``: each side's pages in token order, the first beginning at request token
    ``src_first``/``dst_first`` (a multiple of that side's tokens per page: 0, or past a prefix decode holds).
    ``start``/``stop``: the tokens moved, by default everything both lists cover (from the later first token
    to the earlier end). Tokens past the request's last one in its last, partly filled page are moved like
    the rest: they are garbage on both sides, and no page outside the two lists is touched.
    """

    src_pages: Any
    dst_pages: Any
    src_first: int = 0
    dst_first: int = 0
    start: int | None = None
    stop: int | None = None


def entry_pieces(heads: HeadGeometry | None, page_bytes: int, entries: int) -> tuple[np.ndarray, np.ndarray]:
    """Where one entry's bytes lie in a page of ``entries`` entries: (coef, unit), uint64, one element per
    *piece*; entry ``e``'s bytes of piece ``i`` are ``unit[i]`` bytes at ``coef[i] x entries + e x unit[i]``.

    A head of a head-major page is one piece per row of its parts (``HeadGeometry.parts``; one row without
    parts), in address order; a token-major page's entry row is one piece; a page without head geometry
    (moved whole: ``entries`` is 1) is one piece of the whole page."""
    if heads is None:
        return np.zeros(1, dtype=_U64), np.full(1, page_bytes // entries, dtype=_U64)
    if heads.major == "token":
        return np.zeros(1, dtype=_U64), np.full(1, heads.num_heads * heads.head_bytes, dtype=_U64)
    if heads.parts is None:
        raise PlanError(f"a head geometry without declared parts ({heads}) cannot say where an entry lies")
    parts = heads.parts or ((1, heads.head_bytes),)
    rows = np.array([r for r, _ in parts], dtype=np.int64)
    units = np.array([u for _, u in parts], dtype=np.int64)
    before = np.concatenate(([0], np.cumsum(rows * units)[:-1]))   # a part's first byte, per entry
    part = np.repeat(np.arange(len(parts)), rows)
    row = np.arange(len(part)) - np.repeat(np.cumsum(rows) - rows, rows)
    in_head = before[part] + row * units[part]
    coef = (np.arange(heads.num_heads)[:, None] * heads.head_bytes + in_head[None, :]).ravel()
    return coef.astype(_U64), np.tile(units[part], heads.num_heads).astype(_U64)


def moves_sections(src: Buffer, dst: Buffer) -> bool:
    """Whether a page of this buffer pair moves by its state sections rather than whole: the pages differ in
    size (padding, between admitted layouts), or either side's state leaves bytes of its page uncovered."""
    return src.page_bytes != dst.page_bytes or src.padded_state or dst.padded_state


def state_pieces(state: StateGeometry | None, buffer: str = "") -> tuple[np.ndarray, np.ndarray]:
    """A state page's real bytes as ``entry_pieces`` of one entry: (coef, unit), uint64, one element per row
    of every section, in address order (a page padded differently on the two sides moves only these)."""
    if state is None:
        raise PlanError(f"buffer {buffer!r}: a state page without sections cannot move between pages padded "
                        "differently (nothing says where its bytes end)")
    secs = state.sections
    reps = np.array([s.repeats for s in secs], dtype=np.int64)
    sec = np.repeat(np.arange(len(secs)), reps)
    row = np.arange(len(sec)) - np.repeat(np.cumsum(reps) - reps, reps)
    start = np.array([s.offset for s in secs], dtype=np.int64)[sec] + row * np.array([s.stride for s in secs],
                                                                                      dtype=np.int64)[sec]
    unit = np.array([s.row_bytes for s in secs], dtype=np.int64)[sec]
    order = np.argsort(start, kind="stable")
    return start[order].astype(_U64), unit[order].astype(_U64)


@dataclass(frozen=True, eq=False)
class _PoolVectors:
    """Per-buffer vectors of one pool, aligned, and per-piece vectors (``entry_pieces``), each buffer's
    ``pieces`` in a row: a row of a head of a head-major page, or the whole entry row of a token-major page."""

    buffer_ids: np.ndarray   # int64: index into Layout.buffers
    pieces: np.ndarray       # int64: pieces per entry (heads x rows when head-major, 1 when token-major)
    piece_coef: np.ndarray   # uint64, per piece: its start in a page is coef x entries per page
    piece_unit: np.ndarray   # uint64, per piece: bytes of one entry in it
    src_base: np.ndarray     # uint64: region addresses
    dst_base: np.ndarray
    src_page: np.ndarray     # uint64: page bytes
    dst_page: np.ndarray
    src_entries: np.ndarray  # uint64: entries per page (head-major: a piece's stride is entries x piece bytes)
    dst_entries: np.ndarray
    src_dev: np.ndarray
    dst_dev: np.ndarray
    tokens_per_entry: int
    src_tokens: int          # the pool's tokens per page on each side
    dst_tokens: int
    padded: bool = False     # a state pool whose pages are padded: its buffers move their sections only

    @classmethod
    def build(cls, src: KVMemory, dst: KVMemory, src_pool: Pool, dst_pool: Pool, *,
              whole: bool = False) -> _PoolVectors:
        """``whole``: a state pool's pages as one token each (moved whole, paired by position)."""
        ids = np.array([src.buffer_index[b.name] for b in src_pool.buffers], dtype=np.int64)
        sb, db = src.layout.buffers, dst.layout.buffers
        src_tpp, dst_tpp = (1, 1) if whole else (src_pool.tokens_per_page, dst_pool.tokens_per_page)
        if src_tpp is None or dst_tpp is None:
            raise PlanError(f"pool {src_pool.name!r} is a state pool: it has no tokens to map")
        geoms = [(sb[i].heads, db[i].heads) for i in ids]
        if src_tpp == dst_tpp:
            # Equal page sizes: every page is one opaque entry of one piece, moved whole (as plan_transfer
            # does, in runs of consecutive pages), so a span starts and stops on page boundaries here
            geoms = [(None, None)] * len(ids)
        elif any(s is None or d is None for s, d in geoms):
            raise PlanError(f"pool {src_pool.name!r}: a buffer without head geometry cannot be translated "
                            f"from {src_tpp} to {dst_tpp} tokens per page")
        entries_src = [g[0].tokens_per_page if g[0] is not None else 1 for g in geoms]
        entries_dst = [g[1].tokens_per_page if g[1] is not None else 1 for g in geoms]
        per_entry = {src_tpp // e for e in entries_src} | {dst_tpp // e for e in entries_dst}
        if len(per_entry) != 1:
            raise PlanError(f"pool {src_pool.name!r}: buffers differ in tokens per entry {sorted(per_entry)}")
        # parts are equal on both sides (translation_difference), so the source's say where pieces lie
        per_buffer = [entry_pieces(g[0], sb[i].page_bytes, e) for g, i, e in zip(geoms, ids, entries_src)]
        padded = whole and any(moves_sections(sb[i], db[i]) for i in ids)
        if padded:   # vLLM pads a state page to its attention page: only the sections move, never the padding
            per_buffer = [state_pieces(sb[i].state, sb[i].name) for i in ids]
        pieces = np.array([len(coef) for coef, _ in per_buffer], dtype=np.int64)

        def u(values: Iterable[int]) -> np.ndarray:
            return np.fromiter(values, dtype=_U64)

        return cls(ids, pieces, np.concatenate([c for c, _ in per_buffer]),
                   np.concatenate([unit for _, unit in per_buffer]),
                   u(src.regions[i].address for i in ids), u(dst.regions[i].address for i in ids),
                   u(sb[i].page_bytes for i in ids), u(db[i].page_bytes for i in ids),
                   u(entries_src), u(entries_dst),
                   u(src.regions[i].device_id for i in ids), u(dst.regions[i].device_id for i in ids),
                   per_entry.pop(), src_tpp, dst_tpp, padded)

    def select(self, selected: np.ndarray | None) -> _PoolVectors:
        if selected is None:
            return self
        keep = np.isin(self.buffer_ids, selected)
        per_piece = np.repeat(keep, self.pieces)
        fields = {name: getattr(self, name) for name in self.__dataclass_fields__}
        return _PoolVectors(**{k: (v[per_piece] if k in _PER_PIECE else v[keep]) if isinstance(v, np.ndarray) else v
                               for k, v in fields.items()})


_PER_PIECE = frozenset({"piece_coef", "piece_unit"})


def _segments(span: TokenSpan, vec: _PoolVectors, pool: str, src_pages: np.ndarray, dst_pages: np.ndarray,
              ) -> tuple[np.ndarray, ...]:
    """The span cut at every page boundary of either side, in entries: (source page, entry offset in it,
    destination page, entry offset, entries), one element per segment."""
    ts, td, c = vec.src_tokens, vec.dst_tokens, vec.tokens_per_entry
    for side, first, tpp in (("source", span.src_first, ts), ("destination", span.dst_first, td)):
        if first < 0 or first % tpp:
            raise PlanError(f"pool {pool!r}: the {side} pages' first token {first} is not a page boundary of "
                            f"{tpp} tokens")
    src_end = span.src_first + len(src_pages) * ts
    dst_end = span.dst_first + len(dst_pages) * td
    start = max(span.src_first, span.dst_first) if span.start is None else span.start
    stop = min(src_end, dst_end) if span.stop is None else span.stop
    if start % c:
        raise PlanError(f"pool {pool!r}: token {start} is inside an entry of {c} tokens")
    stop = -(-stop // c) * c   # the last entry is moved whole, as its page is
    if not (max(span.src_first, span.dst_first) <= start <= stop <= min(src_end, dst_end)):
        raise PlanError(f"pool {pool!r}: tokens [{start}, {stop}) are not covered by both sides' pages: "
                        f"source [{span.src_first}, {src_end}), destination [{span.dst_first}, {dst_end})")
    if start == stop:
        empty = np.zeros(0, dtype=np.int64)
        return empty, empty, empty, empty, empty
    cuts = np.union1d(np.arange(span.src_first, src_end, ts), np.arange(span.dst_first, dst_end, td))
    cuts = np.concatenate(([start], cuts[(cuts > start) & (cuts < stop)], [stop]))
    lo, n = cuts[:-1], np.diff(cuts)
    sp, so = np.divmod(lo - span.src_first, ts)
    dp, do = np.divmod(lo - span.dst_first, td)
    return src_pages[sp], so // c, dst_pages[dp], do // c, n // c


def _rows(vec: _PoolVectors, seg: tuple[np.ndarray, ...]) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Rows for every (buffer, segment, piece), merged where adjacent on both sides: (src N x 3, dst N x 3,
    buffer ids)."""
    sp, so, dp, do, n = (a.astype(_U64) for a in seg)
    nseg = len(n)
    # One element per (buffer, piece): which buffer, which piece of its entries
    owner = np.repeat(np.arange(len(vec.pieces)), vec.pieces)
    piece = np.arange(len(owner)) - np.repeat(np.cumsum(vec.pieces) - vec.pieces, vec.pieces)
    pb = vec.piece_unit[:, None]

    def side(base: np.ndarray, page: np.ndarray, entries: np.ndarray, pages: np.ndarray,
             offsets: np.ndarray) -> np.ndarray:
        # entry e of piece i of a page: coef_i x entries + e x unit_i (entry_pieces)
        return (base[owner][:, None] + pages[None, :] * page[owner][:, None]
                + (vec.piece_coef * entries[owner])[:, None] + offsets[None, :] * pb).ravel()

    # Rows in (buffer, segment, piece) order: a whole page's pieces, then the next page's, are adjacent
    order = np.lexsort((np.repeat(piece, nseg), np.tile(np.arange(nseg), len(owner)), np.repeat(owner, nseg)))
    src = side(vec.src_base, vec.src_page, vec.src_entries, sp, so)[order]
    dst = side(vec.dst_base, vec.dst_page, vec.dst_entries, dp, do)[order]
    length = (pb * n[None, :]).ravel()[order]
    row_owner = np.repeat(owner, nseg)[order]
    ids = vec.buffer_ids[row_owner]
    # Merge a row into the one before when both sides continue it within one buffer
    follows = np.zeros(len(src), dtype=bool)
    follows[1:] = (src[:-1] + length[:-1] == src[1:]) & (dst[:-1] + length[:-1] == dst[1:]) & (ids[:-1] == ids[1:])
    heads = np.flatnonzero(~follows)
    lengths = np.add.reduceat(length, heads) if len(heads) else length[:0]
    dev = row_owner[heads]
    src_descs = np.stack([src[heads], lengths, vec.src_dev[dev]], axis=1)
    dst_descs = np.stack([dst[heads], lengths, vec.dst_dev[dev]], axis=1)
    return src_descs, dst_descs, ids[heads]


@dataclass(frozen=True, slots=True)
class Segments:
    """One pool's part of a ``TokenPlan`` as its digests see it: each (buffer, segment) cell is entries
    ``[src_entry, src_entry + entries)`` of source page ``src_page`` and ``[dst_entry, ...)`` of destination
    page ``dst_page`` (int64 arrays, one element per segment), in every buffer of ``buffer_ids``. ``whole``:
    the pool's page sizes are equal (or it is a state pool): each segment is one whole page, whatever its
    buffers' head geometry says; a state pool whose pages differ in padding is not whole: each segment is
    its page's one entry, the state sections (``hashing.hash_entries``)."""

    pool: str
    buffer_ids: np.ndarray
    src_page: np.ndarray
    src_entry: np.ndarray
    dst_page: np.ndarray
    dst_entry: np.ndarray
    entries: np.ndarray
    whole: bool


@dataclass(frozen=True, eq=False)
class TokenPlan(RowsPlan):
    """Rows from ``src_memory`` into ``dst_memory`` whose pools may differ in tokens per page: row i of
    ``src_descs`` is copied to row i of ``dst_descs``. The surface transports post (``Plan``); rows are pieces
    of pages, so it goes over NIXL as a per-request descriptor list, never as prepared per-page indices.
    ``segments``: per pool, the cells the rows move (what ``integrity.digest_plan`` hashes)."""

    segments: tuple[Segments, ...] = ()

    def page_selectors(self) -> tuple[np.ndarray, np.ndarray]:
        raise PlanError("a plan between different page sizes moves pieces of pages: it cannot index per-page "
                        "prepared lists; use the transport's per-request descriptor lists (descriptors='dlist')")

    def __repr__(self) -> str:
        return f"TokenPlan({self.num_descriptors} rows, {self.nbytes / 2**20:.2f} MiB)"


class TokenPlanner:
    """Plans writes from ``src`` into ``dst``, whose pools may differ in tokens per page.

    Built once per pair: it checks the layouts can be translated (``translation_difference``) and builds
    each pool's per-buffer vectors; ``plan`` is then vectorised over segments, pieces and buffers.
    """

    def __init__(self, src: KVMemory, dst: KVMemory, *, state_pools: bool = False) -> None:
        """``state_pools``: plan state pools too, their pages moved whole and paired by position (a span's
        tokens are then pages: ``TokenSpan(src, dst, src_first=position, dst_first=0)``)."""
        diff = translation_difference(src.layout, dst.layout)
        if diff is not None:
            raise PlanError(f"prefill and decode layouts cannot be translated: {diff}")
        self.src, self.dst = src, dst
        self._pools = {sp.name: (sp, dp, _PoolVectors.build(src, dst, sp, dp, whole=sp.tokens_per_page is None))
                       for sp, dp in zip(src.layout.pools, dst.layout.pools)
                       if sp.tokens_per_page is not None or state_pools}

    def plan(self, spans: Mapping[str, TokenSpan], buffers: Iterable[str] | None = None) -> TokenPlan:
        """Rows for ``spans`` (pool -> ``TokenSpan``); ``buffers`` restricts them to those buffers.

        Validated at this edge: every page inside every buffer of its pool on its side, destination pages
        unique, the token range covered by both lists; ``PlanError`` naming pool, side and values otherwise.
        """
        selected = select_buffers(self.src, buffers)
        parts, cells = [], []
        for pool, span in spans.items():
            if pool not in self._pools:
                raise PlanError(f"pool {pool!r}: no such token pool in the layout "
                                f"(token pools: {sorted(self._pools)})")
            src_pool, dst_pool, vec = self._pools[pool]
            src_pages = as_pages(pool, "source", span.src_pages)
            dst_pages = as_pages(pool, "destination", span.dst_pages)
            check_pages(src_pool, "source", src_pages, unique=False)
            check_pages(dst_pool, "destination", dst_pages, unique=True)
            vec = vec.select(selected)
            seg = _segments(span, vec, pool, src_pages, dst_pages)
            if len(seg[0]) and len(vec.buffer_ids):
                parts.append(_rows(vec, seg))
                whole = not vec.padded and (src_pool.tokens_per_page is None or vec.src_tokens == vec.dst_tokens)
                cells.append(Segments(pool, vec.buffer_ids, *(readonly(np.asarray(a, dtype=np.int64)) for a in seg),
                                      whole))
        return _plan_of(self.src, self.dst, parts, tuple(cells))


def _plan_of(src: KVMemory, dst: KVMemory, parts: Sequence[tuple[np.ndarray, ...]],
             cells: tuple[Segments, ...] = ()) -> TokenPlan:
    if not parts:
        empty = np.zeros((0, 3), dtype=_U64)
        return TokenPlan(src, dst, readonly(empty), readonly(empty.copy()), readonly(np.zeros(0, dtype=np.int64)))
    src_descs, dst_descs, ids = (np.concatenate([p[i] for p in parts]) for i in range(3))
    return TokenPlan(src, dst, readonly(src_descs), readonly(dst_descs), readonly(ids), cells)


def plan_token_transfer(src: KVMemory, dst: KVMemory, spans: Mapping[str, TokenSpan],
                        buffers: Iterable[str] | None = None) -> TokenPlan:
    """One plan in one call (``TokenPlanner(src, dst).plan(...)``); keep the planner to plan again."""
    return TokenPlanner(src, dst).plan(spans, buffers)


# -- chunks of a request between page sizes (the control plane's view) ----------------------------------------
def chunk_span(pool: str, sizes: tuple[int, int] | None, src_pages: np.ndarray, position: int,
               dst_pages: np.ndarray | None, prefix: int, request: str = "") -> TokenSpan | None:
    """One pool's part of one chunk as a ``TokenSpan``, or None when it has no page or every token of it is in
    decode's prefix.

    ``src_pages`` sit at prefill page ``position`` of the request, so they hold tokens ``[position x Ts,
    (position + n) x Ts)``; decode holds the first ``prefix`` pages of its own (tokens ``prefix x Td``) and
    leased ``dst_pages`` for the rest. Source pages wholly inside the prefix leave the span, one straddling
    it moves only its tokens past it; tokens past the lease's end (the garbage tail of prefill's last
    page) do not move, so a page straddling the prefix when decode leased nothing past it gives None.
    ``sizes`` (Ts, Td), or None for a state pool: its pages pair by position in decode's list, whole.
    ``PlanError`` (naming the request, the pool and both ranges) when the chunk reaches past the lease: a
    source page that begins past decode's last leased token, or a state page past its list.
    Prefill (writing) and decode (reading, pull mode) compute the same span from the same numbers."""
    n = len(src_pages)
    what = f"request {request!r}, pool {pool!r}" if request else f"pool {pool!r}"
    if n == 0:
        return None
    if sizes is None:
        have = 0 if dst_pages is None else len(dst_pages)
        if position + n > have:
            raise PlanError(f"{what}: chunk covers destination positions {position}..{position + n - 1} but "
                            f"decode leased {have} pages")
        return TokenSpan(src_pages, dst_pages, position, 0, position, position + n)
    ts, td = sizes
    held = prefix * td
    src_first = position * ts
    skip = max(0, min(n, (held - src_first) // ts))   # source pages wholly inside the prefix
    src_pages, src_first, n = src_pages[skip:], src_first + skip * ts, n - skip
    if n == 0:
        return None
    leased = 0 if dst_pages is None else len(dst_pages)
    dst_end = held + leased * td
    if src_first + (n - 1) * ts >= dst_end:
        if leased == 0:
            raise PlanError(f"{what}: decode leased no pages for tokens past its prefix of {held}, the chunk has "
                            f"tokens [{src_first}, {src_first + n * ts})")
        raise PlanError(f"{what}: chunk covers tokens [{src_first}, {src_first + n * ts}) ({ts} per page) but "
                        f"decode leased pages for tokens [{held}, {dst_end}) ({td} per page)")
    start, stop = max(src_first, held), min(src_first + n * ts, dst_end)
    if stop <= start:
        # No lease past the prefix (decode holds the whole request, e.g. SGLang's decode radix cache matched
        # every input token): the one source page straddling the prefix holds only the garbage tail past it.
        return None
    return TokenSpan(src_pages, dst_pages, src_first, held, start, stop)


class PageSizePlanner:
    """The planner of a session (prefill) or link (decode) whose pools' page sizes may differ: chunks of a
    request, at prefill's page positions, mapped by token into decode's leased pages past its prefix.

    Built once per peer at the handshake over ``TokenPlanner`` (state pools included, moved whole); what
    ``TPPlanner`` is across TP sizes, this is across page sizes. ``sizes``: token pool -> (prefill's, decode's)
    tokens per page; ``translated``: the pools where they differ."""

    def __init__(self, src: KVMemory, dst: KVMemory) -> None:
        self.tokens = TokenPlanner(src, dst, state_pools=True)
        self.src, self.dst = src, dst
        self.sizes: dict[str, tuple[int, int] | None] = {
            sp.name: None if sp.tokens_per_page is None or dp.tokens_per_page is None
            else (sp.tokens_per_page, dp.tokens_per_page)
            for sp, dp in zip(src.layout.pools, dst.layout.pools)}
        self.translated = frozenset(p for p, s in self.sizes.items() if s is not None and s[0] != s[1])

    def spans(self, src: Mapping[str, np.ndarray], positions: Mapping[str, int], dst: Mapping[str, np.ndarray],
              prefix: Mapping[str, int], request: str = "") -> dict[str, TokenSpan]:
        """Each pool's span of a chunk (``chunk_span``), pools wholly inside decode's prefix left out."""
        out = {}
        for pool, pages in src.items():
            span = chunk_span(pool, self.sizes[pool], pages, positions[pool], dst.get(pool), prefix.get(pool, 0),
                              request)
            if span is not None:
                out[pool] = span
        return out

    def page_tokens(self, pool: str) -> tuple[int, int]:
        """(prefill's, decode's) tokens per page of ``pool``; (1, 1) for a state pool (a page a request)."""
        sizes = self.sizes.get(pool)
        return sizes if sizes is not None else (1, 1)

    def position(self, pool: str, span: TokenSpan) -> int:
        """Where ``span``'s first source page sits: its prefill page position in the request (a state pool:
        its position in decode's list). ``chunk_span`` given it and the same pages gives ``span`` again."""
        sizes = self.sizes[pool]
        return span.src_first if sizes is None else span.src_first // sizes[0]

    def plan(self, spans: Mapping[str, TokenSpan], buffer_ids: np.ndarray | None = None) -> TokenPlan:
        """Rows for ``spans`` (``buffer_ids``: the buffers as ``select_buffers`` chose them; None: all)."""
        names = None if buffer_ids is None else [self.src.layout.buffers[i].name for i in buffer_ids.tolist()]
        return self.tokens.plan(spans, names)
