"""A small HTTP proxy for ``vllm serve`` processes: a prefill first, then a decode with its transfer params.

Part of the integrations layer, above ``scheduler`` (whose transfer parameters it carries), below the
``kvferry vllm-proxy`` command. It speaks vLLM's OpenAI-compatible ``/v1/completions``: each request goes
to a prefill server with ``max_tokens=1`` and ``kv_transfer_params={"do_remote_decode": true}``; prefill's
answer carries the transfer parameters, and the original request goes to a decode server with them, whose
answer (streamed or not) is the client's. This is the hand-off vLLM's own disaggregated examples do; the
connector on both servers is kvferry's. ``aiohttp`` (a vLLM dependency) is imported only here.

Faults (docs/vllm.md, "Faults"): prefills and decodes are taken in turn (round robin). A prefill that
refuses the connection, fails, answers an error or does not answer within ``prefill_timeout`` is skipped
for ``down_for`` seconds and the next one is tried; when none answers, the client gets a 502 (or, with
``fallback="decode"``, decode prefills the request itself). A decode that refuses the connection is
skipped the same way before anything was sent to it; one that fails after it got the request gives the
client a 502 (non-streamed: decode's whole answer is read before the client sees a byte, so a decode that
dies mid-answer never yields a truncated 200) or, streamed, an SSE ``error`` event and no ``[DONE]``.
Every answer comes within ``timeout`` of the request.
"""

from __future__ import annotations

import asyncio
import itertools
import json
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from kvferry.errors import PeerLost, UsageError

__all__ = ["Backends", "ProxyConfig", "make_app", "serve"]

PATH = "/v1/completions"
FALLBACKS = ("error", "decode")
KEEPALIVE = 2.0   # seconds an idle connection to a server is kept


@dataclass(frozen=True, slots=True)
class ProxyConfig:
    """Where the servers are (``http://host:port``, one or more of each) and the deadlines (seconds).

    ``timeout``: the whole request, both hops. ``prefill_timeout``: one prefill hop (the prompt's
    prefill: a server stalled longer is treated as down). ``down_for``: how long a server that failed is
    skipped (retried anyway when every server of its role is skipped). ``fallback``: what a request
    gets when no prefill answered: ``"error"`` (a 502) or ``"decode"`` (sent to decode without transfer
    params: decode prefills it itself)."""

    prefill_urls: Sequence[str]
    decode_urls: Sequence[str]
    timeout: float = 300.0
    prefill_timeout: float = 30.0
    down_for: float = 2.0
    fallback: str = "error"

    def __post_init__(self) -> None:
        if not self.prefill_urls or not self.decode_urls:
            raise UsageError(f"kvferry vllm-proxy: needs at least one prefill and one decode server, got "
                             f"prefill {list(self.prefill_urls)}, decode {list(self.decode_urls)}")
        if self.fallback not in FALLBACKS:
            raise UsageError(f"kvferry vllm-proxy: fallback must be one of {FALLBACKS}, got {self.fallback!r}")
        for name in ("timeout", "prefill_timeout"):
            if not getattr(self, name) > 0:
                raise UsageError(f"kvferry vllm-proxy: {name} must be > 0, got {getattr(self, name)!r}")


@dataclass
class Backends:
    """The servers of one role, taken in turn; one that failed is skipped until ``down_for`` after."""

    urls: Sequence[str]
    down_for: float
    _turn: itertools.count = field(default_factory=itertools.count)
    _down_until: dict[str, float] = field(default_factory=dict)

    def order(self) -> list[str]:
        """Every server once, starting at the next in turn, those marked down last."""
        start = next(self._turn) % len(self.urls)
        turn = [*self.urls[start:], *self.urls[:start]]
        now = time.monotonic()
        return [u for u in turn if self._down_until.get(u, 0.0) <= now] + \
               [u for u in turn if self._down_until.get(u, 0.0) > now]

    def all_down(self) -> bool:
        now = time.monotonic()
        return all(self._down_until.get(u, 0.0) > now for u in self.urls)

    def failed(self, url: str) -> None:
        self._down_until[url] = time.monotonic() + self.down_for

    def answered(self, url: str) -> None:
        self._down_until.pop(url, None)


