"""vLLM's KV cache as a kvferry layout: one buffer per layer tensor, one pool per KV cache group.

Part of the integrations layer, above ``kvferry.layout`` and below ``worker``. vLLM hands a connector one
tensor per attention layer (``register_kv_caches``) and, per KV cache group, one block table per request.
Block ``j`` of a request holds tokens ``[j * block_size, (j + 1) * block_size)``, so a request's block ids
*are* its page list. Each layer's tensor becomes its own ``Buffer`` with its own page size and page count,
read off the tensor itself; a single group becomes a ``Pool`` whose page index is the group's block id.
Several groups (hybrid models: full attention beside sliding windows) share one pool, because vLLM lays
them over the same memory (``memory_from_kv_caches``); a sliding-window group moves only its window's blocks.

A state group (Mamba: a conv state and an SSM state per layer, fixed size, not per token) is overlaid the
same way: a block of a state group holds one request's whole state for each of its layers, in the page an
attention block of another layer would use. Its block table is not per token: with vLLM's Mamba cache mode
``none`` (prefix caching off) the request's state is block 0 of its table, one block, written in place by
every step and final once the request stops. The same bytes are then read under two geometries, told apart
by the group that owns the block id: attention blocks cut by KV heads, state blocks by channel sections
(``kvferry.layout.state``). So a state group is a pool of its own, ``state_pool_name``, over the same
regions as ``HYBRID_POOL`` and declared its alias (``Pool.aliases``: ``KVMemory`` accepts exactly equal
regions, the lease table keeps one page space), and a request's page there is its state block
(``request_pages``). Across TP sizes ``kvferry.plan.tp`` moves each section's channels to the decode rank
that holds them (``mamba2_state_geometry``); between equal TP sizes the page moves whole.

Pages are whole blocks. What a block holds inside depends on the attention kernel, so slicing tokens out
of a block by the tensor's shape would be wrong; copying whole blocks between two instances of the same
kernel is always right, and the kernel's name goes into each buffer's ``kind`` so the handshake refuses two
different ones. Between two block sizes whole blocks do not pair, and a token's bytes must be found inside
a block: vLLM-CPU's tensor is ``[num_blocks, kv_heads, block_size, 2 x head_size]``, but its kernel (ISAs
``vec`` and ``vec16``, read off ``cpu_attn_reshape_and_cache`` for fp32, bf16 and fp16 at block sizes 32,
64 and 128: tests/test_vllm_block_sizes.py) keeps each head's block as K ``[head_size][block_size]`` (a
token's K is one element in each of ``head_size`` rows) and then V ``[block_size][head_size]``. The buffers
declare that as their head geometry's parts (``cpu_kernel_parts``), and ``kvferry.plan.tokens`` maps token
ranges by them. A kernel not read that way (AMX, NEON, ...), a sliding-window group or several groups
declare none (parts None): their blocks move between equal block sizes only.

No vLLM import here: tensors are duck-typed (``shape``, ``dtype``, ``data_ptr``), so numpy arrays work too.
"""

from __future__ import annotations

import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import xxhash

from kvferry.errors import LayoutError
from kvferry.layout import Buffer, HeadGeometry, KVMemory, Layout, Pool, StateGeometry
from kvferry.layout.spec import MAX_NAME_LEN

__all__ = ["CPU_KERNEL_ISAS", "HYBRID_POOL", "NULL_BLOCK", "STATE_POOL", "GroupPart", "GroupSpec", "RankPlace",
           "by_group", "cpu_kernel_parts", "decode_pages", "first_held_tokens", "group_transfer_id",
           "mamba2_state_geometry", "memory_from_kv_caches", "num_blocks_for", "pool_name", "rank_kv_heads",
           "recv_parts", "request_pages", "send_parts", "single_pool", "state_pool_name", "token_block_size"]

_LAYER_INDEX = re.compile(r"layers\.(\d+)\.")


NULL_BLOCK = 0   # vLLM's null block: a placeholder in block tables (e.g. before a sliding window), never data


