"""kvferry's vLLM connector against vLLM's own NixlConnector: TTFT and KV arrival at concurrency 1 and 32,
and multi-turn sessions with prefix caching on in both instances (``--sessions``).

Run under ``.venv-vllm`` (``make test-vllm`` sets it up)::

    LD_PRELOAD=.venv-vllm/lib/libiomp5.so .venv-vllm/bin/python bench/vllm_connectors.py --json out.json
    LD_PRELOAD=.venv-vllm/lib/libiomp5.so .venv-vllm/bin/python bench/vllm_connectors.py --sessions 32 \
        --turns 5 --connectors kvferry,nixl --json sessions.json

A tiny random Llama (2 layers, written with transformers, fp32, 32-token blocks) so that on 2 CPU cores the
figures show the transfer path rather than the model. Per connector: one prefill and one decode instance
(engine cores in their own processes, as ``vllm serve`` runs them), 4 warm-up requests, then ``--requests``
prompts of 2-400 tokens one at a time (concurrency 1) and all at once (concurrency 32).

* TTFT: prefill's first-token latency (the prompt computed) + decode's first-token latency (KV arrived,
  the last prompt token computed, one token sampled), both measured by vLLM per request. The offline
  API hands a batch to decode only when all of prefill's requests returned; a proxy forwards each as it
  finishes, so the sum is what a client behind a proxy would see, less the proxy's own hop.
* KV arrival: decode's queued -> scheduled time: a remote-prefilled request is queued, waits for its KV
  (``WAITING_FOR_REMOTE_KVS``), and is scheduled once its KV arrived (or failed).

``--sessions S --turns T``: S chat sessions (a first prompt of 16-200 tokens, then 8-64 new user tokens a
turn, as tests/vllm_pd.py's), both instances with vLLM's prefix cache on, so that from turn 2 on decode holds
the earlier turns' blocks and receives only the rest. Each turn's prompt is built from the plain instance's
answers; the turn's requests go one at a time (TTFT as above). Per turn: TTFT p50/p99, where decode's prompt
tokens came from (``vllm:prompt_tokens_by_source``) and the bytes the connector moved: kvferry's from a
recording transport on prefill (``recording_nixl`` below, every NIXL write's plan bytes), NixlConnector's
from its own ``vllm:nixl_bytes_transferred`` histogram on decode (the side that reads).

Every request's tokens are checked against one plain instance; a run with a differing token fails.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np

from kvferry.workload.vllm_chaos import write_model  # the tests' and the soak's tiny model

ENV = {"VLLM_CPU_KVCACHE_SPACE": "1", "VLLM_CPU_OMP_THREADS_BIND": "nobind", "HF_HUB_OFFLINE": "1",
       "TORCHDYNAMO_DISABLE": "1", "KMP_BLOCKTIME": "0", "VLLM_ENABLE_V1_MULTIPROCESSING": "1"}
MAX_TOKENS = 16
WARMUP = 4
BLOCK_SIZE = 32
COMMON = dict(skip_tokenizer_init=True, enforce_eager=True, dtype="float32", block_size=BLOCK_SIZE,
              enable_prefix_caching=False, max_model_len=1024, max_num_seqs=64, disable_log_stats=False,
              gpu_memory_utilization=0.15)


SOURCES = ("local_compute", "local_cache_hit", "external_kv_transfer")


def connector_config(name: str, role: str, record: bool = False) -> dict[str, Any]:
    if name in ("kvferry", "kvferry-pull"):   # kvferry-pull: decode reads prefill's blocks (mode "pull")
        extra: dict[str, Any] = {"mode": "pull"} if name == "kvferry-pull" and role == "kv_consumer" else {}
        if record and role == "kv_producer":   # imported in vLLM's worker process (PYTHONPATH: main)
            extra["transport"] = "vllm_connectors:recording_nixl"
        return {"kv_connector": "KVFerryConnector", "kv_connector_module_path": "kvferry.integrations.vllm",
                "kv_role": role, "kv_connector_extra_config": extra}
    return {"kv_connector": "NixlConnector", "kv_role": "kv_both", "kv_buffer_device": "cpu"}


def make_prompts(num: int, seed: int) -> list[Any]:
    from vllm.inputs import TokensPrompt

    rng = np.random.default_rng(seed)
    return [TokensPrompt(prompt_token_ids=rng.integers(3, 1000, int(n)).tolist()) for n in rng.integers(2, 400, num)]


def greedy(max_tokens: int, params: dict[str, Any] | None = None) -> Any:
    from vllm import SamplingParams

    extra = None if params is None else {"kv_transfer_params": params}
    return SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True, extra_args=extra)


def recording_nixl(side: str) -> Any:
    """kvferry's NIXL transport, adding each write's bytes to ``$KVFERRY_BENCH_RECORD`` (one line each)."""
    from kvferry.transport.nixl import NixlTransport

    class RecordingNixl(NixlTransport):
        def write(self, plan: Any, peer: str, notif: bytes, label: str = "") -> Any:
            with open(os.environ["KVFERRY_BENCH_RECORD"], "a") as record:
                record.write(f"{int(plan.nbytes)}\n")
            return super().write(plan, peer, notif, label)

    return RecordingNixl()


def start(model: Path, kv_transfer_config: dict[str, Any] | None, side_port: int | None = None,
          **overrides: Any) -> Any:
    from vllm import LLM

    if side_port is not None:   # NixlConnector's side channel: one port per instance, read at start-up
        os.environ["VLLM_NIXL_SIDE_CHANNEL_PORT"] = str(side_port)
    return LLM(model=str(model), kv_transfer_config=kv_transfer_config, **{**COMMON, **overrides})


def stop(llm: Any) -> None:
    llm.llm_engine.engine_core.shutdown()
    gc.collect()


def pd_round(prefill: Any, decode: Any, prompts: list[Any]) -> list[dict[str, Any]]:
    """One batch through prefill then decode; per request: tokens, TTFT parts, KV arrival."""
    firsts = prefill.generate(prompts, greedy(1, {"do_remote_decode": True}), use_tqdm=False)
    outs = decode.generate(prompts, [greedy(MAX_TOKENS, f.kv_transfer_params) for f in firsts], use_tqdm=False)
    return [{"tokens": list(o.outputs[0].token_ids), "error": o.outputs[0].finish_reason != "length",
             "ttft": f.metrics.first_token_latency + o.metrics.first_token_latency,
             "kv_arrival": o.metrics.scheduled_ts - o.metrics.queued_ts} for f, o in zip(firsts, outs)]


def measure(name: str, model: Path, prompts: list[Any], expected: list[list[int]]) -> dict[str, Any]:
    nixl = name == "nixl"
    prefill = start(model, connector_config(name, "kv_producer"), 5601 if nixl else None)
    decode = start(model, connector_config(name, "kv_consumer"), 5611 if nixl else None)
    try:
        pd_round(prefill, decode, make_prompts(WARMUP, seed=1))
        conc1 = [r for p in prompts for r in pd_round(prefill, decode, [p])]
        conc32 = pd_round(prefill, decode, prompts)
    finally:
        stop(decode)
        stop(prefill)
    out: dict[str, Any] = {}
    for label, rows in (("1", conc1), (str(len(prompts)), conc32)):
        equal = sum(r["tokens"] == e for r, e in zip(rows, expected))
        out[label] = {"equal": equal, "errors": sum(r["error"] for r in rows),
                      **{f"{key}_{q}_ms": float(np.percentile([r[key] for r in rows], q) * 1e3)
                         for key in ("ttft", "kv_arrival") for q in (50, 99)}}
        if equal != len(rows):
            raise SystemExit(f"{name} at concurrency {label}: {equal}/{len(rows)} prompts equal one instance")
    return out


def make_sessions(num: int, turns: int, seed: int) -> list[list[list[int]]]:
    """Per session: its first prompt (16-200 tokens), then each later turn's new user tokens (8-64)."""
    rng = np.random.default_rng(seed)
    return [[rng.integers(3, 1000, int(rng.integers(16, 200))).tolist()]
            + [rng.integers(3, 1000, int(rng.integers(8, 64))).tolist() for _ in range(turns - 1)]
            for _ in range(num)]


