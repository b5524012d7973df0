"""Page hashing: the one place kvferry's page digests read memory.

The bottom of the integrity layer, above ``plan``, below ``digests`` (which decides which pages to
hash, and checks the results). A
cell is (buffer, page); its digest is the xxh3-64 (python-xxhash) of the page's bytes, or, for a write
across tensor-parallel sizes, of the slice of the page that one rank pair moves (a ``tp.PageSlice``:
``num_tokens`` segments of ``nbytes``, strided, concatenated in token order; read at the source offsets
on prefill, at the destination offsets on decode). A whole-page slice hashes as the page does.

One call per page, since a page is the unit a mismatch must name and the library has no batched API.
Host buffers are hashed in one loop over slices of a flat view per buffer (built once per binding): no
Python work per buffer, which was most of a sampled digest's cost. Measured alternatives
(bench/RESULTS-integrity.md): gathering pages into a block first is slower (a copy of every byte);
threads do not help, because python-xxhash holds the GIL for inputs under 64 KiB and pages are smaller.
"""

from __future__ import annotations

import weakref
from collections.abc import Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np
import xxhash

from kvferry.arrays import readonly
from kvferry.errors import LayoutError
from kvferry.layout.memory import KVMemory
from kvferry.plan.tokens import entry_pieces, state_pieces

if TYPE_CHECKING:
    from kvferry.plan.tp import PageSlice

__all__ = ["HashIndex", "entry_shape", "hash_cells", "hash_entries", "hash_index", "hash_pages", "hash_slices",
           "read_pages"]

_HASH_SEED = 0  # fixed: both sides must hash alike; sampling, not hashing, is what digests' ``seed`` varies


@dataclass(frozen=True, slots=True)
class HashIndex:
    """Per binding, built once: what hashing a (buffer, page) cell needs, without per-buffer lookups."""

    by_name: dict[str, int]              # buffer name -> index into layout.buffers
    num_pages: np.ndarray                # int64 [buffers]
    page_bytes: np.ndarray               # int64 [buffers]
    views: tuple[memoryview | None, ...]  # flat bytes of each host buffer; None: GPU or not readable here
    all_host: bool                       # every view present: the fast path needs no per-call check
    # Buffer-name tuples seen in digests (decode gets the same one with every chunk) -> their indices.
    tables: dict[tuple[str, ...], tuple[np.ndarray, bool]]

    def buffer_table(self, names: tuple[str, ...]) -> tuple[np.ndarray, bool]:
        """(int64 index of each name into layout.buffers, -1 where unknown; True when none is unknown),
        built once per distinct tuple (at most ``_MAX_TABLES`` kept: the names come from the wire)."""
        hit = self.tables.get(names)
        if hit is None:
            table = readonly(np.array([self.by_name.get(n, -1) for n in names], dtype=np.int64))
            hit = (table, bool(len(table) == 0 or int(np.minimum.reduce(table)) >= 0))
            if len(self.tables) >= _MAX_TABLES:
                self.tables.clear()
            self.tables[names] = hit
        return hit


_INDEXES: weakref.WeakKeyDictionary[KVMemory, HashIndex] = weakref.WeakKeyDictionary()
_MAX_TABLES = 64


def hash_index(memory: KVMemory) -> HashIndex:
    """``memory``'s ``HashIndex``, built on first use and kept as long as ``memory`` lives."""
    index = _INDEXES.get(memory)
    if index is None:
        bufs = memory.layout.buffers
        views = tuple(_host_view(memory, b.name) for b in bufs)
        index = HashIndex({b.name: i for i, b in enumerate(bufs)},
                          readonly(np.array([b.num_pages for b in bufs], dtype=np.int64)),
                          readonly(np.array([b.page_bytes for b in bufs], dtype=np.int64)), views,
                          all(v is not None for v in views), {})
        _INDEXES[memory] = index   # a race builds it twice, harmlessly
    return index


def _host_view(memory: KVMemory, name: str) -> memoryview | None:
    if memory.remote or memory.region(name).device != "cpu":
        return None
    return memoryview(memory.array(name).reshape(-1))


