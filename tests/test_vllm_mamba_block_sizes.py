"""A hybrid Mamba model between prefill and decode of different block sizes, on numpy memory (no vLLM).

vLLM sizes a hybrid model's attention block so its page holds the Mamba state, and pads the state's page to
the attention page (``_align_hybrid_block_size``): two instances at different ``--block-size`` differ in
their attention blocks' tokens *and* in the state page's padding, the state itself (its Mamba2 channel
sections) alike. kvferry maps the attention pool's token ranges (as for any model) and moves the state page
section by section, only its real bytes, one state page per request.

Both connector halves of each side over the local transport (tests/test_vllm_mamba_ranks.py's model: conv
``[x 16 | B 4 | C 4]`` x 3 rows, SSM 2 heads x 8 x 4, 2 KV heads of 8, fp32), the attention blocks filled in
vLLM-CPU's kernel order (``layout.cpu_kernel_parts``), at 16 -> 32, 32 -> 16 and 16 -> 64, prompts under, at
and over a block. Decode's whole cache must be what its kernel would hold: each prompt's tokens in its leased
blocks, the state sections in its state block, the state page's padding and every other block untouched.
Refused at the handshake by name: different state sections, and different TP sizes together with different
block sizes. Seconds.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest

from kvferry.control.core.admission import layout_difference, translates
from kvferry.errors import PlanError
from kvferry.integrations.vllm.layout import (
    HYBRID_POOL,
    STATE_POOL,
    GroupSpec,
    RankPlace,
    cpu_kernel_parts,
    mamba2_state_geometry,
    memory_from_kv_caches,
)
from kvferry.integrations.vllm.scheduler import SchedulerSide
from kvferry.integrations.vllm.worker import WorkerConfig, WorkerSide
from kvferry.layout.memory import KVMemory
from kvferry.plan.tokens import PageSizePlanner

from .test_vllm_adapter import Instance
from .test_vllm_mamba import prefill_finishes, wait_for
from .test_vllm_mamba_ranks import (
    ATTNS,
    HEAD_SIZE,
    HEADS,
    MIXERS,
    PAD,
    Model,
    shapes,
    state_bytes,
)

NUM_BLOCKS = 64
PAIRS = [(16, 32), (32, 16), (16, 64)]
PARTS = cpu_kernel_parts("vec", HEAD_SIZE, "float32")


def page(block: int, tp: int = 1) -> int:
    return HEADS // tp * block * 2 * HEAD_SIZE * 4


def groups(block: int, layout: str = "SD", tp: int = 1) -> tuple[GroupSpec, GroupSpec]:
    geometry = mamba2_state_geometry(shapes(tp, layout), (4, 4), layout, 1, tp) if layout else None
    return GroupSpec(MIXERS, 1024, state=True, geometry=geometry), GroupSpec(ATTNS, block)


def caches(raw: np.ndarray, block: int, tp: int = 1) -> dict[str, np.ndarray]:
    """vLLM's views over the backing bytes ``raw`` ``[slots, blocks, page]``: per slot an attention layer's
    ``[blocks, heads, block, 2 x head_size]`` and a Mamba layer's state, its real bytes a page apart."""
    out: dict[str, np.ndarray] = {}
    for slot, (mixer, attn) in enumerate(zip(MIXERS, ATTNS)):
        base = raw[slot].reshape(-1)
        out[mixer] = np.lib.stride_tricks.as_strided(base.view(np.int8), (NUM_BLOCKS, 1, 1, state_bytes(tp)),
                                                     (page(block, tp), 1, 1, 1))
        out[attn] = base.view(np.float32).reshape(NUM_BLOCKS, HEADS // tp, block, 2 * HEAD_SIZE)
    return out


def memory(raw: np.ndarray, block: int, layout: str = "SD", tp: int = 1) -> KVMemory:
    return memory_from_kv_caches(caches(raw, block, tp), groups(block, layout, tp), NUM_BLOCKS,
                                 place=RankPlace(tp, 0, HEADS // tp), head_parts=dict.fromkeys(ATTNS, PARTS))


def kv_tokens(rid: str, slot: int, num_tokens: int) -> np.ndarray:
    """A request's attention K and V in one layer slot, ``[2, heads, token, head_size]``: distinct, nonzero."""
    rng = np.random.default_rng([ord(c) for c in rid] + [slot])
    return rng.integers(1, 200, (2, HEADS, num_tokens, HEAD_SIZE)).astype(np.float32)


def kernel_write(raw: np.ndarray, slot: int, table: list[int], block: int, kv: np.ndarray, stop: int) -> None:
    """Tokens ``[0, stop)`` of ``kv`` into ``table``'s blocks as vLLM-CPU's kernel keeps them (per head, K
    ``[dim][slot]`` then V ``[slot][dim]``; tests/test_vllm_block_sizes.py reads it off the kernel)."""
    floats = raw[slot].view(np.float32).reshape(NUM_BLOCKS, HEADS, 2, HEAD_SIZE * block)
    for i, b in enumerate(table):
        lo, hi = i * block, min(stop, (i + 1) * block)
        if lo >= hi:
            break
        k = floats[b, :, 0].reshape(HEADS, HEAD_SIZE, block)
        v = floats[b, :, 1].reshape(HEADS, block, HEAD_SIZE)
        k[:, :, :hi - lo] = kv[0][:, lo:hi].transpose(0, 2, 1)
        v[:, :hi - lo] = kv[1][:, lo:hi]


class Side(Instance):
    """One instance's connector halves over ``raw`` (``Instance.step``, test_vllm_adapter's)."""

    def __init__(self, role: str, raw: np.ndarray, block: int, layout: str = "SD", **extra: Any) -> None:
        self.raw, self.block = raw, block
        self.memory = memory(raw, block, layout)
        self.worker = WorkerSide(WorkerConfig.from_extra(role, {"transport": "local", **extra}), self.memory)
        self.scheduler = SchedulerSide(groups(block, layout), self.worker.address)
        self.sending: set[str] = set()
        self.recving: set[str] = set()
        self.failed: set[str] = set()


def need(tokens: int, block: int) -> int:
    return -(-tokens // block)


def lengths(ts: int, td: int) -> list[int]:
    """Prompt lengths (prefill computes all but the last token): under a block of either side, at one, over."""
    return sorted({5, ts, ts + 1, td, td + 1, ts + td + 3, 2 * max(ts, td) + 7})


@pytest.mark.parametrize(("ts", "td"), PAIRS, ids=[f"{a}to{b}" for a, b in PAIRS])
def test_attention_tokens_and_state_sections_arrive_between_block_sizes(ts: int, td: int) -> None:
    hand_offs(ts, td)


def test_pull_mode_and_the_ds_conv_layout() -> None:
    """Decode reading prefill's blocks itself plans the same rows; the ``DS`` conv layout's sections too."""
    hand_offs(32, 16, "DS", mode="pull")


def hand_offs(ts: int, td: int, layout: str = "SD", **decode_extra: Any) -> None:
    """Every prompt of ``lengths`` handed off at once from a prefill of ``ts`` tokens a block to a decode of
    ``td``; decode's cache is compared whole with what it must hold."""
    model = Model(ts * 100 + td)
    rng = np.random.default_rng(ts + td)
    src_raw = rng.integers(0, 256, (2, NUM_BLOCKS, page(ts)), dtype=np.uint8)   # garbage never to arrive
    dst_raw = np.full((2, NUM_BLOCKS, page(td)), PAD, np.uint8)
    src_free, dst_free = (list(rng.permutation(np.arange(1, NUM_BLOCKS))) for _ in range(2))
    want = dst_raw.copy()
    requests = []
    for i, n in enumerate(lengths(ts, td)):
        rid = f"r{n}"
        src_state, dst_state = int(src_free.pop()), int(dst_free.pop())
        src_table = [int(src_free.pop()) for _ in range(need(n - 1, ts))]
        dst_table = [int(dst_free.pop()) for _ in range(need(n, td))]   # vLLM allocates for the whole prompt
        # prefill: its blocks full of the request's tokens (the last one's tail too: it may move), its state
        whole = need(n - 1, ts) * ts
        moved = min(whole, need(n - 1, td) * td)   # prefill's last block moves up to decode's lease's end
        for slot in range(2):
            kv = kv_tokens(rid, slot, max(whole, moved))
            kernel_write(src_raw, slot, src_table, ts, kv, whole)
            kernel_write(want, slot, dst_table, td, kv, moved)
            state = np.frombuffer(model.state(slot, i, 1, 0, layout), np.uint8)
            src_raw[slot, src_state, :len(state)] = state
            want[slot, dst_state, :len(state)] = state   # its padding: decode's own, untouched
        requests.append((rid, n, (src_state, src_table), (dst_state, dst_table)))
    prefill = Side("producer", src_raw, ts, layout, digest_mode="full")
    decode = Side("consumer", dst_raw, td, layout, digest_mode="full", **decode_extra)
    try:
        assert translates(prefill.memory.layout, decode.memory.layout)
        for rid, n, src, dst in requests:
            prompt = list(range(3, 3 + n))
            params = prefill_finishes(prefill, prompt, ([src[0]], src[1]), request_id=rid)
            assert decode.scheduler.matched_tokens(rid, n, params, 0) == (n - 1, True)
            decode.scheduler.after_alloc(rid, params, ([dst[0]], dst[1]), n - 1, prompt)
        ids = {r[0] for r in requests}
        wait_for(lambda: (prefill.step(), decode.step(), ids <= decode.recving | decode.failed)[-1], 20)
        assert not decode.failed, (ts, td, decode.failed)
        wait_for(lambda: (prefill.step(), ids <= prefill.sending)[-1])
    finally:
        decode.worker.close()
        prefill.worker.close()
    for slot in range(2):
        bad = np.flatnonzero(~(dst_raw[slot] == want[slot]).all(axis=1))
        assert not len(bad), f"{ts}->{td}, layer slot {slot}: decode blocks {bad.tolist()} differ"


def test_the_state_moves_section_by_section_one_page_a_request() -> None:
    """The plan's state rows: one per state buffer (the packed sections coalesce), the state's real bytes,
    between pages of 2,048 and 4,096 bytes; the attention pool's rows map tokens."""
    src, dst = memory(np.zeros((2, NUM_BLOCKS, page(16)), np.uint8), 16), memory(
        np.zeros((2, NUM_BLOCKS, page(32)), np.uint8), 32)
    planner = PageSizePlanner(src, dst)
    spans = planner.spans({HYBRID_POOL: np.array([3, 4, 5]), STATE_POOL: np.array([7])},
                          {HYBRID_POOL: 0, STATE_POOL: 0}, {HYBRID_POOL: np.array([9, 10]), STATE_POOL: np.array([2])},
                          {})
    plan = planner.plan(spans)
    state_ids = [src.buffer_index[m] for m in MIXERS]
    rows = np.isin(plan.row_buffer_ids, state_ids)
    assert rows.sum() == len(MIXERS)
    assert (plan.src_descs[rows, 1] == state_bytes(1)).all()
    for i, m in zip(np.flatnonzero(rows), MIXERS):
        assert int(plan.src_descs[i, 0]) == src.region(m).address + 7 * page(16)
        assert int(plan.dst_descs[i, 0]) == dst.region(m).address + 2 * page(32)


def test_different_state_sections_or_tp_sizes_with_block_sizes_are_refused_by_name() -> None:
    """A conv state laid out ``SD`` on one side and ``DS`` on the other (equal bytes, other sections), a state
    without sections (nothing says where its bytes end), and a decode of another TP size and block size:
    refused at the handshake, naming the pool, buffer and why."""
    sd = memory(np.zeros((2, NUM_BLOCKS, page(16)), np.uint8), 16, "SD")
    ds = memory(np.zeros((2, NUM_BLOCKS, page(32)), np.uint8), 32, "DS")
    diff = layout_difference(sd.layout, ds.layout)
    assert diff is not None and f"pool {STATE_POOL!r}, buffer {MIXERS[0]!r}: state sections" in diff, diff
    assert "2048 and 4096 bytes" in diff, diff
    with pytest.raises(PlanError, match="state sections"):
        PageSizePlanner(sd, ds)
    bare = memory(np.zeros((2, NUM_BLOCKS, page(16)), np.uint8), 16, ""), memory(
        np.zeros((2, NUM_BLOCKS, page(32)), np.uint8), 32, "")   # no sections: where do its bytes end?
    diff = layout_difference(bare[0].layout, bare[1].layout)
    assert diff is not None and f"pool {STATE_POOL!r}, buffer {MIXERS[0]!r}: page_bytes differs" in diff, diff
    tp2 = memory(np.zeros((2, NUM_BLOCKS, page(32, 2)), np.uint8), 32, "SD", tp=2)
    diff = layout_difference(sd.layout, tp2.layout)
    assert diff is not None and f"pool {HYBRID_POOL!r}: tokens_per_page differs (local 16, remote 32)" in diff
    assert "page sizes are translated between equal TP sizes only" in diff, diff
