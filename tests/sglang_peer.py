"""One side (prefill or decode) of a PD transfer through SGLang's own transfer-layer classes, no model.

Run under .venv-sglang by tests/test_sglang.py: ``python tests/sglang_peer.py prefill|decode '<json>' [rank]``.
Builds a real SGLang memory pool on CPU (MLA, the DSA indexer pool with fp8 or bf16 index keys, or
DeepSeek-V4's), fills it with seeded bytes, builds ``KVArgs`` the way SGLang's schedulers do
(``get_kv_transfer_buf_infos`` + ``setup_state_kv_args``), picks the backend through
``get_kv_class(TransferBackend(name), ...)`` (``kvferry`` through SGLang's ``load_plugins()``), and drives
the sender or receiver of every request in SGLang's call order. Prefill (rank 0) also hosts the
bootstrap server. Prints one JSON line with the outcome; decode's line includes the byte check of every
buffer.

Across TP sizes (``prefill_tp``/``decode_tp`` in the config) each attention-TP rank is a process of its
own, told its rank through SGLang's parallel context, as SGLang's scheduler processes are. The MLA pools
hold the same bytes on every rank in SGLang, but each prefill rank fills its pool from its own seed, so
decode can tell which rank's bytes landed: exactly the one that should write it (``src_rank``), and none
from a rank that must only report. The MHA pools (``mha``; ``mha_v`` and ``mha_vw``, whose V head dim is narrower
or wider than K's) are SGLang's ``MHATokenToKVPool`` with each rank's share of ``MHA_KV_HEADS`` KV heads: decode checks
every token row of every KV page head by head against the prefill rank that holds that head.
"""

from __future__ import annotations

import json
import os
import sys
import time
from dataclasses import dataclass
from typing import Any

import numpy as np

os.environ.setdefault("SGLANG_DISAGGREGATION_NIXL_BACKEND", "UCX")
os.environ.setdefault("SGLANG_PLUGINS", "kvferry")

AUX_SLOTS, AUX_ITEM = 96, 64
DEADLINE = 90.0
# The MHA model: KV heads over all ranks, K and V head dims (mha_v: V narrower than K, mha_vw: wider), tokens
# per page.
MHA_KV_HEADS, MHA_PAGE = 4, 16
MHA_DIMS = {"mha": (32, 32), "mha_v": (32, 16), "mha_vw": (16, 32), "gdn": (32, 32), "mamba2": (32, 32),
            "mamba2_g2": (32, 32), "mamba2_g4": (32, 32)}
# The hybrid model (``gdn``): SGLang's HybridLinearKVPool, full attention (an MHA pool of MHA_KV_HEADS heads) on
# layers 1 and 3, gated delta net state (its MambaPool) on layers 0 and 2, Qwen3-Next's shape scaled down: conv
# state ``[q | k | v]`` (key heads x head dim twice, value heads x head dim), kernel 4, bf16; recurrent state
# ``[value heads, head dim, head dim]`` fp32.
GDN_KEY_HEADS, GDN_VALUE_HEADS, GDN_HEAD_DIM, GDN_KERNEL, GDN_SLOTS = 4, 8, 16, 4, 96
# The Mamba2 hybrids (``mamba2``: one group, ``mamba2_g2``: two, ``mamba2_g4``: four), Granite 4.0-H's layout
# scaled down: the same HybridLinearKVPool, its MambaPool sized by SGLang's Mamba2StateShape from a
# GraniteMoeHybrid config the test writes (which the backend reads back): conv state ``[x | B | C]`` (x: heads x
# head dim, B and C: groups x d_state each), kernel 4, bf16; SSM state ``[heads, head dim, d_state]`` fp32.
MAMBA2_HEADS, MAMBA2_HEAD_DIM, MAMBA2_D_STATE, MAMBA2_KERNEL = 8, 16, 16, 4
MAMBA2_GROUPS = {"mamba2": 1, "mamba2_g2": 2, "mamba2_g4": 4}
# Different page sizes on the two sides (``cfg["pages"]``: [prefill's, decode's]): pools of this many tokens,
# requests of 1 to MAX_REQUEST_TOKENS tokens.
PAGED_TOKENS, MAX_REQUEST_TOKENS = 4096, 160


def is_mha(kind: str) -> bool:
    return kind in MHA_DIMS


def model_dir(cfg: dict[str, Any], role: str) -> str:
    """A Hugging Face config for the MHA model (what SGLang's ``ModelConfig`` reads for ``model_path``), in
    a directory of its own; ``{role}_config_heads`` makes that side's config claim another head count."""
    import tempfile

    heads = cfg.get(f"{role}_config_heads", MHA_KV_HEADS)
    path = tempfile.mkdtemp(prefix=f"kvferry-model-{role}-")
    if cfg.get("pool") in MAMBA2_GROUPS:
        with open(os.path.join(path, "config.json"), "w") as f:
            json.dump(mamba2_config(cfg, role, heads), f)
        return path
    with open(os.path.join(path, "config.json"), "w") as f:
        json.dump({"architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": 256,
                   "num_attention_heads": 8, "num_key_value_heads": heads, "head_dim": 32,
                   "num_hidden_layers": 2, "intermediate_size": 512, "vocab_size": 1000,
                   "max_position_embeddings": 2048, "torch_dtype": "bfloat16"}, f)
    return path


def mamba2_config(cfg: dict[str, Any], role: str, heads: int) -> dict[str, Any]:
    """A tiny GraniteMoeHybrid config (Mamba2 on layers 0 and 2, attention on 1 and 3) with the pool's sizes;
    ``{role}_mamba_groups`` makes that side's config claim another group count."""
    groups = cfg.get(f"{role}_mamba_groups", MAMBA2_GROUPS[cfg["pool"]])
    hidden = MAMBA2_HEADS * MAMBA2_HEAD_DIM // 2
    return {"architectures": ["GraniteMoeHybridForCausalLM"], "model_type": "granitemoehybrid",
            "hidden_size": hidden, "num_attention_heads": 8, "num_key_value_heads": heads,
            "num_hidden_layers": 4, "layer_types": ["mamba", "attention", "mamba", "attention"],
            "intermediate_size": 256, "shared_intermediate_size": 256, "num_local_experts": 0,
            "vocab_size": 1000, "max_position_embeddings": 2048, "torch_dtype": "bfloat16",
            "mamba_d_state": MAMBA2_D_STATE, "mamba_d_conv": MAMBA2_KERNEL, "mamba_expand": 2,
            "mamba_d_head": MAMBA2_HEAD_DIM, "mamba_n_heads": MAMBA2_HEADS, "mamba_n_groups": groups}


def setup_context(cfg: dict[str, Any], tp_size: int = 1, tp_rank: int = 0, role: str = "prefill") -> None:
    from sglang.srt.runtime_context import get_context, get_parallel

    # An MHA decode learns its KV heads from its model config unless the config says otherwise
    # (``{role}_model_config`` False: a path with no config, read offline).
    model = {}
    if is_mha(cfg.get("pool", "")):
        has_config = cfg.get(f"{role}_model_config", True)
        model = {"model_path": model_dir(cfg, role) if has_config else "/nonexistent/kvferry-model"}
    get_context().override_server_args(
        device="cpu", tp_size=tp_size, pp_size=1, dp_size=1, disaggregation_transfer_backend=cfg["backend"],
        disaggregation_bootstrap_port=cfg["port"], host="127.0.0.1", **model).install()
    get_parallel().override_permanently(tp_rank=tp_rank, attn_tp_rank=tp_rank, attn_cp_rank=0, attn_dcp_rank=0,
                                        attn_dp_rank=0, pp_group=None, attn_dcp_size=1)


def tp_of(cfg: dict[str, Any], role: str) -> int:
    return int(cfg.get(f"{role}_tp", 1))


def src_rank(cfg: dict[str, Any], decode_rank: int) -> int:
    """The prefill rank whose bytes decode rank ``decode_rank`` must hold: for MLA pools SGLang's and
    kvferry's choice agree, the first prefill rank overlapping it (``floor(d * P / D)``)."""
    return decode_rank * tp_of(cfg, "prefill") // tp_of(cfg, "decode")


