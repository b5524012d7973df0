"""Presets: published per-token sizes, capacities that really differ, budget mode, argument errors."""

from __future__ import annotations

import ctypes

import numpy as np
import pytest

from kvferry.errors import LayoutError
from kvferry.layout import HeadGeometry, KVMemory, Layout
from kvferry.layout.presets import PRESETS, describe_presets, get_preset, preset_knobs
from kvferry.plan import plan_decode_rank
from kvferry.plan.ranks import shard_layout

CAPACITIES = [1, 7, 256, 20_000]


def per_token(layout: Layout, name: str) -> float:
    buf = layout.buffer(name)
    tpp = layout.pool(layout.pool_of[name]).tokens_per_page
    assert tpp is not None
    return buf.page_bytes / tpp


@pytest.mark.parametrize("name", list(PRESETS))
@pytest.mark.parametrize("num_pages", CAPACITIES)
def test_every_preset_builds_at_several_capacities(name: str, num_pages: int) -> None:
    layout = get_preset(name, num_pages=num_pages)
    assert isinstance(layout, Layout)
    assert all(b.num_pages >= 1 for b in layout.buffers)
    # The main pool (the first one) carries exactly the requested capacity in some buffer.
    assert num_pages in {b.num_pages for b in layout.pools[0].buffers}
    assert Layout.from_manifest(layout.to_manifest()) == layout


@pytest.mark.parametrize("name", list(PRESETS))
def test_layered_buffers_carry_their_layer(name: str) -> None:
    layout = get_preset(name, num_pages=8)
    for buf in layout.buffers:
        assert buf.layer is not None
        assert f"L{buf.layer}" in buf.name.split(".")


def test_llama3_8b_geometry() -> None:
    layout = get_preset("llama3_8b", num_pages=100)
    assert len(layout.buffers) == 2 * 32
    k = layout.buffer("L12.k")
    assert (k.page_bytes, k.dtype, k.kind, k.layer) == (16 * 8 * 128 * 2, "bf16", "k", 12)
    assert per_token(layout, "L0.v") == 8 * 128 * 2
    assert get_preset("llama3_8b", num_pages=1, page_tokens=32).buffer("L0.k").page_bytes == 32 * 8 * 128 * 2


@pytest.mark.parametrize(("dtype", "index_bytes"), [("fp8", 132), ("bf16", 256)])
def test_deepseek_v32_per_token_sizes(dtype: str, index_bytes: int) -> None:
    layout = get_preset("deepseek_v32", num_pages=10, indexer_dtype=dtype)
    assert layout.pool("kv").tokens_per_page == 64
    assert per_token(layout, "L0.kv") == 656 == 512 + 4 * 4 + 64 * 2
    assert per_token(layout, "L60.idx") == index_bytes
    assert layout.buffer("L60.idx").kind == "index_k"
    assert len(layout.buffers) == 2 * 61
    assert layout.pool("kv").uniform_pages  # V3.2 sizes both from the same page count


def dsv4_roles(layout: Layout) -> dict[str, set[int]]:
    return {
        "c4": {b.layer for b in layout.pool("c4").buffers if b.kind == "kv"},
        "idx": {b.layer for b in layout.pool("c4").buffers if b.kind == "index_k"},
        "c128": {b.layer for b in layout.pool("c128").buffers},
        "swa": {b.layer for b in layout.pool("swa").buffers},
    }


def test_deepseek_v4_follows_the_flash_layer_schedule() -> None:
    layout = get_preset("deepseek_v4", num_pages=1000)
    roles = dsv4_roles(layout)
    assert roles["c4"] == roles["idx"] == set(range(2, 43, 2))  # compress_ratios 4 from layer 2
    assert roles["c128"] == set(range(3, 43, 2))
    assert roles["swa"] == set(range(43))  # every layer keeps its 128-token window
    assert [p.name for p in layout.pools] == ["c4", "c128", "swa"]
    assert layout.pools[0].buffers[0].name == "c4.kv.L2"


@pytest.mark.parametrize(("dtype", "index_bytes"), [("fp8", 132), ("bf16", 256)])
def test_deepseek_v4_per_entry_sizes(dtype: str, index_bytes: int) -> None:
    layout = get_preset("deepseek_v4", num_pages=1000, indexer_dtype=dtype)
    assert layout.pool("c4").tokens_per_page == 256  # 64 entries x 4 tokens
    assert layout.buffer("c4.kv.L2").page_bytes == 64 * 584
    assert layout.buffer("c4.idx.L2").page_bytes == 64 * index_bytes
    assert per_token(layout, "c4.idx.L2") == index_bytes / 4
    assert layout.buffer("c128.kv.L3").page_bytes == 2 * 584  # 2 entries x 128 tokens
    assert per_token(layout, "swa.kv.L0") == 584


