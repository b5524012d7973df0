"""Layouts of real model families, sized from their published configurations.

The top of the layout layer, above ``spec``: a preset builds a ``Layout`` (no memory, no addresses) whose
buffers differ exactly where the real engine's do: page sizes, dtypes, page counts, pools. The demo, the
tests and ``kvferry audit`` use them so that heterogeneity is the default case, never the exception.

Every preset takes its capacity as exactly one of ``num_pages=`` (pages of the preset's main pool, always
its first pool; other pools derive theirs as documented per preset) or ``budget_bytes=`` (the largest
such ``num_pages`` whose whole layout fits the budget), plus keyword-only knobs. Bad arguments raise
``LayoutError``.

Per-token sizes come from each model's ``config.json`` on the Hugging Face Hub and from the cache formats
of the engines that serve it (vLLM, SGLang); each constant below names the fields it is derived from.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable, Iterable
from typing import Any

from kvferry.errors import LayoutError
from kvferry.layout.spec import Buffer, HeadGeometry, Layout, Pool
from kvferry.layout.state import StateGeometry

__all__ = ["DEFAULT_PRESET", "PRESETS", "deepseek_v4", "deepseek_v32", "describe_presets", "get_preset", "gpt_oss",
           "llama3_8b", "preset_knobs", "qwen3_next", "qwen3_next_state", "token_salad"]

Preset = Callable[..., Layout]

BF16 = 2
FP32 = 4

# -- Llama 3 8B: meta-llama/Meta-Llama-3-8B config.json -------------------------------------------------
# num_hidden_layers=32; num_key_value_heads=8 (GQA, num_attention_heads=32); head_dim=128
# (hidden_size 4096 / 32 heads, stated as head_dim=128 in newer configs); torch_dtype=bfloat16.
LLAMA3_8B_LAYERS = 32
LLAMA3_8B_KV_HEADS = 8
LLAMA3_8B_HEAD_DIM = 128

# -- DeepSeek V3.2: deepseek-ai/DeepSeek-V3.2(-Exp) config.json ------------------------------------------
# num_hidden_layers=61; MLA with kv_lora_rank=512 and qk_rope_head_dim=64; sparse indexer with
# index_head_dim=128 (index_n_heads=64, index_topk=2048).
# KV cache in FlashMLA's fp8 format ("fp8_ds_mla" in vLLM): the 512 latent dims in fp8, one fp32 scale per
# 128 dims (4 x 4 B) and the 64 rope dims kept in bf16: 512 + 16 + 128 = 656 B per token.
# Indexer keys: 128 dims in fp8 + one fp32 scale = 132 B per token, or 128 x bf16 = 256 B.
# Page of 64 tokens: FlashMLA's block size.
DSV32_LAYERS = 61
DSV32_KV_BYTES = 512 + 4 * FP32 + 64 * BF16  # 656
DSV32_PAGE_TOKENS = 64
INDEX_HEAD_DIM = 128
INDEX_BYTES = {"fp8": INDEX_HEAD_DIM + FP32, "bf16": INDEX_HEAD_DIM * BF16}  # 132, 256
INDEX_DTYPES = {"fp8": "fp8_e4m3", "bf16": "bf16"}

# -- DeepSeek V4 (Flash): deepseek-ai/DeepSeek-V4-Flash config.json --------------------------------------
# num_hidden_layers=43, num_key_value_heads=1, head_dim=512 with qk_rope_head_dim=64, index_head_dim=128,
# sliding_window=128, compress_ratios=[0, 0, 4, 128, 4, 128, ..., 4] (+ a trailing MTP entry):
# layers 0-1 keep only the 128-token sliding window; even layers from 2 add a compress-by-4 KV ("c4",
# CSA) with indexer keys; odd layers from 3 a compress-by-128 KV ("c128", HCA). Every layer keeps the
# raw sliding-window KV.
# Entry size: vLLM's DSV4 fp8 cache stores 448 NoPE dims in fp8, the 64 RoPE dims in bf16 (128 B) and
# 8 B of UE8M0 scales: 584 B per entry (its "[256 // 4, head_dim] = [64, 584]" KV block).
# Pages: vLLM uses 256-token blocks and stores 256 // ratio entries per compressed block: c4 pages hold
# 64 entries (256 tokens), c128 pages 2 entries (256 tokens); the SWA group uses 64-token pages.
# Not public, chosen here: how SGLang's DSV4 host pool sizes the indexer buffer. We size it from its own
# byte budget computed for fp8 keys (132 B/entry), the FP8-only sizing the seed write-up describes; in
# bf16 the same bytes hold 132/256 of the pages. Not modelled: the compressors' running state caches.
DSV4_LAYERS = 43
DSV4_KV_BYTES = 448 + 64 * BF16 + 8  # 584
DSV4_PAGE_TOKENS = 256
DSV4_C4_ENTRIES = DSV4_PAGE_TOKENS // 4  # 64
DSV4_C128_ENTRIES = DSV4_PAGE_TOKENS // 128  # 2
DSV4_SWA_PAGE_TOKENS = 64
DSV4_SLIDING_WINDOW = 128

# -- Qwen3-Next: Qwen/Qwen3-Next-80B-A3B config.json -----------------------------------------------------
# num_hidden_layers=48, full_attention_interval=4 (layers 3, 7, ..., 47 are full attention, GQA with
# num_key_value_heads=2 and head_dim=256, bf16); the other 36 are Gated DeltaNet layers with
# linear_num_key_heads=16, linear_num_value_heads=32, linear_key_head_dim=linear_value_head_dim=128,
# linear_conv_kernel_dim=4. Per request and layer they keep a conv state of (kernel - 1) x conv_dim
# bf16 values, conv_dim = 2 x 16 x 128 (q, k) + 32 x 128 (v) = 8192, and a recurrent state of
# 32 heads x 128 x 128 in fp32 (mamba_ssm_dtype float32, SGLang's default).
QWEN3_NEXT_LAYERS = 48
QWEN3_NEXT_FULL_INTERVAL = 4
QWEN3_NEXT_KV_HEADS = 2
QWEN3_NEXT_HEAD_DIM = 256
QWEN3_NEXT_LINEAR_KEY_HEADS = 16      # linear_num_key_heads
QWEN3_NEXT_LINEAR_VALUE_HEADS = 32    # linear_num_value_heads
QWEN3_NEXT_LINEAR_KEY_DIM = 128       # linear_key_head_dim
QWEN3_NEXT_LINEAR_VALUE_DIM = 128     # linear_value_head_dim
QWEN3_NEXT_CONV_KERNEL = 4            # linear_conv_kernel_dim
QWEN3_NEXT_KEY_DIM = QWEN3_NEXT_LINEAR_KEY_HEADS * QWEN3_NEXT_LINEAR_KEY_DIM        # 2048: q's channels, and k's
QWEN3_NEXT_VALUE_DIM = QWEN3_NEXT_LINEAR_VALUE_HEADS * QWEN3_NEXT_LINEAR_VALUE_DIM  # 4096: v's
QWEN3_NEXT_CONV_DIM = 2 * QWEN3_NEXT_KEY_DIM + QWEN3_NEXT_VALUE_DIM  # 8192
QWEN3_NEXT_CONV_BYTES = (QWEN3_NEXT_CONV_KERNEL - 1) * QWEN3_NEXT_CONV_DIM * BF16  # 49152
QWEN3_NEXT_SSM_ELEMS = QWEN3_NEXT_LINEAR_VALUE_HEADS * QWEN3_NEXT_LINEAR_KEY_DIM * QWEN3_NEXT_LINEAR_VALUE_DIM

# -- gpt-oss: openai/gpt-oss-120b and gpt-oss-20b config.json --------------------------------------------
# num_hidden_layers=36 (120b) or 24 (20b); layer_types alternate sliding_attention (even layers) and
# full_attention (odd layers); sliding_window=128; num_key_value_heads=8, head_dim=64, bf16.
GPT_OSS_LAYERS = {"120b": 36, "20b": 24}
GPT_OSS_KV_HEADS = 8
GPT_OSS_HEAD_DIM = 64
GPT_OSS_SLIDING_WINDOW = 128
# SGLang's --swa-full-tokens-ratio default: the SWA pool holds 0.8 x the full pool's tokens.
GPT_OSS_SWA_RATIO = 0.8

DEFAULT_PRESET = "deepseek_v4"


# -- capacity ----------------------------------------------------------------------------------------------
def _check_positive(preset: str, what: str, value: object) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise LayoutError(f"preset {preset}: {what} must be an int >= 1, got {value!r}")
    return value


def _choice(preset: str, what: str, value: object, allowed: Iterable[str]) -> str:
    allowed = list(allowed)
    if value not in allowed:
        raise LayoutError(f"preset {preset}: {what} must be one of {allowed}, got {value!r}")
    return str(value)


def _sized(preset: str, build: Callable[[int], Layout], num_pages: object, budget_bytes: object) -> Layout:
    """Build at ``num_pages``, or at the largest ``num_pages`` whose layout fits ``budget_bytes``.

    ``build(n).nbytes`` must not decrease with ``n`` (true for every preset: each capacity is a
    non-decreasing function of ``n``), which makes a doubling-then-bisection search exact.
    """
    if (num_pages is None) == (budget_bytes is None):
        raise LayoutError(f"preset {preset}: give exactly one of num_pages= or budget_bytes=, "
                          f"got num_pages={num_pages!r}, budget_bytes={budget_bytes!r}")
    if num_pages is not None:
        return build(_check_positive(preset, "num_pages", num_pages))
    budget = _check_positive(preset, "budget_bytes", budget_bytes)
    smallest = build(1)
    if smallest.nbytes > budget:
        raise LayoutError(f"preset {preset}: budget {budget} B is below the smallest layout "
                          f"({smallest.nbytes} B at num_pages=1)")
    return build(_largest_fitting(build, budget))


def _largest_fitting(build: Callable[[int], Layout], budget: int) -> int:
    lo, hi = 1, 2  # invariant: build(lo) fits; build(hi) does not, once found
    while build(hi).nbytes <= budget:
        lo, hi = hi, hi * 2
    while hi - lo > 1:
        mid = (lo + hi) // 2
        if build(mid).nbytes <= budget:
            lo = mid
        else:
            hi = mid
    return lo


def _scaled(num_pages: int, ratio: float) -> int:
    """A derived capacity: at least one page, never decreasing in ``num_pages``."""
    return max(1, int(num_pages * ratio))


# -- presets -----------------------------------------------------------------------------------------------
def llama3_8b(num_pages: int | None = None, budget_bytes: int | None = None, *,
              page_tokens: int = 16, num_layers: int = LLAMA3_8B_LAYERS) -> Layout:
    """Llama 3 8B: dense GQA, one pool with a K and a V buffer per layer (all alike).

    ``page_bytes = page_tokens x 8 KV heads x 128 dims x 2 B`` (bf16).
    """
    _check_positive("llama3_8b", "page_tokens", page_tokens)
    layers = range(_check_positive("llama3_8b", "num_layers", num_layers))
    page_bytes = page_tokens * LLAMA3_8B_KV_HEADS * LLAMA3_8B_HEAD_DIM * BF16

    def build(n: int) -> Layout:
        return Layout([Pool("kv", _kv_pair(layers, page_bytes, n), page_tokens)])

    return _sized("llama3_8b", build, num_pages, budget_bytes)


def _kv_pair(layers: Iterable[int], page_bytes: int, num_pages: int, prefix: str = "") -> list[Buffer]:
    """K then V buffer per layer, named ``L12.k`` / ``L12.v`` (with an optional pool prefix)."""
    return [Buffer(f"{prefix}L{layer}.{role}", page_bytes, num_pages, "bf16", role, layer)
            for layer in layers for role in ("k", "v")]


def deepseek_v32(num_pages: int | None = None, budget_bytes: int | None = None, *,
                 indexer_dtype: str = "fp8", num_layers: int = DSV32_LAYERS) -> Layout:
    """DeepSeek V3.2: MLA latent (656 B/token, fp8) plus sparse-indexer keys (132 B fp8 / 256 B bf16).

    One pool of 64-token pages; per layer an ``L12.kv`` and an ``L12.idx`` buffer with the same page
    count but different page sizes.
    """
    index_bytes = INDEX_BYTES[_choice("deepseek_v32", "indexer_dtype", indexer_dtype, INDEX_BYTES)]
    layers = range(_check_positive("deepseek_v32", "num_layers", num_layers))

    def build(n: int) -> Layout:
        kv = [Buffer(f"L{i}.kv", DSV32_PAGE_TOKENS * DSV32_KV_BYTES, n, "fp8_ds_mla", "kv", i)
              for i in layers]
        idx = [Buffer(f"L{i}.idx", DSV32_PAGE_TOKENS * index_bytes, n, INDEX_DTYPES[indexer_dtype],
                      "index_k", i) for i in layers]
        return Layout([Pool("kv", kv + idx, DSV32_PAGE_TOKENS)])

    return _sized("deepseek_v32", build, num_pages, budget_bytes)


def _dsv4_ratio(layer: int) -> int:
    """compress_ratios of DeepSeek-V4-Flash: 0 for layers 0-1, then 4 (even) and 128 (odd)."""
    if layer < 2:
        return 0
    return 4 if layer % 2 == 0 else 128


def _fp8_sized_index_pages(num_pages: int, indexer_dtype: str) -> int:
    """Index-K pages from a byte budget sized for fp8 keys: equal in fp8, 132/256 of them in bf16."""
    return max(1, num_pages * INDEX_BYTES["fp8"] // INDEX_BYTES[indexer_dtype])


def _c4_pool(c4_layers: list[int], num_pages: int, index_pages: int, indexer_dtype: str) -> Pool:
    kv = [Buffer(f"c4.kv.L{i}", DSV4_C4_ENTRIES * DSV4_KV_BYTES, num_pages, "fp8_ds_mla", "kv", i)
          for i in c4_layers]
    idx = [Buffer(f"c4.idx.L{i}", DSV4_C4_ENTRIES * INDEX_BYTES[indexer_dtype], index_pages,
                  INDEX_DTYPES[indexer_dtype], "index_k", i) for i in c4_layers]
    # All KV buffers, then all index-K buffers: the order of SGLang's flat kv_data_ptrs lists, where
    # buffer 0 is a KV buffer and the index-K buffers come after it.
    return Pool("c4", kv + idx, DSV4_PAGE_TOKENS)


def _c128_pool(c128_layers: list[int], num_pages: int) -> Pool:
    kv = [Buffer(f"c128.kv.L{i}", DSV4_C128_ENTRIES * DSV4_KV_BYTES, num_pages, "fp8_ds_mla", "kv", i)
          for i in c128_layers]
    return Pool("c128", kv, DSV4_PAGE_TOKENS)


def deepseek_v4(num_pages: int | None = None, budget_bytes: int | None = None, *,
                indexer_dtype: str = "bf16", num_layers: int = DSV4_LAYERS,
                index_pages: int | None = None, swa_pages: int | None = None) -> Layout:
    """DeepSeek V4 (Flash) hybrid: c4 KV + index-K pool, c128 KV pool, sliding-window pool.

    ``num_pages`` counts c4 pages (256 tokens each); c128 gets as many (also 256 tokens each). Index-K
    buffers have ``index_pages`` pages, by default sized from an fp8 byte budget (so in bf16, the
    default here as in the motivating bug, they hold fewer pages than the KV buffers beside them).
    The SWA pool (64-token pages, every layer) has ``swa_pages``, by default ``num_pages``: a quarter
    of the c4 token capacity, ample for 128-token windows.
    """
    name = "deepseek_v4"
    _choice(name, "indexer_dtype", indexer_dtype, INDEX_BYTES)
    layers = range(_check_positive(name, "num_layers", num_layers))
    c4 = [i for i in layers if _dsv4_ratio(i) == 4]
    c128 = [i for i in layers if _dsv4_ratio(i) == 128]
    fixed_index = None if index_pages is None else _check_positive(name, "index_pages", index_pages)
    fixed_swa = None if swa_pages is None else _check_positive(name, "swa_pages", swa_pages)

    def build(n: int) -> Layout:
        idx_n = fixed_index or _fp8_sized_index_pages(n, indexer_dtype)
        swa = [Buffer(f"swa.kv.L{i}", DSV4_SWA_PAGE_TOKENS * DSV4_KV_BYTES, fixed_swa or n, "fp8_ds_mla",
                      "kv", i) for i in layers]
        pools = [_c4_pool(c4, n, idx_n, indexer_dtype)] if c4 else []
        pools += [_c128_pool(c128, n)] if c128 else []
        return Layout([*pools, Pool("swa", swa, DSV4_SWA_PAGE_TOKENS, DSV4_SLIDING_WINDOW)])

    return _sized(name, build, num_pages, budget_bytes)


def token_salad(num_pages: int | None = None, budget_bytes: int | None = None, *,
                num_layers: int = 4, index_pages: int | None = None, indexer_dtype: str = "bf16") -> Layout:
    """The seed write-up's failing case, small: c4 KV + bf16 index-K with half the pages, then c128.

    Layers alternate c4 (even) and c128 (odd). Index-K buffers default to ``num_pages // 2`` pages: the
    byte budget of fp8 keys (1 B per element) holding bf16 keys (2 B), exactly the mismatch that a
    sender computing slot counts from buffer 0 (``c4.kv.L0``) turns into wrong addresses.
    """
    name = "token_salad"
    _choice(name, "indexer_dtype", indexer_dtype, INDEX_BYTES)
    layers = range(_check_positive(name, "num_layers", num_layers))
    fixed_index = None if index_pages is None else _check_positive(name, "index_pages", index_pages)

    def build(n: int) -> Layout:
        pools = [_c4_pool([i for i in layers if i % 2 == 0], n, fixed_index or max(1, n // 2), indexer_dtype)]
        odd = [i for i in layers if i % 2 == 1]
        return Layout(pools + ([_c128_pool(odd, n)] if odd else []))

    return _sized(name, build, num_pages, budget_bytes)


def qwen3_next(num_pages: int | None = None, budget_bytes: int | None = None, *,
               page_tokens: int = 16, num_slots: int | None = None, ssm_dtype: str = "fp32") -> Layout:
    """Qwen3-Next (80B-A3B): a GQA KV pool for every 4th layer plus a per-request state-slot pool.

    ``num_pages`` counts full-attention pages; the state pool (``tokens_per_page=None``) has
    ``num_slots`` slots, by default one per 4096 tokens of KV capacity (a guess at the mean context;
    engines size it from max running requests). Each linear layer has a conv-state buffer (48 KiB per
    slot, bf16) and a recurrent-state buffer (2 MiB per slot in fp32, 1 MiB in bf16), held apart as
    SGLang's MambaPool holds them.

    Geometry, as SGLang lays it out (so that ``plan.ranks.shard_layout`` gives each TP rank its part and the
    TP planner moves each decode rank exactly its heads and channels), from the config's
    ``linear_num_key_heads`` 16, ``linear_num_value_heads`` 32, ``linear_key_head_dim`` 128,
    ``linear_value_head_dim`` 128 and ``linear_conv_kernel_dim`` 4:

    * conv state ``[conv_dim, kernel - 1]`` (SGLang's ``Mamba2StateShape``, channel-major): three sections
      ``[q 2048 | k 2048 | v 4096]`` channels of 3 bf16 values each, every one sharded on its own (SGLang's
      ``conv_shard_groups`` ``[key_dim, key_dim, value_dim]``, as ``integrations.sglang`` declares a GDN
      state): rank ``r`` of ``T`` holds channels ``[r x 2048/T, (r+1) x 2048/T)`` of q, the same of k, and
      its quarter, half... of v, not a contiguous ``8192/T`` cut;
    * recurrent state ``[value heads, key_head_dim, value_head_dim]``: one section of 32 value heads of
      128 x 128 values, sharded by heads;
    * attention K and V: ``HeadGeometry`` of 2 KV heads of 256 bf16 values, token-major (SGLang's
      ``MHATokenToKVPool`` entries ``[tokens, heads, head_dim]``), so attention shards up to TP 2.
    """
    name = "qwen3_next"
    _check_positive(name, "page_tokens", page_tokens)
    ssm_elem = {"fp32": FP32, "bf16": BF16}[_choice(name, "ssm_dtype", ssm_dtype, ("fp32", "bf16"))]
    fixed_slots = None if num_slots is None else _check_positive(name, "num_slots", num_slots)
    full = [i for i in range(QWEN3_NEXT_LAYERS) if (i + 1) % QWEN3_NEXT_FULL_INTERVAL == 0]
    linear = [i for i in range(QWEN3_NEXT_LAYERS) if i not in full]
    kv_heads = HeadGeometry(QWEN3_NEXT_KV_HEADS, QWEN3_NEXT_HEAD_DIM * BF16, page_tokens, "token")
    conv, ssm = qwen3_next_state(ssm_elem)

    def build(n: int) -> Layout:
        slots = fixed_slots or max(1, n * page_tokens // 4096)
        state = [Buffer(f"L{i}.conv", conv.extent, slots, "bf16", "state", i, None, conv) for i in linear]
        state += [Buffer(f"L{i}.ssm", ssm.extent, slots, ssm_dtype, "state", i, None, ssm) for i in linear]
        attention = [Buffer(f"L{layer}.{role}", kv_heads.page_bytes, n, "bf16", role, layer, kv_heads)
                     for layer in full for role in ("k", "v")]
        return Layout([Pool("full", attention, page_tokens), Pool("mamba", state, None)])

    return _sized(name, build, num_pages, budget_bytes)


def qwen3_next_state(ssm_elem: int = FP32) -> tuple[StateGeometry, StateGeometry]:
    """Qwen3-Next's GDN state at TP 1 as channel sections: (conv, recurrent), ``ssm_elem`` bytes a recurrent
    value (``qwen3_next``'s docstring says how each is cut)."""
    window = (QWEN3_NEXT_CONV_KERNEL - 1) * BF16   # one channel's bytes: its kernel - 1 window values
    conv = StateGeometry.packed([(1, [(QWEN3_NEXT_KEY_DIM, window, True), (QWEN3_NEXT_KEY_DIM, window, True),
                                      (QWEN3_NEXT_VALUE_DIM, window, True)])])
    head = QWEN3_NEXT_LINEAR_KEY_DIM * QWEN3_NEXT_LINEAR_VALUE_DIM * ssm_elem
    ssm = StateGeometry.packed([(1, [(QWEN3_NEXT_LINEAR_VALUE_HEADS, head, True)])])
    return conv, ssm


def gpt_oss(num_pages: int | None = None, budget_bytes: int | None = None, *,
            variant: str = "120b", page_tokens: int = 16, swa_ratio: float = GPT_OSS_SWA_RATIO) -> Layout:
    """gpt-oss (120b or 20b): alternating 128-token sliding-window and full layers, two pools.

    ``num_pages`` counts full-pool pages; the SWA pool gets ``swa_ratio`` of them (SGLang's default
    0.8): same page size, different capacity.
    """
    name = "gpt_oss"
    num_layers = GPT_OSS_LAYERS[_choice(name, "variant", variant, GPT_OSS_LAYERS)]
    _check_positive(name, "page_tokens", page_tokens)
    if not isinstance(swa_ratio, (int, float)) or not 0 < swa_ratio <= 1:
        raise LayoutError(f"preset {name}: swa_ratio must be in (0, 1], got {swa_ratio!r}")
    page_bytes = page_tokens * GPT_OSS_KV_HEADS * GPT_OSS_HEAD_DIM * BF16
    sliding = range(0, num_layers, 2)
    full = range(1, num_layers, 2)

    def build(n: int) -> Layout:
        swa_pages = _scaled(n, swa_ratio)
        return Layout([Pool("full", _kv_pair(full, page_bytes, n, "full."), page_tokens),
                       Pool("swa", _kv_pair(sliding, page_bytes, swa_pages, "swa."), page_tokens,
                            GPT_OSS_SLIDING_WINDOW)])

    return _sized(name, build, num_pages, budget_bytes)


# -- registry ----------------------------------------------------------------------------------------------
PRESETS: dict[str, Preset] = {
    "llama3_8b": llama3_8b,
    "deepseek_v32": deepseek_v32,
    "deepseek_v4": deepseek_v4,
    "token_salad": token_salad,
    "qwen3_next": qwen3_next,
    "gpt_oss": gpt_oss,
}


def preset_knobs(name: str) -> dict[str, Any]:
    """The keyword-only knobs of preset ``name`` with their defaults."""
    params = inspect.signature(_lookup(name)).parameters.values()
    return {p.name: p.default for p in params if p.kind is inspect.Parameter.KEYWORD_ONLY}


def describe_presets() -> dict[str, str]:
    """Preset name -> the first line of its docstring."""
    return {name: (fn.__doc__ or "").strip().splitlines()[0] for name, fn in PRESETS.items()}


def get_preset(name: str, **kwargs: Any) -> Layout:
    """Build preset ``name`` with ``num_pages=`` or ``budget_bytes=`` and its knobs.

    Raises LayoutError for an unknown name (listing the known ones), an unknown knob (listing the
    preset's knobs) or a bad value.
    """
    fn = _lookup(name)
    accepted = {"num_pages", "budget_bytes", *preset_knobs(name)}
    unknown = sorted(set(kwargs) - accepted)
    if unknown:
        knobs = ", ".join(sorted(preset_knobs(name))) or "none"
        raise LayoutError(f"preset {name} does not take {', '.join(unknown)} (its knobs: {knobs})")
    return fn(**kwargs)


def _lookup(name: str) -> Preset:
    try:
        return PRESETS[name]
    except KeyError:
        raise LayoutError(f"unknown preset {name!r} (known: {', '.join(PRESETS)})") from None
