"""Page digests: prove that the pages decode holds are the pages prefill sent.

The integrity layer's core, above ``hashing`` and ``plan``, below ``control``. The prefill side calls
``digest_plan`` on the plan it is about to post (or has posted) and sends the ``PageDigests`` with its
completion message, as ``to_bytes()``; the decode side decodes them with ``PageDigests.from_bytes`` (untrusted
input) and calls ``verify_digests`` on its own memory before it reports the request done. A mismatch raises
``PageMismatchError``, a ``kvferry.IntegrityError`` naming pool, buffer, layer, page, expected and actual
digest.

Digests are keyed by buffer and *destination* page, so decode checks its own pages without knowing the
source page numbers. ``digest_pages`` hashes source pages before the destination is known (prefill's
``send``) and ``SourceDigests.keyed`` names the destination pages later; ``digest_plan`` is the two in one.
``sampling`` draws the pages to hash with numpy across all buffers at once; ``hashing`` hashes them
(xxh3-64, one call per page).

Across tensor-parallel sizes a prefill page is not a decode page: prefill rank ``r`` writes only the heads
it shares with decode rank ``d``. ``digest_plan`` given a ``tp.TPPlan`` then hashes, per (buffer,
destination page), the slice of the page the pair moves, and decode passes that link's slices
(``TPPlanner(prefill memory, memory).slices``) to ``verify_digests``. Several prefill ranks each digest
their own slice of one decode page; each link's digests are checked with that link's slices.

Between page sizes a prefill page is not a decode page either, and one decode page may be written by two
chunks: ``digest_plan`` given a ``tokens.TokenPlan`` hashes, per (buffer, segment of one source and one
destination page), the entries the segment moves, and keys it by destination page and entry range
(``PageDigests.spans``); decode hashes the same entries of its page (``hashing.hash_entries``).

Modes: ``off`` (nothing), ``sampled`` (``samples_per_buffer`` pages per buffer, chosen independently per
buffer from the plan's pages with ``seed``, so different buffers cover different pages) and ``full``.
"""

from __future__ import annotations

import itertools
import weakref
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from enum import Enum
from typing import Annotated, cast

import msgspec
import numpy as np

from kvferry.arrays import readonly
from kvferry.codec import decode_versioned, encode
from kvferry.errors import IntegrityError, KVFerryError, PageMismatchError, UsageError
from kvferry.integrity.hashing import entry_shape, hash_cells, hash_entries, hash_index, hash_pages
from kvferry.integrity.sampling import PageSampler, SampleShape, draw
from kvferry.layout.memory import KVMemory
from kvferry.layout.spec import MAX_BUFFERS, MAX_NAME_LEN
from kvferry.plan.contract import Plan
from kvferry.plan.planner import TransferPlan
from kvferry.plan.ranks import PageSlice
from kvferry.plan.tokens import TokenPlan
from kvferry.plan.tp import TPPlan

__all__ = ["DIGESTS_VERSION", "DigestMode", "PageDigests", "PageMismatch", "PageMismatchError", "SourceDigests",
           "digest_pages", "digest_plan", "hash_pages", "verify_digests"]

# Bump when the wire fields, their encoding or the hash function change; decoders refuse other versions.
# 2: entry ranges of pages (``spans``), for writes between page sizes.
DIGESTS_VERSION = 2
# Caps on untrusted digest messages: 4M entries is 20 x a 128k-token DeepSeek request in full mode.
MAX_ENTRIES = 1 << 22
MAX_MESSAGE_BYTES = 128 << 20


