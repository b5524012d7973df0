"""kvferry's vLLM connector behind vllm-router (issue 49): 2 prefill + 2 decode ``vllm serve`` instances.

The router users deploy for vLLM PD (``vllm-router`` 0.1.17, a Rust binary in its wheel; scripts/setup-vllm.sh
installs it into ``.venv-vllm``): ``vllm-router --vllm-pd-disaggregation --prefill URL --prefill URL --decode URL
--decode URL --policy P --kv-connector nixl``. It posts each request to a prefill with ``max_tokens: 1`` and
``kv_transfer_params: {"do_remote_decode": true, ...}`` and then to a decode with what that prefill returned
(kvferry's ``kvferry_address``, ``kvferry_request_id``, ...): nothing on kvferry's side needs to change.

Under ``round_robin`` and ``consistent_hash``: 24 prompts at once, a streamed answer, and multi-turn chat
sessions (``/v1/chat/completions``, a chat template, the decode's prefix cache on, sessions kept on one decode
by ``X-Session-ID``). Every answer's tokens equal one plain instance's greedy tokens for the same prompt ids.
Then the same 2P2D with vLLM's NixlConnector (decode pulls prefill's blocks), the peer users compare with,
and TTFT and time per request (streamed, one request at a time through the router) printed side by side.

Slow: it starts eight ``vllm serve`` processes (four at a time) and one plain instance; 352-526 s
measured in three runs on 2026-12-05 on 2 cores shared with other work (load 15-54), ``RUN_S``.
"""

from __future__ import annotations

import asyncio
import json
import os
import shutil
import statistics
import sys
import time
from collections import Counter
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("vllm", reason="vLLM is not installed (make test-vllm)")

from kvferry.workload.vllm_chaos import Server, kvferry_config, nixl_config, server_env

from .deploy_commands import vllm_router_argv
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

RUN_S = "352, 444 and 526 s (three runs, both connectors and policies; 2026-12-05, 2 cores shared, load 15-54)"
pytestmark = [pytest.mark.vllm, pytest.mark.slow, pytest.mark.timeout(2400)]

NUM_PROMPTS = 24
MAX_TOKENS = 12
POLICIES = ("round_robin", "consistent_hash")
NUM_SESSIONS = 4
NUM_TURNS = 3
NUM_TIMED = 8   # streamed one at a time, for TTFT and time per request
# The word-level tokenizer's chat template: each message's content, one after the other.
CHAT_TEMPLATE = "{% for m in messages %}{{ m['content'] }} {% endfor %}"


def router_binary() -> str | None:
    """``vllm-router`` beside this Python (``.venv-vllm/bin``, as scripts/setup-vllm.sh installs it), or on
    PATH, or where ``KVFERRY_VLLM_ROUTER`` says."""
    beside = Path(sys.executable).parent / "vllm-router"
    return os.environ.get("KVFERRY_VLLM_ROUTER") or (str(beside) if beside.exists() else shutil.which("vllm-router"))


ROUTER = router_binary()
if ROUTER is None:
    pytest.skip("vllm-router is not installed (scripts/setup-vllm.sh installs it)", allow_module_level=True)


def router_command(policy: str, prefills: Sequence[str], decodes: Sequence[str], port: int) -> list[str]:
    """docs/deploy.md's line (tests/test_deploy_doc.py holds the page to ``deploy_commands``), retries left at the
    router's defaults. Its Prometheus exporter gets a port of its own: every vllm-router binds 29000 by default,
    and a second one on the host then exits at start ("failed to install Prometheus metrics exporter ...
    Address already in use", seen 2026-12-05 beside another session's router)."""
    return vllm_router_argv(str(ROUTER), policy, prefills, decodes, port, free_port())


@pytest.fixture(scope="module")
def model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = write_tokenizer(write_model(tmp_path_factory.mktemp("tiny-llama")))
    (path / "chat_template.jinja").write_text(CHAT_TEMPLATE)
    return path


