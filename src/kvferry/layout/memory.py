"""Memory binding: each buffer of a layout bound to a real region (address, bytes, device).

Part of the layout layer, above ``spec``, below ``presets`` and the planner. ``KVMemory`` is what the planner
reads addresses from and what a transport registers. It is built from numpy arrays, torch tensors (CPU or
CUDA: ``torch`` is never imported here, tensors are recognised by duck typing), raw ``(pointer, length,
bytes-per-page)`` lists as engines keep them, or a peer's manifest (a *remote* binding: addresses only, never
dereferenced here).

Each buffer's slot count comes from its own region: ``nbytes // page_bytes``, with a remainder refused.
The per-pool numpy arrays the planner needs (bases, page sizes, capacities, flat block starts) are built
once here, so planning does no per-buffer Python work.
"""

from __future__ import annotations

import ctypes
import hashlib
import itertools
import threading
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from functools import cached_property
from typing import Any

import numpy as np

from kvferry.arrays import readonly
from kvferry.codec import decode_versioned, encode
from kvferry.errors import LayoutError
from kvferry.layout.manifest import MANIFEST_VERSION, MemoryMsg, RegionMsg
from kvferry.layout.spec import Layout

__all__ = ["KVMemory", "PoolArrays", "Region", "distinct_regions"]

DEVICE_KINDS = ("cpu", "cuda")
MAX_ADDRESS = (1 << 64) - 1


@dataclass(frozen=True, slots=True)
class Region:
    """Where one buffer lives: ``nbytes`` at ``address`` on ``device`` (``cpu`` or ``cuda``) ``device_id``."""

    buffer: str
    address: int
    nbytes: int
    device: str = "cpu"
    device_id: int = 0

    @property
    def end(self) -> int:
        return self.address + self.nbytes


@dataclass(frozen=True, slots=True)
class PoolArrays:
    """Per-buffer vectors of one pool, aligned with ``Pool.buffers`` (read-only numpy arrays)."""

    buffer_ids: np.ndarray   # int64: index of each buffer in ``Layout.buffers``
    base: np.ndarray         # uint64: region start address
    page_bytes: np.ndarray   # uint64
    num_pages: np.ndarray    # int64: this buffer's own capacity
    device_id: np.ndarray    # uint64
    flat_start: np.ndarray   # int64: first row of this buffer in ``KVMemory.page_descs()``
    min_pages: int           # smallest capacity in the pool: every page index must be below it
    # Buffers of one kind share page size and device (a model's layers repeat a few kinds): the planner
    # broadcasts rows per kind and adds each buffer's base, instead of multiplying per buffer.
    kind: np.ndarray         # int64: row of ``kinds`` describing this buffer
    kinds: np.ndarray        # uint64 [K, 2]: (page_bytes, device_id) of each kind in the pool
    # uint64 [B, 3]: (page_bytes, base, device_id) per buffer, so that a small plan's rows are one matrix
    # product: [page_bytes, base, device] @ [[start, length, 0], [1, 0, 0], [0, 0, 1]] = one row.
    row_basis: np.ndarray
    # ``flat_start`` as Python ints: a few pages' selector lists are built from it without a numpy call.
    flat_start_ints: tuple[int, ...]
    # Bytes of one page across all these buffers, as an int: a plan's size without a numpy call.
    page_bytes_sum: int


# The vectors of PoolArrays that have one entry per buffer (restricted together by ``KVMemory.pool_subset``).
PER_BUFFER = ("buffer_ids", "base", "page_bytes", "num_pages", "device_id", "flat_start", "kind", "row_basis")
_MAX_SUBSETS = 256  # distinct buffer selections remembered per binding (layer-by-layer sends reuse a few)