class DigestMode(str, Enum):
    """How many pages a request's digests cover."""

    OFF = "off"
    SAMPLED = "sampled"
    FULL = "full"

    @classmethod
    def parse(cls, value: DigestMode | str, error: type[KVFerryError] = UsageError) -> DigestMode:
        """``"sampled"`` -> ``DigestMode.SAMPLED``; raises ``error`` naming the valid modes (``UsageError``
        for an argument, ``IntegrityError`` for a mode read from the wire)."""
        try:
            return cls(value)
        except ValueError:
            valid = ", ".join(m.value for m in cls)
            raise error(f"unknown digest mode {value!r} (expected one of: {valid})") from None

    @classmethod
    def from_peer(cls, value: str) -> DigestMode:
        """A peer's announced mode; one this side does not know counts as off (the stronger mode of the
        two sides applies, so a peer cannot weaken this side's)."""
        return cls._value2member_map_.get(value, cls.OFF)  # type: ignore[return-value]

    def stronger(self, other: DigestMode) -> DigestMode:
        """The stronger of two modes (members are declared weakest first)."""
        order = list(DigestMode)
        return self if order.index(self) >= order.index(other) else other


@dataclass(frozen=True, slots=True)
class PageMismatch:
    """One destination page whose digest differs from the one prefill sent."""

    pool: str
    buffer: str
    layer: int | None
    page: int
    expected: int
    actual: int

    def __str__(self) -> str:
        layer = "" if self.layer is None else f" (layer {self.layer})"
        return (f"pool {self.pool!r}, buffer {self.buffer!r}{layer}, page {self.page}: "
                f"expected digest {self.expected:#018x}, actual {self.actual:#018x}")


@dataclass(frozen=True, eq=False)
class PageDigests:
    """Digests of destination pages, buffer by buffer.

    Entry i says: page ``pages[i]`` of buffer ``buffer_names[buffer_ids[i]]`` must hash to ``digests[i]``.
    ``shape`` is the layout's shape fingerprint ("" when unknown), checked by ``verify_digests``. ``spans``
    (between page sizes; None otherwise): int64 [N, 2], entry i covers only entries ``[first, first +
    count)`` of its page (``hashing.hash_entries``; count 0: the whole page).
    """

    mode: DigestMode
    buffer_names: tuple[str, ...]
    buffer_ids: np.ndarray   # uint32 [N]: index into buffer_names
    pages: np.ndarray        # int64 [N]: destination page
    digests: np.ndarray      # uint64 [N]: xxh3-64 of the page bytes
    shape: str = ""
    spans: np.ndarray | None = None

    def __len__(self) -> int:
        return len(self.digests)

    @classmethod
    def empty(cls, mode: DigestMode = DigestMode.OFF, shape: str = "") -> PageDigests:
        return cls(mode, (), readonly(np.zeros(0, np.uint32)), readonly(np.zeros(0, np.int64)),
                   readonly(np.zeros(0, np.uint64)), shape)

    @classmethod
    def merge(cls, parts: Iterable[PageDigests]) -> PageDigests:
        """One ``PageDigests`` holding every entry of ``parts`` (chunked or layer-by-layer sends).

        The merged mode is the weakest of the parts (``full`` only if every part is full); the parts must
        share a layout shape.
        """
        parts = list(parts)
        if not parts:
            return cls.empty()
        shapes = {p.shape for p in parts} - {""}
        if len(shapes) > 1:
            raise IntegrityError(f"cannot merge digests of different layout shapes: {sorted(shapes)}")
        names: dict[str, int] = {}
        ids = []
        for p in parts:
            table = np.array([names.setdefault(n, len(names)) for n in p.buffer_names], dtype=np.uint32)
            ids.append(table[p.buffer_ids] if len(p) else np.zeros(0, np.uint32))
        order = [DigestMode.OFF, DigestMode.SAMPLED, DigestMode.FULL]
        mode = min((p.mode for p in parts), key=order.index)
        pages = readonly(np.concatenate([p.pages for p in parts]))
        digests = readonly(np.concatenate([p.digests for p in parts]))
        spans = None
        if any(p.spans is not None for p in parts):
            spans = readonly(np.concatenate([p.spans if p.spans is not None else np.zeros((len(p), 2), np.int64)
                                             for p in parts]))
        return cls(mode, tuple(names), readonly(np.concatenate(ids)), pages, digests, shapes.pop() if shapes else "",
                   spans)

    # -- wire ------------------------------------------------------------------------------------------
    def to_bytes(self) -> bytes:
        """Versioned msgpack; ``PageDigests.from_bytes`` round-trips it exactly."""
        return encode(_DigestsMsg(
            DIGESTS_VERSION, self.mode.value, self.shape, list(self.buffer_names),
            self.buffer_ids.astype("<u4").tobytes(), self.pages.astype("<i8").tobytes(),
            self.digests.astype("<u8").tobytes(), b"" if self.spans is None else self.spans.astype("<i8").tobytes()))

    @classmethod
    def from_bytes(cls, data: bytes) -> PageDigests:
        """Decode untrusted bytes: sizes capped, arrays length- and range-checked; IntegrityError if not."""
        if isinstance(data, (bytes, bytearray, memoryview)) and len(data) > MAX_MESSAGE_BYTES:
            raise IntegrityError(f"page digests message of {len(data)} bytes exceeds {MAX_MESSAGE_BYTES}")
        # One decode on the happy path (decode_versioned peeks at the version first, a second pass over
        # every chunk's digests); any failure goes the careful way, whose error names a version mismatch.
        try:
            msg = _DIGESTS_DECODER.decode(data)
        except (msgspec.DecodeError, msgspec.ValidationError, TypeError):
            msg = None
        if msg is None or msg.version != DIGESTS_VERSION:
            msg = decode_versioned(data, _DigestsMsg, version=DIGESTS_VERSION, what="page digests",
                                   error=IntegrityError)
        return _from_msg(msg)