@dataclass(frozen=True, slots=True)
class GroupSpec:
    """One vLLM KV cache group: the layers sharing one block table, the tokens per block, and for a
    sliding-window group the window (tokens a query attends to, itself included; None: full attention)."""

    layer_names: tuple[str, ...]
    block_size: int
    sliding_window: int | None = None
    state: bool = False   # a request-scoped state group (Mamba): its state block, not blocks of tokens
    # How this rank's state page cuts into channel sections (``mamba2_state_geometry``); None: not known,
    # the page moves whole between equal TP sizes only.
    geometry: StateGeometry | None = None

    def first_needed_block(self, num_tokens: int) -> int:
        """The first block decode reads: it recomputes the last prompt token (to sample from it), whose
        window reaches back to token ``num_tokens - window``; full attention reads from block 0."""
        if self.sliding_window is None or self.state:
            return 0
        return max(0, num_tokens - self.sliding_window) // self.block_size

    def first_kept_block(self, num_tokens: int) -> int:
        """The first block vLLM still holds once ``num_tokens`` tokens are computed: it frees every block
        wholly before the window of the *next* token, ``num_tokens - window + 1`` (single_type_kv_cache_manager)."""
        if self.sliding_window is None or self.state:
            return 0
        return max(0, num_tokens - self.sliding_window + 1) // self.block_size

    def transferable(self, num_tokens: int) -> bool:
        """Whether prefill still holds every block decode needs. Not when the token decode's recomputed
        last token reaches back to is the last token of a block prefill freed (one prompt length in
        ``block_size``): vLLM's prefill frees for its next token, not for decode's recompute."""
        return self.first_kept_block(num_tokens) <= self.first_needed_block(num_tokens)


HYBRID_POOL = "blocks"
STATE_POOL = "state"


def state_pool_name(groups: Sequence[GroupSpec], index: int) -> str:
    """The pool of state group ``index``: ``STATE_POOL`` when the model has one state group, else
    ``state<k>`` for its ``k``-th (vLLM splits many Mamba layers into several groups of equal size)."""
    states = [i for i, group in enumerate(groups) if group.state]
    return STATE_POOL if len(states) == 1 else f"{STATE_POOL}{states.index(index)}"


def mamba2_state_geometry(shapes: Sequence[Sequence[int]], itemsizes: Sequence[int], conv_layout: str,
                          n_groups: int, tp_size: int) -> StateGeometry | None:
    """This rank's Mamba2 state page as channel sections, from vLLM's ``MambaSpec.shapes`` (conv, SSM) and
    element sizes, ``VLLM_SSM_CONV_STATE_LAYOUT`` and the model's ``mamba_n_groups``; None when the shapes
    are not a Mamba2 conv and SSM state or the groups split in a way vLLM does not make.

    The conv state is ``[x | B | C]`` over channels (``mamba_mixer2``'s ``conv1d`` over ``xBC``): x sharded
    by heads; B and C ``n_groups x d_state`` channels each, sharded when the groups divide over the ranks,
    else (one group: vLLM's ``extra_groups_for_head_shards``) the same group on every rank, replicated.
    ``SD`` stores it ``(kernel - 1, channels)``: ``kernel - 1`` rows of one element per channel; ``DS``
    ``(channels, kernel - 1)``: one row of ``kernel - 1`` elements per channel. The SSM state after it,
    ``(heads, head_dim, d_state)``, is sharded by heads. Both packed from byte 0, as vLLM views a page."""
    if len(shapes) != 2 or len(itemsizes) != 2 or len(shapes[0]) != 2 or len(shapes[1]) != 3:
        return None
    if n_groups % tp_size == 0:
        groups, sharded = n_groups // tp_size, True
    elif n_groups == 1:
        groups, sharded = 1, False
    else:
        return None
    heads, head_dim, d_state = (int(n) for n in shapes[1])
    rows, channels = (int(n) for n in shapes[0]) if conv_layout == "SD" else reversed([int(n) for n in shapes[0]])
    x = channels - 2 * groups * d_state
    if conv_layout not in ("SD", "DS") or x <= 0:
        return None
    conv, ssm = itemsizes
    if conv_layout == "SD":
        part = (rows, [(x, conv, True), (groups * d_state, conv, sharded), (groups * d_state, conv, sharded)])
    else:
        part = (1, [(x, rows * conv, True), (groups * d_state, rows * conv, sharded),
                    (groups * d_state, rows * conv, sharded)])
    return StateGeometry.packed([part, (1, [(heads, head_dim * d_state * ssm, True)])])


def single_pool(groups: Sequence[GroupSpec]) -> bool:
    """Whether the groups make one pool of their own, ``pool_name(0)``: one attention group. Several groups,
    or any state group, make ``HYBRID_POOL``."""
    return len(groups) == 1 and not groups[0].state


