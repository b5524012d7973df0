"""Page digests: prove that the pages decode holds are the pages prefill sent.

Layer 4 of kvferry (beside ``transport``, above ``plan``). The prefill side calls ``digest_plan`` on the
plan it is about to post (or has posted) and sends the ``PageDigests`` with its completion message, as
``to_bytes()``; the decode side decodes them with ``PageDigests.from_bytes`` (untrusted input) and calls
``verify_digests`` on its own memory before it reports the request done. A mismatch raises
``PageMismatchError``, a ``kvferry.IntegrityError`` naming pool, buffer, layer, page, expected and actual
digest.

Digests are keyed by buffer and *destination* page, so decode checks its own pages without knowing the
source page numbers. ``digest_pages`` hashes source pages before the destination is known (prefill's
``send``) and ``SourceDigests.keyed`` names the destination pages later; ``digest_plan`` is the two in one.
The hash is xxh3-64 (python-xxhash): one call per page, since a page is the unit a mismatch must name and
the library has no batched API. Both sides pick the pages to hash with numpy across all buffers at once and
hash them in one loop over slices of a flat view per buffer (built once per binding): no Python work per
buffer, which was most of a sampled digest's cost. Measured alternatives (bench/RESULTS-integrity.md):
gathering pages into a block first is slower (a copy of every byte); threads do not help, because
python-xxhash holds the GIL for inputs under 64 KiB and pages are smaller.

Modes: ``off`` (nothing), ``sampled`` (``samples_per_buffer`` pages per buffer, chosen independently per
buffer from the plan's pages with ``seed``, so different buffers cover different pages) and ``full``.
"""

from __future__ import annotations

import weakref
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from enum import Enum
from typing import Annotated

import msgspec
import numpy as np
import xxhash

from .errors import IntegrityError, LayoutError
from .layout import MAX_BUFFERS, MAX_NAME_LEN
from .memory import KVMemory
from .plan import TransferPlan

__all__ = [
    "DIGESTS_VERSION",
    "DigestMode",
    "PageDigests",
    "PageMismatch",
    "PageMismatchError",
    "SourceDigests",
    "digest_pages",
    "digest_plan",
    "hash_pages",
    "verify_digests",
]

# Bump when the wire fields, their encoding or the hash function change; decoders refuse other versions.
DIGESTS_VERSION = 1
# Caps on untrusted digest messages: 4M entries is 20 x a 128k-token DeepSeek request in full mode.
MAX_ENTRIES = 1 << 22
MAX_MESSAGE_BYTES = 128 << 20
_HASH_SEED = 0  # fixed: both sides must hash alike; sampling, not hashing, is what ``seed`` varies


class DigestMode(str, Enum):
    """How many pages a request's digests cover."""

    OFF = "off"
    SAMPLED = "sampled"
    FULL = "full"

    @classmethod
    def parse(cls, value: DigestMode | str) -> DigestMode:
        """``"sampled"`` -> ``DigestMode.SAMPLED``; raises IntegrityError naming the valid modes."""
        try:
            return cls(value)
        except ValueError:
            valid = ", ".join(m.value for m in cls)
            raise IntegrityError(f"unknown digest mode {value!r} (expected one of: {valid})") from None


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


class PageMismatchError(IntegrityError):
    """Pages differ from what was sent. ``mismatches`` lists every one; the message names the first."""

    def __init__(self, mismatches: Sequence[PageMismatch], num_checked: int, mode: DigestMode) -> None:
        self.mismatches: tuple[PageMismatch, ...] = tuple(mismatches)
        self.num_checked = num_checked
        counts: dict[str, int] = {}
        for m in self.mismatches:
            counts[m.buffer] = counts.get(m.buffer, 0) + 1
        hit = ", ".join(f"{name} x{n}" for name, n in list(counts.items())[:8])
        more = f" and {len(counts) - 8} more" if len(counts) > 8 else ""
        super().__init__(f"{len(self.mismatches)} of {num_checked} pages checked ({mode.value} digests) "
                         f"differ from what was sent; first: {self.mismatches[0]}; buffers hit: {hit}{more}")


