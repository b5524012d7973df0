"""SGLang's KVArgs as a kvferry layout, without SGLang: the adapter reads KVArgs through its attributes,
so a namespace with the same lists stands in. Runs in CI (no SGLang there)."""

from __future__ import annotations

import ctypes
import subprocess
import sys
from types import SimpleNamespace

import numpy as np
import pytest

from kvferry import KVMemory, LayoutError, plan_transfer
from kvferry.errors import PlanError, UsageError
from kvferry.integrations.sglang.layout import chunk_pages, kvargs_memory, request_pages


def _kvargs(arrays: dict[str, list[np.ndarray]], states: list[tuple[str, list[np.ndarray]]]) -> SimpleNamespace:
    def lists(arrs: list[np.ndarray]) -> tuple[list[int], list[int], list[int]]:
        return [a.ctypes.data for a in arrs], [a.nbytes for a in arrs], [a.shape[1] for a in arrs]

    kv, aux = lists(arrays["kv"]), lists(arrays["aux"])
    st = [lists(a) for _, a in states]
    return SimpleNamespace(
        kv_data_ptrs=kv[0], kv_data_lens=kv[1], kv_item_lens=kv[2], kv_layer_ids=[0, 1][:len(kv[0])],
        aux_data_ptrs=aux[0], aux_data_lens=aux[1], aux_item_lens=aux[2], page_size=64,
        kv_cache_dtype_str="fp8_e4m3", kv_layout="v4", state_types=[t for t, _ in states],
        state_data_ptrs=[s[0] for s in st], state_data_lens=[s[1] for s in st], state_item_lens=[s[2] for s in st],
        state_layer_ids=[[] for _ in st])


def _seed_case() -> tuple[SimpleNamespace, dict[str, list[np.ndarray]]]:
    """The seed's shape: a KV entry of 40 pages beside an index-K entry of 24 (bf16 in the same budget)."""
    arrays = {"kv": [np.zeros((40, 584), np.uint8), np.zeros((24, 256), np.uint8)],
              "aux": [np.zeros((8, 64), np.uint8)], "dsa": [np.zeros((24, 256), np.uint8)],
              "swa": [np.zeros((5, 96), np.uint8), np.zeros((3, 32), np.uint8)]}
    args = _kvargs(arrays, [("dsa", arrays["dsa"]), ("swa", arrays["swa"])])
    return args, arrays


def test_each_entry_keeps_its_own_slot_count() -> None:
    args, _ = _seed_case()
    memory, names = kvargs_memory(args)
    slots = {b.name: b.num_pages for b in memory.layout.buffers}
    assert slots == {"kv.0": 40, "kv.1": 24, "aux.0": 8, "state0.dsa.0": 24, "state1.swa.0": 5, "state1.swa.1": 3}
    assert names.states == ("state0.dsa", "state1.swa") and names.aux == "aux"
    assert memory.layout.buffer("kv.0").dtype == "fp8_e4m3/v4"   # the KV byte layout is part of the shape
    assert memory.layout.buffer("state0.dsa.0").kind == "index_k"


def test_pages_move_where_the_indices_say() -> None:
    src_args, src = _seed_case()
    dst_args, dst = _seed_case()
    rng = np.random.default_rng(0)
    for group in src.values():
        for a in group:
            a[...] = rng.integers(0, 256, a.shape, dtype=np.uint8)
    src_mem, names = kvargs_memory(src_args)
    dst_mem, _ = kvargs_memory(dst_args)
    pages = request_pages(names, [23, 0], 7, [[23], [2]])
    src_pages = request_pages(names, [5, 23], 1, [[0], [1]])
    moved = {pool: (src_pages[pool], pages[pool]) for pool in pages}
    plan = plan_transfer(src_mem, dst_mem, moved)
    for (src_addr, nbytes, _), (dst_addr, _, _) in zip(plan.src_descs.tolist(), plan.dst_descs.tolist()):
        ctypes.memmove(dst_addr, src_addr, nbytes)
    assert np.array_equal(dst["kv"][1][[23, 0]], src["kv"][1][[5, 23]])
    assert np.array_equal(dst["dsa"][0][23], src["dsa"][0][0])
    assert np.array_equal(dst["swa"][1][2], src["swa"][1][1]) and np.array_equal(dst["aux"][0][7], src["aux"][0][1])
    assert not dst["kv"][0][1:23].any()   # pages no index named stay as they were


