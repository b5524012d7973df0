"""Hybrid KV cache groups: a tiny random Gemma3 (a sliding-window layer and a full-attention layer).

With ``SupportsHMA`` vLLM keeps its hybrid KV cache manager on: the model gets two KV cache groups (one
per attention kind), each its own block table, each a kvferry pool. Full attention moves every prompt
block, the sliding window the blocks of its window. Prompt lengths include the ones where prefill has
already freed a block decode's window needs (``GroupSpec.transferable``): those decode prefills itself.
Every prompt's tokens equal one vLLM instance's. Skipped unless vLLM is importable (make test-vllm).
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("vllm", reason="vLLM is not installed (make test-vllm)")

from kvferry.integrations.vllm.layout import HYBRID_POOL, GroupSpec

from .vllm_pd import (
    BLOCK_SIZE,
    close_llm,
    greedy,
    make_llm,
    make_sessions,
    metric,
    prompt_sources,
    session_answers,
    session_prompt,
    tokens,
)

# Three more vLLM instances: marked slow, out of `make test` (make test-vllm-slow).
pytestmark = [pytest.mark.vllm, pytest.mark.slow, pytest.mark.timeout(900)]

WINDOW = 64
MAX_TOKENS = 16
# 95, 127, 159 and 351: prefill frees the block holding token N - WINDOW, which decode's recompute of the
# last prompt token reads (N - WINDOW + 1 is a multiple of the block size); the others move.
LENGTHS = (5, 33, 63, 64, 65, 95, 100, 127, 159, 200, 257, 300, 351, 390)


def write_gemma3(path: Path) -> Path:
    """Two layers, the first sliding-window (64 tokens), the second full attention; random weights."""
    import torch
    from transformers import Gemma3ForCausalLM, Gemma3TextConfig

    torch.manual_seed(0)
    config = Gemma3TextConfig(vocab_size=1000, hidden_size=128, intermediate_size=256, num_hidden_layers=2,
                              num_attention_heads=4, num_key_value_heads=2, head_dim=32,
                              max_position_embeddings=2048, initializer_range=0.2, sliding_window=WINDOW,
                              layer_types=["sliding_attention", "full_attention"], tie_word_embeddings=False)
    Gemma3ForCausalLM(config).save_pretrained(path, safe_serialization=True)
    return path


@pytest.fixture(scope="module")
def model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_gemma3(tmp_path_factory.mktemp("tiny-gemma3"))


@pytest.fixture(scope="module")
def prompts() -> list[Any]:
    import numpy as np
    from vllm.inputs import TokensPrompt

    rng = np.random.default_rng(2)
    return [TokensPrompt(prompt_token_ids=rng.integers(3, 1000, n).tolist()) for n in LENGTHS]


@pytest.fixture(scope="module")
def sessions() -> list[list[list[int]]]:
    return make_sessions(8, 3, seed=7)


@pytest.fixture(scope="module")
def plain(model: Path, prompts: list[Any], sessions: list[list[list[int]]]) -> dict[str, Any]:
    """One plain instance's tokens (no disaggregation, no prefix cache): the prompts' and the sessions'."""
    llm = make_llm(model)
    try:
        return {"prompts": tokens(llm.generate(prompts, greedy(MAX_TOKENS), use_tqdm=False)),
                "sessions": session_answers(llm, sessions, MAX_TOKENS)}
    finally:
        close_llm(llm)


@pytest.fixture(scope="module")
def expected(plain: dict[str, Any]) -> list[list[int]]:
    return plain["prompts"]


@pytest.fixture(scope="module")
def pair(model: Path, expected: list[list[int]], tmp_path_factory: pytest.TempPathFactory,
         ) -> Iterator[tuple[Any, Any, Path]]:
    record = tmp_path_factory.mktemp("record") / "writes.jsonl"
    with pytest.MonkeyPatch.context() as patch:   # read by the engine processes the instances spawn
        patch.setenv("KVFERRY_VLLM_RECORD", str(record))
        prefill = make_llm(model, "kv_producer", {"transport": "tests.vllm_faults:recording_nixl",
                                                  "digest_mode": "full"})
        decode = make_llm(model, "kv_consumer")
    yield prefill, decode, record
    close_llm(decode)
    close_llm(prefill)


