"""Fault injection for tests, demos and the stress run: faults kvferry must catch and localise.

Part of the diagnostics layer, above ``plan`` and the transport contract, below the workload's
``FaultyTransport`` and the CLI. Two faults:

- ``buffer0-slots``: the sender of the motivating bug. It indexes one flat per-page descriptor list over
  every buffer (``KVMemory.page_descs()``, as SGLang's ``kv_data_ptrs``) at ``b * num_slots + page``,
  with ``num_slots = kv_data_lens[0] // kv_item_lens[0]`` taken from buffer 0 for *every* buffer.
  From the first buffer after one whose page count differs from buffer 0's, rows land in the wrong block.
  ``buffer0_slot_count_descs`` returns those rows as a ``FaultyPlan``, a ``TransferPlan`` a transport's
  ``write`` (or a plain memmove) executes like any other.
- ``flip``: XOR bytes of destination pages after a write (``flip_bytes``): a transport that corrupts.

``FaultSpec.parse`` reads them from strings (``"buffer0-slots"``, ``"flip:c4.idx.L3"``,
``"flip:c4.idx.L3:5,9"``) for ``--inject`` switches.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from enum import Enum
from functools import cached_property

import numpy as np

from kvferry.arrays import cat_int, readonly
from kvferry.errors import FaultSpecError, LayoutError, PlanError, TransportError
from kvferry.layout.memory import KVMemory
from kvferry.plan.planner import PagesArg, Row, TransferPlan, plan_transfer

__all__ = ["FaultKind", "FaultSpec", "FaultSpecError", "FaultyPlan", "buffer0_slot_count_descs", "flip_bytes"]


class FaultKind(str, Enum):
    NONE = "none"
    BUFFER0_SLOTS = "buffer0-slots"
    FLIP = "flip"


@dataclass(frozen=True, eq=False)
class FaultyPlan(TransferPlan):
    """The rows the buffer-0 slot-count sender would post, one per (buffer, page) like a prepared list.

    ``pools`` is the clean plan's (what the request meant to move); the descriptors are the buggy ones.
    Row i was meant to move page ``intended_src[i]`` -> ``intended_dst[i]`` of buffer ``intended_buffer[i]``
    (index into ``Layout.buffers``) and moves ``src_index[i]`` -> ``dst_index[i]`` of each side's
    ``page_descs()`` instead. ``dropped`` counts rows a NIXL sender could not have posted (see
    ``buffer0_slot_count_descs``).
    """

    intended_buffer: np.ndarray
    intended_src: np.ndarray
    intended_dst: np.ndarray
    src_index: np.ndarray
    dst_index: np.ndarray
    dropped: int

    @cached_property
    def src_descs(self) -> np.ndarray:
        return readonly(self.src_memory.page_descs()[self.src_index])

    @cached_property
    def dst_descs(self) -> np.ndarray:
        return readonly(self.dst_memory.page_descs()[self.dst_index])

    @cached_property
    def num_descriptors(self) -> int:
        return len(self.src_index)

    @cached_property
    def nbytes(self) -> int:
        return int(self.src_descs[:, 1].sum())

    def page_selectors(self) -> tuple[np.ndarray, np.ndarray]:
        """The buggy flat indices, exactly what the faulty sender hands ``make_prepped_xfer``."""
        return self.src_index, self.dst_index

    def row(self, index: int) -> Row:
        """Row ``index``: the buffer and pages it was meant for, the addresses it really hits."""
        if not 0 <= index < self.num_descriptors:
            raise PlanError(f"row {index} out of range 0..{self.num_descriptors - 1}")
        name = self.src_memory.layout.buffers[int(self.intended_buffer[index])].name
        src_addr, nbytes, _ = (int(v) for v in self.src_descs[index])
        return Row(index, self.src_memory.layout.pool_of[name], name, int(self.intended_src[index]),
                   int(self.intended_dst[index]), 1, src_addr, int(self.dst_descs[index, 0]), nbytes)

    def buffer_rows(self, buffer: str) -> slice:
        hits = np.flatnonzero(self.intended_buffer == self.src_memory.buffer_index.get(buffer, -1))
        return slice(int(hits[0]), int(hits[-1]) + 1) if len(hits) else slice(0, 0)

    def __repr__(self) -> str:
        return f"FaultyPlan(buffer0-slots, {self.num_descriptors} rows, {self.dropped} dropped)"


def buffer0_slot_count_descs(src: KVMemory, dst: KVMemory, pages: PagesArg,
                             buffers: Iterable[str] | None = None, *, strict: bool = False) -> FaultyPlan:
    """The descriptor rows of the buffer-0 slot-count sender for ``pages``, as a postable plan.

    The page lists are validated like any plan (``plan_transfer``): the bug is in the indexing, not in
    the request. Each side computes its own ``num_slots`` from its buffer 0, as the buggy code did.
    A buggy index that stays inside the flat list selects a real page of some registered buffer, the
    silent corruption of the motivating report. An index past the end of the list, or a row whose source
    and destination pages have different sizes, is one NIXL itself would refuse (invalid descriptor
    index, length mismatch): with ``strict`` this raises ``TransportError`` as the NIXL call would;
    by default those rows are dropped (counted in ``dropped``) so the rest of the fault still lands and
    the pages they should have written keep stale bytes.
    """
    clean = plan_transfer(src, dst, pages, buffers)
    src_slots, dst_slots = _buffer0_slots(src), _buffer0_slots(dst)
    gid = np.concatenate([np.repeat(pp.buffer_ids, len(pp.src_pages)) for pp in clean.pools] or [[]])
    s_pages = cat_int([np.tile(pp.src_pages, len(pp.buffer_ids)) for pp in clean.pools])
    d_pages = cat_int([np.tile(pp.dst_pages, len(pp.buffer_ids)) for pp in clean.pools])
    gid = gid.astype(np.int64)
    s_idx, d_idx = gid * src_slots + s_pages, gid * dst_slots + d_pages
    s_list, d_list = src.page_descs(), dst.page_descs()
    ok = (s_idx < len(s_list)) & (d_idx < len(d_list))
    ok[ok] = s_list[s_idx[ok], 1] == d_list[d_idx[ok], 1]
    if strict and not ok.all():
        bad = int(np.flatnonzero(~ok)[0])
        name = src.layout.buffers[int(gid[bad])].name
        raise TransportError(f"buffer0-slots: row for buffer {name!r} page {int(s_pages[bad])} indexes "
                             f"descriptor {int(s_idx[bad])}/{int(d_idx[bad])}, outside the prepared lists "
                             f"({len(s_list)}/{len(d_list)}) or with mismatched lengths")
    return FaultyPlan(src, dst, clean.pools, readonly(gid[ok]), readonly(s_pages[ok]), readonly(d_pages[ok]),
                      readonly(s_idx[ok]), readonly(d_idx[ok]), int((~ok).sum()))


def _buffer0_slots(mem: KVMemory) -> int:
    """``kv_data_lens[0] // kv_item_lens[0]``: buffer 0's slot count, the number the bug used for all."""
    return mem.regions[0].nbytes // mem.layout.buffers[0].page_bytes


