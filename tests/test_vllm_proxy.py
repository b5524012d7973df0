"""``kvferry vllm-proxy`` against stand-in servers (no vLLM): round robin, a prefill that is down, stalled or
failing, a decode that refuses, dies mid-answer or mid-stream, the fallback to decode.

Needs aiohttp (it comes with vLLM: ``make test-vllm`` runs this in ``.venv-vllm``); skipped without it.
"""

from __future__ import annotations

import asyncio
import json
import socket
from collections.abc import Awaitable, Callable
from typing import Any

import pytest

from kvferry.errors import UsageError

aiohttp = pytest.importorskip("aiohttp", reason="aiohttp is not installed (it comes with vLLM)")
from aiohttp import web  # noqa: E402

from kvferry.integrations.vllm.proxy import ProxyConfig, make_app  # noqa: E402

Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]


def port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def prefill_answering(seen: list[int]) -> Handler:
    async def handle(request: web.Request) -> web.StreamResponse:
        body = await request.json()
        assert body["max_tokens"] == 1 and body["kv_transfer_params"] == {"do_remote_decode": True}
        seen.append(request.url.port or 0)
        return web.json_response({"kv_transfer_params": {"from": request.url.port}})
    return handle


def decode_answering(seen: list[int]) -> Handler:
    async def handle(request: web.Request) -> web.StreamResponse:
        body = await request.json()
        seen.append(request.url.port or 0)
        return web.json_response({"choices": [{"token_ids": [7], "finish_reason": "length",
                                               "params": body.get("kv_transfer_params")}]})
    return handle


async def stalled(request: web.Request) -> web.StreamResponse:
    await asyncio.sleep(3)   # past the tests' prefill_timeout of 1 s (the stand-in's shutdown waits for it)
    return web.json_response({})


async def failing(request: web.Request) -> web.StreamResponse:
    return web.json_response({"error": "boom"}, status=500)


async def dies_mid_answer(request: web.Request) -> web.StreamResponse:
    response = web.StreamResponse(status=200, headers={"Content-Type": "application/json"})
    await response.prepare(request)
    await response.write(b'{"choices": [{"token_ids": [7')
    assert request.transport is not None
    request.transport.close()   # as a SIGKILLed server: the connection drops mid-body
    return response


def resets_first(handler: Handler) -> Handler:
    """Drops the first connection without an answer (as a server resuming from SIGSTOP whose overdue
    keep-alive timer closes a connection with a request unread), then answers as ``handler``."""
    calls = [0]

    async def handle(request: web.Request) -> web.StreamResponse:
        calls[0] += 1
        if calls[0] == 1:
            assert request.transport is not None
            request.transport.abort()
            return web.Response()
        return await handler(request)
    return handle


def run(prefills: list[Handler | None], decodes: list[Handler | None], requests: list[dict[str, Any]],
        **config: Any) -> list[tuple[int, Any]]:
    """Serve the stand-ins (None: nothing listens on that port) and the proxy; send ``requests`` one by one."""
    async def main() -> list[tuple[int, Any]]:
        runners = []

        async def serve(app: web.Application) -> str:
            where = port()
            runner = web.AppRunner(app)
            await runner.setup()
            await web.TCPSite(runner, "127.0.0.1", where).start()
            runners.append(runner)
            return f"http://127.0.0.1:{where}"

        async def backend(handler: Handler | None) -> str:
            if handler is None:
                return f"http://127.0.0.1:{port()}"
            app = web.Application()
            app.router.add_post("/v1/completions", handler)
            return await serve(app)

        urls = ([await backend(h) for h in prefills], [await backend(h) for h in decodes])
        proxy = await serve(make_app(ProxyConfig(*urls, **config)))
        got = []
        try:
            async with aiohttp.ClientSession() as http:
                for body in requests:
                    async with http.post(proxy + "/v1/completions", json=body) as answer:
                        text = await answer.text()
                        got.append((answer.status, text if body.get("stream") else json.loads(text)))
        finally:
            for runner in runners:
                await runner.cleanup()
        return got

    return asyncio.run(main())


def test_prefills_and_decodes_are_taken_in_turn() -> None:
    prefilled: list[int] = []
    decoded: list[int] = []
    got = run([prefill_answering(prefilled)] * 2, [decode_answering(decoded)] * 3, [{"prompt": [1]}] * 6)
    assert [status for status, _ in got] == [200] * 6
    assert len(set(prefilled)) == 2 and [prefilled.count(p) for p in set(prefilled)] == [3, 3]
    assert len(set(decoded)) == 3 and all(decoded.count(p) == 2 for p in set(decoded))
    # Decode got the transfer params of the prefill that answered.
    assert [body["choices"][0]["params"]["from"] for _, body in got] == prefilled


@pytest.mark.parametrize("bad", [None, stalled, failing], ids=["down", "stalled", "failing"])
def test_a_bad_prefill_is_skipped_for_the_next(bad: Handler | None) -> None:
    prefilled: list[int] = []
    got = run([bad, prefill_answering(prefilled)], [decode_answering([])], [{"prompt": [1]}] * 3,
              prefill_timeout=1.0)
    assert [status for status, _ in got] == [200] * 3
    assert len(prefilled) == 3


@pytest.mark.parametrize("bad", [None, stalled, failing], ids=["down", "stalled", "failing"])
def test_no_prefill_answering_is_an_error_for_the_client(bad: Handler | None) -> None:
    got = run([bad], [decode_answering([])], [{"prompt": [1]}], prefill_timeout=1.0)
    status, body = got[0]
    assert status == 502 and "no prefill server answered: prefill http://127.0.0.1:" in body["error"]["message"]


def test_the_fallback_sends_to_decode_without_transfer_params() -> None:
    got = run([None], [decode_answering([])], [{"prompt": [1]}], fallback="decode")
    assert got[0][0] == 200 and got[0][1]["choices"][0]["params"] is None


def test_a_decode_that_refuses_is_skipped_and_none_is_an_error() -> None:
    decoded: list[int] = []
    assert [s for s, _ in run([prefill_answering([])], [None, decode_answering(decoded)], [{}] * 4)] == [200] * 4
    assert len(decoded) == 4
    status, body = run([prefill_answering([])], [None], [{}])[0]
    assert status == 502 and "no decode server answered" in body["error"]["message"]


def test_a_decode_dying_mid_answer_is_a_502_never_a_truncated_200() -> None:
    status, body = run([prefill_answering([])], [dies_mid_answer], [{}])[0]
    assert status == 502 and "failed mid-answer" in body["error"]["message"]


def test_a_decode_dying_mid_stream_ends_the_stream_with_an_error_event() -> None:
    status, text = run([prefill_answering([])], [dies_mid_answer], [{"stream": True}])[0]
    assert status == 200 and "failed mid-stream" in text and "[DONE]" not in text


def test_the_config_is_checked() -> None:
    with pytest.raises(UsageError, match="at least one prefill"):
        ProxyConfig([], ["http://127.0.0.1:1"])
    with pytest.raises(UsageError, match="fallback must be one of"):
        ProxyConfig(["http://127.0.0.1:1"], ["http://127.0.0.1:2"], fallback="retry")


def test_a_connection_dropped_before_any_answer_is_tried_once_more() -> None:
    prefilled: list[int] = []
    decoded: list[int] = []
    got = run([resets_first(prefill_answering(prefilled))], [resets_first(decode_answering(decoded))], [{}] * 2)
    assert [status for status, _ in got] == [200, 200] and len(prefilled) == 2 and len(decoded) == 2
