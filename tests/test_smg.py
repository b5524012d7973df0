"""kvferry's vLLM connector behind smg 1.13.0 (SGLang Model Gateway) routing vLLM PD over HTTP (issue 49).

smg runs vLLM PD sequentially (prefill capped at one token, then decode) and decides the hand-off by the prefill
worker's connector name: NixlConnector (tag prefill ``do_remote_decode``, relay what it returns to decode),
MooncakeConnector, MoRIIOConnector; any other name, or none, is pass-through. vLLM's HTTP server does not report
its connector, so workers given as ``--prefill URL --decode URL`` carry none. Run here, one prefill and one
decode ``vllm serve`` with kvferry's connector:

* pass-through (``--prefill``/``--decode``): every answer right, no KV moved (decode's kvferry counters stay
  at 0, its prompt tokens all ``local_compute``): the silent recompute smg's docs warn of. kvferry's decode
  now says so in its log (``SchedulerSide.unhanded``).
* the workers registered through ``POST /workers`` with ``"kv_connector": "NixlConnector"`` (docs/deploy.md):
  every prompt's KV moves through kvferry (one verified transfer per request, none failed, no prompt token
  computed on decode past the last), answers equal to one plain instance.

smg from its own venv (``.venv-smg`` or ``KVFERRY_SMG_VENV``; scripts/setup-smg.sh); skipped without it.
Slow: two ``vllm serve`` processes and a plain instance; 110 s measured on 2026-12-05 (2 cores shared, load
about 8): pass-through 0 transfers and all 1771 prompt tokens computed on decode; registered 8/8 transfers,
0 prompt tokens computed on decode; both 8/8 answers equal to the plain instance's.
"""

from __future__ import annotations

import asyncio
import json
import os
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("vllm", reason="vLLM is not installed (make test-vllm)")

from kvferry.workload.vllm_chaos import Server, kvferry_config, server_env

from .deploy_commands import smg_argv, smg_worker
from .vllm_pd import (
    close_llm,
    free_port,
    greedy,
    make_llm,
    make_prompts,
    scrape,
    scraped,
    serve_command,
    tokenizer_words,
    tokens,
    write_model,
    write_tokenizer,
)

ROOT = Path(__file__).resolve().parents[1]
SMG = Path(os.environ.get("KVFERRY_SMG_VENV") or ROOT / ".venv-smg") / "bin" / "smg"
if not SMG.exists():
    pytest.skip(f"smg is not installed ({SMG}: scripts/setup-smg.sh)", allow_module_level=True)

pytestmark = [pytest.mark.vllm, pytest.mark.slow, pytest.mark.timeout(1500)]

NUM_PROMPTS = 8
MAX_TOKENS = 12
UNHANDED = "came with no kv_transfer_params"


@pytest.fixture(scope="module")
def model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_tokenizer(write_model(tmp_path_factory.mktemp("tiny-llama")))


def http_json(url: str, body: dict[str, Any] | None = None, timeout: float = 30.0) -> tuple[int, Any]:
    data = None if body is None else json.dumps(body).encode()
    request = urllib.request.Request(url, data, {"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(request, timeout=timeout) as answer:
            text = answer.read().decode()
            return answer.status, json.loads(text) if text.strip().startswith(("{", "[")) else text
    except urllib.error.HTTPError as exc:
        return exc.code, exc.read().decode(errors="replace")


def wait_ready(url: str, server: Server, timeout: float = 120.0) -> None:
    """Until smg has a healthy prefill and decode (``/readiness``)."""
    deadline = time.monotonic() + timeout
    while True:
        assert server.alive(), f"smg exited; see {server.log}"
        try:
            if http_json(url + "/readiness", timeout=5)[0] == 200:
                return
        except OSError:
            pass
        assert time.monotonic() < deadline, f"smg not ready within {timeout:.0f} s; see {server.log}"
        time.sleep(0.5)


def complete_all(url: str, model: Path, prompts: list[list[int]]) -> list[list[int]]:
    import aiohttp

    words = tokenizer_words()

    async def one(http: Any, prompt: list[int]) -> list[int]:
        # smg takes a text prompt only; the word-level tokenizer maps each word back to its one id (id - 2).
        text = " ".join(words[t - 2] for t in prompt)
        body = {"model": str(model), "prompt": text, "max_tokens": MAX_TOKENS, "temperature": 0.0,
                "ignore_eos": True, "return_token_ids": True}
        async with http.post(url + "/v1/completions", json=body) as answer:
            text = await answer.text()
            assert answer.status == 200, text
            return list(json.loads(text)["choices"][0]["token_ids"])

    async def main() -> list[list[int]]:
        async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=600)) as http:
            first = await one(http, prompts[0])
            return [first, *await asyncio.gather(*(one(http, p) for p in prompts[1:]))]

    return asyncio.run(main())