class KVMemory:
    """A layout bound to memory. Treat as immutable; build with one of the class methods."""

    def __init__(self, layout: Layout, regions: Sequence[Region], *, owners: Mapping[str, Any] | None = None,
                 remote: bool = False) -> None:
        self.layout = layout
        self.regions: tuple[Region, ...] = tuple(regions)
        self.remote = remote
        # Keeps the arrays/tensors alive as long as the binding: their memory must not be freed under us.
        self._owners = dict(owners or {})
        self._regions_by_name = {r.buffer: r for r in self.regions}
        # Per-pool vectors this binding built, by id (kept alive here, so an id is never reused while
        # listed): ``built_here`` recognises them. ``_subsets``: buffer selections, oldest first.
        self._built: dict[int, PoolArrays] = {}
        self._subsets: dict[tuple[str, bytes], PoolArrays] = {}
        self._subsets_lock = threading.Lock()
        self._check_regions()

    # -- construction ----------------------------------------------------------------------------------
    @classmethod
    def allocate(cls, layout: Layout) -> KVMemory:
        """Zeroed host memory (numpy) for every buffer of ``layout``."""
        arrays = {b.name: np.zeros((b.num_pages, b.page_bytes), dtype=np.uint8) for b in layout.buffers}
        return cls.from_arrays(layout, arrays)

    @classmethod
    def from_arrays(cls, layout: Layout, arrays: Mapping[str, Any]) -> KVMemory:
        """Bind each buffer to a C-contiguous numpy array or torch tensor (CPU or CUDA) of any dtype."""
        missing = [b.name for b in layout.buffers if b.name not in arrays]
        extra = sorted(set(arrays) - {b.name for b in layout.buffers})
        if missing or extra:
            raise LayoutError(f"from_arrays: missing buffers {missing[:5]}, unknown buffers {extra[:5]}")
        regions = [_region_of(b.name, arrays[b.name]) for b in layout.buffers]
        return cls(layout, regions, owners=arrays)

    @classmethod
    def from_pointers(cls, layout: Layout, ptrs: Sequence[int], lens: Sequence[int],
                      item_lens: Sequence[int], *, device: str = "cpu", device_id: int = 0) -> KVMemory:
        """Bind from engine-style lists, one entry per buffer in ``layout.buffers`` order.

        ``lens[i] // item_lens[i]`` is buffer i's slot count, computed for each buffer from its own region
        (never from buffer 0's), and must equal the layout's ``num_pages`` for that buffer; use
        ``Layout.with_capacities`` to take capacities from the regions.
        """
        bufs = layout.buffers
        if not len(ptrs) == len(lens) == len(item_lens) == len(bufs):
            raise LayoutError(f"from_pointers: {len(bufs)} buffers but {len(ptrs)} pointers, "
                              f"{len(lens)} lengths, {len(item_lens)} item lengths")
        regions = []
        for buf, ptr, nbytes, item in zip(bufs, ptrs, lens, item_lens):
            if int(item) != buf.page_bytes:
                raise LayoutError(f"buffer {buf.name!r}: item length {item} != layout page_bytes {buf.page_bytes}")
            regions.append(Region(buf.name, int(ptr), int(nbytes), device, device_id))
        return cls(layout, regions)

    # -- manifest: a peer's view of this binding -------------------------------------------------------
    def manifest(self) -> bytes:
        """Layout plus addresses, versioned; the peer decodes it with ``KVMemory.from_manifest``."""
        msg = MemoryMsg(MANIFEST_VERSION, self.layout.to_wire(),
                         [RegionMsg(r.address, r.nbytes, r.device, r.device_id) for r in self.regions],
                         self.layout.tp_size, self.layout.tp_rank)
        return encode(msg)

    @classmethod
    def from_manifest(cls, data: bytes) -> KVMemory:
        """A remote binding from untrusted bytes: shapes, sizes and address ranges all re-checked."""
        msg = decode_versioned(data, MemoryMsg, version=MANIFEST_VERSION, what="manifest", error=LayoutError)
        layout = Layout.from_wire(msg.pools, msg.tp_size, msg.tp_rank)
        if len(msg.regions) != len(layout.buffers):
            raise LayoutError(f"manifest: {len(layout.buffers)} buffers but {len(msg.regions)} regions")
        regions = [Region(b.name, r.address, r.nbytes, r.device, r.device_id)
                   for b, r in zip(layout.buffers, msg.regions)]
        return cls(layout, regions, remote=True)

    # -- access ----------------------------------------------------------------------------------------
    def region(self, buffer_name: str) -> Region:
        try:
            return self._regions_by_name[buffer_name]
        except KeyError:
            raise LayoutError(f"no buffer {buffer_name!r} in this memory binding") from None

    def address(self, buffer_name: str) -> int:
        return self.region(buffer_name).address

    @property
    def is_device(self) -> bool:
        """True when any region is GPU memory."""
        return any(r.device != "cpu" for r in self.regions)

    def owner(self, buffer_name: str) -> Any:
        """The array or tensor this buffer was bound from (None for raw pointers and peers' memory).

        The way to reach GPU memory: a CUDA tensor cannot be viewed as a numpy array.
        """
        self.region(buffer_name)
        return self._owners.get(buffer_name)

    def array(self, buffer_name: str) -> np.ndarray:
        """A writable ``(num_pages, page_bytes)`` uint8 view of a local host buffer."""
        region = self.region(buffer_name)
        if self.remote:
            raise LayoutError(f"buffer {buffer_name!r} is a peer's memory: it cannot be read here")
        if region.device != "cpu":
            raise LayoutError(f"buffer {buffer_name!r} is {region.device} memory: use the tensor, not array()")
        buf = self.layout.buffer(buffer_name)
        owner = self._owners.get(buffer_name)
        if isinstance(owner, np.ndarray):
            flat = owner.reshape(-1).view(np.uint8)
        else:
            # Raw host pointer (from_pointers) or a CPU tensor: wrap the region without copying.
            flat = np.ctypeslib.as_array((ctypes.c_uint8 * region.nbytes).from_address(region.address))
        return flat.reshape(buf.num_pages, buf.page_bytes)

    # -- planner and transport support -----------------------------------------------------------------
    @cached_property
    def binding_fingerprint(self) -> str:
        """Hex digest of layout shape, capacities and every region: equal only for the same binding."""
        key = (self.layout.instance_fingerprint,
               tuple((r.address, r.nbytes, r.device, r.device_id) for r in self.regions))
        return hashlib.blake2b(repr(key).encode(), digest_size=16).hexdigest()

    @cached_property
    def region_bounds(self) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """``(starts, ends, device_ids)`` uint64 arrays sorted by start: for vectorised bounds checks.

        ``ends`` and ``device_ids`` carry one extra entry in front, a region that holds nothing (end 0,
        no device), so ``np.searchsorted(starts, addr, side="right")`` indexes them directly: 0 for an
        address below every region, else the region starting at or below the address, shifted by one.
        """
        regs = sorted(self.regions, key=lambda r: r.address)
        return (readonly(np.array([r.address for r in regs], dtype=np.uint64)),
                readonly(np.array([0] + [r.end for r in regs], dtype=np.uint64)),
                readonly(np.array([MAX_ADDRESS] + [r.device_id for r in regs], dtype=np.uint64)))

    @cached_property
    def buffer_index(self) -> dict[str, int]:
        """Buffer name -> its index in ``layout.buffers``."""
        return {b.name: i for i, b in enumerate(self.layout.buffers)}

    @cached_property
    def pool_arrays(self) -> dict[str, PoolArrays]:
        """Per-pool numpy vectors, built once per binding so planning does no per-buffer Python work."""
        bufs = self.layout.buffers
        caps = np.array([b.num_pages for b in bufs], dtype=np.int64)
        flat_start = np.concatenate(([0], np.cumsum(caps)[:-1])).astype(np.int64)
        index = {b.name: i for i, b in enumerate(bufs)}
        out: dict[str, PoolArrays] = {}
        for pool in self.layout.pools:
            ids = np.array([index[b.name] for b in pool.buffers], dtype=np.int64)
            regs = [self.regions[i] for i in ids]
            kind_of = [(b.page_bytes, r.device_id) for b, r in zip(pool.buffers, regs)]
            kinds = list(dict.fromkeys(kind_of))
            base = np.array([r.address for r in regs], dtype=np.uint64)
            page_bytes = np.array([b.page_bytes for b in pool.buffers], dtype=np.uint64)
            device_id = np.array([r.device_id for r in regs], dtype=np.uint64)
            out[pool.name] = arrays = PoolArrays(
                buffer_ids=readonly(ids),
                base=readonly(base),
                page_bytes=readonly(page_bytes),
                num_pages=readonly(caps[ids]),
                device_id=readonly(device_id),
                flat_start=readonly(flat_start[ids]),
                min_pages=pool.min_pages,
                kind=readonly(np.array([kinds.index(k) for k in kind_of], dtype=np.int64)),
                kinds=readonly(np.array(kinds, dtype=np.uint64).reshape(-1, 2)),
                row_basis=readonly(np.stack([page_bytes, base, device_id], axis=1)),
                flat_start_ints=tuple(flat_start[ids].tolist()),
                page_bytes_sum=int(page_bytes.sum()),
            )
            self._built[id(arrays)] = arrays
        return out

    def pool_subset(self, pool: str, keep: np.ndarray) -> PoolArrays:
        """``pool_arrays[pool]`` restricted to the buffers where the bool mask ``keep`` is True.

        Built once per distinct selection (layer-by-layer sends reuse a few; the oldest of more than
        ``_MAX_SUBSETS`` is forgotten) and recognised by ``built_here`` like the whole pool's vectors.
        """
        key = (pool, keep.tobytes())
        hit = self._subsets.get(key)
        if hit is not None:
            return hit
        full = self.pool_arrays[pool]
        fields = {f: readonly(getattr(full, f)[keep]) for f in PER_BUFFER}
        sub = PoolArrays(**fields, min_pages=full.min_pages, kinds=full.kinds,
                         flat_start_ints=tuple(fields["flat_start"].tolist()),
                         page_bytes_sum=int(fields["page_bytes"].sum()))
        with self._subsets_lock:
            if len(self._subsets) >= _MAX_SUBSETS:
                old = self._subsets.pop(next(iter(self._subsets)))
                self._built.pop(id(old), None)
            self._subsets[key] = sub
            self._built[id(sub)] = sub
        return sub

    def built_here(self, arrays: PoolArrays) -> bool:
        """True when ``arrays`` is this binding's own (``pool_arrays`` or a ``pool_subset``), so its
        vectors are this binding's regions and capacities (what a transport's fast check relies on)."""
        return self._built.get(id(arrays)) is arrays

    def page_descs(self) -> np.ndarray:
        """Flat per-page ``N x 3`` uint64 ``(address, page_bytes, device_id)`` over all buffers.

        Buffer b's block begins at the sum of the ``num_pages`` of the buffers before it, on this side.
        This is the list NIXL's ``prep_xfer_dlist`` takes; ``TransferPlan.page_selectors`` indexes it.
        """
        bufs = self.layout.buffers
        caps = np.array([b.num_pages for b in bufs], dtype=np.int64)
        pb = np.repeat(np.array([b.page_bytes for b in bufs], dtype=np.uint64), caps)
        base = np.repeat(np.array([r.address for r in self.regions], dtype=np.uint64), caps)
        dev = np.repeat(np.array([r.device_id for r in self.regions], dtype=np.uint64), caps)
        flat_start = np.concatenate(([0], np.cumsum(caps)[:-1]))
        page = np.arange(int(caps.sum()), dtype=np.int64) - np.repeat(flat_start, caps)
        out = np.empty((len(page), 3), dtype=np.uint64)
        out[:, 0] = base + page.astype(np.uint64) * pb
        out[:, 1] = pb
        out[:, 2] = dev
        return out

    def __repr__(self) -> str:
        where = "remote" if self.remote else "local"
        return (f"KVMemory({where}, {len(self.layout.pools)} pools, {len(self.regions)} buffers, "
                f"{self.layout.nbytes / 2**20:.1f} MiB)")

    # -- validation ------------------------------------------------------------------------------------
    def _check_regions(self) -> None:
        bufs = self.layout.buffers
        if len(self.regions) != len(bufs):
            raise LayoutError(f"{len(bufs)} buffers but {len(self.regions)} regions")
        for buf, reg in zip(bufs, self.regions):
            _check_region(buf.name, buf.page_bytes, buf.num_pages, reg)
        _check_disjoint(_unaliased(self.layout, self.regions))