def test_deepseek_v4_index_k_page_count_differs_from_kv() -> None:
    layout = get_preset("deepseek_v4", num_pages=1000)  # default indexer dtype is bf16
    kv, idx = layout.buffer("c4.kv.L2"), layout.buffer("c4.idx.L2")
    assert kv.num_pages == 1000
    assert idx.num_pages == 1000 * 132 // 256 != kv.num_pages
    assert not layout.pool("c4").uniform_pages
    forced = get_preset("deepseek_v4", num_pages=1000, indexer_dtype="fp8", index_pages=300)
    assert forced.buffer("c4.idx.L42").num_pages == 300


def test_token_salad_reproduces_the_seed_case() -> None:
    layout = get_preset("token_salad", num_pages=20_000)
    c4 = layout.pool("c4")
    assert c4.buffers[0].name == "c4.kv.L0"
    assert {b.num_pages for b in c4.buffers if b.kind == "kv"} == {20_000}
    assert {b.num_pages for b in c4.buffers if b.kind == "index_k"} == {10_000}
    assert {b.dtype for b in c4.buffers if b.kind == "index_k"} == {"bf16"}
    assert per_token(layout, "c4.idx.L0") * 4 == 256
    assert [p.name for p in layout.pools] == ["c4", "c128"]
    assert len(layout.buffers) == 6  # 2 c4 layers x (kv, idx) + 2 c128 layers


def test_qwen3_next_state_pool() -> None:
    layout = get_preset("qwen3_next", num_pages=4096, num_slots=5)
    full, mamba = layout.pool("full"), layout.pool("mamba")
    assert {b.layer for b in full.buffers} == set(range(3, 48, 4))
    assert per_token(layout, "L3.k") == 2 * 256 * 2
    assert mamba.tokens_per_page is None
    assert len(mamba.buffers) == 2 * 36
    assert layout.buffer("L0.conv").page_bytes == 3 * (2 * 16 * 128 + 32 * 128) * 2
    assert layout.buffer("L0.ssm").page_bytes == 32 * 128 * 128 * 4
    bf16 = get_preset("qwen3_next", num_pages=1, ssm_dtype="bf16")
    assert bf16.buffer("L0.ssm").page_bytes == 32 * 128 * 128 * 2
    assert {b.num_pages for b in mamba.buffers} == {5}



def test_qwen3_next_state_is_cut_by_channel_sections_from_the_config() -> None:
    """Conv ``[q 2048 | k 2048 | v 4096]`` channels of 3 bf16 values, each sharded on its own; the recurrent
    state 32 value heads of 128 x 128; the sections fill each page (no padding), and at TP 2 each rank
    holds half of every section (attention: one of the 2 KV heads); at TP 4 the state still divides but 2
    KV heads do not, refused by name."""
    layout = get_preset("qwen3_next", num_pages=8, num_slots=2, ssm_dtype="bf16")
    conv, ssm = layout.buffer("L0.conv"), layout.buffer("L0.ssm")
    assert conv.state is not None and ssm.state is not None
    assert [(s.channels, s.channel_bytes, s.sharded) for s in conv.state.sections] == [
        (2048, 6, True), (2048, 6, True), (4096, 6, True)]
    assert [(s.channels, s.channel_bytes) for s in ssm.state.sections] == [(32, 128 * 128 * 2)]
    assert conv.state.extent == conv.page_bytes and ssm.state.extent == ssm.page_bytes
    assert layout.buffer("L3.k").heads == HeadGeometry(2, 512, 16, "token")
    half = shard_layout(layout, 2, 1)
    assert half.buffer("L0.conv").page_bytes == conv.page_bytes // 2
    assert [s.channels for s in half.buffer("L0.conv").state.sections] == [1024, 1024, 2048]
    assert half.buffer("L0.ssm").page_bytes == ssm.page_bytes // 2 and half.buffer("L3.v").heads.num_heads == 1
    assert half.model_fingerprint == layout.model_fingerprint
    with pytest.raises(LayoutError, match="buffer 'L3.k': 2 KV heads do not divide evenly over tp_size 4"):
        shard_layout(layout, 4, 0)


