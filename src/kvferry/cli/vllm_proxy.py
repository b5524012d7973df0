"""``kvferry vllm-proxy``: one address in front of a prefill and a decode ``vllm serve`` using kvferry.

A command module, below ``main``, above ``kvferry.integrations.vllm.proxy`` (imported in the handler: it
needs aiohttp, which comes with vLLM). See docs/vllm.md.
"""

from __future__ import annotations

import argparse

__all__ = ["add_parser", "run_proxy"]


def add_parser(subparsers: argparse._SubParsersAction) -> None:
    """Register ``kvferry vllm-proxy`` (handler ``run_proxy``)."""
    p = subparsers.add_parser(
        "vllm-proxy", help="serve /v1/completions through a prefill and a decode vLLM server",
        description="Send each completion request to the prefill server (max_tokens 1, do_remote_decode), "
                    "then to the decode server with the kv_transfer_params prefill returned; answer with "
                    "decode's response (streamed or not). Both servers run kvferry's KV connector.")
    p.add_argument("--prefill", required=True, help="prefill server URL, e.g. http://127.0.0.1:8100")
    p.add_argument("--decode", required=True, help="decode server URL, e.g. http://127.0.0.1:8200")
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=8000)
    p.add_argument("--timeout", type=float, default=300.0, help="seconds one hop may take")
    p.set_defaults(handler=run_proxy)


def run_proxy(args: argparse.Namespace) -> int:
    """Handler: serve until interrupted."""
    from kvferry.integrations.vllm.proxy import ProxyConfig, serve

    serve(ProxyConfig(args.prefill.rstrip("/"), args.decode.rstrip("/"), args.timeout), args.host, args.port)
    return 0