def token_block_size(groups: Sequence[GroupSpec]) -> int | None:
    """The tokens per block of the token-paged groups (one size: ``_hybrid_memory`` refuses others), or
    None when every group is a state group. Bindings are cut in these blocks."""
    sizes = sorted({group.block_size for group in groups if not group.state})
    if len(sizes) > 1:
        raise LayoutError(f"KV cache groups with different block sizes {sizes}: not supported")
    return sizes[0] if sizes else None


@dataclass(frozen=True, slots=True)
class RankPlace:
    """This worker's place in its tensor-parallel group, and how its blocks split into KV heads.

    ``kv_heads``: the KV heads this rank holds when the model's split evenly over the ranks (None when vLLM
    replicates heads because there are fewer than ranks, or when unknown: such blocks move rank to rank
    only, between equal TP sizes). ``replicated``: every rank holds the same bytes (MLA's latent cache):
    a decode rank reads one prefill rank's copy, whatever the two TP sizes."""

    tp_size: int = 1
    tp_rank: int = 0
    kv_heads: int | None = None
    replicated: bool = False


def rank_kv_heads(total_kv_heads: int, tp_size: int) -> int | None:
    """A rank's KV heads when ``total_kv_heads`` split evenly over ``tp_size`` ranks, else None (vLLM
    replicates heads over ranks when there are fewer than ranks: no rank holds a distinct share)."""
    if total_kv_heads < tp_size or total_kv_heads % tp_size:
        return None
    return total_kv_heads // tp_size


# vLLM-CPU attention ISAs whose block order was read off the kernel (see the module docstring)
CPU_KERNEL_ISAS = ("vec", "vec16")
_PROBED_DTYPES = ("float32", "bfloat16", "float16")


def cpu_kernel_parts(isa: str | None, head_size: int, dtype: str) -> tuple[tuple[int, int], ...] | None:
    """A head's block of vLLM-CPU's attention kernel as ``HeadGeometry.parts``: K as ``head_size`` rows of a
    token's one element each, then V token by token; None for an ISA or element type not read (the kernel's
    order there is unknown: no page-size translation)."""
    if isa not in CPU_KERNEL_ISAS or dtype not in _PROBED_DTYPES:
        return None
    itemsize = 4 if dtype == "float32" else 2
    return ((head_size, itemsize), (1, head_size * itemsize))


def _heads(view: Any, page_bytes: int, block_size: int, place: RankPlace,
           parts: tuple[tuple[int, int], ...] | None = None) -> HeadGeometry | None:
    """How one block of ``view`` (``[num_blocks, ...]``) cuts into this rank's KV heads, or None.

    Head-major ``[num_blocks, heads, block_size, ...]`` (the CPU kernels: each head's part of a block is
    contiguous; ``parts`` says what it holds inside, None when unknown) or token-major ``[num_blocks,
    block_size, heads, ...]`` (the CUDA flash-attention K and V views: a token's bytes lie where the shape
    says, unless ``parts`` is None). Whole heads are what moves between TP sizes, so the order inside a
    head's part matters only between block sizes; a shape that could be either (as many heads as tokens
    per block) gets none."""
    if place.replicated:
        return HeadGeometry.whole_page(page_bytes)
    heads = place.kv_heads
    shape = tuple(view.shape)
    if heads is None or len(shape) < 3 or page_bytes % (heads * block_size) or heads == block_size:
        return None
    head_bytes = page_bytes // (heads * block_size)
    if shape[1] == heads:
        return HeadGeometry(heads, head_bytes, block_size, "head", parts=parts)
    if shape[1] == block_size and shape[2] == heads:
        return HeadGeometry(heads, head_bytes, block_size, "token", parts=None if parts is None else ())
    return None


def pool_name(group: int) -> str:
    """The pool of KV cache group ``group`` when there is one group: pools are named by position, as vLLM's
    block tables are. Several groups share one pool, ``HYBRID_POOL`` (see ``memory_from_kv_caches``)."""
    return f"group{group}"


