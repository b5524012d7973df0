"""The ``kvferry`` entry point: one argparse parser with a subcommand per command module.

The top of the command line, above every command module (``layouts``, ``demo``, ``stress``, ``chaos``,
``simulate``, ``diff``, ``bench``, ``vllm_proxy``), which in turn sit above ``args``. Each command module has
``add_parser(subparsers)``, which adds its subcommand and sets ``handler=fn(args) -> int``; heavy
dependencies (nixl, zmq, torch, matplotlib, aiohttp) are imported inside the handlers, so ``kvferry --help``
stays fast. ``KVFerryError`` from a handler becomes a one-line message on stderr and exit status 2.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence

from kvferry.cli import bench, chaos, demo, diff, layouts, simulate, stress, vllm_chaos, vllm_proxy
from kvferry.errors import KVFerryError

__all__ = ["COMMANDS", "build_parser", "main"]

# Each adds its subcommands, in the order ``kvferry --help`` lists them.
COMMANDS = (layouts.add_presets_parser, layouts.add_audit_parser, layouts.add_sizing_parser, demo.add_parser,
            stress.add_parser, chaos.add_parser, simulate.add_parser, diff.add_parser, bench.add_parser,
            vllm_proxy.add_parser, vllm_chaos.add_parser)


def main(argv: Sequence[str] | None = None) -> int:
    """Run one subcommand; return its exit status (0 ok, 2 usage or kvferry error)."""
    parser = build_parser()
    try:
        args = parser.parse_args(argv)
    except SystemExit as exc:  # argparse exits on --help and on usage errors; hand back the status
        return exc.code if isinstance(exc.code, int) else 2
    try:
        return int(args.handler(args))
    except KVFerryError as exc:
        print(f"kvferry {args.command}: error: {exc}", file=sys.stderr)
        return 2


def build_parser() -> argparse.ArgumentParser:
    """The top-level parser with every command in ``COMMANDS`` registered."""
    parser = argparse.ArgumentParser(
        prog="kvferry", description="Move paged, heterogeneous KV cache from prefill to decode workers.")
    subparsers = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)
    for add in COMMANDS:
        add(subparsers)
    return parser