def _from_msg(msg: _DigestsMsg) -> PageDigests:
    mode = DigestMode.parse(msg.mode, IntegrityError)
    n = len(msg.digests) // 8
    if len(msg.digests) % 8 or len(msg.buffer_ids) != 4 * n or len(msg.pages) != 8 * n:
        raise IntegrityError(f"malformed page digests: array sizes disagree ({len(msg.buffer_ids)} B of ids, "
                             f"{len(msg.pages)} B of pages, {len(msg.digests)} B of digests)")
    # Read-only views of the message's bytes (no copy on a little-endian host; converted elsewhere).
    ids = np.frombuffer(msg.buffer_ids, dtype="<u4").astype(np.uint32, copy=False)
    pages = np.frombuffer(msg.pages, dtype="<i8").astype(np.int64, copy=False)
    if mode is DigestMode.OFF and n:
        raise IntegrityError(f"malformed page digests: mode 'off' with {n} entries")
    # ufunc reductions: ndarray.max/min add a Python-level wrapper (this runs per chunk).
    if n and int(np.maximum.reduce(ids)) >= len(msg.buffer_names):
        raise IntegrityError(f"malformed page digests: buffer id {int(np.maximum.reduce(ids))} but only "
                             f"{len(msg.buffer_names)} buffer names")
    if n and int(np.minimum.reduce(pages)) < 0:
        raise IntegrityError(f"malformed page digests: negative page {int(np.minimum.reduce(pages))}")
    spans = None
    if msg.spans:
        if len(msg.spans) != 16 * n:
            raise IntegrityError(f"malformed page digests: {len(msg.spans)} B of entry ranges for {n} entries")
        spans = np.frombuffer(msg.spans, dtype="<i8").astype(np.int64, copy=False).reshape(n, 2)
        if n and int(np.minimum.reduce(spans.ravel())) < 0:
            raise IntegrityError("malformed page digests: a negative entry range")
        spans = readonly(spans)
    return PageDigests(mode, tuple(msg.buffer_names), readonly(ids), readonly(pages),
                       readonly(np.frombuffer(msg.digests, dtype="<u8").astype(np.uint64, copy=False)), msg.shape,
                       spans)