def test_a_sliding_window_model_moves_both_groups_and_decodes_the_same_tokens(
        pair: tuple[Any, Any, Path], prompts: list[Any], expected: list[list[int]]) -> None:
    prefill, decode, record = pair
    for llm in (prefill, decode):   # SupportsHMA: vLLM kept the hybrid KV cache manager on
        assert llm.llm_engine.vllm_config.scheduler_config.disable_hybrid_kv_cache_manager is False
    external = metric(decode, "vllm:prompt_tokens_by_source", "external_kv_transfer")
    local = metric(decode, "vllm:prompt_tokens_by_source", "local_compute")

    firsts = prefill.generate(prompts, greedy(1, {"do_remote_decode": True}), use_tqdm=False)
    params = [out.kv_transfer_params for out in firsts]
    outputs = decode.generate(prompts, [greedy(MAX_TOKENS, p) for p in params], use_tqdm=False)

    got = tokens(outputs)
    equal = sum(g == e for g, e in zip(got, expected))
    assert equal == len(prompts), f"{equal}/{len(prompts)} prompts decoded the same tokens as one instance"
    sliding = GroupSpec(("model.layers.0.self_attn.attn",), BLOCK_SIZE, WINDOW)
    moved = [n for n in LENGTHS if sliding.transferable(n)]
    kept_here = [n for n in LENGTHS if not sliding.transferable(n)]
    assert kept_here == [95, 127, 159, 351]
    assert [bool(p.get("kvferry_address")) for p in params] == [n in moved for n in LENGTHS]
    assert metric(decode, "vllm:prompt_tokens_by_source", "external_kv_transfer") - external == sum(moved)
    assert metric(decode, "vllm:prompt_tokens_by_source", "local_compute") - local == sum(kept_here)
    # One pool over the overlaid groups; per moved prompt, the full-attention group's every block under the
    # prompt and the sliding window's blocks from its first needed one.
    writes = [json.loads(line)["pages"] for line in record.read_text().splitlines()]
    assert {pool for w in writes for pool in w} == {HYBRID_POOL}
    assert sum(w[HYBRID_POOL] for w in writes) == sum(2 * -(-n // BLOCK_SIZE) - sliding.first_needed_block(n)
                                                      for n in moved)


def test_multi_turn_sessions_keep_decodes_prefix_cache_in_both_groups(
        pair: tuple[Any, Any, Path], sessions: list[list[list[int]]], plain: dict[str, Any]) -> None:
    """Prefix caching on in both instances, 8 sessions x 3 turns: from turn 2 decode's cache holds the earlier
    turns' blocks of both groups, and kvferry moves the rest (each group a transfer of its own, announced
    past decode's hit: ``layout.by_group``); a prompt whose window block prefill freed is prefilled on decode
    past its hit. Every answer equals the plain instance's."""
    prefill, decode, _ = pair
    want = plain["sessions"]
    sliding = GroupSpec(("model.layers.0.self_attn.attn",), BLOCK_SIZE, WINDOW)
    got: list[list[list[int]]] = [[] for _ in sessions]
    for turn in range(len(sessions[0])):
        prompts = [session_prompt(s, w[:turn]) for s, w in zip(sessions, want)]
        before = prompt_sources(decode)
        firsts = prefill.generate(prompts, greedy(1, {"do_remote_decode": True}), use_tqdm=False)
        params = [out.kv_transfer_params for out in firsts]
        outputs = decode.generate(prompts, [greedy(MAX_TOKENS, p) for p in params], use_tqdm=False)
        moved = {source: value - before[source] for source, value in prompt_sources(decode).items()}
        for answers, answer in zip(got, tokens(outputs)):
            answers.append(answer)
        kept_here = [len(p) for p in prompts if not sliding.transferable(len(p))]
        assert [bool(p.get("kvferry_address")) for p in params] == [sliding.transferable(len(p)) for p in prompts]
        print(f"turn {turn + 1}: {sum(map(len, prompts))} prompt tokens, {moved['local_cache_hit']:.0f} in decode's "
              f"cache, {moved['external_kv_transfer']:.0f} from kvferry, {moved['local_compute']:.0f} computed "
              f"({len(kept_here)} prompts prefill did not send)")
        assert moved["local_compute"] <= sum(kept_here) and moved["external_kv_transfer"] > 0
        assert sum(moved.values()) == sum(map(len, prompts))
        if turn:
            assert moved["local_cache_hit"] > 0
    equal = sum(g == w for answers, wants in zip(got, want) for g, w in zip(answers, wants))
    assert equal == len(sessions) * len(sessions[0]), f"{equal} answers equal the plain instance's"