def test_an_index_past_one_entry_is_refused_not_wrapped() -> None:
    """Page 30 exists in the 40-page KV entry but not in the 24-page index-K entry of the same pool: kvferry
    refuses it (a buffer-0 slot count would have addressed past the end of the index-K entry)."""
    args, _ = _seed_case()
    memory, _names = kvargs_memory(args)
    other = KVMemory.allocate(memory.layout)
    with pytest.raises(PlanError, match=r"kv\.1"):
        plan_transfer(memory, other, {"kv": (np.array([30]), np.array([30]))})


def test_chunks_put_kv_at_offsets_and_the_tail_on_the_last() -> None:
    args, _ = _seed_case()
    _, names = kvargs_memory(args)
    pages, offsets = chunk_pages(names, [4, 5], 2, False, 3, [[1], [2]])
    assert set(pages) == {"kv"} and offsets == {"kv": 2}
    pages, offsets = chunk_pages(names, [], 4, True, 3, [[1], None])
    # The last chunk names the KV pool even with no KV pages: where the request's KV ends (its position)
    assert set(pages) == {"kv", "aux", "state0.dsa"} and len(pages["kv"]) == 0 and offsets == {"kv": 4}
    with pytest.raises(UsageError, match="negative"):
        request_pages(names, [-1], None, None)


def test_unsupported_state_and_bad_lists_are_refused() -> None:
    args, _arrays = _seed_case()
    args.state_types = ["dsa_tail", "swa"]
    with pytest.raises(LayoutError, match="dsa_tail"):
        kvargs_memory(args)
    args, _ = _seed_case()
    args.kv_item_lens = args.kv_item_lens[:1]
    with pytest.raises(LayoutError, match="kv_data"):
        kvargs_memory(args)