@dataclass(frozen=True, eq=False)
class PageDigests:
    """Digests of destination pages, buffer by buffer.

    Entry i says: page ``pages[i]`` of buffer ``buffer_names[buffer_ids[i]]`` must hash to ``digests[i]``.
    ``shape`` is the layout's shape fingerprint ("" when unknown), checked by ``verify_digests``.
    """

    mode: DigestMode
    buffer_names: tuple[str, ...]
    buffer_ids: np.ndarray   # uint32 [N]: index into buffer_names
    pages: np.ndarray        # int64 [N]: destination page
    digests: np.ndarray      # uint64 [N]: xxh3-64 of the page bytes
    shape: str = ""

    def __len__(self) -> int:
        return len(self.digests)

    @classmethod
    def empty(cls, mode: DigestMode = DigestMode.OFF, shape: str = "") -> PageDigests:
        return cls(mode, (), _ro(np.zeros(0, np.uint32)), _ro(np.zeros(0, np.int64)),
                   _ro(np.zeros(0, np.uint64)), shape)

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
        return cls(mode, tuple(names), _ro(np.concatenate(ids)), _ro(np.concatenate([p.pages for p in parts])),
                   _ro(np.concatenate([p.digests for p in parts])), shapes.pop() if shapes else "")

    # -- wire ------------------------------------------------------------------------------------------
    def to_bytes(self) -> bytes:
        """Versioned msgpack; ``PageDigests.from_bytes`` round-trips it exactly."""
        return _ENCODER.encode(_DigestsMsg(
            DIGESTS_VERSION, self.mode.value, self.shape, list(self.buffer_names),
            self.buffer_ids.astype("<u4").tobytes(), self.pages.astype("<i8").tobytes(),
            self.digests.astype("<u8").tobytes()))

    @classmethod
    def from_bytes(cls, data: bytes) -> PageDigests:
        """Decode untrusted bytes: sizes capped, arrays length- and range-checked; IntegrityError if not."""
        if not isinstance(data, (bytes, bytearray, memoryview)):
            raise IntegrityError(f"page digests must be bytes, got {type(data).__name__}")
        if len(data) > MAX_MESSAGE_BYTES:
            raise IntegrityError(f"page digests message of {len(data)} bytes exceeds {MAX_MESSAGE_BYTES}")
        try:
            msg = msgspec.msgpack.decode(data, type=_DigestsMsg)
        except (msgspec.DecodeError, msgspec.ValidationError) as exc:
            raise IntegrityError(f"malformed page digests: {exc}") from exc
        if msg.version != DIGESTS_VERSION:
            raise IntegrityError(f"page digests version {msg.version} is not supported "
                                 f"(expected {DIGESTS_VERSION})")
        return _from_msg(msg)


def _from_msg(msg: _DigestsMsg) -> PageDigests:
    mode = DigestMode.parse(msg.mode)
    n = len(msg.digests) // 8
    if len(msg.digests) % 8 or len(msg.buffer_ids) != 4 * n or len(msg.pages) != 8 * n:
        raise IntegrityError(f"malformed page digests: array sizes disagree ({len(msg.buffer_ids)} B of ids, "
                             f"{len(msg.pages)} B of pages, {len(msg.digests)} B of digests)")
    ids = np.frombuffer(msg.buffer_ids, dtype="<u4").astype(np.uint32)
    pages = np.frombuffer(msg.pages, dtype="<i8").astype(np.int64)
    if mode is DigestMode.OFF and n:
        raise IntegrityError(f"malformed page digests: mode 'off' with {n} entries")
    if n and int(ids.max()) >= len(msg.buffer_names):
        raise IntegrityError(f"malformed page digests: buffer id {int(ids.max())} but only "
                             f"{len(msg.buffer_names)} buffer names")
    if n and int(pages.min()) < 0:
        raise IntegrityError(f"malformed page digests: negative page {int(pages.min())}")
    return PageDigests(mode, tuple(msg.buffer_names), _ro(ids), _ro(pages),
                       _ro(np.frombuffer(msg.digests, dtype="<u8").astype(np.uint64)), msg.shape)


