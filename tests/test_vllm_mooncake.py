"""Issue 33: two ``vllm serve`` processes behind ``kvferry vllm-proxy``, the connector on Mooncake's Transfer
Engine (``"transport": "mooncake"``): every prompt decodes the tokens one plain instance decodes.

A pair of servers of its own (the module's in test_vllm.py runs over NIXL), so marked slow
(``make test-vllm-slow``). Skipped where vLLM or the Mooncake wheel cannot import.
"""

from __future__ import annotations

import asyncio
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from kvferry.transport import mooncake_available

pytest.importorskip("vllm", reason="vLLM is not installed (make test-vllm)")
if not mooncake_available():
    pytest.skip("Mooncake's Transfer Engine cannot import (pip install 'kvferry[mooncake]', docs/mooncake.md)",
                allow_module_level=True)

from .vllm_pd import (
    close_llm,
    free_port,
    greedy,
    make_llm,
    make_prompts,
    serve_command,
    server_metric,
    tokens,
    wait_healthy,
    write_model,
)

pytestmark = [pytest.mark.vllm, pytest.mark.slow, pytest.mark.timeout(1500)]

NUM_PROMPTS = 24
MAX_TOKENS = 16


@pytest.fixture(scope="module")
def model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_model(tmp_path_factory.mktemp("tiny-llama"))


@pytest.fixture(scope="module")
def prompts() -> list[Any]:
    return make_prompts(NUM_PROMPTS, seed=33)


@pytest.fixture(scope="module")
def expected(model: Path, prompts: list[Any]) -> list[list[int]]:
    """Greedy tokens of one plain instance (no connector, no prefix cache), closed before the servers start."""
    llm = make_llm(model)
    try:
        return tokens(llm.generate(prompts, greedy(MAX_TOKENS), use_tqdm=False))
    finally:
        close_llm(llm)


@pytest.fixture(scope="module")
def servers(model: Path, expected: list[list[int]],
            tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, str]]:
    ports = {name: free_port() for name in ("prefill", "decode", "proxy")}
    mooncake = {"transport": "mooncake"}
    commands = {"prefill": serve_command(model, ports["prefill"], "kv_producer", mooncake),
                "decode": serve_command(model, ports["decode"], "kv_consumer", mooncake),
                "proxy": [sys.executable, "-m", "kvferry", "vllm-proxy", "--port", str(ports["proxy"]),
                          "--prefill", f"http://127.0.0.1:{ports['prefill']}",
                          "--decode", f"http://127.0.0.1:{ports['decode']}"]}
    logs = tmp_path_factory.mktemp("serve-mooncake")
    procs = {name: subprocess.Popen(cmd, stdout=(logs / f"{name}.log").open("wb"), stderr=subprocess.STDOUT)
             for name, cmd in commands.items()}
    try:
        urls = {name: f"http://127.0.0.1:{port}" for name, port in ports.items()}
        for url in urls.values():
            wait_healthy(url, list(procs.values()), timeout=600.0)   # a loaded 2-core host: minutes
        yield urls
    finally:
        for proc in procs.values():
            proc.terminate()
        for proc in procs.values():
            try:
                proc.wait(timeout=60)
            except subprocess.TimeoutExpired:   # a server still starting can sit on SIGTERM: no stray left behind
                proc.kill()
                proc.wait(timeout=30)


def test_online_over_mooncake_through_the_proxy(servers: dict[str, str], model: Path, prompts: list[Any],
                                                expected: list[list[int]]) -> None:
    import aiohttp

    async def complete(session: aiohttp.ClientSession, prompt: Any) -> list[int]:
        body = {"model": str(model), "prompt": prompt["prompt_token_ids"], "max_tokens": MAX_TOKENS,
                "temperature": 0.0, "ignore_eos": True, "return_token_ids": True}
        async with session.post(servers["proxy"] + "/v1/completions", json=body) as answer:
            assert answer.status == 200, await answer.text()
            return list((await answer.json())["choices"][0]["token_ids"])

    async def all_at_once() -> list[list[int]]:
        async with aiohttp.ClientSession() as session:
            return list(await asyncio.gather(*(complete(session, p) for p in prompts)))

    before = server_metric(servers["decode"], "vllm:prompt_tokens_by_source_total", "external_kv_transfer")
    got = asyncio.run(all_at_once())
    after = server_metric(servers["decode"], "vllm:prompt_tokens_by_source_total", "external_kv_transfer")
    equal = sum(g == e for g, e in zip(got, expected))
    assert equal == len(prompts), f"{equal}/{len(prompts)} prompts decoded the same tokens as one instance"
    # Random prompts: decode's cache held none of them, so every prompt token came over Mooncake.
    assert after - before == sum(len(p["prompt_token_ids"]) for p in prompts)