def decode_figures(url: str) -> dict[str, float]:
    samples = scrape(url)
    return {"done": scraped(samples, "vllm:kvferry_requests_done_total", role="decode"),
            "failed": scraped(samples, "vllm:kvferry_requests_failed_total", role="decode"),
            "local": scraped(samples, "vllm:prompt_tokens_by_source_total", source="local_compute")}


def through_smg(model: Path, logs: Path, prompts: list[list[int]], decode: Server, name: str,
                argv_workers: tuple[list[str], list[str]], registered: tuple[str, str] | None) -> dict[str, Any]:
    """One smg in front of the two servers, the prompts through it, decode's figures before and after."""
    port = free_port()
    argv = smg_argv(str(SMG), port, free_port(), *argv_workers)
    smg = Server(f"smg-{name}", argv, logs, dict(os.environ), f"http://127.0.0.1:{port}")
    url = smg.url or ""
    smg.start()
    try:
        smg.wait_healthy(60)
        if registered is not None:
            for worker, kind in zip(registered, ("prefill", "decode")):
                status, answer = http_json(url + "/workers", smg_worker(worker, kind))
                assert status in (200, 201, 202), (status, answer)
        wait_ready(url, smg)
        before = decode_figures(decode.url or "")
        got = complete_all(url, model, prompts)
        time.sleep(3.0)   # an engine reports a transfer's end at its next step
        return {"tokens": got, "before": before, "after": decode_figures(decode.url or ""),
                "workers": http_json(url + "/workers")[1]}
    finally:
        smg.terminate()


@pytest.fixture(scope="module")
def runs(model: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, Any]]:
    logs = tmp_path_factory.mktemp("smg-logs")
    prompts = [p["prompt_token_ids"] for p in make_prompts(NUM_PROMPTS, seed=491)]
    servers = {}
    for role in ("prefill", "decode"):
        port = free_port()
        cmd = serve_command(model, port, "kv_producer", tokenizer=True)
        cmd[cmd.index("--kv-transfer-config") + 1] = json.dumps(kvferry_config(role))
        servers[role] = Server(f"kvferry-{role}", cmd, logs, server_env(), f"http://127.0.0.1:{port}")
    started = time.monotonic()
    out: dict[str, Any] = {"prompts": prompts}
    try:
        for server in servers.values():
            server.start()
        for server in servers.values():
            server.wait_healthy()
        urls = (servers["prefill"].url or "", servers["decode"].url or "")
        out["passthrough"] = through_smg(model, logs, prompts, servers["decode"], "passthrough",
                                         ([urls[0]], [urls[1]]), None)
        out["registered"] = through_smg(model, logs, prompts, servers["decode"], "registered", ([], []), urls)
        out["decode_log"] = servers["decode"].log.read_text(errors="replace")
    finally:
        for server in servers.values():
            server.terminate()
    out["run_s"] = time.monotonic() - started
    yield out


def reference(model: Path, prompts: list[list[int]]) -> list[list[int]]:
    from vllm.inputs import TokensPrompt

    llm = make_llm(model)
    try:
        return tokens(llm.generate([TokensPrompt(prompt_token_ids=p) for p in prompts], greedy(MAX_TOKENS),
                                   use_tqdm=False))
    finally:
        close_llm(llm)


def moved(run: dict[str, Any]) -> dict[str, float]:
    return {key: run["after"][key] - run["before"][key] for key in run["after"]}


def test_smg_moves_kvferrys_kv_once_told_the_connector(runs: dict[str, Any], model: Path) -> None:
    prompts = runs["prompts"]
    expected = reference(model, prompts)
    prompt_tokens = sum(len(p) for p in prompts)
    passthrough, registered = moved(runs["passthrough"]), moved(runs["registered"])
    print(f"\nsmg 1.13.0, vLLM PD over HTTP, kvferry 1P1D, {len(prompts)} prompts ({prompt_tokens} prompt tokens), "
          f"{runs['run_s']:.0f} s:\n  workers as --prefill/--decode (pass-through): {passthrough}\n"
          f"  workers registered with kv_connector NixlConnector: {registered}\n"
          f"  smg's /workers then: {runs['registered']['workers']}")
    for name in ("passthrough", "registered"):
        assert runs[name]["tokens"] == expected, f"{name}: answers differ from one plain instance"

    # Pass-through: nothing moved, decode computed every prompt itself, and kvferry's decode said so.
    assert passthrough["done"] == 0 and passthrough["failed"] == 0
    assert passthrough["local"] >= prompt_tokens
    assert UNHANDED in runs["decode_log"]

    # Registered: one verified kvferry transfer per request; decode computed only each prompt's last token.
    assert registered["done"] == len(prompts) and registered["failed"] == 0
    assert registered["local"] <= len(prompts)
