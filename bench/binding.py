"""What binding a hand-off to its tokens costs (issue 31), per request, on each side.

    python bench/binding.py [--repeats 300] [--requests 300] [--json OUT]

Four figures, each for prompts of 128 to 32,768 tokens:

* ``token_binding``: hashing the prompt's token ids into chained per-block entries, what the vLLM connector's
  scheduler does once per request on each side (blocks of 32 tokens, vLLM's here) and SGLang's backend (64).
* ``check_binding``: prefill's comparison of two equal bindings (the whole walk, the case of every request
  served), on its progress thread when decode's announce meets its send.
* the ``Announce`` message: bytes and msgpack encode + decode time, with and without the binding.
* a hand-off between two endpoints in this process (local transport, digests sampled), announce to decode's
  ``done``, one request in flight, bound and unbound interleaved: the binding's whole cost in a request's
  latency (hashing on both sides included, as the engines pay it).

Median microseconds (p99 for the end-to-end runs). Figures depend on the machine and its load; run on an idle
one for anything but orders of magnitude.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from collections.abc import Callable
from typing import Any

import numpy as np

from kvferry import Buffer, KVMemory, Layout, Pool, token_binding
from kvferry.control import DecodeEndpoint, EndpointOptions, PrefillEndpoint, wire
from kvferry.integrity.binding import check_binding

LENGTHS = (128, 1024, 8192, 32768)


def median_us(fn: Callable[[], Any], repeats: int) -> float:
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times) * 1e6


def micro(repeats: int) -> dict[str, Any]:
    rng = np.random.default_rng(0)
    rows = []
    for n in LENGTHS:
        tokens = rng.integers(0, 150_000, n).tolist()
        row: dict[str, Any] = {"tokens": n}
        for block in (32, 64):
            bound = token_binding(tokens, block)
            twin = token_binding(tokens, block)
            row[f"bind_b{block}_us"] = median_us(lambda b=block, t=tokens: token_binding(t, b), repeats)
            row[f"check_b{block}_us"] = median_us(lambda b=bound, t=twin: check_binding("r", b, t), repeats)
        bound = token_binding(tokens, 32, label="cmpl-0123456789abcdef-0-01234567")
        pages = wire.encode_pages({"kv": np.arange(-(-n // 32))})
        plain = wire.Announce("cmpl-0123456789abcdef-0-01234567", 1, pages)
        with_binding = wire.Announce(plain.request_id, 1, pages, {}, *wire.binding_fields(bound))
        for name, msg in (("plain", plain), ("bound", with_binding)):
            data = wire.encode(msg)
            row[f"announce_{name}_bytes"] = len(data)
            row[f"announce_{name}_us"] = median_us(lambda m=msg: wire.decode(wire.encode(m)), repeats)
        rows.append(row)
    return {"repeats": repeats, "rows": rows}


def end_to_end(requests: int, num_tokens: int) -> dict[str, Any]:
    """Announce -> decode done, one request in flight, bound and unbound interleaved (each request's prompt
    hashed on both sides inside the timed span, as the engines do)."""
    pages = -(-num_tokens // 32)
    layout = Layout([Pool("kv", [Buffer(f"L{i}", 4096, 2 * pages, "bf16", "kv", i) for i in range(4)],
                          tokens_per_page=32)])
    src, dst = KVMemory.allocate(layout), KVMemory.allocate(layout)
    options = EndpointOptions(request_timeout=30.0)
    rng = np.random.default_rng(1)
    tokens = rng.integers(0, 150_000, num_tokens).tolist()
    latency: dict[str, list[float]] = {"bound": [], "unbound": []}
    with PrefillEndpoint(src, "local", options=options) as prefill, \
            DecodeEndpoint(dst, "local", options=options) as decode:
        decode.connect(prefill.address)
        for i in range(2 * requests + 20):
            arm = "bound" if i % 2 else "unbound"
            rid = f"r{i}"
            t0 = time.perf_counter()
            decode.announce(rid, {"kv": np.arange(pages)},
                            binding=token_binding(tokens, 32, rid) if arm == "bound" else None)
            prefill.send(rid, {"kv": np.arange(pages, 2 * pages)},
                         binding=token_binding(tokens, 32, rid) if arm == "bound" else None)
            decode.wait(rid, timeout=30)
            if i >= 20:   # warm-up
                latency[arm].append(time.perf_counter() - t0)
            prefill.wait(rid, timeout=30)
    out: dict[str, Any] = {"requests_per_arm": requests, "tokens": num_tokens, "pages": pages}
    for arm, values in latency.items():
        out[f"{arm}_p50_us"] = float(np.percentile(values, 50) * 1e6)
        out[f"{arm}_p99_us"] = float(np.percentile(values, 99) * 1e6)
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--repeats", type=int, default=300)
    parser.add_argument("--requests", type=int, default=300, help="requests per arm in the end-to-end runs")
    parser.add_argument("--json", metavar="OUT")
    args = parser.parse_args()
    results = {"micro": micro(args.repeats),
               "end_to_end": [end_to_end(args.requests, n) for n in (1024, 8192)]}
    print("tokens  bind b32  bind b64  check b32  announce bytes plain/bound  encode+decode plain/bound (us)")
    for r in results["micro"]["rows"]:
        print(f"{r['tokens']:6d}  {r['bind_b32_us']:8.1f}  {r['bind_b64_us']:8.1f}  {r['check_b32_us']:9.1f}  "
              f"{r['announce_plain_bytes']:7d} / {r['announce_bound_bytes']:7d}  "
              f"{r['announce_plain_us']:7.1f} / {r['announce_bound_us']:7.1f}")
    for e in results["end_to_end"]:
        print(f"end to end, {e['tokens']} tokens ({e['pages']} pages), {e['requests_per_arm']} per arm: p50 "
              f"unbound {e['unbound_p50_us']:.0f} us, bound {e['bound_p50_us']:.0f} us; p99 unbound "
              f"{e['unbound_p99_us']:.0f} us, bound {e['bound_p99_us']:.0f} us")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=1)


if __name__ == "__main__":
    main()
