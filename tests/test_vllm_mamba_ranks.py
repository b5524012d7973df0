"""Hybrid Mamba state between TP sizes (different and equal) through kvferry's vLLM connector, on numpy memory.

Each TP rank is one worker-side half (``WorkerSide``, local transport, in this process) over numpy caches laid
out as vLLM lays a hybrid model's (tests/test_vllm_mamba.py's ``vllm_caches``, per rank): each Mamba layer's
state view on an attention layer's bytes, one padded page per block. The connector's own layout code binds
them: attention layers in ``blocks`` (cut by KV heads), state layers in ``state`` (an alias of ``blocks``
over the same regions, cut by Mamba2's channel sections). One scheduler-side half per instance hands every
rank the same plan, as vLLM broadcasts connector metadata.

The model (one Mamba2 group, so B and C are the same on every rank: vLLM replicates a group below the TP
size): conv ``[x 16 | B 4 | C 4]`` over 3 window rows, SSM 2 heads x 8 x 4, attention 2 KV heads, fp32.
Every test checks each decode rank's bytes: its conv rows hold its x channels and the whole B and C, its
SSM its heads, its attention blocks its KV heads; the state page's padding and every other block (the
state block's neighbour among them) are as they were.
"""

from __future__ import annotations

import logging
from collections.abc import Iterator
from typing import Any

import numpy as np
import pytest

from kvferry.integrations.vllm.layout import (
    HYBRID_POOL,
    STATE_POOL,
    GroupSpec,
    RankPlace,
    mamba2_state_geometry,
    memory_from_kv_caches,
)
from kvferry.integrations.vllm.scheduler import SchedulerSide
from kvferry.integrations.vllm.worker import WorkerConfig, WorkerSide

from .test_vllm_mamba import wait_for

NUM_BLOCKS = 24
BLOCK = 16
HEADS, HEAD_SIZE = 2, 8                   # attention: KV heads, floats per K (and V)
X, GROUP, WINDOW = 16, 4, 3               # conv: x channels, B and C channels (one group), window rows
SSM_HEADS, HEAD_DIM, D_STATE = 2, 8, 4
MIXERS = ("model.layers.0.mixer", "model.layers.2.mixer")
ATTNS = ("model.layers.1.self_attn.attn", "model.layers.3.self_attn.attn")
PAD = 0x5A                                # decode's untouched bytes
log = logging.getLogger(__name__)


def page(tp: int) -> int:
    return HEADS // tp * BLOCK * 2 * HEAD_SIZE * 4