def _check_region(name: str, page_bytes: int, num_pages: int, reg: Region) -> None:
    if reg.buffer != name:
        raise LayoutError(f"region for {reg.buffer!r} given where buffer {name!r} was expected")
    if reg.device not in DEVICE_KINDS:
        raise LayoutError(f"buffer {name!r}: device must be one of {DEVICE_KINDS}, got {reg.device!r}")
    if not 0 <= reg.device_id < 1 << 16:
        raise LayoutError(f"buffer {name!r}: device_id out of range: {reg.device_id}")
    if reg.address <= 0 or reg.nbytes <= 0 or reg.address + reg.nbytes > MAX_ADDRESS:
        raise LayoutError(f"buffer {name!r}: invalid region address={reg.address:#x} nbytes={reg.nbytes}")
    if reg.nbytes % page_bytes:
        raise LayoutError(f"buffer {name!r}: region of {reg.nbytes} bytes is not a whole number of "
                          f"{page_bytes}-byte pages (remainder {reg.nbytes % page_bytes})")
    slots = reg.nbytes // page_bytes
    if slots != num_pages:
        raise LayoutError(f"buffer {name!r}: region holds {slots} pages of {page_bytes} bytes but the layout "
                          f"declares {num_pages} (use Layout.with_capacities to take capacities from regions)")