def flip_bytes(memory: KVMemory, buffer: str, pages: Iterable[int], *, seed: int = 0,
               num_bytes: int = 1) -> list[tuple[int, int]]:
    """XOR 0xFF into ``num_bytes`` bytes of each page of ``buffer`` in ``pages`` (host memory).

    Offsets are drawn from ``seed``; returns the ``(page, offset)`` pairs flipped so a test can check
    the report names them. Call after the write completed: it models bytes corrupted in flight.
    """
    arr = memory.array(buffer)
    page_list = [int(p) for p in pages]
    bad = [p for p in page_list if not 0 <= p < arr.shape[0]]
    if bad:
        raise LayoutError(f"flip: page {bad[0]} is outside buffer {buffer!r} ({arr.shape[0]} pages)")
    rng = np.random.default_rng(seed)
    flips = []
    for page in page_list:
        for offset in rng.choice(arr.shape[1], size=min(num_bytes, arr.shape[1]), replace=False).tolist():
            arr[page, offset] ^= 0xFF
            flips.append((page, offset))
    return flips


@dataclass(frozen=True, slots=True)
class FaultSpec:
    """A fault to inject: ``kind``, and for ``flip`` the buffer and destination pages (None = all of the
    request's pages of that buffer)."""

    kind: FaultKind = FaultKind.NONE
    buffer: str | None = None
    pages: tuple[int, ...] | None = None

    @classmethod
    def parse(cls, text: str) -> FaultSpec:
        """``none`` | ``buffer0-slots`` | ``flip:BUFFER`` | ``flip:BUFFER:PAGE[,PAGE...]``."""
        head, _, rest = text.strip().partition(":")
        if head in ("", "none") and not rest:
            return cls()
        if head == FaultKind.BUFFER0_SLOTS.value and not rest:
            return cls(FaultKind.BUFFER0_SLOTS)
        if head == FaultKind.FLIP.value and rest:
            buffer, _, page_text = rest.partition(":")
            if buffer:
                return cls(FaultKind.FLIP, buffer, _parse_pages(text, page_text) if page_text else None)
        raise FaultSpecError(f"invalid fault {text!r}: expected none, buffer0-slots, flip:BUFFER or "
                             "flip:BUFFER:PAGE[,PAGE...]")

    def __str__(self) -> str:
        if self.kind is not FaultKind.FLIP:
            return self.kind.value
        pages = "" if self.pages is None else ":" + ",".join(map(str, self.pages))
        return f"flip:{self.buffer}{pages}"

    def plan(self, src: KVMemory, dst: KVMemory, pages: PagesArg,
             buffers: Iterable[str] | None = None) -> TransferPlan:
        """The plan to post under this fault: the buggy rows for ``buffer0-slots``, else the clean plan."""
        if self.kind is FaultKind.BUFFER0_SLOTS:
            return buffer0_slot_count_descs(src, dst, pages, buffers)
        return plan_transfer(src, dst, pages, buffers)

    def after_write(self, dst: KVMemory, pages: PagesArg, *, seed: int = 0) -> list[tuple[int, int]]:
        """Apply a ``flip`` to the destination once the write is done; returns the flipped (page, offset)."""
        if self.kind is not FaultKind.FLIP or self.buffer is None:
            return []
        if self.pages is not None:
            return flip_bytes(dst, self.buffer, self.pages, seed=seed)
        pool = dst.layout.pool_of.get(self.buffer)
        if pool is None:
            raise LayoutError(f"flip: no buffer {self.buffer!r} in the destination layout")
        _, dst_pages = pages.get(pool, ((), ()))
        return flip_bytes(dst, self.buffer, np.asarray(dst_pages, dtype=np.int64).tolist(), seed=seed)


def _parse_pages(text: str, page_text: str) -> tuple[int, ...]:
    try:
        pages = tuple(int(p) for p in page_text.split(","))
    except ValueError:
        raise FaultSpecError(f"invalid fault {text!r}: pages must be integers separated by commas") from None
    if any(p < 0 for p in pages):
        raise FaultSpecError(f"invalid fault {text!r}: pages must be >= 0")
    return pages