@pytest.fixture(scope="module")
def logs(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("router-logs")


def pd_servers(connector: str, model: Path, logs: Path) -> dict[str, Server]:
    """Two prefill and two decode ``vllm serve`` processes with ``connector`` ("kvferry" or "nixl"), started
    (not yet healthy); the model's tokenizer and chat template loaded (text and chat prompts)."""
    servers: dict[str, Server] = {}
    for name in ("prefill0", "prefill1", "decode0", "decode1"):
        role = "prefill" if name.startswith("prefill") else "decode"
        port = free_port()
        config = kvferry_config(role) if connector == "kvferry" else nixl_config(role)
        cmd = serve_command(model, port, "kv_producer", tokenizer=True)
        cmd[cmd.index("--kv-transfer-config") + 1] = json.dumps(config)
        cmd += ["--chat-template", str(model / "chat_template.jinja")]
        env = {"VLLM_NIXL_SIDE_CHANNEL_PORT": str(free_port())} if connector == "nixl" else {}
        servers[name] = Server(f"{connector}-{name}", cmd, logs, server_env(env), f"http://127.0.0.1:{port}")
    for server in servers.values():
        server.start()
    return servers


class Relay:
    """An HTTP relay in front of one server, in a thread of this process, that keeps the JSON body of every
    request it passes on (what vllm-router sends that server) and streams the answer back unchanged."""

    def __init__(self, target: str) -> None:
        import threading

        self.target = target
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.bodies: list[dict[str, Any]] = []
        self._loop = asyncio.new_event_loop()
        self._ready = threading.Event()
        self._thread = threading.Thread(target=self._serve, daemon=True)
        self._thread.start()
        assert self._ready.wait(30), "the relay did not start"

    def _serve(self) -> None:
        from aiohttp import ClientSession, web

        async def relay(request: web.Request) -> web.StreamResponse:
            data = await request.read()
            if data:
                self.bodies.append(json.loads(data))
            headers = {k: v for k, v in request.headers.items() if k.lower() in ("content-type", "x-request-id")}
            async with ClientSession() as http, http.request(request.method, self.target + request.path_qs,
                                                             data=data or None, headers=headers) as got:
                answer = web.StreamResponse(status=got.status, headers={"Content-Type": got.content_type})
                await answer.prepare(request)
                async for chunk in got.content.iter_any():
                    await answer.write(chunk)
                await answer.write_eof()
                return answer

        async def main() -> None:
            app = web.Application()
            app.router.add_route("*", "/{tail:.*}", relay)
            runner = web.AppRunner(app)
            await runner.setup()
            await web.TCPSite(runner, "127.0.0.1", self.port).start()
            self._runner = runner
            self._ready.set()

        asyncio.set_event_loop(self._loop)
        self._loop.run_until_complete(main())
        self._loop.run_forever()

    def close(self) -> None:
        asyncio.run_coroutine_threadsafe(self._runner.cleanup(), self._loop).result(30)
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(30)


# -- the client ------------------------------------------------------------------------------------------------
async def complete(http: Any, url: str, model: Path, prompt: list[int]) -> dict[str, Any]:
    body = {"model": str(model), "prompt": prompt, "max_tokens": MAX_TOKENS, "temperature": 0.0,
            "ignore_eos": True, "return_token_ids": True}
    async with http.post(url + "/v1/completions", json=body) as answer:
        text = await answer.text()
        assert answer.status == 200, text
        got = json.loads(text)
    return {"prompt": prompt, "tokens": got["choices"][0]["token_ids"], "id": got["id"]}


async def streamed(http: Any, url: str, model: Path, prompt: list[int]) -> dict[str, Any]:
    """One streamed completion: its tokens, when the first came (TTFT) and when the last did."""
    body = {"model": str(model), "prompt": prompt, "max_tokens": MAX_TOKENS, "temperature": 0.0,
            "ignore_eos": True, "return_token_ids": True, "stream": True}
    got: list[int] = []
    t0 = time.monotonic()
    first = None
    name = ""
    async with http.post(url + "/v1/completions", json=body) as answer:
        assert answer.status == 200, await answer.text()
        async for line in answer.content:
            text = line.decode().strip()
            if text.startswith("data: {"):
                chunk = json.loads(text[len("data: "):])
                name = name or chunk.get("id", "")
                ids = chunk["choices"][0].get("token_ids") or []
                if ids and first is None:
                    first = time.monotonic() - t0
                got.extend(ids)
    return {"prompt": prompt, "tokens": got, "ttft": first, "total": time.monotonic() - t0, "id": name}


async def chat_session(http: Any, url: str, model: Path, index: int, words: list[str]) -> list[dict[str, Any]]:
    """One multi-turn chat session (each turn the history, the answers and a new user message), kept on one
    decode by ``X-Session-ID``; per turn the prompt ids the server built and the answer's tokens."""
    messages: list[dict[str, str]] = []
    turns = []
    for turn in range(NUM_TURNS):
        start = (index * 97 + turn * 31) % (len(words) - 40)
        messages.append({"role": "user", "content": " ".join(words[start:start + 20 + 7 * turn])})
        body = {"model": str(model), "messages": messages, "max_tokens": MAX_TOKENS, "temperature": 0.0,
                "ignore_eos": True, "return_token_ids": True}
        async with http.post(url + "/v1/chat/completions", json=body,
                             headers={"X-Session-ID": f"session-{index}"}) as answer:
            text = await answer.text()
            assert answer.status == 200, text
            got = json.loads(text)
        choice = got["choices"][0]
        turns.append({"prompt": got["prompt_token_ids"], "tokens": choice["token_ids"], "id": got["id"]})
        messages.append({"role": "assistant", "content": choice["message"]["content"]})
    return turns


def run_policy(url: str, model: Path, prompts: list[list[int]]) -> dict[str, list[dict[str, Any]]]:
    import aiohttp

    words = tokenizer_words()

    async def main() -> dict[str, list[dict[str, Any]]]:
        timeout = aiohttp.ClientTimeout(total=600)
        async with aiohttp.ClientSession(timeout=timeout) as http:
            batch = await asyncio.gather(*(complete(http, url, model, p) for p in prompts))
            stream = [await streamed(http, url, model, prompts[0])]
            sessions = await asyncio.gather(*(chat_session(http, url, model, i, words) for i in range(NUM_SESSIONS)))
        return {"batch": list(batch), "stream": stream, "chat": [t for s in sessions for t in s]}

    return asyncio.run(main())


def timed(url: str, model: Path, prompts: list[list[int]]) -> list[dict[str, Any]]:
    """``NUM_TIMED`` streamed requests one at a time: TTFT and time per request through the router."""
    import aiohttp

    async def main() -> list[dict[str, Any]]:
        async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=600)) as http:
            return [await streamed(http, url, model, p) for p in prompts[:NUM_TIMED]]

    return asyncio.run(main())