def _unaliased(layout: Layout, regions: Sequence[Region]) -> list[Region]:
    """The regions left to check for overlaps once declared aliases are set aside: a buffer of a pool that
    ``aliases`` another whose region is *exactly* one of that pool's buffers' (address, length, device, page
    size and page count) is the same bytes under another geometry, not an overlap. Any other alias buffer
    stays in, so an alias that only partly covers a region is refused like any overlap."""
    pool_of = layout.pool_of
    buffers = layout.buffers
    aliased = {p.name: p.aliases for p in layout.pools if p.aliases is not None}
    if not aliased:
        return list(regions)
    owned = {(pool_of[b.name], r.address, r.nbytes, r.device, r.device_id, b.page_bytes, b.num_pages)
             for b, r in zip(buffers, regions) if pool_of[b.name] not in aliased}
    left, claimed = [], set()
    for b, r in zip(buffers, regions):
        pool = pool_of[b.name]
        key = (aliased.get(pool), r.address, r.nbytes, r.device, r.device_id, b.page_bytes, b.num_pages)
        if key in owned and (pool, key) not in claimed:   # one buffer of each aliasing pool per region
            claimed.add((pool, key))
            continue
        left.append(r)
    return left


def distinct_regions(regions: Sequence[Region]) -> list[Region]:
    """Each region's bytes once: aliased buffers (``Pool.aliases``) share regions, which a transport
    registers only once."""
    seen: dict[tuple[int, int, str, int], Region] = {}
    for r in regions:
        seen.setdefault((r.address, r.nbytes, r.device, r.device_id), r)
    return list(seen.values())