# -- prefill side ------------------------------------------------------------------------------------------
def digest_plan(plan: TransferPlan, mode: DigestMode | str, *, seed: int = 0,
                samples_per_buffer: int = 2) -> PageDigests:
    """Digest the source pages ``plan`` sends, keyed by buffer and destination page.

    Called on the prefill side once the source pages hold the request's final KV (before or after the
    write is posted: it only reads). Blocking; cost measured in bench/RESULTS-integrity.md. CUDA regions
    are read by copying the chosen pages to host through torch (see ``read_pages``). Equal to
    ``digest_pages`` over the plan's source pages, keyed by its destination pages.
    """
    cells = [(pp.pool, pp.buffer_ids, pp.src_pages) for pp in plan.pools]
    source = _digest_cells(plan.src_memory, cells, mode, seed, samples_per_buffer)
    return source.keyed({pp.pool: pp.dst_pages for pp in plan.pools})


def digest_pages(memory: KVMemory, pages: Mapping[str, np.ndarray], mode: DigestMode | str, *,
                 seed: int | np.random.Generator = 0, samples_per_buffer: int = 2,
                 buffers: Iterable[str] | None = None) -> SourceDigests:
    """Digest source pages (pool -> validated int64 pages) before their destination pages are known.

    Covers exactly the cells ``plan_transfer(memory, peer, {pool: (pages[pool], dst)}, buffers)`` writes,
    in the same order, and with the same int ``seed`` samples as ``digest_plan`` on that plan does;
    ``SourceDigests.keyed`` then names the destination pages. Lets prefill hash on the thread that calls
    ``send`` (the pages are final then) rather than on its progress thread. Blocking.
    """
    keep = None if buffers is None else [memory.buffer_index[n] for n in buffers]
    cells = []
    for pool, src in pages.items():
        ids = memory.pool_arrays[pool].buffer_ids
        ids = ids if keep is None else ids[np.isin(ids, keep)]
        if len(src) and len(ids):  # the planner leaves such pools out of the plan too
            cells.append((pool, ids, np.asarray(src, dtype=np.int64)))
    return _digest_cells(memory, cells, mode, seed, samples_per_buffer)


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
        starts = np.cumsum([0] + [len(x) for x in lists[:-1]])
        pages = np.concatenate(lists)[starts[self.pool_ids] + self.positions]
        return PageDigests(self.mode, self.buffer_names, self.buffer_ids, _ro(pages), self.digests, self.shape)


_Cells = Sequence[tuple[str, np.ndarray, np.ndarray]]   # per pool: (name, buffer ids into layout.buffers, pages)


def _digest_cells(memory: KVMemory, cells: _Cells, mode: DigestMode | str, seed: int | np.random.Generator,
                  k: int) -> SourceDigests:
    """Choose the pages to hash (every one, or ``k`` per buffer), then hash them all in one pass."""
    mode = DigestMode.parse(mode)
    shape = memory.layout.shape_fingerprint
    if mode is not DigestMode.OFF and k < 1:
        raise IntegrityError(f"samples_per_buffer must be >= 1, got {k}")
    if mode is DigestMode.OFF or not cells:
        return SourceDigests(mode, (), *_empty_entries(), shape=shape)
    rng = _rng(seed) if mode is DigestMode.SAMPLED else None
    local, gids, pools, pos, src = [], [], [], [], []
    for p, (_, ids, pages) in enumerate(cells):
        chosen = _choose(rng, len(ids), len(pages), mode, k)   # [buffers of the pool, picks]: positions
        first = sum(len(c[1]) for c in cells[:p])               # plan-wide number of the pool's first buffer
        local.append(np.repeat(np.arange(first, first + len(ids), dtype=np.uint32), chosen.shape[1]))
        gids.append(np.repeat(ids, chosen.shape[1]))
        pools.append(np.full(chosen.size, p, dtype=np.int64))
        pos.append(chosen.ravel())
        src.append(pages[chosen].ravel())
    bufs = memory.layout.buffers
    names = tuple(bufs[g].name for c in cells for g in c[1].tolist())
    digests = _hash_cells(memory, np.concatenate(gids), np.concatenate(src))
    return SourceDigests(mode, names, _ro(np.concatenate(local)), tuple(c[0] for c in cells),
                         _ro(np.concatenate(pools)), _ro(np.concatenate(pos)), _ro(digests), shape)