def hash_cells(memory: KVMemory, gids: np.ndarray, pages: np.ndarray,
               slices: Mapping[str, PageSlice] | None = None, side: str = "src", *,
               gid_list: list[int] | None = None, page_bytes: np.ndarray | None = None) -> np.ndarray:
    """xxh3-64 of page ``pages[i]`` of buffer ``gids[i]`` (indices into layout.buffers), as uint64.

    With ``slices`` (buffer name -> its ``PageSlice``; every buffer in ``gids`` must have one), of that
    slice of the page, at its ``side`` ("src" or "dst") offsets. Pages must be in range (a memoryview
    slice past the end is short, not an error). GPU buffers and slices go buffer by buffer. ``gid_list``
    and ``page_bytes``: ``gids.tolist()`` and each cell's page bytes, when the caller keeps them.
    """
    index = hash_index(memory)
    views = index.views
    if slices is not None or (not index.all_host and any(views[g] is None for g in np.unique(gids).tolist())):
        return _hash_by_buffer(memory, gids, pages, slices, side)
    pb = index.page_bytes[gids] if page_bytes is None else page_bytes
    fn, seed = xxhash.xxh3_64_intdigest, _HASH_SEED
    out = [fn(views[g][o:o + n], seed)  # type: ignore[index]
           for g, o, n in zip(gids.tolist() if gid_list is None else gid_list, (pages * pb).tolist(), pb.tolist())]
    return np.array(out, dtype=np.uint64)


def _hash_by_buffer(memory: KVMemory, gids: np.ndarray, pages: np.ndarray,
                    slices: Mapping[str, PageSlice] | None, side: str) -> np.ndarray:
    out = np.zeros(len(gids), dtype=np.uint64)
    bufs = memory.layout.buffers
    for g in np.unique(gids).tolist():
        at, name = np.flatnonzero(gids == g), bufs[g].name
        if slices is None:
            out[at] = hash_pages(memory, name, pages[at])
        else:
            out[at] = hash_slices(memory, name, pages[at], slices[name], side)
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


def hash_slices(memory: KVMemory, buffer: str, pages: np.ndarray, piece: PageSlice, side: str) -> np.ndarray:
    """xxh3-64 of ``piece`` of each page of ``buffer`` in ``pages`` (``side``: "src" or "dst" offsets)."""
    if piece.whole:
        return hash_pages(memory, buffer, pages)
    if piece.pieces:
        return _hash_pieces(memory, buffer, pages, piece.pieces, side)
    offset, stride = (piece.src_offset, piece.src_stride) if side == "src" else (piece.dst_offset, piece.dst_stride)
    arr, index = _host_pages(memory, buffer, pages)
    if piece.num_tokens == 1:  # head-major: one contiguous segment per page
        view = arr[:, offset:offset + piece.nbytes]
    else:  # token-major: a page is num_tokens rows of ``stride`` bytes; the slice is a column band of them
        view = arr.reshape(len(arr), piece.num_tokens, stride)[:, :, offset:offset + piece.nbytes]
    # Fancy indexing copies only the slice bytes, contiguous per page: one hash call per page.
    return _hash_rows(np.ascontiguousarray(view[index]).reshape(len(index), -1))


def _hash_pieces(memory: KVMemory, buffer: str, pages: np.ndarray, pieces: tuple[PageSlice, ...],
                 side: str) -> np.ndarray:
    """A state slice's digest: its pieces' rows in order, gathered by byte index (a state page is small)."""
    at = [np.add.outer((p.src_offset if side == "src" else p.dst_offset)
                       + np.arange(p.num_tokens, dtype=np.int64) * (p.src_stride if side == "src" else p.dst_stride),
                       np.arange(p.nbytes, dtype=np.int64)).reshape(-1) for p in pieces]
    arr, index = _host_pages(memory, buffer, pages)
    return _hash_rows(np.ascontiguousarray(arr[index][:, np.concatenate(at)]))


