"""kvferry's vLLM connector at tensor-parallel sizes > 1, one process per rank over NIXL, without vLLM.

Each rank is its own process with one worker-side half over numpy KV caches shaped as vLLM-CPU's, bound by
the connector's own layout code (``tests/vllm_tp_ranks.py``); this process plays the two engine cores.
Every test checks the bytes of every decode rank: each received block holds exactly the rank's KV heads of
prefill's block, every other block (a held prefix among them) is untouched. The same flow inside real vLLM
engines is tests/test_vllm.py's TP tests (slow suite).
"""

from __future__ import annotations

from collections.abc import Iterator

import numpy as np
import pytest

from kvferry.integrations.vllm.layout import GroupSpec, num_blocks_for
from kvferry.integrations.vllm.scheduler import SchedulerSide

from .vllm_tp_ranks import BLOCK_SIZE, LAYERS, NUM_BLOCKS, Rank, RankSpec, global_kv, head_slice

pytest.importorskip("nixl")
pytest.importorskip("kvferry.transport.nixl")
pytestmark = pytest.mark.nixl

GROUPS = (GroupSpec(LAYERS, BLOCK_SIZE),)
HEADS = 4


class Request:
    def __init__(self, rid: str, num_tokens: int, src: list[int], dst: list[int], held: int) -> None:
        self.rid, self.num_tokens, self.src, self.dst, self.held = rid, num_tokens, src, dst, held


def _requests(n: int, seed: int, prefix: str = "req") -> list[Request]:
    """``n`` prompts of lengths that are not whole blocks; every third one with a decode prefix-cache hit."""
    rng = np.random.default_rng(seed)
    lengths = [int(x) for x in rng.integers(2, 60, n)]
    lengths = [x + 1 if x % BLOCK_SIZE == 0 else x for x in lengths]
    blocks = [num_blocks_for(x, BLOCK_SIZE) for x in lengths]
    src = rng.permutation(np.arange(1, NUM_BLOCKS["producer"]))
    dst = rng.permutation(np.arange(1, NUM_BLOCKS["consumer"]))
    assert sum(blocks) < len(dst)
    reqs, at = [], 0
    for i, (length, nb) in enumerate(zip(lengths, blocks)):
        held = (nb - 1) if i % 3 == 0 else 0    # whole blocks, short of the prompt
        reqs.append(Request(f"{prefix}-{i}", length, src[at:at + nb].tolist(), dst[at:at + nb].tolist(), held))
        at += nb
    return reqs


class Groups:
    """Rank processes kept for the whole module (each costs a process start): one group per key."""

    def __init__(self) -> None:
        self.groups: dict[tuple[object, ...], list[Rank]] = {}

    def get(self, role: str, tp: int, heads: int = HEADS, **kw: object) -> list[Rank]:
        key = (role, tp, heads, *sorted(kw.items()))
        if key not in self.groups:
            self.groups[key] = [Rank(RankSpec(role, tp, r, heads, **kw)) for r in range(tp)]  # type: ignore[arg-type]
        return self.groups[key]

    def close(self) -> None:
        for group in self.groups.values():
            for rank in group:
                rank.close()


@pytest.fixture(scope="module")
def groups() -> Iterator[Groups]:
    started = Groups()
    yield started
    started.close()


def _hand_off(prefill: list[Rank], decode: list[Rank], reqs: list[Request], *,
              refused: bool = False) -> tuple[set[str], dict[str, str]]:
    """vLLM's hand-off through both scheduler halves; what vLLM would see: requests finished on every decode
    rank, and those any rank failed. ``refused``: decode never announces, so prefill holds its blocks until
    its request timeout (not waited for)."""
    addresses = [r.address for r in prefill]
    psched = SchedulerSide(GROUPS, addresses[0], tuple(addresses) if len(addresses) > 1 else ())  # type: ignore[arg-type]
    params = {}
    for req in reqs:
        keep, params[req.rid] = psched.finished(req.rid, {"do_remote_decode": True}, [req.src], req.num_tokens, True)
        assert keep and params[req.rid]
    send_plan = psched.take_plan()
    for rank in prefill:      # vLLM hands every worker the same connector metadata
        rank.plan(send_plan)
    dsched = SchedulerSide(GROUPS)
    for req in reqs:
        held_tokens = req.held * BLOCK_SIZE
        count, is_async = dsched.matched_tokens(req.rid, req.num_tokens, params[req.rid], held_tokens)
        assert is_async and count == req.num_tokens - held_tokens
        dsched.after_alloc(req.rid, params[req.rid], [req.dst], count)
    recv_plan = dsched.take_plan()
    for rank in decode:
        rank.plan(recv_plan)
    ids = [r.rid for r in reqs]
    finished: set[str] = set(ids)
    failed: dict[str, str] = {}
    for rank in decode:   # vLLM's aggregator: finished once every rank reported it; failed if any did
        done, why = rank.collect(ids)
        finished &= done
        failed.update({rid: f"decode rank {rank.spec.tp_rank}: {reason}" for rid, reason in why.items()})
    for rank in [] if refused else prefill:
        sent, _ = rank.collect(ids)
        assert set(ids) <= sent, f"prefill rank {rank.spec.tp_rank} still holds {set(ids) - sent}"
    return finished, failed


