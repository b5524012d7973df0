"""Page digests: prove that the pages decode holds are the pages prefill sent.

Layer 4 of kvferry (beside ``transport``, above ``plan``). The prefill side calls ``digest_plan`` on the
plan it is about to post (or has posted) and sends the ``PageDigests`` with its completion message, as
``to_bytes()``; the decode side decodes them with ``PageDigests.from_bytes`` (untrusted input) and calls
``verify_digests`` on its own memory before it reports the request done. A mismatch raises
``PageMismatchError``, a ``kvferry.IntegrityError`` naming pool, buffer, layer, page, expected and actual
digest.

Digests are keyed by buffer and *destination* page, so decode checks its own pages without knowing the
source page numbers. The hash is xxh3-64 (python-xxhash): one call per page, since a page is the unit a
mismatch must name and the library has no batched API. Measured alternatives (bench/RESULTS-integrity.md):
a Python loop over numpy row views costs ~0.15 us per page on top of the hash, less than gathering pages
into a block first (a copy of every byte); threads do not help, because python-xxhash holds the GIL for
inputs under 64 KiB and pages are smaller.

Modes: ``off`` (nothing), ``sampled`` (``samples_per_buffer`` pages per buffer, chosen independently per
buffer from the plan's pages with ``seed``, so different buffers cover different pages) and ``full``.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
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
    are read by copying the chosen pages to host through torch (see ``read_pages``).
    """
    mode = DigestMode.parse(mode)
    shape = plan.src_memory.layout.shape_fingerprint
    if mode is DigestMode.OFF:
        return PageDigests.empty(mode, shape)
    if samples_per_buffer < 1:
        raise IntegrityError(f"samples_per_buffer must be >= 1, got {samples_per_buffer}")
    rng = np.random.default_rng(seed % (1 << 64))  # any int: request ids may hash negative
    layout_bufs = plan.src_memory.layout.buffers
    names, ids, pages, digests = [], [], [], []
    for pp in plan.pools:
        chosen = _choose(rng, len(pp.buffer_ids), len(pp.src_pages), mode, samples_per_buffer)
        for b, gid in enumerate(pp.buffer_ids.tolist()):
            sel = chosen[b]
            ids.append(np.full(len(sel), len(names), dtype=np.uint32))
            names.append(layout_bufs[gid].name)
            pages.append(pp.dst_pages[sel])
            digests.append(hash_pages(plan.src_memory, names[-1], pp.src_pages[sel]))
    if not names:
        return PageDigests.empty(mode, shape)
    return PageDigests(mode, tuple(names), _ro(np.concatenate(ids)), _ro(np.concatenate(pages)),
                       _ro(np.concatenate(digests)), shape)


def _choose(rng: np.random.Generator, num_buffers: int, num_pages: int, mode: DigestMode,
            k: int) -> np.ndarray:
    """Indices into the pool's page list, one row per buffer: all of them, or ``k`` drawn per buffer."""
    if mode is DigestMode.FULL or num_pages <= k:
        return np.broadcast_to(np.arange(num_pages), (num_buffers, num_pages))
    # k smallest of uniform keys = k pages without replacement, independently for each buffer; sorted
    # so the hashes read memory in page order.
    keys = rng.random((num_buffers, num_pages))
    return np.sort(np.argpartition(keys, k - 1, axis=1)[:, :k], axis=1)


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
    order = np.argsort(digests.buffer_ids, kind="stable")
    bounds = np.flatnonzero(np.diff(digests.buffer_ids[order])) + 1
    mismatches: list[PageMismatch] = []
    for group in np.split(order, bounds):
        name = digests.buffer_names[int(digests.buffer_ids[group[0]])]
        mismatches += _verify_buffer(memory, name, digests.pages[group], digests.digests[group])
    if mismatches:
        raise PageMismatchError(mismatches, len(digests), digests.mode)


def _verify_buffer(memory: KVMemory, name: str, pages: np.ndarray, expected: np.ndarray) -> list[PageMismatch]:
    layout = memory.layout
    try:
        buf = layout.buffer(name)
    except LayoutError:
        raise IntegrityError(f"page digests name buffer {name!r}, which this layout does not have") from None
    lo, hi = int(pages.min()), int(pages.max())
    if lo < 0 or hi >= buf.num_pages:
        raise IntegrityError(f"page digests name page {lo if lo < 0 else hi} of buffer {name!r}, which has "
                             f"{buf.num_pages} pages on this side")
    actual = hash_pages(memory, name, pages)
    bad = np.flatnonzero(actual != expected)
    pool = layout.pool_of[name]
    return [PageMismatch(pool, name, buf.layer, int(pages[i]), int(expected[i]), int(actual[i]))
            for i in bad.tolist()]


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