def num_blocks_for(num_tokens: int, block_size: int) -> int:
    """Blocks holding the first ``num_tokens`` tokens (the last one possibly partly filled)."""
    return -(-num_tokens // block_size)


def request_pages(block_ids: Sequence[Sequence[int]], groups: Sequence[GroupSpec],
                  num_tokens: int) -> dict[str, list[int]]:
    """A request's page list per pool: the blocks decode reads for its first ``num_tokens`` tokens, in
    token order (all of them under full attention, the window's under a sliding window). Both sides
    compute the same positions from ``num_tokens``, so the lists pair up page by page. Prefill sends this
    whole list; decode announces the part past its prefix cache (``decode_pages``).

    ``block_ids[g]`` is the request's block table in group ``g`` (vLLM's ``KVCacheBlocks.get_block_ids()``).
    Several groups share one pool, and its list is position-major: block position ``j`` of every group
    that needs it, then position ``j + 1``'s. So the blocks under any decode prefix are a leading part of
    the list, whatever the prefix: prefill sends before it learns decode's (see ``decode_pages``). Each
    state group's state block is its pool's one page (``state_pool_name``): no prefix holds it, it always
    moves.
    Raises ``LayoutError`` when a group's table is shorter than the tokens need, or holds vLLM's null block
    where KV or state must be (a sliding-window block already freed).
    """
    return _pages(block_ids, groups, num_tokens, 0)


def decode_pages(block_ids: Sequence[Sequence[int]], groups: Sequence[GroupSpec], num_tokens: int,
                 held_tokens: int) -> tuple[dict[str, list[int]], dict[str, int]]:
    """Decode's side of ``request_pages`` when its prefix cache already holds the first ``held_tokens``
    tokens (vLLM's local hit, whole blocks): the pages decode lacks, to announce, and per pool how many
    leading pages of prefill's list it holds (the announce's ``prefix``: kvferry skips those pages).

    Raises ``LayoutError`` for a hit that is not whole blocks of every group or not short of the prompt.
    """
    held = _held_blocks(groups, num_tokens, held_tokens)
    pages = _pages(block_ids, groups, num_tokens, held)
    # Per token-paged group, its needed blocks under the hit; a state block is never under it.
    counts = [held - min(held, group.first_needed_block(num_tokens)) for group in groups if not group.state]
    if not single_pool(groups):
        return pages, {HYBRID_POOL: sum(counts)}
    return pages, {pool_name(0): counts[0]}


# -- one transfer per group: sliding windows between block sizes --------------------------------------------
@dataclass(frozen=True, slots=True)
class GroupPart:
    """One KV cache group's part of a request, moved as a transfer of its own (``by_group``): its blocks
    in token order, ``pages[0]`` at block index ``first`` of the request (prefill: the send's ``offset``;
    decode: the announce's ``prefix``, the blocks before it neither leased nor written)."""

    group: int
    pool: str
    pages: tuple[int, ...]
    first: int

    def transfer_id(self, request_id: str, num_parts: int) -> str:
        return group_transfer_id(request_id, self.group, num_parts)


def group_transfer_id(request_id: str, group: int, num_groups: int) -> str:
    """Group ``group``'s kvferry request id of a request moved per group: the request's own when it is the
    only group. Both sides derive it from the transfer id prefill handed out."""
    return request_id if num_groups == 1 else f"{request_id}#g{group}"


def by_group(groups: Sequence[GroupSpec]) -> bool:
    """Whether a request moves as one transfer per KV cache group: a sliding-window group and no state group.

    Between block sizes kvferry maps a pool's tokens, and a pool's list must then be one run of the
    request's tokens from a block boundary of each side. A sliding window's blocks begin where each side's
    vLLM stopped freeing them (``first_kept_block``, in that side's blocks), and several groups' blocks share
    one pool: so each group is its own run, sent at its first kept block and announced past decode's own
    (``send_parts``, ``recv_parts``), at every block size alike (prefill cannot know decode's)."""
    return any(g.sliding_window is not None for g in groups) and not any(g.state for g in groups)


def first_held_tokens(groups: Sequence[GroupSpec], num_tokens: int) -> list[int]:
    """Per group, the first token this side holds once ``num_tokens`` tokens are computed: the first of its
    first kept block (vLLM nulls the blocks before it, see ``GroupSpec.first_kept_block``); 0 under full
    attention."""
    return [group.first_kept_block(num_tokens) * group.block_size for group in groups]


def send_parts(block_ids: Sequence[Sequence[int]], groups: Sequence[GroupSpec], num_tokens: int) -> list[GroupPart]:
    """Prefill's parts of a finished request (``by_group``): per group, every block it still holds under the
    first ``num_tokens`` tokens, from its first kept one. ``LayoutError`` for a short table or a null block."""
    return _group_parts(block_ids, groups, num_tokens, 0)


def recv_parts(block_ids: Sequence[Sequence[int]], groups: Sequence[GroupSpec], num_tokens: int,
               held_tokens: int) -> list[GroupPart]:
    """Decode's parts (``by_group``): per group, its non-null blocks under ``num_tokens`` tokens past its
    prefix-cache hit of ``held_tokens`` (whole blocks). vLLM allocates a remote request's sliding-window
    blocks from ``first_kept_block(num_tokens)`` on (``allocate_external_computed_blocks``), so every token
    of those blocks must arrive: the window's, and those before it in its first block, which a later
    request's prefix-cache hit may read."""
    return _group_parts(block_ids, groups, num_tokens, _held_blocks(groups, num_tokens, held_tokens))


def _group_parts(block_ids: Sequence[Sequence[int]], groups: Sequence[GroupSpec], num_tokens: int,
                 start: int) -> list[GroupPart]:
    if len(block_ids) != len(groups):
        raise LayoutError(f"{len(block_ids)} block tables for {len(groups)} KV cache groups")
    pool = pool_name(0) if single_pool(groups) else HYBRID_POOL
    parts = []
    for index, (table, group) in enumerate(zip(block_ids, groups)):
        need = num_blocks_for(num_tokens, group.block_size)
        first = min(max(start, group.first_kept_block(num_tokens)), need)
        blocks = np.asarray(table[first:need], dtype=np.int64)
        if len(blocks) != need - first:
            raise LayoutError(f"group {index}: {num_tokens} tokens need {need} blocks of {group.block_size} "
                              f"tokens, the block table has {len(table)}")
        nulls = np.flatnonzero(blocks == NULL_BLOCK)
        if len(nulls):
            raise LayoutError(f"group {index}: block {first + int(nulls[0])} of {num_tokens} tokens is vLLM's null "
                              "block (freed), its KV is needed")
        parts.append(GroupPart(index, pool, tuple(blocks.tolist()), first))
    return parts


def _held_blocks(groups: Sequence[GroupSpec], num_tokens: int, held_tokens: int) -> int:
    size = token_block_size(groups)
    if size is None:
        if held_tokens:
            raise LayoutError(f"decode's prefix-cache hit of {held_tokens} tokens in a model of state groups only")
        return 0
    if held_tokens % size or not 0 <= held_tokens < num_tokens:
        raise LayoutError(f"decode's prefix-cache hit of {held_tokens} tokens is not whole blocks of "
                          f"{size} tokens short of the prompt's {num_tokens}")
    return held_tokens // size


def _pages(block_ids: Sequence[Sequence[int]], groups: Sequence[GroupSpec], num_tokens: int,
           start: int) -> dict[str, list[int]]:
    """The request's pages from block position ``start`` on (see ``request_pages``)."""
    if len(block_ids) != len(groups):
        raise LayoutError(f"{len(block_ids)} block tables for {len(groups)} KV cache groups")
    columns: list[tuple[int, list[int]]] = []   # per token-paged group: its first position sent, its blocks
    states: dict[str, list[int]] = {}   # per state group's pool: the request's state block
    for index, (table, group) in enumerate(zip(block_ids, groups)):
        if group.state:
            states[state_pool_name(groups, index)] = [_state_block(index, table, group)]
            continue
        need = num_blocks_for(num_tokens, group.block_size)
        if len(table) < need:
            raise LayoutError(f"{pool_name(index)}: {num_tokens} tokens need {need} blocks of "
                              f"{group.block_size} tokens, the block table has {len(table)}")
        first = max(start, group.first_needed_block(num_tokens))
        blocks = [int(b) for b in table[first:need]]
        if NULL_BLOCK in blocks:
            raise LayoutError(f"{pool_name(index)}: block {first + blocks.index(NULL_BLOCK)} of {num_tokens} "
                              f"tokens is vLLM's null block (freed), its KV is needed")
        columns.append((first, blocks))
    if single_pool(groups):
        return {pool_name(0): columns[0][1]}
    size = token_block_size(groups)
    if size is None:
        return states
    return {HYBRID_POOL: _position_major(columns, num_blocks_for(num_tokens, size)), **states}


def _state_block(index: int, table: Sequence[int], group: GroupSpec) -> int:
    """A state group's block for the request: block 0 of its table (vLLM's Mamba cache mode ``none``: one
    state per request, updated in place; ``connector`` refuses the other modes)."""
    if not len(table):
        raise LayoutError(f"group {index} (state, layers {list(group.layer_names)}): the request has no state block")
    block = int(table[0])
    if block == NULL_BLOCK:
        raise LayoutError(f"group {index} (state, layers {list(group.layer_names)}): the request's state block "
                          "is vLLM's null block")
    return block


def _position_major(columns: Sequence[tuple[int, list[int]]], need: int) -> list[int]:
    """Several groups' blocks in one list, position by position (one block size: ``_hybrid_memory``)."""
    grid = np.full((need, len(columns)), -1, dtype=np.int64)   # -1: a position the group does not send
    for group, (first, blocks) in enumerate(columns):
        grid[first:need, group] = blocks
    flat = grid.ravel()
    return flat[flat >= 0].tolist()


def memory_from_kv_caches(kv_caches: Mapping[str, Any], groups: Sequence[GroupSpec], num_blocks: int, *,
                          cache_dtype: str = "auto", kinds: Mapping[str, str] | None = None,
                          place: RankPlace = RankPlace(),
                          head_parts: Mapping[str, tuple[tuple[int, int], ...] | None] | None = None) -> KVMemory:
    """Bind vLLM's per-layer KV tensors as a ``KVMemory``: a buffer per tensor, a pool per group.

    A tensor is ``[num_blocks, ...]`` (one buffer named after the layer) or ``[2, num_blocks, ...]`` (K and
    V apart, as the CUDA flash-attention layout: two buffers ``<layer>.k`` and ``<layer>.v``). Anything
    else raises ``LayoutError`` naming the layer and shape. ``cache_dtype`` is vLLM's ``cache_dtype``
    (``"auto"``: the tensor's own dtype); ``kinds`` maps a layer to its buffer kind (default ``"kv"``).

    Several groups (vLLM's hybrid KV cache manager), or a state group: vLLM overlays them, the i-th layer of
    each group on the same bytes, which is sound because one block pool serves every group and a block id
    is owned by one group at a time. Attention layers on the same bytes cannot be told apart, so each
    distinct attention tensor is one buffer (named after the layers on it) of one pool, ``HYBRID_POOL``,
    indexed by block id; a request's pages there are its blocks in every token-paged group
    (``request_pages``). A state layer's tensor is ``[num_blocks, ...]`` of its state's real bytes, each
    block a stride of the page apart (vLLM pads a state's page to the attention page): it is a buffer of
    its group's state pool (``state_pool_name``), its page the stride, padding included, its sections the
    group's ``geometry``, over exactly the attention buffer's region on its bytes (the pool ``aliases``
    ``HYBRID_POOL``; a state layer with no attention layer under it is widened to its own pages).

    ``place``: the worker's TP rank; each buffer then says how its blocks cut into this rank's KV heads
    (``_heads``), or a state buffer into channel sections, which lets kvferry's TP planner move KV and
    state between prefill and decode of different TP sizes.

    ``head_parts``: per layer, where a token's bytes lie inside a head's block (``cpu_kernel_parts``; a
    token-major layer needs only ``()``: the shape says it). A layer without, a sliding-window group, and
    several groups declare none (parts None): the handshake then refuses a prefill or decode of another
    block size, since their block lists do not start at token 0 on both sides alike (a window's first block).
    """
    if not single_pool(groups):
        return _hybrid_memory(kv_caches, groups, num_blocks, cache_dtype, kinds or {}, place, head_parts or {})
    pools: list[Pool] = []
    arrays: dict[str, Any] = {}
    for index, group in enumerate(groups):
        buffers = []
        for layer in group.layer_names:
            if layer not in kv_caches:
                raise LayoutError(f"{pool_name(index)}: layer {layer!r} has no registered KV tensor")
            kind = (kinds or {}).get(layer, "kv")
            for name, view in _block_views(layer, kv_caches[layer], num_blocks):
                page_bytes = _nbytes(view) // num_blocks
                parts = (head_parts or {}).get(layer)
                buffers.append(Buffer(name, page_bytes, num_blocks, _dtype(view, cache_dtype), kind,
                                      _layer_index(layer), _heads(view, page_bytes, group.block_size, place, parts)))
                arrays[name] = view
        pools.append(Pool(pool_name(index), buffers, tokens_per_page=group.block_size))
    return KVMemory.from_arrays(Layout(pools, place.tp_size, place.tp_rank), arrays)


@dataclass(frozen=True, slots=True)
class _View:
    """One layer's block view on its way into a hybrid pool's buffer."""

    name: str
    layer: str
    tensor: Any
    page_bytes: int   # bytes from one block to the next (a state view's real bytes are fewer)
    state: bool


def _hybrid_memory(kv_caches: Mapping[str, Any], groups: Sequence[GroupSpec], num_blocks: int, cache_dtype: str,
                   kinds: Mapping[str, str], place: RankPlace,
                   head_parts: Mapping[str, tuple[tuple[int, int], ...] | None]) -> KVMemory:
    """``HYBRID_POOL`` over the distinct attention tensors of several overlaid groups, and a state pool per
    state group over the same regions (see ``memory_from_kv_caches``)."""
    block_size = token_block_size(groups)
    regions: dict[int, list[_View]] = {}   # by address: the attention layers on those bytes
    states: dict[str, list[tuple[_View, StateGeometry | None]]] = {}   # per state pool: its layers' views
    for index, group in enumerate(groups):
        for layer in group.layer_names:
            if layer not in kv_caches:
                raise LayoutError(f"group {index}: layer {layer!r} has no registered KV tensor")
            for name, view in _block_views(layer, kv_caches[layer], num_blocks):
                if group.state:
                    states.setdefault(state_pool_name(groups, index), []).append(
                        (_View(name, layer, view, _block_stride(view), True), group.geometry))
                else:
                    regions.setdefault(_address(view), []).append(
                        _View(name, layer, view, _nbytes(view) // num_blocks, False))
    pools: list[Pool] = []
    arrays: dict[str, Any] = {}
    if regions:
        buffers = []
        for on_it in regions.values():
            name = _joined([view.name for view in on_it])
            page_bytes = _region_page(name, on_it)
            array = _dense_view(on_it, num_blocks, page_bytes)
            kind = "+".join(dict.fromkeys(kinds.get(view.layer, "kv") for view in on_it))
            heads = None if block_size is None else _heads(array, page_bytes, block_size, place,
                                                             _region_parts(on_it, head_parts))
            buffers.append(Buffer(name, page_bytes, num_blocks, _dtype(on_it[0].tensor, cache_dtype), kind,
                                  _layer_index(on_it[0].layer), heads))
            arrays[name] = array
        pools.append(Pool(HYBRID_POOL, buffers, tokens_per_page=block_size))
    for pool, views in states.items():
        buffers = [_state_buffer(view, geometry, regions.get(_address(view.tensor), []), num_blocks, kinds, arrays)
                   for view, geometry in views]
        pools.append(Pool(pool, buffers, aliases=HYBRID_POOL if regions else None))
    return KVMemory.from_arrays(Layout(pools, place.tp_size, place.tp_rank), arrays)


def _state_buffer(view: _View, geometry: StateGeometry | None, under: Sequence[_View], num_blocks: int,
                  kinds: Mapping[str, str], arrays: dict[str, Any]) -> Buffer:
    """A state layer's buffer: its whole padded pages, over exactly the region of the attention layers
    ``under`` it (their page must be its block stride), cut by ``geometry`` inside the real bytes."""
    if under:
        _region_page(_joined([view.name, *(u.name for u in under)]), [view, *under])
    real = _nbytes(view.tensor) // num_blocks
    if geometry is not None and geometry.extent > real:
        raise LayoutError(f"layer {view.layer!r}: its state sections end at byte {geometry.extent}, past the "
                          f"{real} bytes of state vLLM hands per block")
    array = _dense_view([view], num_blocks, view.page_bytes)
    arrays[view.name] = array
    return Buffer(view.name, view.page_bytes, num_blocks, _dtype(array, "auto"), kinds.get(view.layer, "state"),
                  _layer_index(view.layer), None, geometry)


def _region_parts(on_it: Sequence[_View], head_parts: Mapping[str, tuple[tuple[int, int], ...] | None],
                  ) -> tuple[tuple[int, int], ...] | None:
    """The kernel order of the attention layers sharing one region (one model, one kernel: alike), or None
    when any of them declares none or two differ (the region's blocks then move between equal sizes only)."""
    parts = {head_parts.get(view.layer) for view in on_it}
    return parts.pop() if len(parts) == 1 else None


def _region_page(name: str, on_it: Sequence[_View]) -> int:
    """The page of the layers sharing one region: all of them one block stride (vLLM pads every group's
    page to one size), or ``LayoutError`` naming the two that differ."""
    first = on_it[0]
    for view in on_it[1:]:
        if view.page_bytes != first.page_bytes:
            raise LayoutError(f"buffer {name!r}: layers {first.layer!r} and {view.layer!r} share an address but "
                              f"not a page size ({first.page_bytes} and {view.page_bytes} bytes per block)")
    return first.page_bytes


def _dense_view(on_it: Sequence[_View], num_blocks: int, page_bytes: int) -> Any:
    """A C-contiguous view of the region's ``num_blocks`` whole pages: an attention layer's tensor when one
    lies there, otherwise the state view widened to its padded pages (bytes, ``[num_blocks, page_bytes]``)."""
    for view in on_it:
        if not view.state and _is_dense(view.tensor):
            return view.tensor
    if not all(view.state for view in on_it):
        return on_it[0].tensor   # an attention layout kvferry cannot bind: ``KVMemory.from_arrays`` says why
    tensor = on_it[0].tensor
    if _itemsize(tensor) != 1:
        raise LayoutError(f"layer {on_it[0].layer!r}: a state view of {tensor.dtype} elements cannot be widened to "
                          "its padded pages (vLLM hands state as bytes)")
    if hasattr(tensor, "storage_offset"):   # torch: the same storage, a stride of one page per block
        import torch

        return torch.as_strided(tensor, (num_blocks, page_bytes), (page_bytes, 1), tensor.storage_offset())
    return np.lib.stride_tricks.as_strided(tensor, (num_blocks, page_bytes), (page_bytes, 1))


def _joined(names: Sequence[str]) -> str:
    """A buffer's name from the layers on it; past the name limit, the first and a hash of all."""
    joined = "+".join(names)
    if len(joined) <= MAX_NAME_LEN:
        return joined
    return f"{names[0]}+{len(names) - 1}:{xxhash.xxh64_hexdigest(joined)}"


def _address(tensor: Any) -> int:
    if hasattr(tensor, "data_ptr"):
        return int(tensor.data_ptr())   # torch
    return int(tensor.__array_interface__["data"][0])   # numpy


def _block_views(layer: str, tensor: Any, num_blocks: int) -> list[tuple[str, Any]]:
    shape = tuple(tensor.shape)
    if shape and shape[0] == num_blocks:
        return [(layer, tensor)]
    if len(shape) > 1 and shape[0] == 2 and shape[1] == num_blocks:
        return [(f"{layer}.k", tensor[0]), (f"{layer}.v", tensor[1])]
    raise LayoutError(f"layer {layer!r}: KV tensor of shape {shape} has no block dimension of {num_blocks} "
                      f"blocks first (expected [num_blocks, ...] or [2, num_blocks, ...])")


def _block_stride(tensor: Any) -> int:
    """Bytes from one block of ``tensor`` (``[num_blocks, ...]``) to the next."""
    stride = tensor.stride(0) * tensor.element_size() if hasattr(tensor, "element_size") else tensor.strides[0]
    return int(stride)


def _itemsize(tensor: Any) -> int:
    return int(tensor.element_size()) if hasattr(tensor, "element_size") else int(tensor.itemsize)


def _is_dense(tensor: Any) -> bool:
    if hasattr(tensor, "is_contiguous"):
        return bool(tensor.is_contiguous())
    return bool(tensor.flags["C_CONTIGUOUS"])


def _nbytes(tensor: Any) -> int:
    if hasattr(tensor, "nbytes") and not hasattr(tensor, "element_size"):
        return int(tensor.nbytes)   # numpy
    return int(tensor.numel()) * int(tensor.element_size())


def _dtype(tensor: Any, cache_dtype: str) -> str:
    if cache_dtype != "auto":
        return cache_dtype
    return str(tensor.dtype).removeprefix("torch.")


def _layer_index(layer: str) -> int | None:
    match = _LAYER_INDEX.search(layer + ".")
    return int(match.group(1)) if match else None
