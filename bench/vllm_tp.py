"""kvferry's vLLM connector against vLLM's NixlConnector at tensor-parallel sizes > 1: TTFT and KV arrival.

Run under ``.venv-vllm`` (``make test-vllm`` sets it up)::

    LD_PRELOAD=.venv-vllm/lib/libiomp5.so .venv-vllm/bin/python bench/vllm_tp.py --pairs 2-2,1-2,2-1 --json out.json

Starvation (issue 29): ``--hogs N`` runs N busy-loop processes beside each measurement (warm-up included), so
the engines' threads are starved of CPU; a differing or failed answer is then counted, not fatal. The
connector ``kvferry-silence`` is kvferry with ``transport_liveness`` off (silence past ``peer_timeout`` is
loss: the rule before protocol 8), the control::

    ... bench/vllm_tp.py --pairs 1-2 --connectors kvferry,kvferry-silence,nixl --requests 25 --hogs 6

The same tiny random Llama (4 heads, 2 KV heads) and the same hand-off as ``bench/vllm_connectors.py``,
whose helpers it uses; per (prefill TP, decode TP) pair and connector, one prefill and one decode instance,
4 warm-up requests, then ``--requests`` prompts all at once. NixlConnector runs only the pairs it supports
(decode TP >= prefill TP for a GQA model). Every request's tokens are checked against one plain TP-1
instance; a differing token fails the run.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))

from vllm_connectors import (  # a sibling script, not a package
    COMMON,
    ENV,
    MAX_TOKENS,
    WARMUP,
    connector_config,
    greedy,
    make_prompts,
    pd_round,
    stop,
    write_model,
)


def config_of(name: str, role: str, peer_timeout: float | None) -> dict[str, Any]:
    """``connector_config``, plus kvferry-silence and ``--peer-timeout`` (heartbeats at a fifth of it)."""
    config = connector_config("kvferry" if name == "kvferry-silence" else name, role)
    extra = config.get("kv_connector_extra_config")
    if extra is not None:
        if name == "kvferry-silence":
            extra["transport_liveness"] = False
        if peer_timeout is not None:
            extra.update(peer_timeout=peer_timeout, heartbeat_interval=peer_timeout / 5)
    return config


@contextlib.contextmanager
def hogs(n: int) -> Iterator[None]:
    """``n`` processes that spin on the CPU until the block ends (the load that starved the engines)."""
    procs = [subprocess.Popen([sys.executable, "-c", "while True: pass"]) for _ in range(n)]
    try:
        yield
    finally:
        for proc in procs:
            proc.kill()
            proc.wait()


def start(model: Path, config: dict[str, Any] | None, tp: int, side_port: int | None = None) -> Any:
    from vllm import LLM

    if side_port is not None:   # NixlConnector's side channel: one port per instance (rank r: port + r)
        os.environ["VLLM_NIXL_SIDE_CHANNEL_PORT"] = str(side_port)
    return LLM(model=str(model), kv_transfer_config=config, tensor_parallel_size=tp, **COMMON)


def supported(name: str, prefill_tp: int, decode_tp: int) -> bool:
    """NixlConnector moves GQA KV only when decode's TP is a multiple of prefill's."""
    return name != "nixl" or decode_tp % prefill_tp == 0


def measure(name: str, model: Path, prompts: list[Any], expected: list[list[int]], prefill_tp: int,
            decode_tp: int, num_hogs: int = 0, peer_timeout: float | None = None) -> dict[str, Any]:
    nixl = name == "nixl"
    with hogs(num_hogs):
        load = os.getloadavg()[0]
        prefill = start(model, config_of(name, "kv_producer", peer_timeout), prefill_tp, 5701 if nixl else None)
        decode = start(model, config_of(name, "kv_consumer", peer_timeout), decode_tp, 5721 if nixl else None)
        try:
            pd_round(prefill, decode, make_prompts(WARMUP, seed=1))
            rows = pd_round(prefill, decode, prompts)
            load = max(load, os.getloadavg()[0])
        finally:
            stop(decode)
            stop(prefill)
    equal = sum(r["tokens"] == e for r, e in zip(rows, expected))
    if equal != len(rows) and not num_hogs:
        raise SystemExit(f"{name} TP {prefill_tp} -> {decode_tp}: {equal}/{len(rows)} prompts equal one instance")
    return {"equal": equal, "errors": sum(r["error"] for r in rows), "load": round(load, 1),
            # Under starvation: an answer that failed (no tokens) is an error; one with tokens unlike the
            # plain instance's would be another user's KV or corruption, never acceptable.
            "other_tokens": sum(bool(r["tokens"]) and not r["error"] and r["tokens"] != e
                                for r, e in zip(rows, expected)),
            **{f"{key}_{q}_ms": float(np.percentile([r[key] for r in rows], q) * 1e3)
               for key in ("ttft", "kv_arrival") for q in (50, 99)}}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--requests", type=int, default=32)
    parser.add_argument("--pairs", default="2-2,1-2,2-1", help="prefill TP-decode TP, comma-separated")
    parser.add_argument("--connectors", default="kvferry,nixl")
    parser.add_argument("--json", type=Path)
    parser.add_argument("--hogs", type=int, default=0, help="busy-loop processes beside each measurement")
    parser.add_argument("--peer-timeout", type=float, default=None,
                        help="kvferry's peer_timeout (heartbeats at a fifth): less starvation trips a shorter one")
    args = parser.parse_args()
    for key, value in ENV.items():
        os.environ.setdefault(key, value)
    pairs = [tuple(int(x) for x in pair.split("-")) for pair in args.pairs.split(",")]
    results: dict[str, dict[str, Any]] = {}
    with tempfile.TemporaryDirectory() as tmp:
        model = write_model(Path(tmp) / "tiny-llama")
        prompts = make_prompts(args.requests, seed=0)
        plain = start(model, None, 1)
        expected = [list(o.outputs[0].token_ids) for o in plain.generate(prompts, greedy(MAX_TOKENS), use_tqdm=False)]
        stop(plain)
        for prefill_tp, decode_tp in pairs:
            for name in args.connectors.split(","):
                if not supported(name, prefill_tp, decode_tp):
                    continue
                started = time.perf_counter()
                key = f"{name} {prefill_tp}->{decode_tp}"
                results[key] = measure(name, model, prompts, expected, prefill_tp, decode_tp, args.hogs,
                                       args.peer_timeout)
                print(f"{key} ({time.perf_counter() - started:.0f} s): {json.dumps(results[key])}", flush=True)
    print("| connector | TP prefill -> decode | tokens equal | failed / other tokens | TTFT p50 / p99 ms | "
          "KV arrival p50 / p99 ms | load |")
    print("|---|---|---|---|---|---|---|")
    for key, r in results.items():
        name, pair = key.split(" ")
        print(f"| {name} | {pair.replace('->', ' -> ')} | {r['equal']}/{args.requests} | {r['errors']} / "
              f"{r['other_tokens']} | {r['ttft_50_ms']:.1f} / {r['ttft_99_ms']:.1f} | {r['kv_arrival_50_ms']:.1f} / "
              f"{r['kv_arrival_99_ms']:.1f} | {r['load']} |")
    if args.json:
        args.json.write_text(json.dumps(results, indent=2))


if __name__ == "__main__":
    main()
