"""Decode-side prefixes: decode already holds a request's leading pages, and only the rest moves.

Every test checks the bytes: each destination page of the rest holds its source page, and every other
page of decode's memory (the prefix decode holds among them) is byte-for-byte what it was.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvferry import KVMemory, LeaseError, PlanError, UsageError
from kvferry.control import DecodeEndpoint, EndpointOptions, PrefillEndpoint, RequestState, wire
from kvferry.errors import RequestFailed
from kvferry.plan.prefix import check_prefix, prefix_pages

from .control_peer import LAYERS, fill, make_layout, snapshot

# Generous peer timeouts: nothing here tests peer death, and a loaded machine must not fail these.
OPTS = EndpointOptions(heartbeat_interval=0.2, peer_timeout=5.0, lease_grace=0.4, request_timeout=20.0)


def _memories() -> tuple[KVMemory, KVMemory]:
    src, dst = KVMemory.allocate(make_layout("prefill")), KVMemory.allocate(make_layout("decode"))
    fill(src, 11)
    fill(dst, 999)
    return src, dst


@pytest.fixture(params=["push", "pull"])
def pair(request: Any) -> Iterator[tuple[PrefillEndpoint, DecodeEndpoint]]:
    src, dst = _memories()
    mode = request.param
    with PrefillEndpoint(src, "local", options=OPTS, mode=("push", "pull")) as prefill, \
            DecodeEndpoint(dst, "local", options=OPTS, mode=mode) as decode:
        decode.connect(prefill.address)
        yield prefill, decode


def _expect(before: dict[str, np.ndarray], src: KVMemory, dst: KVMemory, src_pages: dict[str, np.ndarray],
            dst_pages: dict[str, np.ndarray], held: dict[str, int]) -> None:
    """Decode's memory is ``before`` except the rest's pages, which hold their source pages."""
    expected = {name: arr.copy() for name, arr in before.items()}
    for pool in dst.layout.pools:
        if pool.name not in dst_pages:
            continue
        rest = src_pages[pool.name][held.get(pool.name, 0):]
        for buf in pool.buffers:
            expected[buf.name][dst_pages[pool.name]] = src.array(buf.name)[rest]
    for name, arr in expected.items():
        np.testing.assert_array_equal(dst.array(name), arr, err_msg=name)


def _request(rng: np.random.Generator, n_main: int) -> tuple[dict[str, np.ndarray], dict[str, np.ndarray]]:
    src = {"main": rng.choice(200, n_main, replace=False), "c4": rng.choice(140, 1, replace=False)}
    dst = {"main": rng.choice(288, n_main, replace=False), "c4": rng.choice(100, 1, replace=False)}
    return src, dst


@pytest.mark.parametrize("how", ["whole", "rest", "chunked", "layered"])
def test_only_the_pages_decode_lacks_move(pair: tuple[PrefillEndpoint, DecodeEndpoint], how: str) -> None:
    prefill, decode = pair
    src_mem, dst_mem = prefill.memory, decode.memory
    before = snapshot(dst_mem)
    rng = np.random.default_rng(3)
    src, dst = _request(rng, 6)
    held = {"main": 4}                      # decode holds the first 4 of 6 main pages; c4's one page moves
    decode.announce("r", {"main": dst["main"][4:], "c4": dst["c4"]}, prefix=held)
    decode_wait_announced(prefill, "r")
    assert prefill.decode_prefix("r") == held
    if how == "whole":                      # vLLM's order: the whole request's pages
        prefill.send("r", src)
    elif how == "rest":                     # SGLang's: from the prefix on
        prefill.send("r", {"main": src["main"][4:], "c4": src["c4"]}, offset={"main": 4, "c4": 0})
    elif how == "chunked":                  # chunks of 3: the second straddles the prefix's end
        prefill.send("r", {"main": src["main"][:3]}, last=False)
        prefill.send("r", {"main": src["main"][3:], "c4": src["c4"]}, offset={"main": 3, "c4": 0})
    else:
        for layer in (0, 1):
            prefill.send("r", src, last=layer == 1, buffers=LAYERS[layer])
    decode.wait("r", timeout=10)
    prefill.wait("r", timeout=10)
    _expect(before, src_mem, dst_mem, src, {"main": dst["main"][4:], "c4": dst["c4"]}, held)
    assert decode.num_leased_pages == 0


def decode_wait_announced(prefill: PrefillEndpoint, rid: str, timeout: float = 5.0) -> None:
    import time

    deadline = time.monotonic() + timeout
    while prefill.decode_prefix(rid) is None:
        assert time.monotonic() < deadline, "announce never reached prefill"
        time.sleep(0.002)


def test_a_token_prefix_turns_into_each_pools_pages(pair: tuple[PrefillEndpoint, DecodeEndpoint]) -> None:
    prefill, decode = pair
    before = snapshot(decode.memory)
    rng = np.random.default_rng(5)
    src = {"main": rng.choice(200, 8, replace=False), "c4": rng.choice(140, 2, replace=False)}
    dst = {"main": rng.choice(288, 4, replace=False), "c4": rng.choice(100, 1, replace=False)}
    # 256 tokens: 4 pages of main (64 tokens each) and 1 of c4 (256 tokens each)
    decode.announce("t", dst, prefix=256)
    prefill.send("t", src)
    decode.wait("t", timeout=10)
    _expect(before, prefill.memory, decode.memory, src, dst, {"main": 4, "c4": 1})


def test_a_prefix_that_is_not_whole_pages_is_refused_naming_the_pool() -> None:
    layout = make_layout("decode")
    with pytest.raises(UsageError, match=r"pool 'c4': a prefix of 128 tokens is not whole pages of 256"):
        prefix_pages(layout, ["main", "c4"], 128)
    assert prefix_pages(layout, ["main"], 128) == {"main": 2}
    with pytest.raises(UsageError, match=r"prefix names pool 'nope'"):
        prefix_pages(layout, ["main"], {"nope": 1})
    with pytest.raises(UsageError, match=r"pool .main.: prefix must be between 0 and \d+ pages, got -1"):
        prefix_pages(layout, ["main"], {"main": -1})
    with pytest.raises(PlanError, match=r"announce from x: prefix names pool 'z'"):
        check_prefix(layout, {"z": 3}, "announce from x")


def test_a_prefix_past_the_request_fails_it_by_name_before_anything_moves(
        pair: tuple[PrefillEndpoint, DecodeEndpoint]) -> None:
    prefill, decode = pair
    before = snapshot(decode.memory)
    rng = np.random.default_rng(9)
    src, dst = _request(rng, 3)
    decode.announce("p", {"main": dst["main"][:1], "c4": dst["c4"]}, prefix={"main": 5})
    prefill.send("p", src)                       # 3 pages, decode claims 5
    with pytest.raises(RequestFailed, match=r"pool 'main': decode claims a prefix of 5 pages but prefill's "
                                            r"request has 3 pages"):
        decode.wait("p", timeout=10)
    assert prefill.poll("p") is RequestState.FAILED
    for name, arr in before.items():             # nothing moved
        np.testing.assert_array_equal(decode.memory.array(name), arr, err_msg=name)
    _wait_no_leases(decode)


def _wait_no_leases(decode: DecodeEndpoint) -> None:
    import time

    deadline = time.monotonic() + 5
    while decode.num_leased_pages and time.monotonic() < deadline:
        time.sleep(0.005)
    assert decode.num_leased_pages == 0


def test_decode_holding_every_page_has_nothing_to_lease(pair: tuple[PrefillEndpoint, DecodeEndpoint]) -> None:
    _, decode = pair
    with pytest.raises(LeaseError, match=r"request 'all': no pages to lease"):
        decode.announce("all", {"main": [], "c4": []}, prefix={"main": 4, "c4": 1})


def test_the_announce_carries_the_prefix_and_a_bad_one_is_refused() -> None:
    msg = wire.Announce("r", 1, wire.encode_pages({"main": np.array([3])}), {"main": 2})
    assert wire.decode(wire.encode(msg)).prefix == {"main": 2}
    old = wire.Announce("r", 1, wire.encode_pages({"main": np.array([3])}))
    assert wire.decode(wire.encode(old)).prefix == {}


@settings(max_examples=25, deadline=None)
@given(n=st.integers(1, 9), held=st.integers(0, 9), cut=st.integers(0, 9), rest_only=st.booleans())
def test_any_prefix_and_chunking_lands_each_page_once(n: int, held: int, cut: int, rest_only: bool) -> None:
    held, cut = min(held, n - 1), min(cut, n)   # at least one page to lease
    src_mem, dst_mem = _memories()
    before = snapshot(dst_mem)
    rng = np.random.default_rng(n * 100 + held * 10 + cut)
    src = {"main": rng.choice(200, n, replace=False)}
    dst = {"main": rng.choice(288, n - held, replace=False)}
    with PrefillEndpoint(src_mem, "local", options=OPTS) as prefill, \
            DecodeEndpoint(dst_mem, "local", options=OPTS) as decode:
        decode.connect(prefill.address)
        decode.announce("h", dst, prefix={"main": held})
        start = held if rest_only else 0
        first = max(start, cut)
        prefill.send("h", {"main": src["main"][start:first]}, offset=start, last=False)
        prefill.send("h", {"main": src["main"][first:]}, offset=first)
        decode.wait("h", timeout=10)
    _expect(before, src_mem, dst_mem, src, dst, {"main": held})


def test_a_pool_decode_holds_whole_leaves_the_chunk(pair: tuple[PrefillEndpoint, DecodeEndpoint]) -> None:
    """A full prefix hit in one pool (SGLang's radix cache holding every KV page, only other pools moving):
    decode leases nothing there, prefill still names the pool, and the rest moves."""
    prefill, decode = pair
    before = snapshot(decode.memory)
    rng = np.random.default_rng(12)
    src, dst = _request(rng, 3)
    decode.announce("full", {"c4": dst["c4"]}, prefix={"main": 3})
    prefill.send("full", src, last=False)
    prefill.send("full", {"main": np.zeros(0, dtype=np.int64)}, offset={"main": 3})   # SGLang's closing chunk
    decode.wait("full", timeout=10)
    prefill.wait("full", timeout=10)
    _expect(before, prefill.memory, decode.memory, src, {"c4": dst["c4"]}, {"main": 3})