def _rng(seed: int | np.random.Generator) -> np.random.Generator:
    if isinstance(seed, np.random.Generator):
        return seed
    return np.random.default_rng(seed % (1 << 64))  # any int: request ids may hash negative


def _empty_entries() -> tuple[np.ndarray, tuple[str, ...], np.ndarray, np.ndarray, np.ndarray]:
    z = _ro(np.zeros(0, np.int64))
    return _ro(np.zeros(0, np.uint32)), (), z, z, _ro(np.zeros(0, np.uint64))


def _choose(rng: np.random.Generator | None, num_buffers: int, num_pages: int, mode: DigestMode,
            k: int) -> np.ndarray:
    """Indices into the pool's page list, one row per buffer: all of them, or ``k`` drawn per buffer."""
    if mode is DigestMode.FULL or num_pages <= k:
        return np.broadcast_to(np.arange(num_pages), (num_buffers, num_pages))
    assert rng is not None
    # k smallest of uniform keys = k pages without replacement, independently for each buffer; sorted
    # so the hashes read memory in page order.
    keys = rng.random((num_buffers, num_pages))
    return np.sort(np.argpartition(keys, k - 1, axis=1)[:, :k], axis=1)


# -- hashing -----------------------------------------------------------------------------------------------
@dataclass(frozen=True, slots=True)
class _HashIndex:
    """Per binding, built once: what hashing a (buffer, page) cell needs, without per-buffer lookups."""

    by_name: dict[str, int]              # buffer name -> index into layout.buffers
    num_pages: np.ndarray                # int64 [buffers]
    page_bytes: np.ndarray               # int64 [buffers]
    views: tuple[memoryview | None, ...]  # flat bytes of each host buffer; None: GPU or not readable here
    all_host: bool                       # every view present: the fast path needs no per-call check


_INDEXES: weakref.WeakKeyDictionary[KVMemory, _HashIndex] = weakref.WeakKeyDictionary()


def _hash_index(memory: KVMemory) -> _HashIndex:
    index = _INDEXES.get(memory)
    if index is None:
        bufs = memory.layout.buffers
        views = tuple(_host_view(memory, b.name) for b in bufs)
        index = _HashIndex({b.name: i for i, b in enumerate(bufs)},
                           _ro(np.array([b.num_pages for b in bufs], dtype=np.int64)),
                           _ro(np.array([b.page_bytes for b in bufs], dtype=np.int64)), views,
                           all(v is not None for v in views))
        _INDEXES[memory] = index   # a race builds it twice, harmlessly
    return index


def _host_view(memory: KVMemory, name: str) -> memoryview | None:
    if memory.remote or memory.region(name).device != "cpu":
        return None
    return memoryview(memory.array(name).reshape(-1))


def _hash_cells(memory: KVMemory, gids: np.ndarray, pages: np.ndarray) -> np.ndarray:
    """xxh3-64 of page ``pages[i]`` of buffer ``gids[i]`` (indices into layout.buffers), as uint64.

    Pages must be in range (a memoryview slice past the end is short, not an error). Host buffers are
    hashed in one loop over slices of one flat view per buffer (no per-buffer Python work: that was most
    of a sampled digest's cost); GPU buffers go through ``hash_pages`` buffer by buffer.
    """
    index = _hash_index(memory)
    views = index.views
    if not index.all_host and any(views[g] is None for g in np.unique(gids).tolist()):
        return _hash_cells_by_buffer(memory, gids, pages)
    pb = index.page_bytes[gids]
    fn, seed = xxhash.xxh3_64_intdigest, _HASH_SEED
    out = [fn(views[g][o:o + n], seed)  # type: ignore[index]
           for g, o, n in zip(gids.tolist(), (pages * pb).tolist(), pb.tolist())]
    return np.array(out, dtype=np.uint64)


def _hash_cells_by_buffer(memory: KVMemory, gids: np.ndarray, pages: np.ndarray) -> np.ndarray:
    out = np.zeros(len(gids), dtype=np.uint64)
    bufs = memory.layout.buffers
    for g in np.unique(gids).tolist():
        at = np.flatnonzero(gids == g)
        out[at] = hash_pages(memory, bufs[g].name, pages[at])
    return out


