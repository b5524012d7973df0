"""A sliding-window model's KV between prefill and decode of different block sizes, without vLLM.

vLLM's ``SlidingWindowManager`` replaces the blocks wholly before a window with its null block (id 0), each
side in its own blocks: prefill, handing its block table to the connector (``_connector_finished``), frees
for its next token, ``get_num_skipped_tokens(N) = N - W + 1`` (window W), so it holds blocks from
``(N - W + 1) // Tp``; decode, allocating a remote request's blocks (``add_local_computed_blocks`` and
``allocate_external_computed_blocks`` with N computed tokens), pads with null blocks up to
``(N - W + 1) // Td`` and allocates the rest. Every token of decode's non-null blocks must arrive (its
window's, and those before the window in its first block: a later request's prefix-cache hit may read
them). kvferry moves each KV cache group as a run of its own tokens (``layout.by_group``).

Here: the tests' 2-layer model (layer 0 a 64-token window, layer 1 full attention) as vLLM overlays it, on
numpy caches shaped like vLLM-CPU's and filled in its kernel's order (``layout.cpu_kernel_parts``, read off
the kernel in tests/test_vllm_block_sizes.py), both connector halves over the local transport, at 16 <-> 64,
32 <-> 128 and 64 <-> 32 and equal sizes, prompt lengths around the window and block boundaries, with and
without a prefix-cache hit on decode. Decode's whole cache must equal what its kernel would hold: the prompt's
tokens in its non-null blocks, the null block and every other block untouched. Where prefill (smaller
blocks) freed tokens decode's first block holds, decode declines the hand-off and prefill frees its blocks at
once; forced to announce anyway, kvferry fails the request naming the missing token. Seconds.
"""

from __future__ import annotations

import logging
from typing import Any

import numpy as np
import pytest

from kvferry.integrations.vllm.layout import GroupSpec, first_held_tokens, recv_parts, send_parts
from kvferry.integrations.vllm.scheduler import SchedulerSide

from .test_vllm_adapter import LAYERS, Instance, wait_for

WINDOW = 64
HEADS, HEAD_SIZE = 2, 32
NUM_BLOCKS = 48
NULL_FILL = {"prefill": 999.0, "decode": -5.0}   # what each side's null block holds: never moved, never written
PAIRS = [(16, 64), (64, 16), (32, 128), (128, 32), (64, 32), (32, 64), (32, 32)]
LENGTHS = (5, 63, 64, 65, 79, 80, 95, 96, 100, 127, 128, 129, 130, 143, 160, 191, 200, 257)


def specs(block_size: int) -> tuple[GroupSpec, GroupSpec]:
    return (GroupSpec((LAYERS[0],), block_size, sliding_window=WINDOW), GroupSpec((LAYERS[1],), block_size))


def kv_tokens(num_tokens: int, layer: int) -> np.ndarray:
    """A layer's K and V of every prompt token, ``[2, heads, token, dim]``: distinct, nonzero."""
    rng = np.random.default_rng(10 + layer)
    return rng.integers(1, 200, (2, HEADS, num_tokens, HEAD_SIZE)).astype(np.float32)


def kernel_write(cache: np.ndarray, block: int, block_size: int, kv: np.ndarray, first: int, stop: int) -> None:
    """Tokens ``[first, stop)`` of ``kv``, all in one block (``block``, holding tokens from ``first -
    first % block_size``), as vLLM-CPU's kernel keeps them: per head, K ``[dim][slot]`` then V ``[slot][dim]``."""
    base = first - first % block_size
    slots = np.arange(first, stop) - base
    flat = cache[block].reshape(HEADS, 2, HEAD_SIZE * block_size)
    k = flat[:, 0].reshape(HEADS, HEAD_SIZE, block_size)
    v = flat[:, 1].reshape(HEADS, block_size, HEAD_SIZE)
    k[:, :, slots] = kv[0][:, first:stop].transpose(0, 2, 1)
    v[:, slots] = kv[1][:, first:stop]