def pairs(answers: Sequence[dict[str, Any]]) -> Counter[str]:
    """Which prefill and decode served each answer, from the id vllm-router gives it
    (``cmpl-___prefill_addr_HOST:PORT___decode_addr_HOST:PORT_<uuid>``)."""
    out: Counter[str] = Counter()
    for answer in answers:
        rest = answer["id"].split("___prefill_addr_", 1)[-1]
        prefill, _, rest = rest.partition("___decode_addr_")
        out[f"{prefill}->{rest.rsplit('_', 1)[0]}"] += 1
    return out


def settled_metrics(decodes: Sequence[Server]) -> dict[str, Any]:
    """The decodes' ``/metrics`` once kvferry's counters stopped moving (an engine reports a transfer's end
    at its next step), within 15 s."""
    def done(samples: dict[str, Any]) -> float:
        return sum(scraped(s, "vllm:kvferry_requests_done_total") for s in samples.values())

    last = {s.name.rsplit("-", 1)[-1]: scrape(s.url or "") for s in decodes}
    deadline = time.monotonic() + 15.0
    while time.monotonic() < deadline:
        time.sleep(1.0)
        now = {s.name.rsplit("-", 1)[-1]: scrape(s.url or "") for s in decodes}
        if done(now) == done(last):
            return now
        last = now
    return last


# -- the test ---------------------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def runs(model: Path, logs: Path) -> Iterator[dict[str, Any]]:
    """Both connectors' 2P2D behind vllm-router under each policy; the servers of one connector are stopped
    before the other's start (two cores)."""
    prompts = [p["prompt_token_ids"] for p in make_prompts(NUM_PROMPTS, seed=49)]
    out: dict[str, Any] = {}
    for connector in ("kvferry", "nixl"):
        servers = pd_servers(connector, model, logs)
        try:
            for server in servers.values():
                server.wait_healthy()
            prefills = [servers[n].url or "" for n in ("prefill0", "prefill1")]
            decodes = [servers[n].url or "" for n in ("decode0", "decode1")]
            before = {n: scrape(servers[n].url or "") for n in ("decode0", "decode1")}
            for policy in POLICIES:
                # Under the second policy the router reaches prefill0 and decode0 through relays that keep
                # what it sent them (not under the first: its timings are the ones compared).
                relays = [Relay(prefills[0]), Relay(decodes[0])] if policy != POLICIES[0] else []
                routed = ([relays[0].url, prefills[1]], [relays[1].url, decodes[1]]) if relays else (prefills, decodes)
                port = free_port()
                router = Server(f"router-{connector}-{policy}", router_command(policy, *routed, port), logs,
                                dict(os.environ), f"http://127.0.0.1:{port}")
                router.start()
                try:
                    router.wait_healthy(60)
                    got = run_policy(router.url or "", model, prompts)
                    if policy == POLICIES[0]:
                        got["timed"] = timed(router.url or "", model, prompts)
                    out[(connector, policy)] = got
                    if relays:
                        out[(connector, "sent")] = (relays[0].bodies, relays[1].bodies)
                finally:
                    router.terminate()
                    for relay in relays:
                        relay.close()
            out[(connector, "metrics")] = (before, settled_metrics([servers[n] for n in ("decode0", "decode1")]))
        finally:
            for server in servers.values():
                server.terminate()
    yield out