# -- prefill side ------------------------------------------------------------------------------------------
def digest_plan(plan: Plan, mode: DigestMode | str, *, seed: int = 0,
                samples_per_buffer: int = 2) -> PageDigests:
    """Digest the source pages ``plan`` sends, keyed by buffer and destination page.

    Called on the prefill side once the source pages hold the request's final KV (before or after the
    write is posted: it only reads). Blocking; cost measured in bench/RESULTS-integrity.md. CUDA regions
    are read by copying the chosen pages to host through torch (see ``hashing.read_pages``). For a
    ``TransferPlan``, equal to ``digest_pages`` over the plan's source pages, keyed by its destination
    pages. For a ``TPPlan`` (across TP sizes), the digests cover the slice of each page the plan writes
    and carry the *destination* layout's shape; decode checks them with that plan's ``slices``.
    """
    if isinstance(plan, TokenPlan):
        return _digest_token_plan(plan, mode, seed, samples_per_buffer)
    if not plan.whole_pages:
        return _digest_tp_plan(cast(TPPlan, plan), mode, seed, samples_per_buffer)
    plan = cast(TransferPlan, plan)
    cells = [(pool_plan.pool, pool_plan.buffer_ids, pool_plan.src_pages) for pool_plan in plan.pools]
    source = _digest_cells(plan.src_memory, cells, mode, seed, samples_per_buffer)
    return source.keyed({pool_plan.pool: pool_plan.dst_pages for pool_plan in plan.pools})


def _digest_tp_plan(plan: TPPlan, mode: DigestMode | str, seed: int, k: int) -> PageDigests:
    index = plan.src_memory.buffer_index  # the same buffer order on both sides (model_difference)
    cells = [(pool_plan.pool, np.array([index[n] for n in pool_plan.buffers], dtype=np.int64), pool_plan.src_pages)
             for pool_plan in plan.pool_pages if pool_plan.buffers and len(pool_plan.src_pages)]
    source = _digest_cells(plan.src_memory, cells, mode, seed, k, plan.slices,
                           plan.dst_memory.layout.shape_fingerprint)
    return source.keyed({pool_plan.pool: pool_plan.dst_pages for pool_plan in plan.pool_pages})


def _digest_token_plan(plan: TokenPlan, mode: DigestMode | str, seed: int, k: int) -> PageDigests:
    """Per (buffer, segment) cell of the plan (``TokenPlan.segments``; ``k`` per buffer and pool when
    sampled), the source entries it moves hashed, keyed by destination page and entry range."""
    mode = DigestMode.parse(mode)
    shape = plan.dst_memory.layout.shape_fingerprint
    if mode is DigestMode.OFF or not plan.segments:
        return PageDigests.empty(mode, shape)
    if mode is DigestMode.SAMPLED and k < 1:
        raise UsageError(f"samples_per_buffer must be >= 1, got {k}")
    rng = np.random.default_rng(seed % (1 << 64))
    gids, seg_parts = [], []
    for cells in plan.segments:
        nb, ns = len(cells.buffer_ids), len(cells.entries)
        if mode is DigestMode.FULL or ns <= k:
            pick = np.tile(np.arange(ns), nb)
            owner = np.repeat(cells.buffer_ids, ns)
        else:   # k segments per buffer, drawn apart for each buffer (different buffers cover different pages)
            pick = np.argsort(rng.random((nb, ns)), axis=1)[:, :k].ravel()
            owner = np.repeat(cells.buffer_ids, k)
        count = np.zeros(len(pick), np.int64) if cells.whole else cells.entries[pick]
        gids.append(owner)
        seg_parts.append((cells.src_page[pick], cells.src_entry[pick] * (count > 0), cells.dst_page[pick],
                          cells.dst_entry[pick] * (count > 0), count))
    gid = np.concatenate(gids).astype(np.int64)
    sp, so, dp, do, n = (np.concatenate([p[i] for p in seg_parts]) for i in range(5))
    digests = hash_entries(plan.src_memory, gid, sp, so, n)
    used, local = np.unique(gid, return_inverse=True)
    names = tuple(plan.src_memory.layout.buffers[g].name for g in used.tolist())
    return PageDigests(mode, names, readonly(local.astype(np.uint32)), readonly(dp.astype(np.int64)),
                       readonly(digests), shape, readonly(np.stack([do, n], axis=1).astype(np.int64)))