def test_qwen3_next_state_moves_tp1_to_tp2_each_rank_its_q_k_v_channels_and_heads() -> None:
    """The TP planner, prefill at TP 1 and decode at TP 2 (one slot, two GDN layers): decode rank ``r`` gets
    channels ``[r x 1024, (r+1) x 1024)`` of q and of k, ``[r x 2048, (r+1) x 2048)`` of v, and value heads
    ``[16 r, 16 (r+1))`` of the recurrent state; not the contiguous half a cut blind to the sections makes."""
    full = get_preset("qwen3_next", num_pages=2, num_slots=2, ssm_dtype="bf16")
    keep = [b for b in full.pool("mamba").buffers if b.layer in (0, 1)]
    layout = Layout([full.pool("mamba").with_buffers(keep)])
    src = KVMemory.allocate(layout)
    rng = np.random.default_rng(48)
    for b in layout.buffers:
        src.array(b.name)[:] = rng.integers(0, 256, src.array(b.name).shape, dtype=np.uint8)
    pages = {"mamba": (np.array([1]), np.array([0]))}
    for r in range(2):
        dst = KVMemory.allocate(shard_layout(layout, 2, r))
        for plan in plan_decode_rank([src], dst, pages).values():
            for (s, n, _), (t, _, _) in zip(plan.src_descs.tolist(), plan.dst_descs.tolist()):
                ctypes.memmove(t, s, n)
        for layer in (0, 1):
            conv = src.array(f"L{layer}.conv")[1].reshape(8192, 6)
            want = np.concatenate([conv[r * 1024:(r + 1) * 1024], conv[2048 + r * 1024:2048 + (r + 1) * 1024],
                                   conv[4096 + r * 2048:4096 + (r + 1) * 2048]]).reshape(-1)
            got = dst.array(f"L{layer}.conv")[0]
            assert np.array_equal(got, want)
            assert not np.array_equal(got, conv.reshape(-1)[r * got.size:(r + 1) * got.size])
            heads = src.array(f"L{layer}.ssm")[1].reshape(32, -1)
            assert np.array_equal(dst.array(f"L{layer}.ssm")[0], heads[16 * r:16 * (r + 1)].reshape(-1))

@pytest.mark.parametrize(("variant", "layers"), [("120b", 36), ("20b", 24)])
def test_gpt_oss_pools(variant: str, layers: int) -> None:
    layout = get_preset("gpt_oss", num_pages=1000, variant=variant)
    swa, full = layout.pool("swa"), layout.pool("full")
    assert {b.layer for b in swa.buffers} == set(range(0, layers, 2))
    assert {b.layer for b in full.buffers} == set(range(1, layers, 2))
    assert per_token(layout, "swa.L0.k") == 8 * 64 * 2
    assert swa.min_pages == 800 and full.min_pages == 1000


@pytest.mark.parametrize("name", list(PRESETS))
@pytest.mark.parametrize("budget", [128 << 20, 3 << 30, 10**10 + 7])
def test_budget_mode_is_the_largest_capacity_within_budget(name: str, budget: int) -> None:
    layout = get_preset(name, budget_bytes=budget)
    assert layout.nbytes <= budget
    main = max(b.num_pages for b in layout.pools[0].buffers)
    assert get_preset(name, num_pages=main) == layout
    assert get_preset(name, num_pages=main + 1).nbytes > budget


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({}, "exactly one of num_pages= or budget_bytes="),
        ({"num_pages": 10, "budget_bytes": 1 << 30}, "exactly one"),
        ({"num_pages": 0}, "num_pages must be an int >= 1"),
        ({"num_pages": True}, "num_pages must be an int"),
        ({"num_pages": 2.5}, "num_pages must be an int"),
        ({"budget_bytes": -1}, "budget_bytes must be an int >= 1"),
        ({"budget_bytes": 1000}, "below the smallest layout"),
        ({"num_pages": 8, "indexer_dtype": "fp16"}, "indexer_dtype must be one of ['fp8', 'bf16']"),
        ({"num_pages": 8, "index_pages": 0}, "index_pages must be an int >= 1"),
        ({"num_pages": 8, "page_tokens": 16}, "does not take page_tokens"),
    ],
)
def test_bad_arguments_raise_layout_error(kwargs: dict[str, object], message: str) -> None:
    with pytest.raises(LayoutError) as info:
        get_preset("deepseek_v4", **kwargs)
    assert message in str(info.value)
    assert "deepseek_v4" in str(info.value)


def test_unknown_preset_lists_the_known_ones() -> None:
    with pytest.raises(LayoutError, match=r"unknown preset 'llama4'.*llama3_8b.*token_salad"):
        get_preset("llama4", num_pages=1)


@pytest.mark.parametrize(("name", "kwargs"), [
    ("gpt_oss", {"variant": "7b"}),
    ("gpt_oss", {"swa_ratio": 0}),
    ("qwen3_next", {"ssm_dtype": "fp16"}),
    ("llama3_8b", {"num_layers": -1}),
])
def test_bad_knob_values(name: str, kwargs: dict[str, object]) -> None:
    with pytest.raises(LayoutError, match=f"preset {name}: {next(iter(kwargs))}"):
        get_preset(name, num_pages=4, **kwargs)


def test_registry_describes_every_preset() -> None:
    described = describe_presets()
    assert list(described) == list(PRESETS)
    assert all(text for text in described.values())
    assert preset_knobs("deepseek_v4")["indexer_dtype"] == "bf16"
