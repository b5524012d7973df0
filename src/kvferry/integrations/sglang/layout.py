"""SGLang's ``KVArgs`` as a kvferry ``Layout`` bound to memory, and SGLang's indices as pages per pool.

SGLang hands its pools to the transfer layer as parallel pointer/length/item-length lists: the main KV
entries (``kv_data_*``), the metadata buffers (``aux_data_*``) and one list per typed state component
(``state_data_*``: SWA, the DSA indexer's keys, DeepSeek-V4's request state...). Here each list becomes a
pool and each entry a buffer whose slot count is its own ``len // item_len``: never another entry's, which
is the mistake (``kv_data_lens[0] // kv_item_lens[0]`` applied to every entry) that scrambled bf16 index-K
pages under PD. SGLang itself is not imported: ``KVArgs`` is read through its attributes.

Across attention TP sizes (MLA pools only): every buffer of an MLA model (the latent KV, the indexer keys,
the state components, aux) holds the same bytes on every TP rank, so each is declared replicated, whole
pages (``HeadGeometry.whole_page``), and the layout placed at the rank's ``(tp_size, tp_rank)``; kvferry's
TP planner then has exactly one prefill rank write each decode rank (``plan.ranks.replica_source``).
Head-sharded state (``HEAD_SHARDED_STATE_TYPES``) is the exception: it is cut by channels, not moved whole.

Mamba state across TP sizes: SGLang's ``MambaPool`` states, per entry, the channels this rank holds on its
sliced axis (``state_dim_per_tensor``, 0 for a slot replicated over the attention-TP group), the rows
before that axis (``state_slice_outer_counts``: Kimi's ``[K-1, dim]`` conv) and, for a conv state made of
independently sharded sub-blocks, their model-wide sizes (``state_conv_shard_groups``: GDN's
``[key_dim, key_dim, value_dim]``). Each entry is then declared a ``StateGeometry`` (``_mamba_geometry``),
and kvferry's TP planner moves each decode rank exactly its channels. A Mamba2 conv state (``[x | B | C]``,
x sharded by heads, B and C by groups, or the same group on every rank when there is one group and several
ranks) comes with no sub-block sizes in ``KVArgs``: the backend reads them from the model config
(``Mamba2Dims``) and its conv entries are cut by ``layout.state.mamba2_conv_sections``. Without them a
contiguous cut would misplace B and C, so such a component gets no geometry and moves between equal TP
sizes only.

Across attention TP sizes (MHA/GQA pools, ``kv_heads`` given): SGLang's ``MHATokenToKVPool`` entries are
``[slots * page_size, heads, head_dim]``, token-major, rank ``r`` holding KV heads ``[r * h, (r+1) * h)``.
Each of the target model's entries is declared ``HeadGeometry(h, item_len // page_size // h, page_size,
"token")``: its own head bytes, so K and V of different head dims are each cut by their own geometry.
Draft entries (another model, head count unknown here) and state components carry no geometry and move
rank to rank only; aux is the same on every rank and declared a replicated whole page. Without
``kv_heads`` nothing carries geometry and an MHA pool moves between equal TP sizes only.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from kvferry.errors import LayoutError, UsageError
from kvferry.layout import Buffer, HeadGeometry, KVMemory, Layout, Pool, StateGeometry
from kvferry.layout.state import mamba2_conv_sections

__all__ = [
    "AUX_POOL",
    "HEAD_SHARDED_STATE_TYPES",
    "KV_POOL",
    "SUPPORTED_STATE_TYPES",
    "Mamba2Dims",
    "PoolNames",
    "chunk_pages",
    "kvargs_memory",
    "rank_kv_heads",
    "request_pages",
    "state_pool_name",
]

KV_POOL = "kv"
AUX_POOL = "aux"

# State components whose indices are plain slot numbers, one per item, addressed in every entry of the
# component. DSA_TAIL's indices encode a live subrange of one ring row instead, so it is refused rather
# than moved wrongly.
SUPPORTED_STATE_TYPES = frozenset({"mamba", "swa", "dsa", "swa_ring", "c128_state", "request_row",
                                   "block_scale", "block_scale_swa", "qsa_pending", "qsa_compressed",
                                   "minimax_index_k", "minimax_dense_kv"})


# State components SGLang slices by head across TP sizes even on an MLA backend (its nixl backend's
# ``_state_component_is_whole_slot``): never declared replicated, so kvferry's handshake refuses such a pair
# across TP sizes, naming the buffer, rather than copy whole slots that hold another rank's heads.
HEAD_SHARDED_STATE_TYPES = frozenset({"mamba", "minimax_index_k", "minimax_dense_kv"})


def state_pool_name(index: int, state_type: str) -> str:
    return f"state{index}.{state_type}"


@dataclass(frozen=True)
class PoolNames:
    """Which kvferry pool carries what: the KV pool, the aux pool (if any), one pool per state component
    (None where the component has no buffers)."""

    kv: str
    aux: str | None
    states: tuple[str | None, ...]


@dataclass(frozen=True)
class Mamba2Dims:
    """A Mamba2 model's state sizes, model-wide, as its config gives them (what SGLang's
    ``Mamba2StateShape.create`` sizes a rank's ``MambaPool`` from): what ``KVArgs`` does not say about a
    Mamba2 conv state ``[x | B | C]``."""

    intermediate_size: int
    n_groups: int
    state_size: int
    num_heads: int
    head_dim: int
    conv_kernel: int

    def conv_channels(self, tp_size: int) -> int | None:
        """A rank's conv channels at ``tp_size`` (groups extended to one per rank when they do not divide, as
        SGLang does), or None when SGLang could not shard it so."""
        groups = self.n_groups if self.n_groups % tp_size == 0 else tp_size
        total = self.intermediate_size + 2 * groups * self.state_size
        return None if total % tp_size or self.num_heads % tp_size else total // tp_size


def _type_value(state_type: Any) -> str:
    return str(getattr(state_type, "value", state_type))


def _entries(ptrs: Sequence[int], lens: Sequence[int], items: Sequence[int], what: str) -> list[tuple[int, int, int]]:
    if not len(ptrs) == len(lens) == len(items):
        raise LayoutError(f"KVArgs {what}: {len(ptrs)} pointers, {len(lens)} lengths, {len(items)} item lengths")
    out = []
    for i, (ptr, nbytes, item) in enumerate(zip(ptrs, lens, items)):
        if int(item) <= 0 or int(nbytes) < int(item):
            raise LayoutError(f"KVArgs {what}[{i}]: {nbytes} bytes cannot hold one {item}-byte item")
        # The tail past the last whole item is never addressed by an index: bind whole items only.
        out.append((int(ptr), int(nbytes) // int(item) * int(item), int(item)))
    return out


def _layer(layer_ids: Sequence[int] | None, i: int, count: int) -> int | None:
    if layer_ids is None or len(layer_ids) != count:
        return None
    return int(layer_ids[i]) if int(layer_ids[i]) >= 0 else None


def rank_kv_heads(total_kv_heads: int | None, tp_size: int) -> int | None:
    """This rank's KV heads when ``total_kv_heads`` split evenly over ``tp_size`` attention-TP ranks, else
    None. SGLang replicates heads when there are fewer than ranks (``max(1, total // tp)`` each): kvferry's
    planner has no replicated-head model, so such a pool gets no geometry (equal TP sizes only)."""
    if not total_kv_heads or total_kv_heads < tp_size or total_kv_heads % tp_size:
        return None
    return total_kv_heads // tp_size


def _token_heads(item: int, page_size: int, heads: int) -> HeadGeometry | None:
    """An MHA entry's page as ``page_size`` token rows of ``heads`` heads, or None when its item does not
    split that way (then it has no head structure kvferry could cut, and moves rank to rank only)."""
    if item % (page_size * heads):
        return None
    return HeadGeometry(heads, item // page_size // heads, page_size, "token")


def _pool(name: str, kind: str, dtype: str, entries: list[tuple[int, int, int]],
          layer_ids: Sequence[int] | None, tokens_per_page: int | None,
          heads: Sequence[HeadGeometry | None], states: Sequence[StateGeometry | None] | None = None) -> Pool:
    states = states or [None] * len(entries)
    buffers = [Buffer(f"{name}.{i}", item, nbytes // item, dtype, kind, _layer(layer_ids, i, len(entries)), heads[i],
                      states[i])
               for i, (_, nbytes, item) in enumerate(entries)]
    return Pool(name, buffers, tokens_per_page=tokens_per_page)


def _whole_pages(entries: list[tuple[int, int, int]], replicated: bool) -> list[HeadGeometry | None]:
    return [HeadGeometry.whole_page(item) if replicated else None for _, _, item in entries]


def _replicated_tokens(item: int, page_size: int) -> HeadGeometry:
    """An MLA entry's page (``[slot][1][dim]``: ``page_size`` token rows, the same on every rank) as one
    replicated head of token rows, so that another page size translates token by token; an item that
    does not split into ``page_size`` rows stays a whole page (equal page sizes only)."""
    if item % page_size:
        return HeadGeometry.whole_page(item)
    return HeadGeometry(1, item // page_size, page_size, "token", True)


def _kv_heads(args: Any, entries: list[tuple[int, int, int]], page_size: int, replicated: bool,
              kv_heads: int | None) -> list[HeadGeometry | None]:
    """Each KV entry's geometry: replicated token rows (MLA), token-major head rows for the target model's
    entries of an MHA pool whose heads are known (draft entries, the last ``num_draft_entries``, get none),
    else none. Either says where each token lies in a page, which lets the two sides' page sizes differ."""
    if replicated and any(int(r or 0) > 1 for r in getattr(args, "mla_compression_ratios", None) or []):
        # DeepSeek-V4's entries hold one row per 4 or 128 tokens, which KVArgs does not say entry by entry:
        # whole pages, so its page sizes must be equal (the handshake refuses otherwise).
        return _whole_pages(entries, True)
    if replicated:
        return [_replicated_tokens(item, page_size) for _, _, item in entries]
    if kv_heads is None:
        return _whole_pages(entries, False)
    num_target = len(entries) - int(getattr(args, "num_draft_entries", 0) or 0)
    return [_token_heads(item, page_size, kv_heads) if i < num_target else None
            for i, (_, _, item) in enumerate(entries)]


def _kv_dtype(args: Any) -> str:
    # The handshake compares dtypes: folding SGLang's KV byte layout in makes two sides that read the same
    # bytes differently (DeepSeek-V4's layouts) incompatible before a byte moves.
    dtype = str(getattr(args, "kv_cache_dtype_str", None) or "auto")
    layout = getattr(args, "kv_layout", None)
    return f"{dtype}/{layout}" if layout else dtype


def kvargs_memory(args: Any, *, device: str = "cpu", device_id: int = 0, tp_size: int = 1, tp_rank: int = 0,
                  replicated: bool = False, kv_heads: int | None = None,
                  mamba2: Mamba2Dims | None = None) -> tuple[KVMemory, PoolNames]:
    """Bind ``args`` (SGLang's ``KVArgs``) as a kvferry ``KVMemory``, and say which pool is which.

    ``tp_size``/``tp_rank``: this rank's place in its attention TP group. ``replicated``: every buffer
    holds the same bytes on every rank (an MLA backend), which is what lets kvferry move it across TP
    sizes. ``kv_heads`` (MHA only): this rank's KV heads, which lets kvferry cut the KV entries by head
    across TP sizes; with neither, buffers carry no head geometry and move between equal TP sizes only.
    ``mamba2``: the model's Mamba2 sizes (from its config), which let a Mamba2 conv state be cut across TP
    sizes when ``KVArgs`` gives no sub-block sizes."""
    kv_entries = _entries(args.kv_data_ptrs, args.kv_data_lens, args.kv_item_lens, "kv_data")
    if not kv_entries:
        raise LayoutError("KVArgs has no KV entries")
    page_size = int(getattr(args, "page_size", 1) or 1)
    pools = [_pool(KV_POOL, "kv", _kv_dtype(args), kv_entries, getattr(args, "kv_layer_ids", None), page_size,
                   _kv_heads(args, kv_entries, page_size, replicated, kv_heads))]
    entries = list(kv_entries)
    aux_entries = _entries(getattr(args, "aux_data_ptrs", None) or [], getattr(args, "aux_data_lens", None) or [],
                           getattr(args, "aux_item_lens", None) or [], "aux_data")
    aux = AUX_POOL if aux_entries else None
    if aux_entries:
        # Metadata SGLang writes alike on every rank: replicated whenever the KV can cross TP sizes.
        pools.append(_pool(AUX_POOL, "aux", "uint8", aux_entries, None, None,
                           _whole_pages(aux_entries, replicated or kv_heads is not None)))
        entries += aux_entries
    states: list[str | None] = []
    for i, st in enumerate(getattr(args, "state_types", None) or []):
        pool, comp = _state_pool(args, i, _type_value(st), replicated, tp_size, mamba2)
        states.append(pool.name if pool is not None else None)
        if pool is not None:
            pools.append(pool)
            entries += comp
    layout = Layout(pools, tp_size, tp_rank)
    ptrs, lens, items = zip(*entries)
    memory = KVMemory.from_pointers(layout, ptrs, lens, items, device=device, device_id=device_id)
    return memory, PoolNames(KV_POOL, aux, tuple(states))


def _state_pool(args: Any, i: int, state_type: str, replicated: bool, tp_size: int = 1,
                mamba2: Mamba2Dims | None = None) -> tuple[Pool | None, list[tuple[int, int, int]]]:
    ptrs = _nth(getattr(args, "state_data_ptrs", None), i)
    if not ptrs:
        return None, []
    if state_type not in SUPPORTED_STATE_TYPES:
        raise LayoutError(f"KVArgs state component {i} ({state_type}): not supported by kvferry's SGLang "
                          f"backend (its indices are not plain slot numbers)")
    comp = _entries(ptrs, _nth(args.state_data_lens, i), _nth(args.state_item_lens, i), f"state_data[{i}]")
    kind = "index_k" if state_type == "dsa" else "state"
    name = state_pool_name(i, state_type)
    layers = _nth(getattr(args, "state_layer_ids", None), i)
    if state_type == "mamba":
        geometry = _mamba_geometry(args, i, comp, tp_size, mamba2)
        if geometry is not None:
            heads = [HeadGeometry.whole_page(item) if g is None else None for (_, _, item), g in zip(comp, geometry)]
            return _pool(name, kind, state_type, comp, layers, None, heads, geometry), comp
    return _pool(name, kind, state_type, comp, layers, None,
                 _whole_pages(comp, replicated and state_type not in HEAD_SHARDED_STATE_TYPES)), comp


def _mamba_geometry(args: Any, i: int, entries: list[tuple[int, int, int]], tp_size: int,
                    mamba2: Mamba2Dims | None = None) -> list[StateGeometry | None] | None:
    """Each entry of mamba component ``i`` as channel sections (None for an entry replicated over the group:
    a whole page from one rank), or None for the component when nothing says how to cut it: no per-entry
    dims, or a conv state without its sub-block sizes (a Mamba2 ``[x | B | C]``) and no ``mamba2`` sizes."""
    dims = list(_nth(getattr(args, "state_dim_per_tensor", None), i))
    groups = list(_nth(getattr(args, "state_conv_shard_groups", None), i)) or [None] * len(entries)
    outers = list(_nth(getattr(args, "state_slice_outer_counts", None), i)) or [1] * len(entries)
    if not (len(dims) == len(groups) == len(outers) == len(entries)) or not (any(groups) or mamba2):
        return None
    out: list[StateGeometry | None] = []
    for (_, _, item), dim, sub, outer in zip(entries, dims, groups, outers):
        if int(dim) == 0:
            out.append(None)
            continue
        dim, outer = int(dim), int(outer or 1)
        if dim < 0 or outer <= 0 or item % (dim * outer):
            return None
        cb = item // (dim * outer)
        if sub and sum(sub) == dim * tp_size and all(int(g) % tp_size == 0 for g in sub):
            sections = [(int(g) // tp_size, cb, True) for g in sub]
        elif sub:   # sub-blocks that do not add up to this rank's channels: nothing says how to cut it
            return None
        elif mamba2 is not None:
            sections = _mamba2_sections(mamba2, dim, outer, cb, tp_size)
            if sections is None:
                return None
        else:
            sections = [(dim, cb, True)]
        out.append(StateGeometry.packed([(outer, sections)]))
    return out


def _mamba2_sections(dims: Mamba2Dims, dim: int, outer: int, cb: int,
                     tp_size: int) -> list[tuple[int, int, bool]] | None:
    """A Mamba2 ``MambaPool`` entry with no sub-block sizes: the conv state (``[channels, kernel - 1]``, this
    rank's conv channels) as ``[x | B | C]``, the SSM state (``[heads, head_dim, d_state]``) as heads; None
    for an entry that is neither (then nothing says how to cut the component)."""
    if outer == 1 and dim == dims.conv_channels(tp_size):
        return mamba2_conv_sections(dim, dims.n_groups, dims.state_size, tp_size, cb)
    if outer == 1 and dims.num_heads == dim * tp_size and cb % (dims.head_dim * dims.state_size) == 0:
        return [(dim, cb, True)]
    return None


def _nth(lists: Sequence[Any] | None, i: int) -> Any:
    return lists[i] if lists is not None and i < len(lists) else []


def _as_pages(indices: Any) -> np.ndarray:
    arr = np.asarray(indices if indices is not None else [], dtype=np.int64).reshape(-1)
    if arr.size and arr.min() < 0:
        raise UsageError(f"negative page index {int(arr.min())}: SGLang passes -1 for unallocated slots")
    return arr


def _tail_pages(names: PoolNames, aux_index: int | None, state_indices: Sequence[Any] | None) -> dict[str, np.ndarray]:
    """The pools carried once per request, with the last chunk: aux and the state components."""
    pages: dict[str, np.ndarray] = {}
    if names.aux is not None and aux_index is not None:
        pages[names.aux] = _as_pages([aux_index])
    for i, indices in enumerate(state_indices or []):
        pool = names.states[i] if i < len(names.states) else None
        if indices is None:
            continue
        arr = _as_pages(indices)
        if arr.size and pool is None:
            raise UsageError(f"state component {i} has indices but no buffers in KVArgs")
        if arr.size:
            pages[pool] = arr  # type: ignore[index]
    return pages


def request_pages(names: PoolNames, kv_indices: Any, aux_index: int | None,
                  state_indices: Sequence[Any] | None) -> dict[str, np.ndarray]:
    """Decode's whole request (``send_metadata``'s arguments) as pages per pool."""
    return {names.kv: _as_pages(kv_indices), **_tail_pages(names, aux_index, state_indices)}


def chunk_pages(names: PoolNames, kv_indices: Any, start: int, last: bool, aux_index: int | None,
                state_indices: Sequence[Any] | None) -> tuple[dict[str, np.ndarray], dict[str, int]]:
    """One prefill ``send`` call as (pages, offsets): the chunk's KV pages are the request's pages
    ``start..`` (positions in the whole request, decode's prefix included); aux and state pages travel
    with the last chunk, as SGLang's own backends send them. The last chunk names the KV pool even when it
    has no KV pages (decode's prefix covered them all): it tells kvferry where the request's KV ends."""
    pages: dict[str, np.ndarray] = {}
    kv = _as_pages(kv_indices)
    if kv.size or last:
        pages[names.kv] = kv
    if last:
        pages.update(_tail_pages(names, aux_index, state_indices))
    return pages, {names.kv: start}

