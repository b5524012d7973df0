"""A padded state page between equal layouts: only its sections move, never its padding.

vLLM pads a Mamba state page to its attention page (19,840 real bytes in 65,536 on the hybrid model of
tests/test_vllm_mamba.py). Between equal layouts kvferry used to move such a page whole; it now plans it as
it does between block sizes (``plan.tokens``, sections only), so each request moves the real state, and
decode's padding (its own bytes) stays as it was. A state whose sections cover its page keeps the whole-page
path.
"""

from __future__ import annotations

from types import SimpleNamespace

import numpy as np
import pytest

from kvferry.control import DecodeEndpoint, EndpointOptions, PrefillEndpoint
from kvferry.control.core.admission import _check_decode_rank, translates
from kvferry.layout import Buffer, KVMemory, Layout, Pool, StateGeometry
from kvferry.plan.tokens import PageSizePlanner

from .test_pool_aliases import PAGE, PAGES, STATE, _arrays, _layout

OPTS = EndpointOptions(heartbeat_interval=0.1, peer_timeout=0.6, lease_grace=0.4, request_timeout=20.0)


def _memory(seed: int) -> tuple[KVMemory, np.ndarray]:
    shared = np.random.default_rng(seed).integers(0, 256, (2, PAGES, PAGE), dtype=np.uint8)
    return KVMemory.from_arrays(_layout(), _arrays(shared)), shared


@pytest.mark.parametrize("mode", ["push", "pull"])
def test_the_sections_arrive_and_decodes_padding_stays_its_own(mode: str) -> None:
    src_mem, src = _memory(1)
    dst_mem, dst = _memory(2)
    assert STATE.nbytes < PAGE and translates(src_mem.layout, dst_mem.layout)
    want = dst.copy()
    want[:, [5, 6]] = src[:, [1, 2]]                       # attention blocks, whole
    want[0, 7, :STATE.nbytes] = src[0, 3, :STATE.nbytes]   # the state's sections (mixer0 lies on attn0)
    with PrefillEndpoint(src_mem, "local", options=OPTS, digest_mode="full") as prefill, \
            DecodeEndpoint(dst_mem, "local", options=OPTS, digest_mode="full", mode=mode) as decode:
        decode.connect(prefill.address)
        decode.announce("r", {"blocks": [5, 6], "state": [7]})
        prefill.send("r", {"blocks": [1, 2], "state": [3]}, last=True)
        decode.wait("r", 5)
        prefill.wait("r", 5)
    for slot in range(2):
        bad = np.flatnonzero(~(dst[slot] == want[slot]).all(axis=1))
        assert not len(bad), f"slot {slot}: pages {bad.tolist()} differ (padding moved, or a section did not)"


def test_the_plan_moves_the_sections_bytes_one_row_a_page() -> None:
    src_mem, _ = _memory(1)
    dst_mem, _ = _memory(2)
    planner = PageSizePlanner(src_mem, dst_mem)
    spans = planner.spans({"state": np.array([3, 9])}, {"state": 0}, {"state": np.array([7, 8])}, {})
    plan = planner.plan(spans)
    assert plan.src_descs[:, 1].tolist() == [STATE.nbytes, STATE.nbytes]
    assert plan.dst_descs[:, 0].tolist() == [dst_mem.region("mixer0").address + p * PAGE for p in (7, 8)]


def test_a_state_that_fills_its_page_keeps_the_whole_page_path() -> None:
    full = StateGeometry.packed([(1, [(16, 4, True), (16, 12, False)])])
    assert full.nbytes == PAGE
    lay = Layout([Pool("blocks", [Buffer("attn0", PAGE, PAGES, "float32", "kv", 1)], tokens_per_page=16),
                  Pool("state", [Buffer("mixer0", PAGE, PAGES, "int8", "state", 0, state=full)])])
    assert not translates(lay, lay)


def test_prepared_descriptor_lists_are_refused_by_name_for_a_padded_state() -> None:
    """NIXL's ``descriptors='prepped'`` indexes whole pages: prefill refuses the session, saying why."""
    src_mem, _ = _memory(1)
    dst_mem, _ = _memory(2)
    session = SimpleNamespace(planner=None, translator=None)
    problem = _check_decode_rank(src_mem, "prepped", session, KVMemory.from_manifest(dst_mem.manifest()))
    assert problem is not None and "pool 'state'" in problem and "padded state page" in problem
    assert "'auto'" in problem
    assert _check_decode_rank(src_mem, "auto", session, KVMemory.from_manifest(dst_mem.manifest())) is None
    assert session.translator is not None