def reference(model: Path, prompts: Sequence[list[int]]) -> dict[tuple[int, ...], list[int]]:
    """One plain instance's greedy tokens for each distinct prompt (started after the PD servers stopped)."""
    from vllm.inputs import TokensPrompt

    distinct = sorted({tuple(p) for p in prompts})
    llm = make_llm(model)
    try:
        got = tokens(llm.generate([TokensPrompt(prompt_token_ids=list(p)) for p in distinct], greedy(MAX_TOKENS),
                                  use_tqdm=False))
    finally:
        close_llm(llm)
    return dict(zip(distinct, got))


def test_2p2d_behind_vllm_router_equals_one_plain_instance(runs: dict[str, Any], model: Path) -> None:
    answers = {key: [a for part in got.values() for a in part] for key, got in runs.items() if key[1] in POLICIES}
    expected = reference(model, [a["prompt"] for group in answers.values() for a in group])
    report = []
    for (connector, policy), group in answers.items():
        equal = sum(expected[tuple(a["prompt"])] == a["tokens"] for a in group)
        report.append(f"{connector:8s} {policy:16s} {equal}/{len(group)} equal; pairs {dict(pairs(group))}")
    print("\n" + "\n".join(report))
    for (connector, policy), group in answers.items():
        bad = [a for a in group if expected[tuple(a["prompt"])] != a["tokens"]]
        assert not bad, f"{connector} under {policy}: {len(bad)}/{len(group)} answers differ from one plain instance"

    # kvferry took what vllm-router forwarded: every request's KV came through it, none failed, and later chat
    # turns hit the decode's prefix cache (kvferry moved only the rest).
    before, after = runs[("kvferry", "metrics")]
    done = sum(scraped(after[d], "vllm:kvferry_requests_done_total", role="decode")
               - scraped(before[d], "vllm:kvferry_requests_done_total", role="decode") for d in after)
    failed = sum(scraped(after[d], "vllm:kvferry_requests_failed_total", role="decode") for d in after)
    kvferry_answers = sum(len(g) for (c, _), g in answers.items() if c == "kvferry")
    cached = sum(scraped(after[d], "vllm:prompt_tokens_by_source_total", source="local_cache_hit")
                 - scraped(before[d], "vllm:prompt_tokens_by_source_total", source="local_cache_hit") for d in after)
    print(f"kvferry decodes: {done:.0f} transfers done, {failed:.0f} failed, for {kvferry_answers} answers; "
          f"{cached:.0f} prompt tokens from the decodes' prefix caches")
    assert failed == 0 and done == kvferry_answers
    assert cached > 0

    # What vllm-router sent: prefill got the prompt with max_tokens 1 and do_remote_decode; decode got the
    # kv_transfer_params that kvferry's prefill returned, as kvferry wrote them.
    to_prefill, to_decode = runs[("kvferry", "sent")]
    asked = [b for b in to_prefill if "kv_transfer_params" in b]
    handed = [b for b in to_decode if "kv_transfer_params" in b]
    print(f"vllm-router to a prefill: {sorted(asked[0])} with kv_transfer_params {asked[0]['kv_transfer_params']}")
    print(f"vllm-router to a decode: kv_transfer_params {handed[0]['kv_transfer_params']}")
    assert asked and all(b["max_tokens"] == 1 and b["kv_transfer_params"].get("do_remote_decode") for b in asked)
    assert handed and all({"kvferry_address", "kvferry_request_id"} <= set(b["kv_transfer_params"]) for b in handed)

    # TTFT and time per request, side by side (streamed, one at a time, round_robin).
    lines = []
    for connector in ("kvferry", "nixl"):
        timed_runs = runs[(connector, POLICIES[0])]["timed"]
        ttft = statistics.median(t["ttft"] for t in timed_runs)
        total = statistics.median(t["total"] for t in timed_runs)
        lines.append(f"{connector:8s} TTFT p50 {ttft * 1000:7.1f} ms   time per request p50 {total * 1000:7.1f} ms "
                     f"({len(timed_runs)} requests, {MAX_TOKENS} tokens each)")
    print("\n".join(lines))
