"""A small HTTP proxy for two ``vllm serve`` processes: prefill first, then decode with its transfer params.

Part of the integrations layer, above ``scheduler`` (whose transfer parameters it carries), below the
``kvferry vllm-proxy`` command. It speaks vLLM's OpenAI-compatible ``/v1/completions``: each request goes
to prefill with ``max_tokens=1`` and ``kv_transfer_params={"do_remote_decode": true}``; prefill's answer
carries the transfer parameters, and the original request goes to decode with them, whose answer (streamed
or not) is the client's. This is the hand-off vLLM's own disaggregated examples do; the connector on both
servers is kvferry's. ``aiohttp`` (a vLLM dependency) is imported only here.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

from kvferry.errors import UsageError

__all__ = ["ProxyConfig", "make_app", "serve"]

PATH = "/v1/completions"


@dataclass(frozen=True, slots=True)
class ProxyConfig:
    """Where the two servers are (``http://host:port``) and how long one hop may take (seconds)."""

    prefill_url: str
    decode_url: str
    timeout: float = 300.0


def make_app(config: ProxyConfig) -> Any:
    """The ``aiohttp.web.Application``: ``POST /v1/completions`` and ``GET /health``."""
    web, client = _aiohttp()

    async def start(app: Any) -> None:
        app["session"] = client.ClientSession(timeout=client.ClientTimeout(total=config.timeout))

    async def stop(app: Any) -> None:
        await app["session"].close()

    async def health(request: Any) -> Any:
        return web.json_response({"prefill": config.prefill_url, "decode": config.decode_url})

    async def completions(request: Any) -> Any:
        body = await request.json()
        session = request.app["session"]
        params, error = await _prefill(session, config.prefill_url, body)
        if error is not None:
            return web.json_response({"error": error}, status=502)
        async with session.post(config.decode_url + PATH, json={**body, "kv_transfer_params": params}) as answer:
            response = web.StreamResponse(status=answer.status, headers={
                "Content-Type": answer.headers.get("Content-Type", "application/json")})
            await response.prepare(request)
            async for chunk in answer.content.iter_any():
                await response.write(chunk)
            await response.write_eof()
            return response

    app = web.Application()
    app.on_startup.append(start)
    app.on_cleanup.append(stop)
    app.router.add_get("/health", health)
    app.router.add_post(PATH, completions)
    return app


async def _prefill(session: Any, url: str, body: dict[str, Any]) -> tuple[dict[str, Any] | None, str | None]:
    """Prefill's transfer params for ``body``, or why there are none."""
    request = {**body, "max_tokens": 1, "stream": False, "kv_transfer_params": {"do_remote_decode": True}}
    request.pop("stream_options", None)
    request.pop("min_tokens", None)
    async with session.post(url + PATH, json=request) as answer:
        text = await answer.text()
    if answer.status != 200:
        return None, f"prefill answered {answer.status}: {text[:500]}"
    params = json.loads(text).get("kv_transfer_params")
    if not params:
        return None, "prefill returned no kv_transfer_params: is it running with kv_role kv_producer?"
    return params, None


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