def _host_pages(memory: KVMemory, buffer: str, pages: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """``(array, index)``: ``array[index]`` are ``pages`` of ``buffer`` as uint8 rows on the host (host
    memory in place, GPU pages a host copy of the chosen ones, ``read_pages``)."""
    rows = read_pages(memory, buffer, pages)
    return (memory.array(buffer), pages) if rows is None else (rows, np.arange(len(pages)))


def _hash_rows(block: np.ndarray) -> np.ndarray:
    """xxh3-64 of each row of a contiguous 2-D uint8 block, as uint64."""
    fn = xxhash.xxh3_64_intdigest
    return np.array([fn(row, _HASH_SEED) for row in block], dtype=np.uint64)


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


def entry_shape(memory: KVMemory, gid: int) -> tuple[int, int, int]:
    """Buffer ``gid``'s page as (pieces, entries, piece bytes): a head-major page is ``heads`` pieces of
    ``entries`` entries each, a token-major one a single piece of ``entries`` entry rows, a buffer without
    head geometry one entry (``plan.tokens`` cuts pages the same way)."""
    buf = memory.layout.buffers[gid]
    heads = buf.heads
    if heads is None:
        return 1, 1, buf.page_bytes
    pieces = heads.num_heads if heads.major == "head" else 1
    return pieces, heads.tokens_per_page, buf.page_bytes // (heads.tokens_per_page * pieces)


def hash_entries(memory: KVMemory, gids: np.ndarray, pages: np.ndarray, first: np.ndarray,
                 count: np.ndarray) -> np.ndarray:
    """xxh3-64 of entries ``[first[i], first[i] + count[i])`` of page ``pages[i]`` of buffer ``gids[i]``, as
    uint64: the bytes a write between page sizes moved into (or out of) one page for one token range, piece
    by piece (``entry_shape``) concatenated; a state buffer's one entry is its sections' bytes (``plan.tokens.
    state_pieces``). ``count[i]`` 0: the whole page (``hash_pages``). Entries must
    be in range (the caller checks what came from the wire)."""
    out = np.zeros(len(gids), dtype=np.uint64)
    fn = xxhash.xxh3_64_intdigest
    bufs = memory.layout.buffers
    for g in np.unique(gids).tolist():
        at = np.flatnonzero(gids == g)
        name = bufs[g].name
        arr, index = _host_pages(memory, name, pages[at])
        arr = arr.reshape(len(arr), -1)
        pieces, entries, piece = entry_shape(memory, g)
        heads = bufs[g].heads
        if bufs[g].state is not None:   # a state page's one entry is its sections (a padded page's real bytes)
            coef, unit = (a.astype(np.int64) for a in state_pieces(bufs[g].state, name))
            out[at] = [fn(arr[p], _HASH_SEED) if c == 0 else fn(arr[p, _entry_bytes(coef, unit, 1, 0, 1)], _HASH_SEED)
                       for p, c in zip(index.tolist(), count[at].tolist())]
            continue
        if heads is not None and heads.parts:   # a kernel's own order inside a head: gathered piece by piece
            coef, unit = (a.astype(np.int64) for a in entry_pieces(heads, bufs[g].page_bytes, entries))
            out[at] = [fn(arr[p], _HASH_SEED) if c == 0 else fn(arr[p, _entry_bytes(coef, unit, entries, f, c)],
                                                                 _HASH_SEED)
                       for p, f, c in zip(index.tolist(), first[at].tolist(), count[at].tolist())]
            continue
        view = arr.reshape(len(arr), pieces, entries, piece)
        out[at] = [fn(arr[p], _HASH_SEED) if c == 0 else fn(np.ascontiguousarray(view[p, :, f:f + c]), _HASH_SEED)
                   for p, f, c in zip(index.tolist(), first[at].tolist(), count[at].tolist())]
    return out


def _entry_bytes(coef: np.ndarray, unit: np.ndarray, entries: int, first: int, count: int) -> np.ndarray:
    """Byte offsets in a page of entries ``[first, first + count)``, piece by piece (``plan.tokens.entry_pieces``)."""
    starts = coef * entries + first * unit
    lengths = count * unit
    return np.repeat(starts - np.cumsum(lengths) + lengths, lengths) + np.arange(int(lengths.sum()))