def digest_pages(memory: KVMemory, pages: Mapping[str, np.ndarray], mode: DigestMode | str, *,
                 seed: int | np.random.Generator | PageSampler = 0, samples_per_buffer: int = 2,
                 buffers: Iterable[str] | None = None) -> SourceDigests:
    """Digest source pages (pool -> validated int64 pages) before their destination pages are known.

    Covers exactly the cells ``plan_transfer(memory, peer, {pool: (pages[pool], dst)}, buffers)`` writes,
    in the same order, and with the same int ``seed`` samples as ``digest_plan`` on that plan does;
    ``SourceDigests.keyed`` then names the destination pages. Lets prefill hash on the thread that calls
    ``send`` (the pages are final then) rather than on its progress thread. Blocking. ``seed``: an int (the
    same int, the same pages), a generator to draw from, or a ``sampling.PageSampler`` (draws in blocks).

    What does not depend on the pages themselves (which buffers, their names and sizes, how many picks per
    buffer) is built once per memory, mode, buffer selection and page count per pool, and reused.
    """
    mode = DigestMode.parse(mode)
    names = None if buffers is None else tuple(buffers)
    key = (mode, samples_per_buffer, names, tuple([(pool, len(src)) for pool, src in pages.items()]))

    def build() -> _Frame:
        keep = None if names is None else [memory.buffer_index[n] for n in names]
        cells = []
        for pool, src in pages.items():
            ids = memory.pool_arrays[pool].buffer_ids
            ids = ids if keep is None else ids[np.isin(ids, keep)]
            if len(src) and len(ids):  # the planner leaves such pools out of the plan too
                cells.append((pool, ids, len(src)))
        return _frame(memory, cells, mode, samples_per_buffer, None, None)

    frame = _cached_frame(memory, key, build)
    return _digest_frame(memory, frame, [np.asarray(pages[pool], dtype=np.int64) for pool in frame.pool_names],
                         seed)


# Per memory: frames by what they are built from (``digest_pages``: mode, samples, buffers, page count per
# pool; ``digest_plan``: the plan's buffer ids and page counts per pool, its slices and shape); bounded.
_FRAMES: weakref.WeakKeyDictionary[KVMemory, dict[object, _Frame]] = weakref.WeakKeyDictionary()
_MAX_FRAMES = 256


def _cached_frame(memory: KVMemory, key: object, build: Callable[[], _Frame]) -> _Frame:
    """``memory``'s frame for ``key``, built on first use (a race builds it twice, harmlessly)."""
    frames = _FRAMES.get(memory)
    if frames is None:
        frames = _FRAMES[memory] = {}
    frame = frames.get(key)
    if frame is None:
        frame = build()
        if len(frames) >= _MAX_FRAMES:
            frames.clear()
        frames[key] = frame
    return frame


@dataclass(frozen=True, eq=False)
class SourceDigests:
    """Digests keyed by position: entry i hashes position ``positions[i]`` of the page list of pool
    ``pool_names[pool_ids[i]]`` in buffer ``buffer_names[buffer_ids[i]]``. From ``digest_pages``."""

    mode: DigestMode
    buffer_names: tuple[str, ...]
    buffer_ids: np.ndarray   # uint32 [N]
    pool_names: tuple[str, ...]
    pool_ids: np.ndarray     # int64 [N]: index into pool_names
    positions: np.ndarray    # int64 [N]: index into that pool's page list
    digests: np.ndarray      # uint64 [N]
    shape: str = ""

    def __len__(self) -> int:
        return len(self.digests)

    def keyed(self, dst_pages: Mapping[str, np.ndarray]) -> PageDigests:
        """The ``PageDigests`` decode checks: position i of pool p is destination page ``dst_pages[p][i]``."""
        if not self.pool_names:
            return PageDigests.empty(self.mode, self.shape)
        lists = [np.asarray(dst_pages[p], dtype=np.int64) for p in self.pool_names]
        if len(lists) == 1:
            pages = lists[0][self.positions]
        else:
            starts = np.array(list(itertools.accumulate([len(x) for x in lists[:-1]], initial=0)), dtype=np.int64)
            pages = np.concatenate(lists)[starts[self.pool_ids] + self.positions]
        return PageDigests(self.mode, self.buffer_names, self.buffer_ids, readonly(pages), self.digests, self.shape)