class Side:
    """One side's cache (both layers on one array, as vLLM overlays the groups) and a request's tables."""

    def __init__(self, role: str, block_size: int, num_tokens: int, seed: int, held: int = 0) -> None:
        self.block_size = block_size
        self.cache = np.zeros((NUM_BLOCKS, HEADS, block_size, 2 * HEAD_SIZE), np.float32)
        self.cache[0] = NULL_FILL[role]
        need = -(-num_tokens // block_size)
        kept = first_held_tokens(specs(block_size), num_tokens)   # per group, in tokens
        ids = np.random.default_rng(seed).permutation(np.arange(1, NUM_BLOCKS))
        self.tables = []
        for group, first in enumerate(kept):
            table = ids[group * need:(group + 1) * need].copy()
            table[:first // block_size] = 0   # vLLM's null block where the window's blocks were freed
            self.tables.append(table.tolist())
        self.kept = kept
        self.held = held

    def fill(self, num_tokens: int, start: int = 0, stop: int | None = None) -> None:
        """The prompt's tokens ``[max(start, group's first), stop)`` into each group's non-null blocks."""
        stop = num_tokens if stop is None else stop
        for group, (table, first) in enumerate(zip(self.tables, self.kept)):
            kv = kv_tokens(num_tokens, group)
            t = max(start, first)
            while t < stop:
                block = t // self.block_size
                end = min(stop, (block + 1) * self.block_size)
                kernel_write(self.cache, table[block], self.block_size, kv, t, end)
                t = end


def instances(ts: int, td: int, prefill_cache: np.ndarray, decode_cache: np.ndarray, **extra: Any,
              ) -> tuple[Instance, Instance]:
    prefill = Instance("producer", {LAYERS[0]: prefill_cache, LAYERS[1]: prefill_cache}, specs=specs(ts),
                       kernel=True, digest_mode="full")
    decode = Instance("consumer", {LAYERS[0]: decode_cache, LAYERS[1]: decode_cache}, specs=specs(td),
                      kernel=True, **extra)
    return prefill, decode


def prefill_holds_what_decode_needs(ts: int, td: int, n: int, held: int = 0) -> bool:
    return all(p <= max(d, held) for p, d in zip(first_held_tokens(specs(ts), n), first_held_tokens(specs(td), n)))


def test_a_prefill_of_larger_or_equal_blocks_always_holds_what_decode_needs() -> None:
    """Prefill holds from the largest multiple of Tp at most ``x = N - W + 1``, decode from the largest multiple
    of Td at most x; when Td divides Tp the former is a multiple of Td at most x, so it is no later: prefill
    holds every token decode's blocks hold. Smaller prefill blocks do not: checked for every N to 4096."""
    for ts, td in [(64, 16), (128, 32), (64, 32), (32, 32), (128, 64)]:
        assert all(prefill_holds_what_decode_needs(ts, td, n) for n in range(1, 4097)), (ts, td)
    short = [n for n in range(1, 300) if not prefill_holds_what_decode_needs(32, 64, n)]
    # x // 32 odd: prefill freed [64k, 64k + 32), which decode's block k still holds
    assert short == [n for n in range(95, 300) if (n - WINDOW + 1) // 32 % 2 == 1]


@pytest.mark.parametrize(("ts", "td"), PAIRS, ids=[f"{a}to{b}" for a, b in PAIRS])
def test_sliding_window_and_full_attention_blocks_arrive_byte_exact(ts: int, td: int) -> None:
    """Per prompt length, a request moves (two transfers: one per group) when prefill holds what decode's
    non-null blocks hold; decode's cache then equals its kernel's, the null block and every block of no group
    untouched. Otherwise decode declines it and prefill frees its blocks at once."""
    outcomes: list[str] = []
    for index, n in enumerate(LENGTHS):
        for hit in sorted({0, (n - 1) // td * td if n > td else 0}):   # none, and the longest whole-block hit
            outcomes.append(hand_off(ts, td, n, hit, index))
    print(f"{ts}->{td}: {outcomes.count('moved')} hand-offs moved, {outcomes.count('short')} declined for tokens "
          f"prefill freed, {outcomes.count('window')} for decode's own window, {outcomes.count('unsent')} unsent")
    assert outcomes.count("moved") >= 10
    assert ("short" in outcomes) == (td > ts), outcomes


@pytest.mark.parametrize(("ts", "td"), [(64, 16), (32, 128)], ids=["64to16", "32to128"])
def test_pull_mode_reads_the_same_runs(ts: int, td: int) -> None:
    """Decode reading prefill's blocks itself (pull) plans the same token runs: the same bytes arrive."""
    outcomes = [hand_off(ts, td, n, 0, index, mode="pull") for index, n in enumerate((65, 100, 192, 200))]
    assert outcomes.count("moved") >= 3, outcomes


def hand_off(ts: int, td: int, n: int, hit: int, index: int, **extra: Any) -> str:
    """One request of ``n`` tokens from prefill (``ts``) to decode (``td``, holding ``hit`` tokens): what
    happened, each outcome checked on decode's whole cache."""
    src, dst = Side("prefill", ts, n, seed=index), Side("decode", td, n, seed=100 + index, held=hit)
    src.fill(n)
    dst.fill(n, stop=hit)   # decode's prefix-cache hit: its own blocks, filled by an earlier request
    want = Side("decode", td, n, seed=100 + index)
    want.fill(n)
    before = dst.cache.copy()
    prefill, decode = instances(ts, td, src.cache, dst.cache, **extra)
    try:
        delay, params = prefill.scheduler.finished("p", {"do_remote_decode": True}, src.tables, n, completed=True)
        if not all(g.transferable(n) for g in specs(ts)):   # prefill's own window block is gone: not sent
            assert not delay and "kvferry_address" not in params
            return "unsent"
        assert delay and params["kvferry_first_tokens"] == src.kept
        got = decode.scheduler.matched_tokens("d", n, params, hit)
        # decode's recompute of the last token reads a block its own vLLM freed, or prefill freed tokens decode's
        # first window block holds: decode computes the prompt itself, prefill frees its blocks now
        outcome = ("short" if not prefill_holds_what_decode_needs(ts, td, n, hit)
                   else "window" if not all(g.transferable(n) for g in specs(td)) else "moved")
        if outcome != "moved":
            assert got == (0, False), (n, hit)
            wait_for(lambda: (decode.step(), prefill.step(), "p" in prefill.sending)[-1])
            np.testing.assert_array_equal(dst.cache, before)
            return outcome
        assert got == (n - hit, True), (n, hit)
        decode.scheduler.after_alloc("d", params, dst.tables, n - hit)
        wait_for(lambda: (prefill.step(), decode.step(), bool(decode.recving))[-1])
        wait_for(lambda: (prefill.step(), "p" in prefill.sending)[-1])
        assert not decode.failed, (n, hit)
        np.testing.assert_array_equal(dst.cache, want.cache, err_msg=f"{ts}->{td}, {n} tokens, hit {hit}")
        assert not prefill.scheduler.has_pending_work() and not decode.scheduler.has_pending_work()
        return outcome
    finally:
        decode.worker.close()
        prefill.worker.close()


@pytest.mark.parametrize(("ts", "td"), [(64, 16), (32, 128)], ids=["64to16", "32to128"])
def test_each_group_is_a_run_of_its_own_tokens(ts: int, td: int) -> None:
    """The parts both sides compute for 130 tokens: prefill's from its first kept block (its send's offset),
    decode's from its own past its hit (its announce's prefix), one per group."""
    n = 130
    src, dst = Side("prefill", ts, n, seed=1), Side("decode", td, n, seed=2)
    sent, announced = send_parts(src.tables, specs(ts), n), recv_parts(dst.tables, specs(td), n, td)
    assert [(p.group, p.first) for p in sent] == [(0, (n - WINDOW + 1) // ts), (1, 0)]
    assert [(p.group, p.first) for p in announced] == [(0, max(1, (n - WINDOW + 1) // td)), (1, 1)]
    for part, table in zip(sent, src.tables):
        assert list(part.pages) == table[part.first:-(-n // ts)] and 0 not in part.pages


def test_forced_past_the_refusal_the_missing_tokens_fail_the_request_by_name(
        caplog: pytest.LogCaptureFixture) -> None:
    """32 -> 64, 100 tokens: prefill holds the window's blocks from token 32, decode's first block holds tokens
    0-63. Decode's scheduler declines; told prefill held them all (forged), it announces, and kvferry's check
    that every leased token was written fails the request, naming the first missing token: nothing of
    prefill's null block or garbage lands as KV."""
    n, ts, td = 100, 32, 64
    src, dst = Side("prefill", ts, n, seed=3), Side("decode", td, n, seed=4)
    src.fill(n)
    prefill, decode = instances(ts, td, src.cache, dst.cache)
    try:
        _, params = prefill.scheduler.finished("p", {"do_remote_decode": True}, src.tables, n, completed=True)
        assert params["kvferry_first_tokens"] == [32, 0] and dst.kept == [0, 0]
        assert decode.scheduler.matched_tokens("d", n, dict(params), 0) == (0, False)
        decode.scheduler.take_plan()   # the cancel, not carried out here: the forged hand-off goes on
        forged = {**params, "kvferry_first_tokens": [0, 0]}
        assert decode.scheduler.matched_tokens("d2", n, forged, 0) == (n, True)
        decode.scheduler.after_alloc("d2", forged, dst.tables, n)
        with caplog.at_level(logging.WARNING, logger="kvferry.vllm"):
            wait_for(lambda: (prefill.step(), decode.step(), bool(decode.recving))[-1])
        assert decode.failed == {"d2"}
        assert "token 0 of the request missing" in caplog.text, caplog.text
        assert not dst.cache[1:].any()   # a failed receive's blocks are zeroed; the null block kept its bytes
        assert (dst.cache[0] == NULL_FILL["decode"]).all()
    finally:
        decode.worker.close()
        prefill.worker.close()


@pytest.mark.parametrize(("ts", "td"), [(64, 32), (32, 128)], ids=["64to32", "32to128"])
def test_a_model_of_sliding_window_layers_only_moves_one_run(ts: int, td: int) -> None:
    """One group (every layer a 64-token window, pool ``group0``, two layer tensors): the same run per group,
    one transfer, the request's own id. Decode's whole caches equal its kernel's."""
    n = 200   # prefill at 32 keeps tokens from 128, decode at 128 from 128: it moves
    only = (GroupSpec(LAYERS, ts, sliding_window=WINDOW),), (GroupSpec(LAYERS, td, sliding_window=WINDOW),)
    tables, caches = [], []
    for spec, size, seed in ((only[0][0], ts, 5), (only[1][0], td, 6)):
        need = -(-n // size)
        table = np.random.default_rng(seed).permutation(np.arange(1, NUM_BLOCKS))[:need]
        table[:spec.first_kept_block(n)] = 0
        tables.append(table.tolist())
        caches.append({layer: np.zeros((NUM_BLOCKS, HEADS, size, 2 * HEAD_SIZE), np.float32) for layer in LAYERS})
    want = {layer: np.zeros_like(c) for layer, c in caches[1].items()}
    for (table, size, spec), target in zip(((tables[0], ts, only[0][0]), (tables[1], td, only[1][0])),
                                           (caches[0], want)):
        for index, layer in enumerate(LAYERS):
            kv = kv_tokens(n, index)
            for t in range(spec.first_kept_block(n) * size, n, size):
                kernel_write(target[layer], table[t // size], size, kv, t, min(n, t + size))
    prefill = Instance("producer", caches[0], specs=only[0], kernel=True, digest_mode="full")
    decode = Instance("consumer", caches[1], specs=only[1], kernel=True)
    try:
        _, params = prefill.scheduler.finished("p", {"do_remote_decode": True}, (tables[0],), n, completed=True)
        assert params["kvferry_first_tokens"] == [only[0][0].first_kept_block(n) * ts]
        assert decode.scheduler.matched_tokens("d", n, params, 0) == (n, True)
        decode.scheduler.after_alloc("d", params, (tables[1],), n)
        plan = decode.scheduler.take_plan()
        first = only[1][0].first_kept_block(n)
        assert [(r.transfer_id, dict(r.prefix)) for r in plan.recvs] == [("p", {"group0": first})]
        decode.worker.start(plan)
        wait_for(lambda: (prefill.step(), decode.step(), bool(decode.recving))[-1])
        assert not decode.failed
        for layer in LAYERS:
            np.testing.assert_array_equal(caches[1][layer], want[layer], err_msg=layer)
    finally:
        decode.worker.close()
        prefill.worker.close()


@pytest.mark.parametrize("first", [None, [0], ["0", 0], [True, 0]], ids=["absent", "short", "str", "bool"])
def test_a_hand_off_without_prefills_first_tokens_is_declined_by_name(first: Any) -> None:
    """``kvferry_first_tokens`` is untrusted input: decode declines a hand-off without a valid one (one int per
    group) and stages the cancel of both groups' transfers, naming the key."""
    scheduler = SchedulerSide(specs(32))
    params = {"do_remote_prefill": True, "kvferry_address": "tcp://prefill", "kvferry_request_id": "p",
              "remote_num_tokens": 130, **({} if first is None else {"kvferry_first_tokens": first})}
    assert scheduler.matched_tokens("d", 130, params, 0) == (0, False)
    cancels = scheduler.take_plan().cancels
    assert [(tid, ranks) for tid, ranks, _ in cancels] == [("p#g0", ("tcp://prefill",)), ("p#g1", ("tcp://prefill",))]
    assert all("kvferry_first_tokens" in why for _, _, why in cancels)
    assert scheduler.matched_tokens("d", 130, params, 0) == (0, False) and not scheduler.take_plan().cancels


def test_a_part_prefill_refuses_stops_the_others_and_decode_hears_at_once(caplog: pytest.LogCaptureFixture) -> None:
    """The full-attention group's send is refused (a block past prefill's cache): the window's part, already
    handed over, is aborted with it, vLLM may free prefill's blocks, and decode fails the request within
    seconds, not at prefill's request timeout (60 s); nothing lands in decode's blocks."""
    n = 130
    src, dst = Side("prefill", 64, n, seed=7), Side("decode", 32, n, seed=8)
    src.tables[1][-1] = NUM_BLOCKS + 5
    prefill, decode = instances(64, 32, src.cache, dst.cache)
    try:
        prefill.scheduler.after_alloc("p", {"do_remote_decode": True}, src.tables, 0)   # issued, as vLLM does
        prefill.step()
        _, params = prefill.scheduler.finished("p", {"do_remote_decode": True}, src.tables, n, completed=True)
        assert decode.scheduler.matched_tokens("d", n, params, 0) == (n, True)
        decode.scheduler.after_alloc("d", params, dst.tables, n)
        with caplog.at_level(logging.WARNING, logger="kvferry.vllm"):
            wait_for(lambda: (prefill.step(), decode.step(), bool(decode.recving))[-1], timeout=10)
        assert "p" in prefill.sending and decode.failed == {"d"}
        assert "kvferry: prefill request p#g1 not sent" in caplog.text
        assert not dst.cache[1:].any()
    finally:
        decode.worker.close()
        prefill.worker.close()