def make_app(config: ProxyConfig) -> Any:
    """The ``aiohttp.web.Application``: ``POST /v1/completions`` and ``GET /health``."""
    web, client = _aiohttp()
    session_key = web.AppKey("session", client.ClientSession)
    prefills = Backends(list(config.prefill_urls), config.down_for)
    decodes = Backends(list(config.decode_urls), config.down_for)

    async def start(app: Any) -> None:
        # No total timeout on the session: each hop sets its own, from the request's deadline. Idle
        # connections are dropped before uvicorn's keep-alive (5 s) closes them from its side: a request on
        # a connection the server just closed fails with ServerDisconnectedError without reaching it.
        connector = client.TCPConnector(limit=0, keepalive_timeout=KEEPALIVE)
        app[session_key] = client.ClientSession(connector=connector, timeout=client.ClientTimeout(total=None))

    async def stop(app: Any) -> None:
        await app[session_key].close()

    async def health(request: Any) -> Any:
        return web.json_response({"prefill": list(config.prefill_urls), "decode": list(config.decode_urls)})

    async def completions(request: Any) -> Any:
        deadline = time.monotonic() + config.timeout
        body = await request.json()
        session = request.app[session_key]
        if decodes.all_down():   # no prefill work (and no blocks held there) for a request no decode takes
            return _error(web, 502, f"every decode server refused a connection within {config.down_for} s")
        params, errors = await _any_prefill(session, prefills, body, deadline, config.prefill_timeout)
        if params is None and config.fallback == "error":
            return _error(web, 502, "no prefill server answered: " + "; ".join(errors))
        decode_body = body if params is None else {**body, "kv_transfer_params": params}
        return await _any_decode(web, client, session, decodes, request, decode_body, deadline, errors)

    app = web.Application()
    app.on_startup.append(start)
    app.on_cleanup.append(stop)
    app.router.add_get("/health", health)
    app.router.add_post(PATH, completions)
    return app


async def _any_prefill(session: Any, prefills: Backends, body: dict[str, Any], deadline: float,
                       hop_timeout: float) -> tuple[dict[str, Any] | None, list[str]]:
    """Transfer params from the first prefill that gives them, and why each one tried did not."""
    errors: list[str] = []
    for url in prefills.order():
        left = deadline - time.monotonic()
        if left <= 0:
            errors.append("the request's deadline passed")
            break
        try:
            params = await _prefill(session, url, body, min(hop_timeout, left))
        except PeerLost as exc:
            prefills.failed(url)
            errors.append(str(exc))
            continue
        prefills.answered(url)
        return params, errors
    return None, errors


async def _prefill(session: Any, url: str, body: dict[str, Any], timeout: float) -> dict[str, Any]:
    """Prefill's transfer params for ``body``; ``PeerLost`` naming the server and what went wrong."""
    import aiohttp

    request = {**body, "max_tokens": 1, "stream": False, "kv_transfer_params": {"do_remote_decode": True}}
    request.pop("stream_options", None)
    request.pop("min_tokens", None)
    try:
        async with await _post_fresh(aiohttp, session, url + PATH, request, timeout) as answer:
            text = await answer.text()
    except (aiohttp.ClientError, asyncio.TimeoutError) as exc:
        raise PeerLost(f"prefill {url}: {type(exc).__name__} {exc} (within {timeout:.1f} s)") from exc
    if answer.status != 200:
        raise PeerLost(f"prefill {url} answered {answer.status}: {text[:300]}")
    try:
        params = json.loads(text).get("kv_transfer_params")
    except (ValueError, AttributeError) as exc:
        raise PeerLost(f"prefill {url} answered 200 with no JSON object: {text[:300]}") from exc
    if not params:
        raise PeerLost(f"prefill {url} returned no kv_transfer_params: is it running with kv_role kv_producer?")
    return params