_Cells = Sequence[tuple[str, np.ndarray, np.ndarray]]   # per pool: (name, buffer ids into layout.buffers, pages)


@dataclass(frozen=True, slots=True)
class _Frame:
    """What digesting some pools' pages needs apart from the pages: built per call, or once and reused
    (``digest_pages``). Entries run pool by pool, buffer by buffer, ``picks[p]`` pages per buffer."""

    mode: DigestMode
    k: int
    pool_names: tuple[str, ...]
    num_buffers: tuple[int, ...]      # per pool
    num_pages: tuple[int, ...]        # per pool
    picks: tuple[int, ...]            # per pool: pages hashed per buffer
    names: tuple[str, ...]            # the buffers, pool by pool
    local: np.ndarray                 # uint32 [N]: index into names (read-only)
    pool_ids: np.ndarray              # int64 [N]: index into pool_names (read-only)
    gids: np.ndarray                  # int64 [N]: index into layout.buffers
    gid_list: list[int]               # gids as a list, and each entry's page bytes: hashing's inputs
    page_bytes: np.ndarray            # int64 [N]
    slices: Mapping[str, PageSlice] | None
    shape: str
    sample_shape: SampleShape         # what ``sampling`` draws positions for
    starts: np.ndarray | None         # int64 [N]: where each entry's pool starts in the pools' pages joined
    fixed: np.ndarray | None          # int64 [N]: the positions, when nothing is drawn (full, or few pages)


def _frame(memory: KVMemory, cells: Sequence[tuple[str, np.ndarray, int]], mode: DigestMode, k: int,
           slices: Mapping[str, PageSlice] | None, shape: str | None) -> _Frame:
    """The frame of ``cells`` (per pool: name, buffer ids, page count) in ``mode``."""
    if mode is not DigestMode.OFF and k < 1:
        raise UsageError(f"samples_per_buffer must be >= 1, got {k}")
    shape = memory.layout.shape_fingerprint if shape is None else shape
    if mode is DigestMode.OFF:
        cells = []
    picks = [n if mode is DigestMode.FULL or n <= k else k for _, _, n in cells]
    counts = [len(ids) * m for (_, ids, _), m in zip(cells, picks)]
    bufs = memory.layout.buffers
    gids = (np.concatenate([ids.repeat(m) for (_, ids, _), m in zip(cells, picks)]).astype(np.int64)
            if cells else np.zeros(0, np.int64))
    sample_shape = tuple((len(ids), n, m) for (_, ids, n), m in zip(cells, picks))
    pool_ids = np.repeat(np.arange(len(cells), dtype=np.int64), counts)
    starts = np.array(list(itertools.accumulate([n for _, _, n in cells], initial=0))[:-1], dtype=np.int64)
    fixed = draw(None, sample_shape)[0] if all(m == n for _, n, m in sample_shape) else None
    return _Frame(mode, k, tuple(c[0] for c in cells), tuple(len(c[1]) for c in cells), tuple(c[2] for c in cells),
                  tuple(picks), tuple(bufs[g].name for c in cells for g in c[1].tolist()),
                  readonly(np.arange(sum(len(c[1]) for c in cells), dtype=np.uint32).repeat(
                      np.repeat(picks, [len(c[1]) for c in cells]).astype(np.int64))),
                  readonly(pool_ids), readonly(gids), gids.tolist(), readonly(hash_index(memory).page_bytes[gids]),
                  slices, shape, sample_shape, readonly(starts[pool_ids]) if len(cells) > 1 else None,
                  None if fixed is None else readonly(fixed))