def fill_seed(cfg: dict[str, Any], role: str, rank: int) -> int:
    return cfg["seed"] + 1000 * rank + (0 if role == "prefill" else 1)


def build_pool(kind: str, tp_size: int = 1, page: int | None = None) -> Any:
    """SGLang's pool ``kind`` at attention TP ``tp_size``; ``page`` (MHA and MLA, the page-size cases): its
    page size, on a pool of PAGED_TOKENS tokens."""
    import torch
    from sglang.srt.mem_cache.deepseek_v4_memory_pool import DeepSeekV4TokenToKVPool
    from sglang.srt.mem_cache.index_key_cache import IndexKeyCache
    from sglang.srt.mem_cache.memory_pool import DSATokenToKVPool, MLATokenToKVPool

    if kind == "gdn":
        return build_gdn_pool(tp_size)
    if kind in MAMBA2_GROUPS:
        return build_mamba2_pool(tp_size, MAMBA2_GROUPS[kind])
    if is_mha(kind):
        from sglang.srt.mem_cache.memory_pool import MHATokenToKVPool

        head_dim, v_head_dim = MHA_DIMS[kind]
        return MHATokenToKVPool(size=PAGED_TOKENS if page else 2048, page_size=page or MHA_PAGE, dtype=torch.bfloat16,
                                head_num=MHA_KV_HEADS // tp_size, head_dim=head_dim, v_head_dim=v_head_dim,
                                layer_num=2, device="cpu", enable_memory_saver=False)
    if kind == "mla":
        return MLATokenToKVPool(size=PAGED_TOKENS if page else 8192, page_size=page or 64, dtype=torch.bfloat16,
                                kv_lora_rank=64,
                                qk_rope_head_dim=16, layer_num=2, device="cpu", enable_memory_saver=False)
    if kind.startswith("dsa"):
        class BF16IndexKeyCache(IndexKeyCache):
            # SGLang 0.5.23 stores index keys as fp8 + scales (132 B/token). The seed's build stored them
            # in bf16 (256 B/token) within the same byte budget: fewer index pages than KV pages.
            def _buffer_shape(self, num_pages: int) -> tuple[int, int]:
                rows, fp8_row = super()._buffer_shape(num_pages)
                bf16_row = self.pool.page_size * self.pool.index_head_dim * 2
                return rows * fp8_row // bf16_row, bf16_row

        class BF16IndexDSAPool(DSATokenToKVPool):
            def _create_index_key_cache(self) -> IndexKeyCache:
                return BF16IndexKeyCache(self, self.index_buf_size)

        cls = BF16IndexDSAPool if kind == "dsa_bf16" else DSATokenToKVPool
        return cls(size=8192, page_size=64, kv_lora_rank=64, dtype=torch.bfloat16, qk_rope_head_dim=16,
                   layer_num=2, device="cpu", index_head_dim=128, enable_memory_saver=False, kv_cache_dim=80)
    if kind == "v4":
        return DeepSeekV4TokenToKVPool(
            max_num_reqs=72, swa_size=8192, c4_size=8192, c128_size=8192, c4_state_pool_size=512,
            c128_state_pool_size=512, page_size=256, swa_page_size=64, dtype=torch.uint8,
            c4_state_dtype=torch.float32, c128_state_dtype=torch.float32, qk_nope_head_dim=448,
            qk_rope_head_dim=64, indexer_head_dim=128, layer_num=4, device="cpu", enable_memory_saver=False,
            compression_ratios=[0, 4, 128, 4])
    raise ValueError(kind)


def build_gdn_pool(tp_size: int) -> Any:
    """SGLang's own hybrid pools at ``tp_size``: a MambaPool built from the Mamba2CacheParams SGLang's Qwen3-Next
    config makes (qwen3_next.py ``mamba2_cache_params``: sub-blocks ``[key_dim, key_dim, value_dim]``), inside a
    HybridLinearKVPool whose full-attention layers are an MHA pool."""
    import torch
    from sglang.srt.configs.mamba_utils import Mamba2CacheParams, Mamba2StateDType, Mamba2StateShape
    from sglang.srt.mem_cache.memory_pool import HybridLinearKVPool, MambaPool

    key_dim, value_dim = GDN_KEY_HEADS * GDN_HEAD_DIM, GDN_VALUE_HEADS * GDN_HEAD_DIM
    shape = Mamba2StateShape.create(tp_world_size=tp_size, intermediate_size=value_dim, n_groups=GDN_KEY_HEADS,
                                    num_heads=GDN_VALUE_HEADS, head_dim=GDN_HEAD_DIM, state_size=GDN_HEAD_DIM,
                                    conv_kernel=GDN_KERNEL, conv_shard_groups=[key_dim, key_dim, value_dim])
    params = Mamba2CacheParams(shape=shape, layers=[0, 2],
                               dtype=Mamba2StateDType(conv=torch.bfloat16, temporal=torch.float32))
    mamba = MambaPool(size=GDN_SLOTS, spec_state_size=0, cache_params=params, mamba_layer_ids=[0, 2], device="cpu")
    return HybridLinearKVPool(size=2048, dtype=torch.bfloat16, page_size=MHA_PAGE, head_num=MHA_KV_HEADS // tp_size,
                              head_dim=MHA_DIMS["gdn"][0], full_attention_layer_ids=[1, 3], device="cpu",
                              mamba_pool=mamba)


def build_mamba2_pool(tp_size: int, n_groups: int) -> Any:
    """SGLang's own hybrid pools for a Mamba2 model at ``tp_size``: a MambaPool sized by ``Mamba2StateShape.create``
    as Granite 4.0-H's config does (no conv sub-block sizes: SGLang 0.5.23 passes none for Mamba2), inside a
    HybridLinearKVPool whose full-attention layers are an MHA pool."""
    import torch
    from sglang.srt.configs.mamba_utils import Mamba2CacheParams, Mamba2StateDType, Mamba2StateShape
    from sglang.srt.mem_cache.memory_pool import HybridLinearKVPool, MambaPool

    shape = Mamba2StateShape.create(tp_world_size=tp_size, intermediate_size=MAMBA2_HEADS * MAMBA2_HEAD_DIM,
                                    n_groups=n_groups, num_heads=MAMBA2_HEADS, head_dim=MAMBA2_HEAD_DIM,
                                    state_size=MAMBA2_D_STATE, conv_kernel=MAMBA2_KERNEL)
    params = Mamba2CacheParams(shape=shape, layers=[0, 2],
                               dtype=Mamba2StateDType(conv=torch.bfloat16, temporal=torch.float32))
    mamba = MambaPool(size=GDN_SLOTS, spec_state_size=0, cache_params=params, mamba_layer_ids=[0, 2], device="cpu")
    return HybridLinearKVPool(size=2048, dtype=torch.bfloat16, page_size=MHA_PAGE, head_num=MHA_KV_HEADS // tp_size,
                              head_dim=MHA_DIMS["mamba2"][0], full_attention_layer_ids=[1, 3], device="cpu",
                              mamba_pool=mamba)


def mamba2_conv_subs(kind: str, dim: int, tp_size: int) -> tuple[tuple[int, bool], ...] | None:
    """A Mamba2 conv entry's sub-blocks as (model-wide channels, sharded): x by heads, B and C by groups, or
    (one group) the same group on every rank; None for an entry that is not the conv (its ``dim`` differs)."""
    groups = MAMBA2_GROUPS[kind]
    x = MAMBA2_HEADS * MAMBA2_HEAD_DIM
    sharded = groups % tp_size == 0
    per_rank = groups // tp_size if sharded else 1
    if dim != x // tp_size + 2 * per_rank * MAMBA2_D_STATE:
        return None
    bc = groups * MAMBA2_D_STATE
    return ((x, True), (bc, groups > 1), (bc, groups > 1))