def hash_pages(memory: KVMemory, buffer: str, pages: np.ndarray) -> np.ndarray:
    """xxh3-64 of each page of ``buffer`` in ``pages``, as uint64 (host memory read in place)."""
    rows = read_pages(memory, buffer, pages)
    fn = xxhash.xxh3_64_intdigest
    if rows is None:
        arr = memory.array(buffer)
        # Indexing a numpy row creates a view (no copy); measured faster than memoryview slicing.
        out = [fn(arr[p], _HASH_SEED) for p in pages.tolist()]
    else:
        out = [fn(row, _HASH_SEED) for row in rows]
    return np.array(out, dtype=np.uint64)


def read_pages(memory: KVMemory, buffer: str, pages: np.ndarray) -> np.ndarray | None:
    """Host copy of GPU pages (``len(pages) x page_bytes`` uint8), or None for host memory (read in place).

    GPU memory is reached through the torch tensor the binding was built from (``KVMemory.from_arrays``);
    a CUDA binding from raw pointers cannot be read here. Untested without a GPU: one gather on the
    device, one copy to host.
    """
    region = memory.region(buffer)
    if region.device == "cpu":
        return None
    tensor = memory.owner(buffer)
    if tensor is None or not hasattr(tensor, "data_ptr"):
        raise LayoutError(f"buffer {buffer!r} is {region.device} memory bound from a raw pointer: "
                          "bind it from its torch tensor to digest or diff it")
    import torch  # lazy: only GPU bindings need it

    page_bytes = memory.layout.buffer(buffer).page_bytes
    flat = tensor.view(torch.uint8).reshape(-1, page_bytes)
    index = torch.as_tensor(np.ascontiguousarray(pages), device=flat.device)
    return flat.index_select(0, index).cpu().numpy()


# -- decode side -------------------------------------------------------------------------------------------
def verify_digests(memory: KVMemory, digests: PageDigests) -> None:
    """Recompute ``digests`` on this side's pages; raise ``PageMismatchError`` listing every mismatch.

    Called by decode after the write completed and before it reports the request done. Raises
    ``IntegrityError`` too when the digests name a buffer or page this layout does not have, or were
    made for another layout shape. Empty digests (mode ``off``) verify nothing and return.
    """
    if not len(digests):
        return
    layout = memory.layout
    if digests.shape and digests.shape != layout.shape_fingerprint:
        raise IntegrityError(f"page digests are for layout shape {digests.shape}, this side has "
                             f"{layout.shape_fingerprint}")
    gids = _local_buffer_ids(memory, digests)
    _check_page_range(memory, digests, gids)
    actual = _hash_cells(memory, gids, digests.pages)
    bad = np.flatnonzero(actual != digests.digests)
    if len(bad):
        bad = bad[np.argsort(digests.buffer_ids[bad], kind="stable")]  # buffer by buffer, as listed
        raise PageMismatchError([_mismatch(memory, digests, int(i), int(actual[i])) for i in bad.tolist()],
                                len(digests), digests.mode)


def _local_buffer_ids(memory: KVMemory, digests: PageDigests) -> np.ndarray:
    """Each entry's buffer as an index into this side's ``layout.buffers``; unknown names refused."""
    by_name = _hash_index(memory).by_name
    table = np.array([by_name.get(n, -1) for n in digests.buffer_names], dtype=np.int64)
    gids = table[digests.buffer_ids]
    if (gids < 0).any():
        name = digests.buffer_names[int(digests.buffer_ids[np.argmax(gids < 0)])]
        raise IntegrityError(f"page digests name buffer {name!r}, which this layout does not have")
    return gids


def _check_page_range(memory: KVMemory, digests: PageDigests, gids: np.ndarray) -> None:
    pages = digests.pages
    caps = _hash_index(memory).num_pages[gids]
    bad = (pages < 0) | (pages >= caps)
    if bad.any():
        i = int(np.argmax(bad))
        raise IntegrityError(f"page digests name page {int(pages[i])} of buffer "
                             f"{digests.buffer_names[int(digests.buffer_ids[i])]!r}, which has {int(caps[i])} "
                             "pages on this side")


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


_ENCODER = msgspec.msgpack.Encoder()


def _ro(a: np.ndarray) -> np.ndarray:
    a.flags.writeable = False
    return a