def _digest_cells(memory: KVMemory, cells: _Cells, mode: DigestMode | str, seed: int,
                  k: int, slices: Mapping[str, PageSlice] | None = None, shape: str | None = None,
                  ) -> SourceDigests:
    """Choose the pages to hash (every one, or ``k`` per buffer), then hash them all in one pass: whole
    pages, or each buffer's ``slices`` entry of them. ``shape``: the layout the digests are checked on."""
    mode = DigestMode.parse(mode)
    counts = [(pool, ids, len(pages)) for pool, ids, pages in cells]
    # Chunks of one request shape share a frame: per plan, building it (the repeats, the fixed draw) cost
    # more than hashing a small chunk's pages. Slices are part of the key (a TP pair's own geometry).
    key = ("plan", mode, k, tuple([(pool, ids.tobytes(), n) for pool, ids, n in counts]),
           None if slices is None else tuple(slices.items()), shape)
    frame = _cached_frame(memory, key, lambda: _frame(memory, counts, mode, k, slices, shape))
    return _digest_frame(memory, frame, [pages for _, _, pages in cells], seed)


def _digest_frame(memory: KVMemory, frame: _Frame, pages: list[np.ndarray],
                  seed: int | np.random.Generator | PageSampler) -> SourceDigests:
    """Hash ``frame``'s cells for these pages (per pool of the frame, in its order)."""
    if not frame.pool_names:
        return SourceDigests(frame.mode, (), *_empty_entries(), shape=frame.shape)
    positions = frame.fixed if frame.fixed is not None else _draw(frame.sample_shape, seed)
    src = pages[0][positions] if frame.starts is None else np.concatenate(pages)[frame.starts + positions]
    digests = hash_cells(memory, frame.gids, src, frame.slices, "src", gid_list=frame.gid_list,
                         page_bytes=frame.page_bytes)
    return SourceDigests(frame.mode, frame.names, frame.local, frame.pool_names, frame.pool_ids,
                         readonly(positions), readonly(digests), frame.shape)


def _draw(shape: SampleShape, seed: int | np.random.Generator | PageSampler) -> np.ndarray:
    if isinstance(seed, PageSampler):
        return seed.take(shape)
    rng = seed if isinstance(seed, np.random.Generator) else np.random.default_rng(seed % (1 << 64))  # ids hash < 0
    return draw(rng, shape)[0]


def _empty_entries() -> tuple[np.ndarray, tuple[str, ...], np.ndarray, np.ndarray, np.ndarray]:
    z = readonly(np.zeros(0, np.int64))
    return readonly(np.zeros(0, np.uint32)), (), z, z, readonly(np.zeros(0, np.uint64))


# -- decode side -------------------------------------------------------------------------------------------
def verify_digests(memory: KVMemory, digests: PageDigests,
                   slices: Mapping[str, PageSlice] | None = None) -> None:
    """Recompute ``digests`` on this side's pages; raise ``PageMismatchError`` listing every mismatch.

    Called by decode after the write completed and before it reports the request done. Across TP sizes,
    ``slices`` is the link's ``TPPlanner(prefill memory, memory).slices``: each digest then covers that
    buffer's slice of the page. Raises ``IntegrityError`` too when the digests name a buffer or page this
    layout does not have, a buffer ``slices`` does not write, or were made for another layout shape.
    Empty digests (mode ``off``) verify nothing and return.
    """
    if not len(digests):
        return
    layout = memory.layout
    if digests.shape and digests.shape != layout.shape_fingerprint:
        raise IntegrityError(f"page digests are for layout shape {digests.shape}, this side has "
                             f"{layout.shape_fingerprint}")
    gids = _local_buffer_ids(memory, digests)
    _check_page_range(memory, digests, gids)
    if slices is not None:
        _check_written(memory, gids, slices)
    if digests.spans is not None:
        _check_entry_range(memory, digests, gids)
        actual = hash_entries(memory, gids, digests.pages, digests.spans[:, 0], digests.spans[:, 1])
    else:
        actual = hash_cells(memory, gids, digests.pages, slices, "dst")
    differ = actual != digests.digests
    if differ.any():
        bad = np.flatnonzero(differ)
        bad = bad[np.argsort(digests.buffer_ids[bad], kind="stable")]  # buffer by buffer, as listed
        raise PageMismatchError([_mismatch(memory, digests, int(i), int(actual[i])) for i in bad.tolist()],
                                len(digests), digests.mode.value)