def build_kv_args(pool: Any, aux: Any, rank: int = 0, heads: bool = False) -> Any:
    from sglang.srt.disaggregation.base.conn import KVArgs
    from sglang.srt.disaggregation.utils import get_kv_transfer_buf_infos, setup_state_kv_args

    args = KVArgs()
    args.engine_rank, args.pp_rank, args.system_dp_rank, args.rust_http_port = rank, 0, 0, None
    args.kv_cache_dtype_str = "bf16"
    args.kv_layout = getattr(pool, "kv_layout", None)
    args.kv_layout = None if args.kv_layout is None else str(getattr(args.kv_layout, "value", args.kv_layout))
    args.prefill_start_layer, args.prefill_end_layer = 0, None
    args.kv_data_ptrs, args.kv_data_lens, args.kv_item_lens = get_kv_transfer_buf_infos(pool)
    args.kv_layer_ids = []
    args.num_draft_entries = 0
    args.page_size = pool.page_size
    args.aux_data_ptrs, args.aux_data_lens, args.aux_item_lens = [aux.data_ptr()], [aux.nbytes], [AUX_ITEM]
    args.ib_device, args.gpu_id = None, 0
    args.kv_data_mem_kinds = ["DRAM"] * len(args.kv_data_ptrs)
    if heads:  # what SGLang's prefill sets for a non-MLA pool (its decode: only with hetero-TP staging)
        args.kv_head_num, args.total_kv_head_num = pool.head_num, MHA_KV_HEADS
    setup_state_kv_args(args, pool)
    return args