def _snapshot(decode: list[Rank]) -> list[dict[str, np.ndarray]]:
    return [rank.caches() for rank in decode]


def _check_bytes(decode: list[Rank], before: list[dict[str, np.ndarray]], reqs: list[Request], seed: int = 5) -> None:
    """Every decode rank: each request's blocks past its prefix hold the rank's heads of prefill's blocks;
    every other block is as it was (``before``: a held prefix was never written)."""
    for rank, was in zip(decode, before):
        mla = rank.spec.mla
        heads = slice(None) if mla else head_slice(rank.spec.total_heads, rank.spec.tp_size, rank.spec.tp_rank)
        caches = rank.caches()
        for layer, name in enumerate(LAYERS):
            want = was[name].copy()
            kv = global_kv(seed, HEADS, layer, mla=mla)
            for req in reqs:
                want[req.dst[req.held:]] = kv[req.src[req.held:]][:, heads]
            got = caches[name]
            bad = np.flatnonzero(~(got == want).reshape(len(got), -1).all(axis=1))
            assert not len(bad), f"decode rank {rank.spec.tp_rank}, {name}: blocks {bad[:8].tolist()} differ"


@pytest.mark.parametrize(("prefill_tp", "decode_tp"), [(2, 2), (2, 1), (1, 2)])
def test_each_decode_rank_receives_exactly_its_heads(groups: Groups, prefill_tp: int, decode_tp: int) -> None:
    prefill = groups.get("producer", prefill_tp)
    decode = groups.get("consumer", decode_tp)
    before = _snapshot(decode)
    reqs = _requests(32, seed=prefill_tp * 10 + decode_tp, prefix=f"tp{prefill_tp}{decode_tp}")
    finished, failed = _hand_off(prefill, decode, reqs)
    assert not failed, failed
    assert finished == {r.rid for r in reqs}
    _check_bytes(decode, before, reqs)


@pytest.mark.parametrize(("prefill_tp", "decode_tp"), [(2, 1), (1, 2)])
def test_mla_each_decode_rank_receives_one_prefill_ranks_latent_copy(groups: Groups, prefill_tp: int,
                                                                     decode_tp: int) -> None:
    """MLA's latent cache is the same on every rank (vLLM replicates it): a decode rank takes one prefill
    rank's copy whole, whatever the two TP sizes."""
    prefill = groups.get("producer", prefill_tp, mla=True)
    decode = groups.get("consumer", decode_tp, mla=True)
    before = _snapshot(decode)
    reqs = _requests(16, seed=8 + prefill_tp, prefix=f"mla{prefill_tp}{decode_tp}")
    finished, failed = _hand_off(prefill, decode, reqs)
    assert not failed and finished == {r.rid for r in reqs}, failed
    _check_bytes(decode, before, reqs)


@pytest.mark.parametrize(("prefill_tp", "decode_tp"), [(2, 2), (2, 1), (1, 2)])
def test_pull_mode_at_any_tp_pair(groups: Groups, prefill_tp: int, decode_tp: int) -> None:
    """Pull mode (decode reads prefill's blocks), byte for byte, at equal and different TP sizes: each decode
    rank reads exactly its KV heads from the prefill ranks that hold them."""
    prefill = groups.get("producer", prefill_tp)
    decode = groups.get("consumer", decode_tp, mode="pull")
    before = _snapshot(decode)
    reqs = _requests(16, seed=6 + prefill_tp * 3 + decode_tp, prefix=f"pull{prefill_tp}{decode_tp}")
    finished, failed = _hand_off(prefill, decode, reqs)
    assert not failed and finished == {r.rid for r in reqs}, failed
    _check_bytes(decode, before, reqs)


def test_a_head_slice_corrupted_on_one_prefill_rank_fails_the_request_by_name(groups: Groups) -> None:
    """Prefill rank 1 of 2 flips a byte of every layer-0 block it writes: each request fails on the decode
    rank its heads go to, naming the buffer and the page; vLLM, which fails a request any rank failed, never
    decodes on it. Rank 0's heads arrive intact."""
    prefill = [Rank(RankSpec("producer", 2, 0, HEADS)),
               Rank(RankSpec("producer", 2, 1, HEADS, fault=f"flip:{LAYERS[0]}"))]
    groups.groups[("faulty",)] = prefill
    decode = groups.get("consumer", 2)
    before = _snapshot(decode)
    reqs = _requests(8, seed=3, prefix="flip")
    _, failed = _hand_off(prefill, decode, reqs)
    assert set(failed) == {r.rid for r in reqs}
    for reason in failed.values():
        assert reason.startswith("decode rank 1: "), reason
        assert LAYERS[0] in reason and "page" in reason, reason
    _check_bytes(decode[:1], before[:1], reqs)     # rank 0 got its heads, verified


def test_head_counts_that_cannot_pair_are_refused_at_the_handshake(groups: Groups) -> None:
    """A decode built for a model with half the KV heads (2 instead of 4) is refused before a byte moves,
    naming both head totals."""
    prefill = groups.get("producer", 1)
    decode = groups.get("consumer", 2, heads=2)
    reqs = _requests(2, seed=4, prefix="heads")
    _, failed = _hand_off(prefill, decode, reqs, refused=True)
    assert set(failed) == {r.rid for r in reqs}
    assert all("total heads" in why and "4" in why and "2" in why for why in failed.values()), failed
