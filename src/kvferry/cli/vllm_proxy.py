"""``kvferry vllm-proxy``: one address in front of prefill and decode ``vllm serve`` processes using kvferry.

A command module, below ``main``, above ``kvferry.integrations.vllm.proxy`` (imported in the handler: it
needs aiohttp, which comes with vLLM). See docs/vllm.md.
"""

from __future__ import annotations

import argparse

__all__ = ["add_parser", "run_proxy"]


def add_parser(subparsers: argparse._SubParsersAction) -> None:
    """Register ``kvferry vllm-proxy`` (handler ``run_proxy``)."""
    p = subparsers.add_parser(
        "vllm-proxy", help="serve /v1/completions through prefill and decode vLLM servers",
        description="Send each completion request to a prefill server (max_tokens 1, do_remote_decode), "
                    "then to a decode server with the kv_transfer_params prefill returned; answer with "
                    "decode's response (streamed or not). The servers run kvferry's KV connector. Several "
                    "of each are taken in turn; a prefill that is down or does not answer within "
                    "--prefill-timeout is skipped and the next tried.")
    p.add_argument("--prefill", required=True, action="append",
                   help="prefill server URL, e.g. http://127.0.0.1:8100 (repeat for several)")
    p.add_argument("--decode", required=True, action="append",
                   help="decode server URL, e.g. http://127.0.0.1:8200 (repeat for several)")
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=8000)
    p.add_argument("--timeout", type=float, default=300.0, help="seconds a whole request may take (default 300)")
    p.add_argument("--prefill-timeout", type=float, default=30.0,
                   help="seconds one prefill hop may take before the next prefill is tried (default 30)")
    p.add_argument("--down-for", type=float, default=2.0,
                   help="seconds a server that failed is skipped (default 2)")
    p.add_argument("--fallback", choices=("error", "decode"), default="error",
                   help="when no prefill answers: a 502 (default), or decode prefills the request itself")
    p.set_defaults(handler=run_proxy)


def run_proxy(args: argparse.Namespace) -> int:
    """Handler: serve until interrupted."""
    from kvferry.integrations.vllm.proxy import ProxyConfig, serve

    config = ProxyConfig([u.rstrip("/") for u in args.prefill], [u.rstrip("/") for u in args.decode],
                         timeout=args.timeout, prefill_timeout=args.prefill_timeout, down_for=args.down_for,
                         fallback=args.fallback)
    serve(config, args.host, args.port)
    return 0