def session_prompt(session: list[list[int]], answers: list[list[int]]) -> list[int]:
    """Turn ``len(answers)``'s prompt: every earlier turn's user tokens and answer, then this turn's."""
    prompt: list[int] = []
    for user, answer in zip(session, answers):
        prompt += [*user, *answer]
    return prompt + list(session[len(answers)])


def plain_answers(model: Path, sessions: list[list[list[int]]]) -> list[list[list[int]]]:
    """Every turn's answer from one plain instance (no disaggregation, no prefix cache), turn by turn."""
    from vllm.inputs import TokensPrompt

    plain = start(model, None)
    answers: list[list[list[int]]] = [[] for _ in sessions]
    for _turn in range(len(sessions[0])):
        prompts = [TokensPrompt(prompt_token_ids=session_prompt(s, a)) for s, a in zip(sessions, answers)]
        for done, out in zip(answers, plain.generate(prompts, greedy(MAX_TOKENS), use_tqdm=False)):
            done.append(list(out.outputs[0].token_ids))
    stop(plain)
    return answers


def moved_bytes(name: str, decode: Any, record: Path) -> float:
    """What the connector moved so far: kvferry's recorded writes, NixlConnector's own histogram."""
    if name == "nixl":
        return sum(m.sum for m in decode.get_metrics() if m.name == "vllm:nixl_bytes_transferred")
    return float(sum(int(line) for line in record.read_text().split())) if record.exists() else 0.0