def _local_buffer_ids(memory: KVMemory, digests: PageDigests) -> np.ndarray:
    """Each entry's buffer as an index into this side's ``layout.buffers``; unknown names refused."""
    table, known = hash_index(memory).buffer_table(digests.buffer_names)
    gids = table[digests.buffer_ids]
    if not known and (gids < 0).any():
        name = digests.buffer_names[int(digests.buffer_ids[np.argmax(gids < 0)])]
        raise IntegrityError(f"page digests name buffer {name!r}, which this layout does not have")
    return gids


def _check_page_range(memory: KVMemory, digests: PageDigests, gids: np.ndarray) -> None:
    pages = digests.pages
    caps = hash_index(memory).num_pages[gids]
    # As uint64 a negative page is above every capacity: one comparison bounds both ends.
    bad = pages.view(np.uint64) >= caps.view(np.uint64)
    if bad.any():
        i = int(np.argmax(bad))
        raise IntegrityError(f"page digests name page {int(pages[i])} of buffer "
                             f"{digests.buffer_names[int(digests.buffer_ids[i])]!r}, which has {int(caps[i])} "
                             "pages on this side")


def _check_entry_range(memory: KVMemory, digests: PageDigests, gids: np.ndarray) -> None:
    """Every entry range (untrusted) inside its page on this side."""
    assert digests.spans is not None
    entries = np.array([entry_shape(memory, g)[1] for g in range(len(memory.layout.buffers))], dtype=np.int64)[gids]
    first, count = digests.spans[:, 0], digests.spans[:, 1]
    bad = (first > entries) | (count > entries - first) | ((count == 0) & (first != 0))
    if bad.any():
        i = int(np.argmax(bad))
        raise IntegrityError(f"page digests name entries [{int(first[i])}, {int(first[i] + count[i])}) of page "
                             f"{int(digests.pages[i])} of buffer {digests.buffer_names[int(digests.buffer_ids[i])]!r}, "
                             f"whose pages hold {int(entries[i])} entries on this side")


def _check_written(memory: KVMemory, gids: np.ndarray, slices: Mapping[str, PageSlice]) -> None:
    for g in np.unique(gids).tolist():
        name = memory.layout.buffers[g].name
        if name not in slices:
            raise IntegrityError(f"page digests name buffer {name!r}, which this prefill rank does not write "
                                 "to this decode rank")


def _mismatch(memory: KVMemory, digests: PageDigests, i: int, actual: int) -> PageMismatch:
    name = digests.buffer_names[int(digests.buffer_ids[i])]
    return PageMismatch(memory.layout.pool_of[name], name, memory.layout.buffer(name).layer,
                        int(digests.pages[i]), int(digests.digests[i]), actual)


# -- wire struct -------------------------------------------------------------------------------------------
_Name = Annotated[str, msgspec.Meta(min_length=1, max_length=MAX_NAME_LEN)]


class _DigestsMsg(msgspec.Struct, forbid_unknown_fields=True):
    version: int
    mode: Annotated[str, msgspec.Meta(max_length=16)]
    shape: Annotated[str, msgspec.Meta(max_length=128)]
    buffer_names: Annotated[list[_Name], msgspec.Meta(max_length=MAX_BUFFERS)]
    buffer_ids: Annotated[bytes, msgspec.Meta(max_length=4 * MAX_ENTRIES)]  # little-endian uint32
    pages: Annotated[bytes, msgspec.Meta(max_length=8 * MAX_ENTRIES)]       # little-endian int64
    digests: Annotated[bytes, msgspec.Meta(max_length=8 * MAX_ENTRIES)]     # little-endian uint64
    spans: Annotated[bytes, msgspec.Meta(max_length=16 * MAX_ENTRIES)] = b""  # little-endian int64 pairs


_DIGESTS_DECODER = msgspec.msgpack.Decoder(_DigestsMsg)