def _check_disjoint(regions: Sequence[Region]) -> None:
    # Two buffers sharing bytes would make one buffer's pages overwrite another's: refuse it.
    by_dev: dict[tuple[str, int], list[Region]] = {}
    for r in regions:
        by_dev.setdefault((r.device, r.device_id), []).append(r)
    for group in by_dev.values():
        group = sorted(group, key=lambda r: r.address)
        for a, b in itertools.pairwise(group):
            if b.address < a.end:
                raise LayoutError(f"buffers {a.buffer!r} and {b.buffer!r} overlap in memory "
                                  f"([{a.address:#x}, {a.end:#x}) and [{b.address:#x}, {b.end:#x}))")


def _region_of(name: str, obj: Any) -> Region:
    """Region of a numpy array or a torch tensor, recognised without importing torch."""
    if isinstance(obj, np.ndarray):
        if not obj.flags.c_contiguous:
            raise LayoutError(f"buffer {name!r}: array must be C-contiguous")
        return Region(name, int(obj.ctypes.data), int(obj.nbytes), "cpu", 0)
    if hasattr(obj, "data_ptr") and hasattr(obj, "element_size"):
        if not obj.is_contiguous():
            raise LayoutError(f"buffer {name!r}: tensor must be contiguous")
        nbytes = int(obj.numel()) * int(obj.element_size())
        if obj.device.type == "cuda":
            return Region(name, int(obj.data_ptr()), nbytes, "cuda", int(obj.device.index or 0))
        if obj.device.type != "cpu":
            raise LayoutError(f"buffer {name!r}: unsupported tensor device {obj.device}")
        return Region(name, int(obj.data_ptr()), nbytes, "cpu", 0)
    raise LayoutError(f"buffer {name!r}: expected a numpy array or torch tensor, got {type(obj).__name__}")
