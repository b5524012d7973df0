"""Page digests for writes across tensor-parallel sizes: the slice of each page a rank pair moves.

Layer 4 of kvferry (beside ``integrity``, whose ``PageDigests`` container, wire format and mismatch errors
it reuses). Across TP sizes a prefill page is not a decode page: prefill rank ``r`` writes only the heads
it shares with decode rank ``d`` (a ``tp.PageSlice``: ``num_tokens`` segments of ``nbytes``, strided), so
``integrity.digest_plan``'s whole-page hashes cannot match. Here entry (buffer, destination page) is the
xxh3-64 of the pair's slice bytes, its segments concatenated in token order: read at the source offsets
of the source page on prefill, at the destination offsets of the destination page on decode. Several
prefill ranks each digest their own slice of one decode page; decode checks each link's digests with that
link's slices (``TPPlanner(remote, local).slices``). Whole-page slices (replicated buffers, equal head
sets) hash the page as ``integrity.hash_pages`` does.

Modes as in ``integrity``: ``off``, ``sampled`` (``samples_per_buffer`` pages per buffer per plan, drawn
with ``seed``) and ``full``.
"""

from __future__ import annotations

from collections.abc import Mapping

import numpy as np
import xxhash

from .errors import IntegrityError, LayoutError
from .integrity import DigestMode, PageDigests, PageMismatch, PageMismatchError, hash_pages, read_pages
from .memory import KVMemory
from .tp import PageSlice, TPPlan

__all__ = ["digest_tp_plan", "hash_slices", "verify_tp_digests"]

_HASH_SEED = 0  # fixed: both sides must hash alike


def digest_tp_plan(plan: TPPlan, mode: DigestMode | str, *, seed: int = 0,
                   samples_per_buffer: int = 2) -> PageDigests:
    """Digest the slices ``plan`` writes, keyed by buffer and destination page.

    Prefill calls it once the source pages hold the request's final KV (it only reads). Blocking. The
    digests carry the *destination* layout's shape fingerprint: decode checks they were made for it.
    """
    mode = DigestMode.parse(mode)
    shape = plan.dst_memory.layout.shape_fingerprint
    if mode is DigestMode.OFF:
        return PageDigests.empty(mode, shape)
    if samples_per_buffer < 1:
        raise IntegrityError(f"samples_per_buffer must be >= 1, got {samples_per_buffer}")
    rng = np.random.default_rng(seed % (1 << 64))
    names: list[str] = []
    ids, pages, digests = [], [], []
    for pp in plan.pool_pages:
        for name in pp.buffers:
            sel = _choose(rng, len(pp.src_pages), mode, samples_per_buffer)
            ids.append(np.full(len(sel), len(names), dtype=np.uint32))
            names.append(name)
            pages.append(pp.dst_pages[sel])
            digests.append(hash_slices(plan.src_memory, name, pp.src_pages[sel], plan.slices[name], "src"))
    if not names:
        return PageDigests.empty(mode, shape)
    return PageDigests(mode, tuple(names), _ro(np.concatenate(ids)), _ro(np.concatenate(pages)),
                       _ro(np.concatenate(digests)), shape)


def verify_tp_digests(memory: KVMemory, digests: PageDigests, slices: Mapping[str, PageSlice]) -> None:
    """Recompute ``digests`` on this decode rank's pages, over the slices one prefill rank writes.

    ``slices`` is that link's ``TPPlanner(prefill memory, memory).slices``. Raises ``PageMismatchError``
    listing every mismatch; ``IntegrityError`` when the digests were made for another layout shape or name
    a buffer that link does not write, or a page out of range. Empty digests verify nothing.
    """
    if not len(digests):
        return
    if digests.shape and digests.shape != memory.layout.shape_fingerprint:
        raise IntegrityError(f"page digests are for layout shape {digests.shape}, this side has "
                             f"{memory.layout.shape_fingerprint}")
    order = np.argsort(digests.buffer_ids, kind="stable")
    bounds = np.flatnonzero(np.diff(digests.buffer_ids[order])) + 1
    mismatches: list[PageMismatch] = []
    for group in np.split(order, bounds):
        name = digests.buffer_names[int(digests.buffer_ids[group[0]])]
        mismatches += _verify_buffer(memory, name, slices, digests.pages[group], digests.digests[group])
    if mismatches:
        raise PageMismatchError(mismatches, len(digests), digests.mode)


def hash_slices(memory: KVMemory, buffer: str, pages: np.ndarray, piece: PageSlice, side: str) -> np.ndarray:
    """xxh3-64 of ``piece`` of each page of ``buffer`` in ``pages`` (``side``: "src" or "dst" offsets)."""
    if piece.whole:
        return hash_pages(memory, buffer, pages)
    offset, stride = (piece.src_offset, piece.src_stride) if side == "src" else (piece.dst_offset, piece.dst_stride)
    rows = read_pages(memory, buffer, pages)  # GPU: a host copy of the chosen pages; host: None
    arr, index = (memory.array(buffer), pages) if rows is None else (rows, np.arange(len(pages)))
    if piece.num_tokens == 1:  # head-major: one contiguous segment per page
        view = arr[:, offset:offset + piece.nbytes]
    else:  # token-major: a page is num_tokens rows of ``stride`` bytes; the slice is a column band of them
        view = arr.reshape(len(arr), piece.num_tokens, stride)[:, :, offset:offset + piece.nbytes]
    # Fancy indexing copies only the slice bytes, contiguous per page: one hash call per page.
    block = np.ascontiguousarray(view[index]).reshape(len(index), -1)
    fn = xxhash.xxh3_64_intdigest
    return np.array([fn(row, _HASH_SEED) for row in block], dtype=np.uint64)


def _verify_buffer(memory: KVMemory, name: str, slices: Mapping[str, PageSlice], pages: np.ndarray,
                   expected: np.ndarray) -> list[PageMismatch]:
    layout = memory.layout
    try:
        buf = layout.buffer(name)
    except LayoutError:
        raise IntegrityError(f"page digests name buffer {name!r}, which this layout does not have") from None
    piece = slices.get(name)
    if piece is None:
        raise IntegrityError(f"page digests name buffer {name!r}, which this prefill rank does not write "
                             "to this decode rank")
    lo, hi = int(pages.min()), int(pages.max())
    if lo < 0 or hi >= buf.num_pages:
        raise IntegrityError(f"page digests name page {lo if lo < 0 else hi} of buffer {name!r}, which has "
                             f"{buf.num_pages} pages on this side")
    actual = hash_slices(memory, name, pages, piece, "dst")
    bad = np.flatnonzero(actual != expected)
    pool = layout.pool_of[name]
    return [PageMismatch(pool, name, buf.layer, int(pages[i]), int(expected[i]), int(actual[i]))
            for i in bad.tolist()]


def _choose(rng: np.random.Generator, num_pages: int, mode: DigestMode, k: int) -> np.ndarray:
    """Indices into a pool's page list: all of them, or ``k`` distinct ones in page-list order."""
    if mode is DigestMode.FULL or num_pages <= k:
        return np.arange(num_pages)
    return np.sort(rng.choice(num_pages, k, replace=False))


def _ro(a: np.ndarray) -> np.ndarray:
    a.flags.writeable = False
    return a