def sources(decode: Any) -> dict[str, float]:
    return {s: sum(m.value for m in decode.get_metrics()
                   if m.name == "vllm:prompt_tokens_by_source" and m.labels.get("source") == s) for s in SOURCES}


def measure_sessions(name: str, model: Path, sessions: list[list[list[int]]], want: list[list[list[int]]],
                     record: Path) -> list[dict[str, Any]]:
    """Per turn: tokens equal, TTFT p50/p99, decode's prompt tokens by source, bytes moved."""
    from vllm.inputs import TokensPrompt

    nixl = name == "nixl"
    os.environ["KVFERRY_BENCH_RECORD"] = str(record)   # read by kvferry prefill's worker process
    prefill = start(model, connector_config(name, "kv_producer", record=True), 5601 if nixl else None,
                    enable_prefix_caching=True)
    decode = start(model, connector_config(name, "kv_consumer"), 5611 if nixl else None, enable_prefix_caching=True)
    turns = []
    try:
        pd_round(prefill, decode, make_prompts(WARMUP, seed=1))
        for turn in range(len(sessions[0])):
            prompts = [session_prompt(s, w[:turn]) for s, w in zip(sessions, want)]
            before, bytes_before = sources(decode), moved_bytes(name, decode, record)
            rows = [r for p in prompts for r in pd_round(prefill, decode, [TokensPrompt(prompt_token_ids=p)])]
            after, bytes_after = sources(decode), moved_bytes(name, decode, record)
            equal = sum(r["tokens"] == w[turn] for r, w in zip(rows, want))
            turns.append({"equal": equal, "errors": sum(r["error"] for r in rows),
                          "prompt_tokens": sum(map(len, prompts)), "bytes": bytes_after - bytes_before,
                          "blocks": sum(-(-len(p) // BLOCK_SIZE) for p in prompts),
                          **{s: after[s] - before[s] for s in SOURCES},
                          **{f"ttft_{q}_ms": float(np.percentile([r["ttft"] for r in rows], q) * 1e3)
                             for q in (50, 99)}})
            if equal != len(rows):
                raise SystemExit(f"{name} turn {turn + 1}: {equal}/{len(rows)} answers equal one instance")
    finally:
        stop(decode)
        stop(prefill)
    return turns


def run_sessions(args: argparse.Namespace, model: Path, tmp: Path) -> dict[str, Any]:
    sessions = make_sessions(args.sessions, args.turns, seed=5)
    want = plain_answers(model, sessions)
    results: dict[str, Any] = {}
    for name in args.connectors.split(","):
        started = time.perf_counter()
        results[name] = measure_sessions(name, model, sessions, want, tmp / f"{name}.record")
        print(f"{name} ({time.perf_counter() - started:.0f} s): {json.dumps(results[name])}", flush=True)
    # Turn 1: decode holds nothing, every block under the prompt moves: a block's bytes (one layout for both).
    first = results[next(iter(results))][0]
    block_bytes = first["bytes"] / first["blocks"]
    print(f"| connector | turn | answers equal | TTFT p50 / p99 ms | prompt tokens: in decode's cache / moved | "
          f"bytes moved | x whole prompt's KV | x KV of the tokens decode lacked |   (a block: {block_bytes:.0f} B)")
    print("|---|---|---|---|---|---|---|---|")
    for name, turns in results.items():
        for number, r in enumerate(turns, 1):
            lacked = r["external_kv_transfer"] * block_bytes / BLOCK_SIZE
            print(f"| {name} | {number} | {r['equal']}/{args.sessions} | {r['ttft_50_ms']:.1f} / "
                  f"{r['ttft_99_ms']:.1f} | {r['local_cache_hit']:.0f} / {r['external_kv_transfer']:.0f} | "
                  f"{r['bytes']:.0f} | {r['bytes'] / (r['blocks'] * block_bytes):.3f} | "
                  f"{r['bytes'] / lacked if lacked else float('nan'):.3f} |")
    return results


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--requests", type=int, default=32)
    parser.add_argument("--connectors", default="kvferry,kvferry-pull,nixl")
    parser.add_argument("--sessions", type=int, default=0, help="multi-turn sessions, prefix caching on (0: off)")
    parser.add_argument("--turns", type=int, default=5)
    parser.add_argument("--json", type=Path)
    args = parser.parse_args()
    for key, value in ENV.items():
        os.environ.setdefault(key, value)
    # vLLM's worker processes import this module by name (the recording transport): put its folder on their path.
    here = str(Path(__file__).resolve().parent)
    os.environ["PYTHONPATH"] = os.pathsep.join(filter(None, [here, os.environ.get("PYTHONPATH")]))
    sys.path.insert(0, here)
    if args.sessions:
        with tempfile.TemporaryDirectory() as tmp:
            results = run_sessions(args, write_model(Path(tmp) / "tiny-llama"), Path(tmp))
        if args.json:
            args.json.write_text(json.dumps(results, indent=2))
        return
    with tempfile.TemporaryDirectory() as tmp:
        model = write_model(Path(tmp) / "tiny-llama")
        prompts = make_prompts(args.requests, seed=0)
        plain = start(model, None)
        expected = [list(o.outputs[0].token_ids) for o in plain.generate(prompts, greedy(MAX_TOKENS), use_tqdm=False)]
        stop(plain)
        results = {}
        for name in args.connectors.split(","):
            started = time.perf_counter()
            results[name] = measure(name, model, prompts, expected)
            print(f"{name} ({time.perf_counter() - started:.0f} s): {json.dumps(results[name])}", flush=True)
    print("| connector | concurrency | tokens equal | TTFT p50 / p99 ms | KV arrival p50 / p99 ms |")
    print("|---|---|---|---|---|")
    for name, by_conc in results.items():
        for conc, r in by_conc.items():
            print(f"| {name} | {conc} | {r['equal']}/{args.requests} | {r['ttft_50_ms']:.1f} / {r['ttft_99_ms']:.1f} "
                  f"| {r['kv_arrival_50_ms']:.1f} / {r['kv_arrival_99_ms']:.1f} |")
    if args.json:
        args.json.write_text(json.dumps(results, indent=2))


if __name__ == "__main__":
    main()