@dataclass(frozen=True)
class Buf:
    """One entry of KVArgs as (pool, pointer, bytes, item bytes): what the byte check walks."""

    group: str
    ptr: int
    nbytes: int
    item: int
    dim: int = 0                  # mamba entries: this rank's channels on the sliced axis (SGLang's KVArgs)
    subs: tuple[int, ...] = ()    # and the model-wide sub-block sizes of a conv state (GDN's q, k, v)

    def view(self) -> np.ndarray:
        import ctypes

        raw = (ctypes.c_uint8 * (self.nbytes // self.item * self.item)).from_address(self.ptr)
        return np.frombuffer(raw, dtype=np.uint8).reshape(-1, self.item)


def buffers(args: Any) -> list[Buf]:
    out = [Buf("kv", p, n, i) for p, n, i in zip(args.kv_data_ptrs, args.kv_data_lens, args.kv_item_lens)]
    out += [Buf("aux", p, n, i) for p, n, i in zip(args.aux_data_ptrs, args.aux_data_lens, args.aux_item_lens)]
    for c, (ptrs, lens, items) in enumerate(zip(args.state_data_ptrs, args.state_data_lens, args.state_item_lens)):
        dims = list(args.state_dim_per_tensor[c]) or [0] * len(ptrs)
        subs = list(args.state_conv_shard_groups[c]) or [None] * len(ptrs)
        out += [Buf(f"state{c}", p, n, i, int(d), tuple(g or ()))
                for p, n, i, d, g in zip(ptrs, lens, items, dims, subs)]
    return out


def fill(bufs: list[Buf], seed: int) -> None:
    rng = np.random.default_rng(seed)
    for b in bufs:
        v = b.view()
        v[...] = rng.integers(0, 256, size=v.shape, dtype=np.uint8)


def capacities(bufs: list[Buf]) -> dict[str, int]:
    """Slots addressable in each index space: an index addresses every entry of its group."""
    caps: dict[str, int] = {}
    for b in bufs:
        caps[b.group] = min(caps.get(b.group, 1 << 62), b.nbytes // b.item)
    return caps


def requests(caps: dict[str, int], n: int, seed: int, pages_per_req: int) -> list[dict[str, Any]]:
    """``n`` requests: random source pages (may repeat across requests), distinct destination pages per
    index space, and the top page of every space used on both sides by some request."""
    rng = np.random.default_rng(seed)
    groups = [g for g in caps if g != "aux"]
    per = {g: pages_per_req if g == "kv" else 1 for g in groups}
    dst = {g: rng.permutation(np.arange(caps[g]))[: n * per[g]] for g in groups}
    for g in groups:  # the highest page of every space is some request's destination...
        if caps[g] - 1 not in dst[g]:
            dst[g][rng.integers(len(dst[g]))] = caps[g] - 1
    reqs = []
    for i in range(n):
        src = {g: rng.integers(0, caps[g], per[g]) for g in groups}
        reqs.append({"room": 1000 + i, "src": {g: v.tolist() for g, v in src.items()},
                     "dst": {g: dst[g][i * per[g]:(i + 1) * per[g]].tolist() for g in groups},
                     "aux_src": i % AUX_SLOTS, "aux_dst": AUX_SLOTS - 1 - i % AUX_SLOTS})
    for g in groups:  # ...and its source
        reqs[int(rng.integers(n))]["src"][g][0] = caps[g] - 1
    return reqs


# Decode-side prefixes (``cfg["prefix"]``): what decode's radix cache already holds of a request. Its pages
# hold SENTINEL beforehand and must keep it. SGLang's payloads then cover only what decode lacks: the KV
# pages and the DSA index pages past the prefix, the SWA window past it, request state whole.
SENTINEL = 0xA5
SWA_WINDOW_PAGES = 2
TOKEN_PAGED = ("kv", "dsa")            # index spaces of token pages: a prefix holds their leading pages
WINDOWED = ("swa", "block_scale_swa")  # the last SWA_WINDOW_PAGES pages, cut at the prefix
PAST = 2                               # a request past the request claims this many pages beyond it


def group_types(args: Any) -> dict[str, str]:
    """Each index space of ``buffers(args)`` and what SGLang calls it (the KV entries: ``kv``)."""
    types = {"kv": "kv"}
    for c, st in enumerate(args.state_types):
        types[f"state{c}"] = str(getattr(st, "value", st))
    return types


def sent_pages(whole: list[int], kind: str, prefix: int, num_pages: int) -> list[int]:
    """What SGLang lists for one index space of a request of ``num_pages`` pages past a prefix of ``prefix``
    pages (prefill.py / decode.py ``_send_kv_chunk``/``_send_kv_metadata`` payloads): ``whole`` holds the
    request's page per position (token pages, the SWA window), or its state slots."""
    if kind in TOKEN_PAGED:
        return whole[prefix:]
    if kind in WINDOWED:
        return whole[max(prefix, num_pages - SWA_WINDOW_PAGES):]
    return whole


def request_shape(i: int, past_every: int = 0, full_every: int = 0) -> tuple[int, int]:
    """Request ``i``'s (pages, prefix pages decode claims): 3 to 5 pages, a prefix of none, one page or all
    but one page in turn; every ``past_every``-th claims PAST pages beyond the request, every
    ``full_every``-th holds all of it (SGLang's full radix hit: only aux and request state move)."""
    num_pages = 3 + (i // 3) % 3
    if past_every and i % past_every == past_every - 1:
        return num_pages, num_pages + PAST
    if full_every and i % full_every == full_every - 1:
        return num_pages, num_pages
    return num_pages, (0, 1, num_pages - 1)[i % 3]


def prefix_requests(caps: dict[str, int], types: dict[str, str], n: int, seed: int,
                    past_every: int = 0, full_every: int = 0) -> list[dict[str, Any]]:
    """``n`` requests with decode prefixes (``request_shape``). Decode's prefix pages come from a shared set
    of cached pages (its radix cache: many requests share them); every page decode receives is distinct
    and outside that set; source pages are random; the top page of every index space is some request's
    destination and some request's source."""
    rng = np.random.default_rng(seed)
    groups = [g for g in caps if g != "aux"]
    shapes = [request_shape(i, past_every, full_every) for i in range(n)]
    held_max = max(p for _, p in shapes)
    cached = {g: rng.permutation(caps[g] - 1)[:held_max] for g in groups if types[g] in TOKEN_PAGED}
    reqs = []
    for i, (num_pages, prefix) in enumerate(shapes):
        whole = {g: rng.integers(0, caps[g], num_pages if types[g] in TOKEN_PAGED + WINDOWED else 1).tolist()
                 for g in groups}
        reqs.append({"room": 1000 + i, "pages": num_pages, "prefix": prefix, "whole": whole,
                     "held": {g: rng.choice(c, prefix, replace=False).tolist() for g, c in cached.items()},
                     "src": {g: sent_pages(whole[g], types[g], prefix, num_pages) for g in groups},
                     "aux_src": i % AUX_SLOTS, "aux_dst": AUX_SLOTS - 1 - i % AUX_SLOTS})
    for g in groups:
        free = np.setdiff1d(np.arange(caps[g]), cached.get(g, []))
        need = sum(len(r["src"][g]) for r in reqs)
        if need > len(free):
            raise ValueError(f"index space {g}: {need} destination pages needed, {len(free)} free")
        dst = rng.permutation(free)[:need]
        if caps[g] - 1 not in dst and need:
            dst[rng.integers(need)] = caps[g] - 1
        at = 0
        for r in reqs:
            r.setdefault("dst", {})[g] = dst[at:at + len(r["src"][g])].tolist()
            at += len(r["src"][g])
        live = [r for r in reqs if r["src"][g]]
        if live:   # the top page as a source: the request's last position, sent whatever the prefix
            r = live[int(rng.integers(len(live)))]
            r["whole"][g][-1] = r["src"][g][-1] = caps[g] - 1
    return reqs


def hold_prefixes(bufs: list[Buf], reqs: list[dict[str, Any]]) -> None:
    """Decode's cached prefix pages: SENTINEL in every byte, which no transfer may change."""
    for b in bufs:
        held = sorted({p for r in reqs for p in r.get("held", {}).get(b.group, [])})
        if held:
            b.view()[held] = SENTINEL


def state_list(args: Any, pages: dict[str, list[int]]) -> list[list[int] | None]:
    return [pages.get(f"state{c}") for c in range(len(args.state_types))]


def host_memory_shim() -> None:
    """SGLang's NIXL backend registers and addresses state buffers (and some descriptor lists) as VRAM
    whatever their memory kind; on a machine without a GPU, UCX refuses that (NIXL_ERR_BACKEND). For the
    comparison only, map VRAM to DRAM in this process's NIXL agent: on GPU boxes those buffers are VRAM
    and nothing changes; here it lets SGLang's own address arithmetic run on host memory."""
    from nixl._api import nixl_agent

    def dram(value: Any) -> Any:
        return "DRAM" if value == "VRAM" else value

    for name in ("register_memory", "deregister_memory", "get_xfer_descs", "get_reg_descs", "prep_xfer_dlist"):
        original = getattr(nixl_agent, name)

        def wrapped(self: Any, *a: Any, _original: Any = original, **kw: Any) -> Any:
            return _original(self, *[dram(x) if isinstance(x, str) else x for x in a],
                             **{k: dram(v) if isinstance(v, str) else v for k, v in kw.items()})

        setattr(nixl_agent, name, wrapped)


def make_manager(cfg: dict[str, Any], role: str, args: Any) -> tuple[Any, Any]:
    from sglang.srt.disaggregation import utils as dutils
    from sglang.srt.plugins import load_plugins
    from sglang.srt.runtime_context import get_context

    load_plugins()
    if cfg["backend"] == "nixl" and cfg.get("host_shim", True):
        host_memory_shim()
    if cfg["backend"] == "mooncake":
        # SGLang's mooncake manager takes the process's shared engine, which its distributed bootstrap
        # creates (sglang.srt.distributed.bootstrap) before any manager: created here the same way.
        from sglang.srt.distributed.device_communicators.mooncake_transfer_engine import (
            init_mooncake_transfer_engine,
        )

        init_mooncake_transfer_engine(hostname="127.0.0.1", gpu_id=0, ib_device=None)
    backend = dutils.TransferBackend(cfg["backend"])
    mode = dutils.DisaggregationMode.PREFILL if role == "prefill" else dutils.DisaggregationMode.DECODE
    server = None
    if role == "prefill" and cfg.get("rank", 0) == 0:
        server = dutils.get_kv_class(backend, dutils.KVClassType.BOOTSTRAP_SERVER)("127.0.0.1", cfg["port"])
        _wait_listening(cfg["port"])
    is_mla = not is_mha(cfg.get(f"{role}_pool", cfg["pool"]))
    mgr = dutils.get_kv_class(backend, dutils.KVClassType.MANAGER)(args, mode, get_context().server_args, is_mla)
    return mgr, server


def _wait_listening(port: int, timeout: float = 10.0) -> None:
    """The bootstrap server starts on a thread; a manager registering before it listens waits out SGLang's
    1 s retry delay, a second per case."""
    import socket

    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            socket.create_connection(("127.0.0.1", port), timeout=0.5).close()
            return
        except OSError:
            time.sleep(0.01)


def run_prefill(cfg: dict[str, Any], mgr: Any, args: Any, reqs: list[dict[str, Any]]) -> dict[str, Any]:
    from sglang.srt.disaggregation import utils as dutils
    from sglang.srt.disaggregation.base.conn import KVPoll

    cls = dutils.get_kv_class(dutils.TransferBackend(cfg["backend"]), dutils.KVClassType.SENDER)
    addr = f"127.0.0.1:{cfg['port']}"
    senders = {r["room"]: cls(mgr, addr, r["room"]) for r in reqs}
    for r in reqs:
        _bind_sender(cfg, senders[r["room"]], args, r)
    sent: set[int] = set()
    done: dict[int, Any] = {}
    metrics: dict[str, list[Any]] = {}
    start = time.perf_counter()
    chunk = cfg.get("chunk_pages", 1)
    popped: dict[str, int | None] = {}
    while len(done) < len(reqs) and time.perf_counter() - start < cfg.get("deadline", DEADLINE):
        for r in reqs:
            room, s = r["room"], senders[r["room"]]
            if room in done:
                continue
            state = s.poll()
            if state == KVPoll.WaitingForInput and room not in sent and \
                    cfg.get("prefill_abort_every") and (room - 1000) % cfg["prefill_abort_every"] == 1:
                s.abort()  # e.g. the prefill scheduler aborted the request before its forward pass
                sent.add(room)
            elif state == KVPoll.WaitingForInput and room not in sent:
                popped[str(room)] = (_send_tokens if "tokens" in r else _send_request)(s, args, r, chunk)
                sent.add(room)
                if cfg.get("die_after") and len(sent) >= cfg["die_after"]:
                    # A prefill crash with writes in flight: decode must fail what did not finish.
                    print(json.dumps({"role": "prefill", "died_after": len(sent)}), flush=True)
                    os._exit(1)
            elif state in (KVPoll.Success, KVPoll.Failed):
                done[room] = _outcome(s, state)
                metric = s.get_transfer_metric()
                metrics[str(room)] = [metric.transfer_total_bytes, metric.transfer_latency_s]
        time.sleep(0.001)
    return {"role": "prefill", "outcomes": {str(k): v for k, v in done.items()},
            "seconds": time.perf_counter() - start, "metrics": metrics, "popped": popped}


def _send_request(s: Any, args: Any, r: dict[str, Any], chunk: int) -> int | None:
    """SGLang's prefill for one bootstrapped request: ``init`` and one ``send`` per chunk, state with the
    last. With a decode prefix (``r["prefix"]``) as its scheduler does it (prefill.py ``finalize_bootstrap``,
    ``_send_kv_chunk``): the prefix popped from the sender, ``init`` with the pages after it, the sends
    starting there (``start_send_idx``), every list cut by the popped prefix; nothing sent when it runs
    past the request. Returns the popped prefix in tokens (None without one)."""
    if "prefix" not in r:
        kv = np.asarray(r["src"]["kv"], dtype=np.int32)
        s.init(len(kv), r["aux_src"])
        for k in range(0, len(kv), chunk):  # chunked prefill: one send per chunk
            last = k + chunk >= len(kv)
            s.send(kv[k:k + chunk], state_list(args, r["src"]) if last else None)
        return None
    page, types = int(args.page_size), group_types(args)
    popped, tokens = int(s.pop_decode_prefix_len()), r["pages"] * int(args.page_size)
    s.init(-(-(tokens - popped) // page), r["aux_src"])   # kv_to_page_num(len(input) - prefix)
    if popped > tokens:
        return popped                                     # start_send_idx > end_idx: SGLang sends nothing
    src = {g: sent_pages(whole, types[g], popped // page, r["pages"]) for g, whole in r["whole"].items()}
    kv = np.asarray(src["kv"], dtype=np.int32)
    for k in range(0, max(len(kv), 1), chunk):   # a prefix covering every page: one send, state only
        last = k + chunk >= len(kv)
        s.send(kv[k:k + chunk], state_list(args, src) if last else None)
    return popped


# Token bindings (``cfg["bind"]``, issue 31): each room's request has its own input ids (``room_tokens``);
# both sides bind them as the plugin does (``bind_tokens``). ``cfg["crossed"]``: pairs of rooms whose
# metadata decode crossed: decode's request holding room a's prompt announces room b, and b's announces a.
# ``cfg["unbound_decode"]``: decode binds nothing (the negative control: the crossed rooms are served).
def room_tokens(room: int, pages: int, page_size: int) -> list[int]:
    """The input ids of room ``room``'s request: ``pages`` KV pages, the last one partial."""
    return np.random.default_rng(room).integers(3, 1000, pages * page_size - 1).tolist()


def _input_ids(room: int, r: dict[str, Any], pages: int, page_size: int) -> list[int]:
    """Room ``room``'s input ids: ``room_tokens``, or between page sizes the request's ``tokens`` of them."""
    if "tokens" in r:
        return np.random.default_rng(room).integers(3, 1000, r["tokens"]).tolist()
    return room_tokens(room, pages, page_size)


def _bind_sender(cfg: dict[str, Any], s: Any, args: Any, r: dict[str, Any]) -> None:
    if cfg.get("bind"):
        s.bind_tokens(_input_ids(r["room"], r, len(r["src"]["kv"]), int(args.page_size)), f"prefill-req-{r['room']}")


def _bind_receiver(cfg: dict[str, Any], rec: Any, args: Any, r: dict[str, Any]) -> None:
    if not cfg.get("bind") or cfg.get("unbound_decode"):
        return
    owner = r["room"]
    for a, b in cfg.get("crossed", ()):
        owner = b if owner == a else a if owner == b else owner
    rec.bind_tokens(_input_ids(owner, r, len(r["dst"]["kv"]), int(args.page_size)), f"decode-req-{owner}")


def _outcome(obj: Any, state: Any) -> str:
    from sglang.srt.disaggregation.base.conn import KVPoll

    if state == KVPoll.Success:
        return "ok"
    try:
        obj.failure_exception()
    except Exception as exc:  # SGLang raises KVTransferError: its text is what a user sees
        return f"failed: {exc}"
    return "failed"


def run_decode(cfg: dict[str, Any], mgr: Any, args: Any, reqs: list[dict[str, Any]]) -> dict[str, Any]:
    from sglang.srt.disaggregation import utils as dutils
    from sglang.srt.disaggregation.base.conn import KVPoll

    addr = f"127.0.0.1:{cfg['port']}"
    t0 = time.perf_counter()
    try:
        while not mgr.try_ensure_parallel_info(addr):
            if time.perf_counter() - t0 > 60:
                raise SystemExit("prefill never registered")
            time.sleep(0.1)
    except RuntimeError as exc:   # SGLang's own checks (its page size, dtype): raised in its decode scheduler
        return {"role": "decode", "refused": f"{type(exc).__name__}: {exc}"}
    cls = dutils.get_kv_class(dutils.TransferBackend(cfg["backend"]), dutils.KVClassType.RECEIVER)
    receivers = {r["room"]: cls(mgr, addr, r["room"]) for r in reqs}
    for r in reqs:
        _bind_receiver(cfg, receivers[r["room"]], args, r)
    for rec in receivers.values():
        rec.init(0)
    announced: set[int] = set()
    done: dict[int, str] = {}
    start = time.perf_counter()
    first_announce: dict[int, float] = {}
    latency: dict[int, float] = {}
    while len(done) < len(reqs) and time.perf_counter() - start < cfg.get("deadline", DEADLINE):
        for r in reqs:
            room, rec = r["room"], receivers[r["room"]]
            if room in done:
                continue
            state = rec.poll()
            if state == KVPoll.WaitingForInput and room not in announced:
                first_announce[room] = time.perf_counter()
                kv = r["dst"]["kv"]
                if cfg.get("claim_none"):   # a decode that lets its held prefix be written (the check's control)
                    kv = r["held"]["kv"] + kv
                rec.send_metadata(np.asarray(kv, dtype=np.int32), r["aux_dst"], state_list(args, r["dst"]),
                                  **_prefix_kwargs(cfg, args, r))
                announced.add(room)
                if cfg.get("abort_every") and (room - 1000) % cfg["abort_every"] == 0:
                    rec.abort()  # the client went away after decode published its pages
            elif state in (KVPoll.Success, KVPoll.Failed):
                done[room] = _outcome(rec, state)
                latency[room] = time.perf_counter() - first_announce.get(room, start)
        time.sleep(0.001)
    elapsed = time.perf_counter() - start
    return {"role": "decode", "outcomes": {str(k): v for k, v in done.items()}, "seconds": elapsed,
            "mean_latency_s": float(np.mean(list(latency.values()))) if latency else None}


# Different page sizes (``cfg["pages"]``: [Ts, Td], prefill's and decode's): each request has ``tokens``
# tokens, prefill's pages at Ts (``whole``: the page of every position) and decode's at Td past a prefix of
# ``prefix`` decode pages (every third request none, a third some, a third all but its last partial page).
# Both sides draw the same requests from the seed.
def page_capacity(page: int) -> int:
    return PAGED_TOKENS // page   # SGLang allocates one page more (its padding page): not used here


def token_requests(cfg: dict[str, Any], n: int, seed: int) -> list[dict[str, Any]]:
    ts, td = cfg["pages"]
    rng = np.random.default_rng(seed)
    reqs = []
    for i in range(n):
        tokens = int(rng.integers(1, MAX_REQUEST_TOKENS + 1))
        most = (tokens - 1) // td if cfg.get("prefix") else 0   # decode's radix match stops before the last token
        prefix = (0, most // 2, most)[i % 3]
        reqs.append({"room": 1000 + i, "tokens": tokens, "prefix": prefix,
                     "whole": rng.integers(0, page_capacity(ts), -(-tokens // ts)).tolist(),
                     "aux_src": i % AUX_SLOTS, "aux_dst": AUX_SLOTS - 1 - i % AUX_SLOTS})
    need = sum(-(-r["tokens"] // td) - r["prefix"] for r in reqs)
    dst = rng.permutation(page_capacity(td))[:need]
    if len(dst) < need:
        raise ValueError(f"{need} destination pages of {td} tokens needed, {len(dst)} in the pool")
    at = 0
    for r in reqs:
        k = -(-r["tokens"] // td) - r["prefix"]
        r["dst"], at = {"kv": dst[at:at + k].tolist()}, at + k
        r["src"] = {"kv": r["whole"]}
    return reqs


def _send_tokens(s: Any, args: Any, r: dict[str, Any], chunk: int) -> int:
    """SGLang's prefill for one request between page sizes (prefill.py ``finalize_bootstrap``,
    ``_send_kv_chunk``): the prefix popped, ``init`` with ``kv_to_page_num(len - popped)``, the pages of the
    tokens from ``popped`` on (``kv_to_page_indices``: the page of every Ts-th token) in chunks. Returns
    the popped prefix."""
    page = int(args.page_size)
    popped = int(s.pop_decode_prefix_len())
    s.init(-(-(r["tokens"] - popped) // page), r["aux_src"])
    kv = np.asarray(r["whole"], dtype=np.int32)[np.arange(popped, r["tokens"], page) // page]
    for k in range(0, max(len(kv), 1), chunk):
        s.send(kv[k:k + chunk], [] if k + chunk >= len(kv) else None)
    return popped


def check_tokens(bufs: list[Buf], cfg: dict[str, Any], reqs: list[dict[str, Any]],
                 outcomes: dict[str, str]) -> dict[str, Any]:
    """Between page sizes, token by token: in every KV entry, each token decode leased past its prefix and
    prefill's pages reach holds that token's row of prefill's page (``[page * Ts + t][heads][dim]``); aux pages
    whole; every other row of decode's memory its own fill. Tokens of failed requests are not judged."""
    import torch

    ts, td = cfg["pages"]
    aux = torch.zeros(AUX_SLOTS, AUX_ITEM, dtype=torch.uint8)
    src_shapes = [Buf(b.group, 0, b.nbytes, b.item)
                  for b in buffers(build_kv_args(build_pool(cfg["pool"], 1, ts), aux))]
    src_fills = _fills(src_shapes, fill_seed(cfg, "prefill", 0))
    before = _fills(bufs, fill_seed(cfg, "decode", 0))
    report: dict[str, Any] = {"tokens_checked": 0, "rows_checked": 0, "bytes_checked": 0, "num_bad_rows": 0,
                              "bad_rows": []}
    for bi, b in enumerate(bufs):
        per = td if b.group == "kv" else 1
        got = b.view().reshape(-1, b.item // per)
        expect = before[bi].reshape(len(got), -1).copy()
        src = src_fills[bi].reshape(-1, src_shapes[bi].item // (ts if b.group == "kv" else 1))
        for r in reqs:
            if outcomes.get(str(r["room"])) != "ok":
                continue
            if b.group == "aux":
                expect[r["aux_dst"]] = src[r["aux_src"]]
                continue
            t = np.arange(r["prefix"] * td, min(len(r["whole"]) * ts, (r["prefix"] + len(r["dst"]["kv"])) * td))
            dst_rows = np.asarray(r["dst"]["kv"])[t // td - r["prefix"]] * td + t % td
            expect[dst_rows] = src[np.asarray(r["whole"])[t // ts] * ts + t % ts]
            report["tokens_checked"] += len(t)
        bad = np.flatnonzero(np.any(got != expect, axis=1))
        report["num_bad_rows"] += len(bad)
        report["bad_rows"] += [{"buffer": bi, "row": int(x)} for x in bad[:3]]
        report["rows_checked"] += len(got)
        report["bytes_checked"] += got.size
    return report


# Failure propagation (``cfg["faults"]``, issue 26): room ``1000 + i`` fails at step FAULT_STEPS[i % 8], on
# decode (d_*) or prefill (p_*); each side notes the wall time it failed a room and the time its poll first
# said Failed (one host, so the two processes' clocks agree).
FAULT_STEPS = ("ok", "d_before", "d_refused", "d_after", "d_mid", "p_before", "p_waiting", "p_mid")
FREED_WAIT = 5.0   # how long a side waits after its last room for its endpoint to hold nothing


def fault_of(room: int) -> str:
    return FAULT_STEPS[(room - 1000) % len(FAULT_STEPS)]


def _send_first(s: Any, r: dict[str, Any]) -> None:
    """``init`` and the first of the request's one-page chunks: the transfer has started, and stays open."""
    kv = np.asarray(r["src"]["kv"], dtype=np.int32)
    s.init(len(kv), r["aux_src"])
    s.send(kv[:1], None)


def _wait_freed(counts: Any) -> dict[str, int]:
    """``counts()`` once all its figures are 0, or as they are after FREED_WAIT."""
    deadline = time.monotonic() + FREED_WAIT
    while any((now := counts()).values()) and time.monotonic() < deadline:
        time.sleep(0.01)
    return now


def run_prefill_faults(cfg: dict[str, Any], mgr: Any, args: Any, reqs: list[dict[str, Any]]) -> dict[str, Any]:
    """SGLang's prefill loop with the failures of FAULT_STEPS: p_before aborts a room before decode
    announced it (once decode announced another: connected, a peer to tell, and polling), p_waiting after
    decode announced it, p_mid
    50 ms after its first chunk; d_mid rooms send one chunk and wait for decode's abort."""
    from sglang.srt.disaggregation import utils as dutils
    from sglang.srt.disaggregation.base.conn import KVPoll

    cls = dutils.get_kv_class(dutils.TransferBackend(cfg["backend"]), dutils.KVClassType.SENDER)
    senders = {r["room"]: cls(mgr, f"127.0.0.1:{cfg['port']}", r["room"]) for r in reqs}
    done: dict[int, str] = {}
    failed_at: dict[int, float] = {}
    seen: dict[int, float] = {}
    sent_at: dict[int, float] = {}
    early_done = False
    start = time.perf_counter()
    while len(done) < len(reqs) and time.perf_counter() - start < cfg.get("deadline", DEADLINE):
        if sent_at and not early_done:   # decode announced a room, so it is in its poll loop: fail p_before
            early_done = True
            for r in reqs:
                if fault_of(r["room"]) == "p_before":
                    failed_at[r["room"]] = time.time()
                    senders[r["room"]].abort()
        for r in reqs:
            room, s, step = r["room"], senders[r["room"]], fault_of(r["room"])
            if room in done:
                continue
            state = s.poll()
            if state in (KVPoll.Success, KVPoll.Failed):
                seen[room] = time.time()
                done[room] = _outcome(s, state)
                s.clear()   # what SGLang's prefill does with a concluded sender
            elif state == KVPoll.WaitingForInput and room not in sent_at:
                sent_at[room] = time.time()
                if step == "p_waiting":
                    failed_at[room] = sent_at[room]
                    s.abort()
                elif step in ("p_mid", "d_mid"):
                    _send_first(s, r)
                else:
                    _send_request(s, args, r, 1)
            elif step == "p_mid" and room not in failed_at and time.time() - sent_at.get(room, 1e18) > 0.05:
                failed_at[room] = time.time()
                s.abort()
        time.sleep(0.001)
    endpoint = mgr.prefill_endpoint
    freed = _wait_freed(lambda: {k: v for k, v in endpoint.counters().items() if k in
                                 ("live_requests", "live_handles", "source_holds")})
    tables = {name: len(getattr(mgr, name)) for name in
              ("request_status", "failure_records", "transfer_infos", "req_to_decode_prefix_len")}
    return {"role": "prefill", "outcomes": {str(k): v for k, v in done.items()}, "failed_at": failed_at,
            "seconds": time.perf_counter() - start,
            "seen_failed": seen, "freed": freed, "tables": tables,
            "heartbeat_interval": mgr.kvferry_options.heartbeat_interval}


def run_decode_faults(cfg: dict[str, Any], mgr: Any, args: Any, reqs: list[dict[str, Any]]) -> dict[str, Any]:
    """SGLang's decode loop with the failures of FAULT_STEPS: d_before aborts a room after ``init``, before
    ``send_metadata``; d_refused passes a page list kvferry refuses (a repeated page); d_after aborts right
    after ``send_metadata``; d_mid once the room is Transferring. p_before rooms are held unannounced (a
    decode waiting for memory) until they fail."""
    from sglang.srt.disaggregation import utils as dutils
    from sglang.srt.disaggregation.base.conn import KVPoll

    addr = f"127.0.0.1:{cfg['port']}"
    start = time.perf_counter()
    while not mgr.try_ensure_parallel_info(addr):
        if time.perf_counter() - start > 60:
            raise SystemExit("prefill never registered")
        time.sleep(0.1)
    cls = dutils.get_kv_class(dutils.TransferBackend(cfg["backend"]), dutils.KVClassType.RECEIVER)
    receivers = {r["room"]: cls(mgr, addr, r["room"]) for r in reqs}
    for r in reqs:
        _bind_receiver(cfg, receivers[r["room"]], args, r)
    for rec in receivers.values():
        rec.init(0)
    done: dict[int, str] = {}
    failed_at: dict[int, float] = {}
    seen: dict[int, float] = {}
    announced: set[int] = set()
    while len(done) < len(reqs) and time.perf_counter() - start < cfg.get("deadline", DEADLINE):
        for r in reqs:
            room, rec, step = r["room"], receivers[r["room"]], fault_of(r["room"])
            if room in done:
                continue
            state = rec.poll()
            if state in (KVPoll.Success, KVPoll.Failed):
                seen[room] = time.time()
                done[room] = _outcome(rec, state)
                rec.clear()   # what SGLang's decode does with a concluded receiver
            elif state == KVPoll.WaitingForInput and room not in announced and step != "p_before":
                announced.add(room)
                kv = r["dst"]["kv"]
                if step == "d_before":
                    failed_at[room] = time.time()
                    rec.abort()
                    continue
                if step == "d_refused":
                    kv, failed_at[room] = [kv[0]] * len(kv), time.time()
                rec.send_metadata(np.asarray(kv, dtype=np.int32), r["aux_dst"], state_list(args, r["dst"]))
                if step == "d_after":
                    failed_at[room] = time.time()
                    rec.abort()
            elif state == KVPoll.Transferring and step == "d_mid" and room not in failed_at:
                failed_at[room] = time.time()
                rec.abort()
        time.sleep(0.001)
    endpoint = mgr.decode_endpoint
    freed = _wait_freed(lambda: {"leased_pages": endpoint.num_leased_pages, "live_leases": endpoint.num_live_leases,
                                 "quarantined_pages": endpoint.num_quarantined_pages})
    tables = {name: len(getattr(mgr, name)) for name in
              ("request_status", "failure_records", "required_prefill_response_num_table",
               "prefill_response_tracker")}
    tables["addr_to_rooms_tracker"] = sum(len(v) for v in mgr.addr_to_rooms_tracker.values())
    return {"role": "decode", "outcomes": {str(k): v for k, v in done.items()}, "failed_at": failed_at,
            "seconds": time.perf_counter() - start,
            "seen_failed": seen, "freed": freed, "tables": tables,
            "heartbeat_interval": mgr.kvferry_options.heartbeat_interval}


def _prefix_kwargs(cfg: dict[str, Any], args: Any, r: dict[str, Any]) -> dict[str, int]:
    """``decode_prefix_len`` as SGLang's decode passes it (tokens); every ``unaligned_every``-th request
    one token more than its whole pages."""
    if "tokens" in r:
        return {"decode_prefix_len": r["prefix"] * int(args.page_size)}
    if "prefix" not in r or cfg.get("claim_none"):
        return {}
    extra = cfg.get("unaligned_every") and (r["room"] - 1000) % cfg["unaligned_every"] == 1
    return {"decode_prefix_len": r["prefix"] * int(args.page_size) + int(bool(extra))}


def _fills(shapes: list[Buf], seed: int) -> list[np.ndarray]:
    """What ``fill`` wrote into buffers of these shapes from ``seed``, regenerated."""
    rng = np.random.default_rng(seed)
    return [rng.integers(0, 256, size=(b.nbytes // b.item, b.item), dtype=np.uint8) for b in shapes]


def _prefill_shapes(cfg: dict[str, Any], bufs: list[Buf]) -> list[Buf]:
    """The buffers of a prefill rank: decode's own shapes, except an MHA pool's, which hold a prefill
    rank's share of the heads (rebuilt here from SGLang's pool at prefill's TP size)."""
    kind = cfg.get("prefill_pool", cfg["pool"])
    if not is_mha(kind):
        return [Buf(b.group, 0, b.nbytes, b.item) for b in bufs]
    import torch

    aux = torch.zeros(AUX_SLOTS, AUX_ITEM, dtype=torch.uint8)
    args = build_kv_args(build_pool(kind, tp_of(cfg, "prefill")), aux)
    return [Buf(b.group, 0, b.nbytes, b.item) for b in buffers(args)]


class Sources:
    """The bytes each destination page of a decode rank must hold, from the prefill ranks' seeded fills:
    whole pages from ``src_rank`` (MLA pools, aux, state), and for an MHA pool's KV entries every token
    row assembled head by head from the prefill rank that holds each head."""

    def __init__(self, cfg: dict[str, Any], bufs: list[Buf], rank: int) -> None:
        self.cfg, self.rank, self.mha = cfg, rank, is_mha(cfg.get("prefill_pool", cfg["pool"]))
        shapes = _prefill_shapes(cfg, bufs)
        ranks = range(tp_of(cfg, "prefill")) if self.mha else [src_rank(cfg, rank)]
        self.fills = {r: _fills(shapes, fill_seed(cfg, "prefill", r)) for r in ranks}

    def pages(self, bi: int, b: Buf, src_page: int) -> list[np.ndarray]:
        """What the page may hold: one candidate, or (``aux_any_rank``: SGLang's nixl writes aux from every
        prefill rank of an MHA pair, whose aux is identical in real serving but not in these per-rank
        fills) any prefill rank's aux page."""
        if self.mha and b.group == "aux" and self.cfg.get("aux_any_rank"):
            return [fills[bi][src_page] for fills in self.fills.values()]
        return [self.page(bi, b, src_page)]

    def page(self, bi: int, b: Buf, src_page: int) -> np.ndarray:
        if b.dim and tp_of(self.cfg, "prefill") != tp_of(self.cfg, "decode"):
            return self.state_page(bi, b, src_page)
        if not (self.mha and b.group == "kv"):
            return self.fills[src_rank(self.cfg, self.rank)][bi][src_page]
        dst_heads = MHA_KV_HEADS // tp_of(self.cfg, "decode")
        src_heads = MHA_KV_HEADS // tp_of(self.cfg, "prefill")
        head_bytes = b.item // MHA_PAGE // dst_heads
        rows = np.empty((MHA_PAGE, dst_heads, head_bytes), dtype=np.uint8)
        for j in range(dst_heads):
            g = self.rank * dst_heads + j   # the model-wide head: prefill rank g // src_heads holds it
            src = self.fills[g // src_heads][bi][src_page].reshape(MHA_PAGE, src_heads, head_bytes)
            rows[:, j] = src[:, g % src_heads]
        return rows.reshape(-1)

    def state_page(self, bi: int, b: Buf, src_page: int) -> np.ndarray:
        """A mamba slot channel by channel: each of the decode rank's channels of each sub-block (the whole
        axis when there are none) from the prefill rank holding that model-wide channel, at its place there.
        A Mamba2 conv's B and C with one group are the same channels on every rank: decode's come from
        ``src_rank`` (kvferry's ``replica_source``), at their place in its slot."""
        ptp, dtp = tp_of(self.cfg, "prefill"), tp_of(self.cfg, "decode")
        cb = b.item // b.dim
        kind = self.cfg["pool"]
        subs = mamba2_conv_subs(kind, b.dim, dtp) if kind in MAMBA2_GROUPS else None
        if subs is None:
            subs = tuple((full, True) for full in b.subs or (b.dim * dtp,))
        out, src_base = [], 0
        for full, sharded in subs:
            dsub, psub = (full // dtp, full // ptp) if sharded else (full, full)
            for j in range(dsub):
                g = self.rank * dsub + j if sharded else j
                rank = g // psub if sharded else src_rank(self.cfg, self.rank)
                at = (src_base + g % psub) * cb
                out.append(self.fills[rank][bi][src_page][at:at + cb])
            src_base += psub
        return np.concatenate(out)


def check_bytes(bufs: list[Buf], cfg: dict[str, Any], reqs: list[dict[str, Any]],
                outcomes: dict[str, str], rank: int = 0) -> dict[str, Any]:
    """Every destination page of every buffer against what it must hold (``Sources``: regenerated from the
    seeds of the prefill ranks that must write this decode rank), every other page against decode's own
    fill. Pages of failed requests are not judged (``cfg["failed_untouched"]``: they must hold decode's own
    fill, as the other pages). The prefix pages decode held (``hold_prefixes``) must
    still hold SENTINEL whatever became of the requests: ``num_held_changed`` counts those that do not."""
    sources = Sources(cfg, bufs, rank)
    before = _fills(bufs, fill_seed(cfg, "decode", rank))
    report: dict[str, Any] = {"pages_checked": 0, "bytes_checked": 0, "bad_pages": [], "touched_elsewhere": [],
                              "held_pages": 0, "num_held_changed": 0}
    for bi, b in enumerate(bufs):
        got = b.view()
        expect = before[bi].copy()
        held = np.array(sorted({p for r in reqs for p in r.get("held", {}).get(b.group, [])}), dtype=np.int64)
        expect[held] = SENTINEL
        report["held_pages"] += len(held)
        report["num_held_changed"] += int(np.any(got[held] != SENTINEL, axis=1).sum()) if len(held) else 0
        judged = np.zeros(len(got), dtype=bool)
        for r in reqs:
            ok = outcomes.get(str(r["room"])) == "ok"
            pairs = [(r["aux_src"], r["aux_dst"])] if b.group == "aux" else \
                list(zip(r["src"].get(b.group, []), r["dst"].get(b.group, [])))
            for s, d in pairs:
                if ok:
                    candidates = sources.pages(bi, b, s)
                    expect[d] = next((c for c in candidates if np.array_equal(got[d], c)), candidates[0])
                judged[d] = judged[d] or not (ok or cfg.get("failed_untouched"))
        judged[held] = True   # counted above, as num_held_changed
        mismatched = np.flatnonzero(np.any(got != expect, axis=1) & ~judged)
        dst_pages = {d for r in reqs for d in (r["dst"].get(b.group, []) if b.group != "aux" else [r["aux_dst"]])}
        for p in mismatched:
            where = report["bad_pages"] if int(p) in dst_pages else report["touched_elsewhere"]
            if len(where) < 5:
                where.append({"buffer": bi, "group": b.group, "page": int(p), "item": b.item})
        report["num_bad_pages"] = report.get("num_bad_pages", 0) + int(sum(int(p) in dst_pages for p in mismatched))
        report["num_touched_elsewhere"] = report.get("num_touched_elsewhere", 0) + \
            int(sum(int(p) not in dst_pages for p in mismatched))
        report.setdefault("bad_pages_by_buffer", {})[str(bi)] = int(sum(int(p) in dst_pages for p in mismatched))
        report["pages_checked"] += len(got)
        report["bytes_checked"] += got.size
    return report


def preload() -> None:
    """Import what every peer imports (torch, SGLang's transfer layer, its pools, NIXL's bindings): seconds
    of CPU per process on 2 cores. tests/test_sglang.py forks its peers from a fork server that ran this
    once, so each case pays for the imports once, not once per rank process."""
    import nixl._api  # noqa: F401
    import sglang.srt.disaggregation.common.conn
    import sglang.srt.disaggregation.nixl.conn
    import sglang.srt.mem_cache.deepseek_v4_memory_pool
    import sglang.srt.mem_cache.memory_pool
    import sglang.srt.plugins  # noqa: F401
    import torch  # noqa: F401

    import kvferry.integrations.sglang.conn  # noqa: F401


def run_child(argv: list[str], out_path: str, env: dict[str, str]) -> None:
    """Entry point of a peer forked from the tests' fork server: ``main`` with ``argv``, stdout to
    ``out_path`` (the JSON report is its last line starting with ``{``), stderr to ``out_path + ".err"``."""
    os.environ.update(env)
    out = os.open(out_path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    err = os.open(out_path + ".err", os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    sys.stdout.flush()
    os.dup2(out, 1)
    os.dup2(err, 2)
    sys.argv = [__file__, *argv]
    main()


def plugin_report(cfg: dict[str, Any]) -> dict[str, Any]:
    """SGLang's ``load_plugins()`` with ``SGLANG_PLUGINS=kvferry``: where ``TransferBackend("kvferry")``
    resolves, and which classes ``get_kv_class`` returns for kvferry and for nixl."""
    from sglang.srt.arg_groups.choices import DISAGG_TRANSFER_BACKEND_CHOICES
    from sglang.srt.disaggregation import utils
    from sglang.srt.managers import disagg_service
    from sglang.srt.plugins import load_plugins

    load_plugins()
    resolves = [mod.__name__ for mod in (utils, disagg_service) if mod.TransferBackend("kvferry")]
    classes = [utils.get_kv_class(utils.TransferBackend(name), kind).__name__ for name, kind in (
        ("kvferry", utils.KVClassType.MANAGER), ("kvferry", utils.KVClassType.RECEIVER),
        ("nixl", utils.KVClassType.MANAGER))]
    from sglang.srt.disaggregation.decode import DecodePreallocQueue
    from sglang.srt.disaggregation.prefill import PrefillBootstrapQueue

    binds = [getattr(fn, "__wrapped__", None) is not None for fn in (
        PrefillBootstrapQueue.create_sender, DecodePreallocQueue._create_receiver_and_enqueue)]
    return {"role": "plugin", "classes": classes, "resolves_in": resolves,
            "in_choices": "kvferry" in DISAGG_TRANSFER_BACKEND_CHOICES, "binding_hooks": binds}


def kvargs_report(cfg: dict[str, Any]) -> dict[str, Any]:
    """The slot count of every ``kv_data`` entry of ``cfg["pool"]``'s KVArgs, and kvferry's for each."""
    import torch

    from kvferry.integrations.sglang.layout import kvargs_memory

    setup_context(cfg)
    aux = torch.zeros(AUX_SLOTS, AUX_ITEM, dtype=torch.uint8)
    args = build_kv_args(build_pool(cfg["pool"]), aux)
    memory, names = kvargs_memory(args)
    return {"role": "kvargs", "want": [n // i for n, i in zip(args.kv_data_lens, args.kv_item_lens)],
            "got": [b.num_pages for b in memory.layout.pool("kv").buffers], "states": list(names.states)}


def main() -> None:
    role, cfg = sys.argv[1], json.loads(sys.argv[2])
    checks = {"plugin": plugin_report, "kvargs": kvargs_report}
    if role in checks:
        print(json.dumps(checks[role](cfg)), flush=True)
        os._exit(0)
    rank = int(sys.argv[3]) if len(sys.argv) > 3 else 0
    cfg["rank"] = rank
    import torch

    setup_context(cfg, tp_of(cfg, role), rank, role)
    kind = cfg.get(f"{role}_pool", cfg["pool"])
    page = cfg["pages"][role == "decode"] if cfg.get("pages") else None
    pool = build_pool(kind, tp_of(cfg, role), page)
    aux = torch.zeros(AUX_SLOTS, AUX_ITEM, dtype=torch.uint8)
    heads = is_mha(kind) and (role == "prefill" or cfg.get("decode_kv_heads", False))
    args = build_kv_args(pool, aux, rank, heads)
    if cfg["backend"] == "nixl" and is_mha(kind) and cfg.get("host_shim", True):
        # SGLang's nixl refuses hetero-TP MHA into non-VRAM destinations outright; declared VRAM, its slice
        # arithmetic runs, and the shim (host_memory_shim) registers the host memory with NIXL as DRAM.
        args.kv_data_mem_kinds = ["VRAM"] * len(args.kv_data_ptrs)
    bufs = buffers(args)
    fill(bufs, fill_seed(cfg, role, rank))
    if cfg.get("pages"):
        reqs = token_requests(cfg, cfg["n"], cfg["seed"] + 7)
    elif cfg.get("prefix"):
        reqs = prefix_requests(capacities(bufs), group_types(args), cfg["n"], cfg["seed"] + 7,
                               cfg.get("past_every", 0), cfg.get("full_every", 0))
        if role == "decode":
            hold_prefixes(bufs, reqs)
    else:
        reqs = requests(capacities(bufs), cfg["n"], cfg["seed"] + 7, cfg.get("pages_per_req", 2))
    try:
        mgr, _server = make_manager(cfg, role, args)
    except Exception as exc:
        print(json.dumps({"role": role, "refused": f"{type(exc).__name__}: {exc}"}), flush=True)
        return
    if cfg.get("faults"):
        out = (run_prefill_faults if role == "prefill" else run_decode_faults)(cfg, mgr, args, reqs)
    else:
        out = run_prefill(cfg, mgr, args, reqs) if role == "prefill" else run_decode(cfg, mgr, args, reqs)
    if "refused" in out:
        print(json.dumps(out), flush=True)
        os._exit(0)
    if role == "decode":
        out["check"] = (check_tokens(bufs, cfg, reqs, out["outcomes"]) if cfg.get("pages") else
                        check_bytes(bufs, cfg, reqs, out["outcomes"], rank))
        out["capacities"] = capacities(bufs)
    out["slots"] = [b.nbytes // b.item for b in bufs]
    if cfg["backend"] == "kvferry":   # SGLang's own managers have no kvferry endpoint
        out["stats"] = mgr.endpoint.stats().to_dict()   # kvferry's endpoint stats (docs/metrics.md)
    out["rank"] = rank
    out["page_size"] = int(args.page_size)
    print(json.dumps(out), flush=True)
    if role == "prefill":
        time.sleep(cfg.get("linger", 1.0))  # let decode finish its last polls before the endpoint goes
    os._exit(0)  # SGLang's threads (bootstrap server, NIXL workers) are not daemons everywhere


if os.environ.get("KVFERRY_SGLANG_PRELOAD") == "1":   # set for the tests' fork server only
    preload()

if __name__ == "__main__":
    main()