async def _any_decode(web: Any, client: Any, session: Any, decodes: Backends, request: Any,
                      body: dict[str, Any], deadline: float, errors: list[str]) -> Any:
    """Decode's answer from the first decode that takes the connection; a 502 when none does or the one
    that took it failed. A decode is retried only while nothing was sent to it: after that it may be
    decoding the request, and prefill's KV for it was handed to that decode alone."""
    for url in decodes.order():
        left = deadline - time.monotonic()
        if left <= 0:
            break
        try:
            answer = await _post_fresh(client, session, url + PATH, body, left)
        except client.ClientConnectorError as exc:
            decodes.failed(url)
            errors.append(f"decode {url}: {exc}")
            continue
        except (client.ClientError, asyncio.TimeoutError) as exc:
            # Not marked down: only a refused connection says the server is gone (the next one refuses too).
            return _error(web, 502, f"decode {url}: {type(exc).__name__} {exc}")
        decodes.answered(url)
        async with answer:
            if body.get("stream"):
                return await _relay_stream(web, client, request, answer, url)
            return await _relay_whole(web, client, answer, url)
    return _error(web, 502, "no decode server answered: " + "; ".join(errors or ["the request's deadline passed"]))


async def _post_fresh(client: Any, session: Any, url: str, body: dict[str, Any], timeout: float) -> Any:
    """POST, once more when the connection was closed or reset before any answer came. The usual cause is
    a server that dropped the connection idle, or, after a stall (SIGSTOP), whose overdue keep-alive timer
    closed it with our request unread: the request never reached the server. A server that died refuses
    the second connection (``ClientConnectorError``, not retried)."""
    try:
        return await session.post(url, json=body, timeout=client.ClientTimeout(total=timeout))
    except client.ClientConnectorError:
        raise
    except (client.ServerDisconnectedError, client.ClientOSError):
        return await session.post(url, json=body, timeout=client.ClientTimeout(total=timeout))


async def _relay_whole(web: Any, client: Any, answer: Any, url: str) -> Any:
    try:
        data = await answer.read()
    except (client.ClientError, asyncio.TimeoutError) as exc:
        return _error(web, 502, f"decode {url} failed mid-answer: {type(exc).__name__} {exc}")
    return web.Response(status=answer.status, body=data,
                        content_type=answer.headers.get("Content-Type", "application/json").split(";")[0])


async def _relay_stream(web: Any, client: Any, request: Any, answer: Any, url: str) -> Any:
    response = web.StreamResponse(status=answer.status, headers={
        "Content-Type": answer.headers.get("Content-Type", "application/json")})
    await response.prepare(request)
    try:
        async for chunk in answer.content.iter_any():
            await response.write(chunk)
    except (client.ClientError, asyncio.TimeoutError) as exc:
        # The status is sent: say so in the stream, and leave out the [DONE] a complete stream ends with.
        event = {"error": {"message": f"decode {url} failed mid-stream: {type(exc).__name__} {exc}",
                           "type": "BadGateway", "code": 502}}
        await response.write(f"data: {json.dumps(event)}\n\n".encode())
    await response.write_eof()
    return response


def _error(web: Any, status: int, message: str) -> Any:
    return web.json_response({"error": {"message": message, "type": "BadGateway", "code": status}}, status=status)


def serve(config: ProxyConfig, host: str, port: int) -> None:
    """Blocking: serve the proxy until interrupted."""
    web, _ = _aiohttp()
    web.run_app(make_app(config), host=host, port=port, print=None)


def _aiohttp() -> tuple[Any, Any]:
    try:
        import aiohttp
        from aiohttp import web
    except ImportError as exc:
        raise UsageError("kvferry vllm-proxy needs aiohttp (it comes with vLLM; or pip install aiohttp)") from exc
    return web, aiohttp
