"""What the endpoints' stats cost per request, hook by hook (``control.stats``), stats on against off.

Each hook is timed in a tight loop (best of ``--repeats`` runs of ``--calls`` calls: the minimum is what
the code costs when nothing else runs, which a loaded machine cannot show in ``bench/control.py``'s p50s),
with the recorder the endpoints use (``StatsRecorder``) and with ``NullRecorder`` (``EndpointOptions(
stats=False)``), and summed into what one request of ``bench/control.py`` pays on each side: prefill posts
a share of a transfer, polls its handle a few times and ends the request; decode checks one chunk's
digests and ends the request.

Usage: ``python bench/stats.py [--calls N] [--repeats N] [--polls N] [--json]``.
"""

from __future__ import annotations

import argparse
import json
import time
from collections.abc import Callable
from typing import Any

import numpy as np

from kvferry import Buffer, KVMemory, Layout, Pool, plan_transfer
from kvferry.control.stats import NullRecorder, StatsRecorder
from kvferry.transport import TransferHandle


class DoneHandle(TransferHandle):
    """A handle that is done at once: what is left is the wrapper's own cost."""

    peer, label = "peer", "label"

    def poll(self) -> bool:
        return True

    def release(self) -> None:
        return


def layout() -> Layout:
    """bench/control.py's layout: 4 layers of KV and indexer keys in a main pool, a compressed pool."""
    main = [b for layer in range(4) for b in (Buffer(f"main.kv.L{layer}", 4096, 1000, "fp8_e4m3", "kv", layer),
                                              Buffer(f"main.idx.L{layer}", 1024, 900, "bf16", "index_k", layer))]
    return Layout([Pool("main", main, tokens_per_page=64),
                   Pool("c4", [Buffer("c4.kv", 2048, 300, "fp8_e4m3", "kv", 0)], tokens_per_page=256)])


def best_ns(fn: Callable[[], Any], calls: int, repeats: int) -> float:
    """Best of ``repeats`` runs: ns per call of ``fn``."""
    best = float("inf")
    for _ in range(repeats):
        t0 = time.perf_counter_ns()
        for _ in range(calls):
            fn()
        best = min(best, (time.perf_counter_ns() - t0) / calls)
    return best


def hooks(recorder: StatsRecorder, plan: Any, pages: dict[str, np.ndarray]) -> dict[str, Callable[[], Any]]:
    """One call of each hook; ``poll`` polls a handle ``posted`` returned (stats on: the timing wrapper)."""
    posted = recorder.posted(plan, DoneHandle())
    return {"post": lambda: recorder.posted(plan, DoneHandle()), "poll": posted.poll,
            "request_done": lambda: recorder.request_done(1e-3, pages), "verified": lambda: recorder.verified(32)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--calls", type=int, default=100_000)
    ap.add_argument("--repeats", type=int, default=7)
    ap.add_argument("--polls", type=int, default=4, help="polls of a handle per request (prefill, push)")
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args()
    lay = layout()
    memory = KVMemory.allocate(lay)
    pages = {"main": np.arange(12), "c4": np.arange(4)}
    plan = plan_transfer(memory, memory, {pool: (p, p + 100) for pool, p in pages.items()})
    out: dict[str, dict[str, float]] = {}
    for name, recorder in (("on", StatsRecorder("prefill", lay)), ("off", NullRecorder("prefill", lay))):
        out[name] = {hook: best_ns(fn, args.calls, args.repeats) for hook, fn in hooks(recorder, plan, pages).items()}
    cost = {hook: out["on"][hook] - out["off"][hook] for hook in out["on"]}
    per_side = {   # what one request adds: prefill posts (at most) a transfer, polls it, ends the request;
        # decode checks a chunk's digests and ends the request
        "prefill_ns": cost["post"] + args.polls * cost["poll"] + cost["request_done"],
        "decode_ns": cost["verified"] + cost["request_done"],
    }
    if args.json:
        print(json.dumps({"hooks_ns": out, "per_request_ns": per_side}, indent=2))
        return
    print(f"best of {args.repeats} x {args.calls} calls, ns per call")
    print(f"{'hook':<16}{'stats on':>10}{'stats off':>11}")
    for hook in out["on"]:
        print(f"{hook:<16}{out['on'][hook]:>10.0f}{out['off'][hook]:>11.0f}")
    print(f"per request, stats on minus off: prefill {per_side['prefill_ns']:.0f} ns, "
          f"decode {per_side['decode_ns']:.0f} ns")


if __name__ == "__main__":
    main()