def shapes(tp: int, layout: str) -> tuple[tuple[int, int], tuple[int, int, int]]:
    conv = (WINDOW, X // tp + 2 * GROUP)
    return (conv if layout == "SD" else conv[::-1]), (SSM_HEADS // tp, HEAD_DIM, D_STATE)


def groups(tp: int, layout: str) -> tuple[GroupSpec, GroupSpec]:
    geometry = mamba2_state_geometry(shapes(tp, layout), (4, 4), layout, 1, tp)
    return GroupSpec(MIXERS, 1024, state=True, geometry=geometry), GroupSpec(ATTNS, BLOCK)


def state_bytes(tp: int) -> int:
    return (WINDOW * (X // tp + 2 * GROUP) + SSM_HEADS // tp * HEAD_DIM * D_STATE) * 4


class Model:
    """Prefill's logical contents, the whole TP group's: per layer slot and block, KV of every head, and for
    state blocks the conv rows of every channel and the SSM state of every head."""

    def __init__(self, seed: int) -> None:
        rng = np.random.default_rng(seed)
        self.kv = rng.standard_normal((2, NUM_BLOCKS, HEADS, BLOCK, 2 * HEAD_SIZE)).astype(np.float32)
        self.x = rng.standard_normal((2, NUM_BLOCKS, WINDOW, X)).astype(np.float32)
        self.b = rng.standard_normal((2, NUM_BLOCKS, WINDOW, GROUP)).astype(np.float32)
        self.c = rng.standard_normal((2, NUM_BLOCKS, WINDOW, GROUP)).astype(np.float32)
        self.ssm = rng.standard_normal((2, NUM_BLOCKS, SSM_HEADS, HEAD_DIM, D_STATE)).astype(np.float32)

    def state(self, slot: int, block: int, tp: int, rank: int, layout: str) -> bytes:
        """Rank ``rank`` of ``tp``'s state page bytes (without padding), as vLLM packs them."""
        xs = X // tp
        conv = np.concatenate([self.x[slot, block][:, rank * xs:(rank + 1) * xs], self.b[slot, block],
                               self.c[slot, block]], axis=1)
        heads = SSM_HEADS // tp
        ssm = self.ssm[slot, block][rank * heads:(rank + 1) * heads]
        return (conv if layout == "SD" else conv.T.copy()).tobytes() + ssm.tobytes()

    def attention(self, slot: int, block: int, tp: int, rank: int) -> bytes:
        heads = HEADS // tp
        return self.kv[slot, block][rank * heads:(rank + 1) * heads].tobytes()


def rank_caches(raw: np.ndarray, tp: int) -> dict[str, np.ndarray]:
    """vLLM's views over one rank's backing bytes ``raw`` ``[slots, blocks, page]``."""
    caches: dict[str, np.ndarray] = {}
    for slot, (mixer, attn) in enumerate(zip(MIXERS, ATTNS)):
        base = raw[slot].reshape(-1)
        caches[mixer] = np.lib.stride_tricks.as_strided(base.view(np.int8), (NUM_BLOCKS, 1, 1, state_bytes(tp)),
                                                        (page(tp), 1, 1, 1))
        caches[attn] = base.view(np.float32).reshape(NUM_BLOCKS, HEADS // tp, BLOCK, 2 * HEAD_SIZE)
    return caches


class Rank:
    def __init__(self, role: str, tp: int, rank: int, layout: str, raw: np.ndarray) -> None:
        self.tp, self.rank, self.raw = tp, rank, raw
        memory = memory_from_kv_caches(rank_caches(raw, tp), groups(tp, layout), NUM_BLOCKS,
                                       place=RankPlace(tp, rank, HEADS // tp))
        self.memory = memory
        extra = {"transport": "local", "digest_mode": "full", "request_timeout": 20.0}
        self.worker = WorkerSide(WorkerConfig.from_extra(role, extra).for_rank(rank), memory)
        self.reasons: dict[str, str] = {}
        report = self.worker._report_failure

        def record(request_id: str, error: Any) -> None:   # the reason vLLM's log line gives, kept for the test
            self.reasons[request_id] = str(error)
            report(request_id, error)

        self.worker._report_failure = record   # type: ignore[method-assign]


class Instance:
    """One vLLM instance: its scheduler half and its TP ranks' worker halves, stepped by hand."""

    def __init__(self, role: str, tp: int, layout: str, model: Model | None, requests: list[Request]) -> None:
        self.ranks = []
        for rank in range(tp):
            raw = np.full((2, NUM_BLOCKS, page(tp)), PAD, np.uint8)
            if model is not None:
                self._fill(raw, model, tp, rank, layout, requests)
            self.ranks.append(Rank(role, tp, rank, layout, raw))
        addresses = [r.worker.address for r in self.ranks]
        self.scheduler = SchedulerSide(groups(tp, layout), addresses[0], tuple(addresses) if tp > 1 else (),
                                       tp_size=tp)
        self.reported: list[set[str]] = [set() for _ in range(tp)]   # per rank: what it reported finished
        self.done: set[str] = set()                                    # what every rank reported
        self.failed: set[str] = set()

    @staticmethod
    def _fill(raw: np.ndarray, model: Model, tp: int, rank: int, layout: str, requests: list[Request]) -> None:
        """Prefill: attention blocks hold the rank's heads; each request's state block its state, then
        padding of this rank's own (random: it must never move across TP sizes)."""
        rng = np.random.default_rng(100 + rank)
        states = {r.src[0] for r in requests}
        for slot in range(2):
            for block in range(NUM_BLOCKS):
                if block in states:
                    data = model.state(slot, block, tp, rank, layout)
                    raw[slot, block] = rng.integers(0, 256, page(tp), dtype=np.uint8)
                    raw[slot, block, :len(data)] = np.frombuffer(data, np.uint8)
                else:
                    raw[slot, block] = np.frombuffer(model.attention(slot, block, tp, rank), np.uint8)

    def step(self) -> None:
        plan = self.scheduler.take_plan()
        for rank in self.ranks:
            rank.worker.start(plan)
            sending, recving, failed = rank.worker.results()
            self.reported[rank.rank] |= sending | recving
            self.failed |= failed
        # vLLM's output aggregator: finished once every rank reported it, in whichever steps they did
        finished = set.intersection(*self.reported) - self.done
        self.done |= finished
        self.scheduler.on_worker_output(tuple(finished), ())

    def close(self) -> None:
        for rank in self.ranks:
            rank.worker.close()


class Request:
    def __init__(self, rid: str, num_tokens: int, src: tuple[int, list[int]], dst: tuple[int, list[int]]) -> None:
        self.rid, self.num_tokens, self.src, self.dst = rid, num_tokens, src, dst
        self.prompt = list(range(7, 7 + num_tokens))

    @property
    def moved(self) -> int:
        """Attention blocks moved: those under the ``num_tokens - 1`` tokens prefill computed."""
        return -(-(self.num_tokens - 1) // BLOCK)


# Prompts under, at and over a block; each decode state block next to one of its attention blocks.
REQUESTS = [Request("a", 9, (20, [1]), (5, [4])), Request("b", 17, (21, [2]), (8, [6, 7])),
            Request("c", 40, (22, [3, 4, 5]), (12, [9, 10, 11])), Request("d", 33, (23, [6, 7, 8]), (16, [13, 14, 15]))]


def hand_off(prefill: Instance, decode: Instance, requests: list[Request]) -> None:
    for req in requests:
        params: dict[str, Any] = {"do_remote_decode": True}
        assert prefill.scheduler.hold_back(params, req.num_tokens, True)
        src = ([req.src[0]], req.src[1])
        delay, out = prefill.scheduler.finished(req.rid, params, src, req.num_tokens - 1, completed=True,
                                                prompt_token_ids=req.prompt[:-1])
        assert delay and out is not None
        assert decode.scheduler.matched_tokens(req.rid, req.num_tokens, out, 0) == (req.num_tokens - 1, True)
        decode.scheduler.after_alloc(req.rid, out, ([req.dst[0]], req.dst[1]), req.num_tokens - 1, req.prompt)


# Equal TP sizes too: a padded state page moves its sections only there as well (its padding is prefill's own
# random bytes, which must not arrive).
@pytest.fixture(params=[(1, 2, "SD"), (2, 1, "SD"), (1, 2, "DS"), (2, 1, "DS"), (1, 1, "SD"), (2, 2, "DS")],
                ids=lambda p: f"{p[0]}to{p[1]}-{p[2]}")
def pair(request: pytest.FixtureRequest) -> Iterator[tuple[Instance, Instance, str]]:
    ptp, dtp, layout = request.param
    prefill = Instance("producer", ptp, layout, Model(ptp * 10 + dtp), REQUESTS)
    decode = Instance("consumer", dtp, layout, None, [])
    yield prefill, decode, layout
    decode.close()
    prefill.close()


def test_each_decode_rank_receives_its_channels_heads_and_the_replicated_groups(
        pair: tuple[Instance, Instance, str]) -> None:
    prefill, decode, layout = pair
    model = Model(prefill.ranks[0].tp * 10 + decode.ranks[0].tp)
    hand_off(prefill, decode, REQUESTS)
    ids = {r.rid for r in REQUESTS}
    wait_for(lambda: (prefill.step(), decode.step(), ids <= decode.done | decode.failed)[-1], 20)
    assert not decode.failed, [rank.reasons for rank in decode.ranks]
    wait_for(lambda: (prefill.step(), ids <= prefill.done)[-1])
    for rank in decode.ranks:
        tp, r = rank.tp, rank.rank
        want = np.full_like(rank.raw, PAD)
        for req in REQUESTS:
            for slot in range(2):
                for src, dst in zip(req.src[1][:req.moved], req.dst[1]):
                    want[slot, dst] = np.frombuffer(model.attention(slot, src, tp, r), np.uint8)
                data = model.state(slot, req.src[0], tp, r, layout)
                want[slot, req.dst[0], :len(data)] = np.frombuffer(data, np.uint8)   # padding: untouched
        for slot in range(2):
            bad = np.flatnonzero(~(rank.raw[slot] == want[slot]).all(axis=1))
            assert not len(bad), f"decode rank {r} of {tp}, layer slot {slot}: blocks {bad.tolist()} differ"
    # What moved: each decode rank's state bytes, not the padded page (the TP planner's sections).
    assert decode.ranks[0].memory.layout.pool(STATE_POOL).buffers[0].state.nbytes == state_bytes(decode.ranks[0].tp)


def test_a_state_block_among_attention_blocks_is_refused_by_the_lease_table() -> None:
    """A request whose state block is one of its own attention blocks, or of another live request's, is
    refused before any byte moves (kvferry checks vLLM's block ownership, not only assumes it), the reason
    naming the pool, the page and the request holding it; decode's blocks stay untouched."""
    reqs = [Request("live", 40, (20, [1, 2, 3]), (5, [6, 7, 8])), Request("own", 17, (21, [4]), (10, [10, 11])),
            Request("other", 9, (22, [5]), (7, [12]))]
    prefill = Instance("producer", 1, "SD", Model(3), reqs)
    decode = Instance("consumer", 2, "SD", None, [])
    try:
        hand_off(prefill, decode, reqs)
        prefill.step()   # prefill issues the ids (it sends once decode announced)
        # Every announce made in this one step, before decode's link to prefill is even up (its handshake
        # takes round trips): "live" holds its lease when the others ask.
        decode.step()
        # A rank's refusal reaches its results from its progress thread: under load a later step brings it
        wait_for(lambda: (decode.step(), all(len(rank.reasons) == 2 for rank in decode.ranks))[-1], 20)
        assert decode.failed == {"own", "other"}
        for rank in decode.ranks:
            assert (f"pool {STATE_POOL!r} page 10 is also its page in pool {HYBRID_POOL!r}"
                    in rank.reasons["own"]), rank.reasons
            assert (f"pool {STATE_POOL!r} page 7 is leased to live request" in rank.reasons["other"]
                    and f"in pool {HYBRID_POOL!r}" in rank.reasons["other"]), rank.reasons
        wait_for(lambda: (prefill.step(), decode.step(), "live" in decode.done)[-1], 20)
        for rank in decode.ranks:
            untouched = [b for b in range(NUM_BLOCKS) if b not in (5, 6, 7, 8)]
            assert (rank.raw[:, untouched] == PAD).all()
    finally:
        decode.close()
        prefill.close()