def test_import_kvferry_does_not_import_sglang() -> None:
    code = ("import sys, kvferry, kvferry.integrations.sglang, kvferry.integrations.sglang.layout; "
            "print(any(m == 'sglang' or m.startswith('sglang.') for m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False"


def test_mla_ranks_are_replicated_and_pair_across_tp_sizes() -> None:
    """An MLA backend's buffers are the same on every attention-TP rank: declared replicated whole pages
    at the rank's TP place, a prefill rank of TP 2 and a decode rank of TP 1 are one model to kvferry's
    TP planner, and only prefill rank 0 (replica_source) has anything to write for decode rank 0."""
    from kvferry.layout.compare import model_difference
    from kvferry.plan.tp import TPPlanner

    src_args, _ = _seed_case()
    dst_args, _ = _seed_case()
    ranks = [kvargs_memory(src_args, tp_size=2, tp_rank=r, replicated=True)[0] for r in range(2)]
    dst, _ = kvargs_memory(dst_args, tp_size=1, tp_rank=0, replicated=True)
    assert (ranks[1].layout.tp_size, ranks[1].layout.tp_rank) == (2, 1)
    assert all(b.heads is not None and b.heads.replicated for b in ranks[1].layout.buffers)
    assert model_difference(ranks[0].layout, dst.layout) is None
    assert set(TPPlanner(ranks[0], dst).slices) == {b.name for b in dst.layout.buffers}
    assert TPPlanner(ranks[1], dst).slices == {}   # SGLang's "dummy" rank: nothing to write, only to report


def test_non_mla_buffers_stay_between_equal_tp_sizes() -> None:
    """Without head geometry (an MHA pool whose rank does not know its KV heads) kvferry refuses to pair
    different TP sizes, naming the buffer."""
    from kvferry.layout.compare import model_difference

    src_args, _ = _seed_case()
    dst_args, _ = _seed_case()
    src, _ = kvargs_memory(src_args, tp_size=2, tp_rank=0)
    dst, _ = kvargs_memory(dst_args)
    assert "buffer 'kv.0': tp_size (the buffer has no head geometry to cut it by) differs: local 2, remote 1" \
        in str(model_difference(src.layout, dst.layout))


def test_head_sharded_state_stays_rank_to_rank_on_mla() -> None:
    """SGLang slices mamba state by head across TP sizes even for MLA models: such a component is not
    declared replicated, so the handshake refuses the cross-TP pair, naming the buffer."""
    from kvferry.layout.compare import model_difference

    def args() -> SimpleNamespace:
        arrays = {"kv": [np.zeros((40, 584), np.uint8)], "aux": [np.zeros((8, 64), np.uint8)]}
        return _kvargs(arrays, [("mamba", [np.zeros((4, 128), np.uint8)])])

    src, _ = kvargs_memory(args(), tp_size=2, tp_rank=0, replicated=True)
    dst, _ = kvargs_memory(args(), replicated=True)
    assert src.layout.buffer("state0.mamba.0").heads is None
    assert "buffer 'state0.mamba.0': tp_size (the buffer has no head geometry" in str(
        model_difference(src.layout, dst.layout))


def _mha_args(heads: int, k_dim: int = 32, v_dim: int = 16, drafts: int = 0) -> SimpleNamespace:
    """SGLang's MHATokenToKVPool as KVArgs: K of 2 layers, V of 2 layers (bf16, 16 tokens a page, ``heads``
    KV heads on this rank), then ``drafts`` draft entries, and one aux buffer."""
    page = 16
    kv = [np.zeros((9, page * heads * d * 2), np.uint8) for d in (k_dim, k_dim, v_dim, v_dim)]
    kv += [np.zeros((9, page * 2 * 64), np.uint8) for _ in range(drafts)]
    args = _kvargs({"kv": kv, "aux": [np.zeros((8, 64), np.uint8)]}, [])
    args.page_size, args.num_draft_entries, args.kv_layer_ids = page, drafts, []
    return args


def test_mha_heads_cut_k_and_v_each_by_its_own_head_bytes() -> None:
    """An MHA rank that knows its KV heads declares token-major head rows on the target model's entries,
    each with its own head bytes (K 64 B, V 32 B a head here), aux a replicated whole page, draft entries
    nothing; prefill TP 2 and decode TP 1 of one model are then one model to the TP planner, and each
    prefill rank writes its half of every token row of K and V."""
    from kvferry.layout.compare import model_difference
    from kvferry.plan.tp import TPPlanner

    ranks = [kvargs_memory(_mha_args(2), tp_size=2, tp_rank=r, kv_heads=2)[0] for r in range(2)]
    dst, _ = kvargs_memory(_mha_args(4), kv_heads=4)
    heads = [b.heads for b in ranks[1].layout.pool("kv").buffers]
    assert [(h.num_heads, h.head_bytes, h.tokens_per_page, h.major) for h in heads] == \
        [(2, 64, 16, "token")] * 2 + [(2, 32, 16, "token")] * 2
    assert ranks[1].layout.buffer("aux.0").heads.replicated
    assert model_difference(ranks[0].layout, dst.layout) is None
    rank1 = TPPlanner(ranks[1], dst).slices
    assert (rank1["kv.0"].nbytes, rank1["kv.0"].dst_offset, rank1["kv.2"].nbytes, rank1["kv.2"].dst_offset) == \
        (128, 128, 64, 64)
    assert "aux.0" not in rank1   # replicated: from replica_source (rank 0) only


def test_mha_head_counts_that_disagree_are_refused_naming_the_buffer() -> None:
    """A decode claiming another head count than prefill's (a wrong model config) cuts its pages into other
    head bytes: the model comparison names the buffer and both values."""
    from kvferry.layout.compare import model_difference

    src, _ = kvargs_memory(_mha_args(2), tp_size=2, tp_rank=0, kv_heads=2)
    dst, _ = kvargs_memory(_mha_args(4), kv_heads=8)
    assert "buffer 'kv.0': head_bytes differs: local 64, remote 32" in str(model_difference(src.layout, dst.layout))


def test_mha_draft_entries_and_uneven_heads_get_no_geometry() -> None:
    """Draft entries (another model, its heads unknown here) move rank to rank only, so a cross-TP pair with
    them is refused naming the draft buffer; heads that do not split evenly over the ranks (SGLang
    replicates them) give no per-rank count at all."""
    from kvferry.integrations.sglang.layout import rank_kv_heads
    from kvferry.layout.compare import model_difference

    src, _ = kvargs_memory(_mha_args(2, drafts=2), tp_size=2, tp_rank=0, kv_heads=2)
    dst, _ = kvargs_memory(_mha_args(4, drafts=2), kv_heads=4)
    assert src.layout.buffer("kv.4").heads is None and src.layout.buffer("kv.3").heads is not None
    assert "buffer 'kv.4': tp_size (the buffer has no head geometry to cut it by) differs: local 2, remote 1" \
        in str(model_difference(src.layout, dst.layout))
    assert [rank_kv_heads(t, tp) for t, tp in [(8, 2), (4, 4), (2, 4), (6, 4), (None, 2), (0, 1)]] == \
        [4, 1, None, None, None, None]


def _mamba_args(tp: int, groups: bool = True) -> SimpleNamespace:
    """A GDN component as SGLang's MambaPool states it at attention TP ``tp``: conv ``[q | k | v]`` (64, 64, 128
    channels over all ranks, 3 bf16 each) and recurrent state (8 heads of 1 KiB), one layer; without
    ``groups``, a Mamba2 conv whose sub-blocks KVArgs does not state."""
    conv, ssm = np.zeros((5, 256 // tp * 6), np.uint8), np.zeros((5, 8 // tp * 1024), np.uint8)
    arrays = {"kv": [np.zeros((40, 584), np.uint8)], "aux": [np.zeros((8, 64), np.uint8)]}
    args = _kvargs(arrays, [("mamba", [conv, ssm])])
    args.state_dim_per_tensor = [[256 // tp, 8 // tp]]
    args.state_conv_shard_groups = [[[64, 64, 128] if groups else None, None]]
    args.state_slice_outer_counts = [[1, 1]]
    args._keep = (conv, ssm, arrays)
    return args


def test_mamba_state_is_cut_by_sglangs_own_dims_and_sub_blocks() -> None:
    """The conv entry becomes three sections (q, k, v each sharded on its own), the recurrent state one; a TP-2
    rank pairs with a TP-1 one, and the planner gives decode rank 1 the second half of each sub-block. A Mamba2
    conv (no sub-block sizes in KVArgs) gets no geometry: refused across TP sizes, naming the buffer."""
    from kvferry.layout.compare import model_difference
    from kvferry.plan.tp import TPPlanner

    one, _ = kvargs_memory(_mamba_args(1), tp_size=1, tp_rank=0, replicated=True)
    two, _ = kvargs_memory(_mamba_args(2), tp_size=2, tp_rank=1, replicated=True)
    conv = two.layout.buffer("state0.mamba.0").state
    assert [(s.offset, s.channels, s.channel_bytes) for s in conv.sections] == [(0, 32, 6), (192, 32, 6), (384, 64, 6)]
    assert two.layout.buffer("state0.mamba.1").state.sections[0].channels == 4
    assert model_difference(one.layout, two.layout) is None
    piece = TPPlanner(one, two).slices["state0.mamba.0"]
    assert [(p.src_offset, p.dst_offset, p.nbytes) for p in piece.pieces] == [
        (32 * 6, 0, 32 * 6), (96 * 6, 32 * 6, 32 * 6), (192 * 6, 64 * 6, 64 * 6)]
    flat, _ = kvargs_memory(_mamba_args(2, groups=False), tp_size=2, tp_rank=0, replicated=True)
    assert flat.layout.buffer("state0.mamba.0").state is None
    assert "buffer 'state0.mamba.0': tp_size (the buffer has no head geometry" in str(
        model_difference(flat.layout, kvargs_memory(_mamba_args(1, groups=False), replicated=True)[0].layout))


def _mamba2_args(tp: int, n_groups: int) -> SimpleNamespace:
    """A Mamba2 component as SGLang's MambaPool states it at attention TP ``tp`` (``Mamba2StateShape.create``:
    groups extended to one per rank when they do not divide): conv ``[x | B | C]`` (x 128 channels over all
    ranks, B and C ``n_groups`` x 16 each, 3 bf16 per channel) with no sub-block sizes, and the SSM state
    (8 heads of 16 x 16 fp32), one layer."""
    groups = n_groups if n_groups % tp == 0 else tp
    channels = (128 + 2 * groups * 16) // tp
    conv, ssm = np.zeros((5, channels * 6), np.uint8), np.zeros((5, 8 // tp * 1024), np.uint8)
    arrays = {"kv": [np.zeros((40, 584), np.uint8)], "aux": [np.zeros((8, 64), np.uint8)]}
    args = _kvargs(arrays, [("mamba", [conv, ssm])])
    args.state_dim_per_tensor = [[channels, 8 // tp]]
    args.state_conv_shard_groups = [[None, None]]
    args.state_slice_outer_counts = [[1, 1]]
    args._keep = (conv, ssm, arrays)
    return args


def test_mamba2_conv_is_cut_by_the_model_configs_sub_blocks() -> None:
    """With the model's Mamba2 sizes (what the backend reads from its config), a conv entry with no sub-block
    sizes becomes x | B | C: x sharded by heads; with one group B and C the same on every rank of TP 2
    (replicated), with two groups sharded. TP 1 and TP 2 then pair, and the planner gives decode rank 1 its x
    half and the whole of B and C. Sizes that do not fit the entries (another group count), or groups SGLang
    spreads over some ranks only (2 over TP 4), declare no geometry: equal TP sizes only."""
    from kvferry.integrations.sglang.layout import Mamba2Dims
    from kvferry.layout.compare import model_difference
    from kvferry.layout.state import mamba2_conv_sections
    from kvferry.plan.tp import TPPlanner

    def memory(tp: int, n_groups: int, rank: int = 0, dims_groups: int | None = None) -> KVMemory:
        dims = Mamba2Dims(128, dims_groups or n_groups, 16, 8, 16, 4)
        return kvargs_memory(_mamba2_args(tp, n_groups), tp_size=tp, tp_rank=rank, replicated=True,
                             mamba2=dims)[0]

    one, two = memory(1, 1), memory(2, 1, rank=1)
    conv = two.layout.buffer("state0.mamba.0").state
    assert [(s.offset, s.channels, s.sharded) for s in conv.sections] == [(0, 64, True), (384, 16, False),
                                                                          (480, 16, False)]
    assert two.layout.buffer("state0.mamba.1").state.sections[0].channels == 4
    assert model_difference(one.layout, two.layout) is None
    piece = TPPlanner(one, two).slices["state0.mamba.0"]
    assert [(p.src_offset, p.dst_offset, p.nbytes) for p in piece.pieces] == [
        (64 * 6, 0, 64 * 6), (128 * 6, 64 * 6, 16 * 6), (144 * 6, 80 * 6, 16 * 6)]
    g2 = memory(2, 2, rank=1).layout.buffer("state0.mamba.0").state
    assert [(s.channels, s.sharded) for s in g2.sections] == [(64, True), (16, True), (16, True)]
    assert model_difference(memory(1, 2).layout, memory(2, 2, rank=1).layout) is None
    for wrong in (memory(2, 1, dims_groups=3), memory(4, 2)):
        assert wrong.layout.buffer("state0.mamba.0").state is None
    assert mamba2_conv_sections(96, 1, 16, 2, 6) == [(64, 6, True), (16, 6, False), (16, 6, False)]
    assert mamba2_conv_sections(32, 1, 16, 2, 6) is None and mamba2_conv_sections(96, 2, 16, 4, 6) is None
