"""Every planner error path, with its message: bad input is refused before a single row exists."""

from __future__ import annotations

import numpy as np
import pytest

from kvferry import Buffer, KVMemory, Layout, PlanError, Pool, plan_transfer


@pytest.fixture
def sides(salad_layout: Layout) -> tuple[KVMemory, KVMemory]:
    return KVMemory.allocate(salad_layout), KVMemory.allocate(salad_layout.with_capacities({"c4.kv.L1": 12}))


@pytest.mark.parametrize("pages, message", [
    ({"c4": ([0, 1], [0])}, "pool 'c4': 2 source pages but 1 destination pages"),
    ({"c4": ([0, 1], [5, 5])}, "pool 'c4': destination page 5 appears more than once"),
    ({"c4": ([0, 24], [0, 1])},
     "pool 'c4', buffer 'c4.idx.L0': source page 24 is out of range \\(this buffer has 24 pages on the source "
     "side, valid 0..23\\)"),
    ({"c4": ([0, 1], [0, 12])},
     "pool 'c4', buffer 'c4.kv.L1': destination page 12 is out of range \\(this buffer has 12 pages"),
    ({"c4": ([-1], [0])}, "pool 'c4', buffer 'c4.kv.L0': source page -1 is out of range"),
    ({"c4": ([0.5], [0])}, "pool 'c4': source pages must be integers, got dtype float64"),
    ({"c4": ([[0]], [[0]])}, "pool 'c4': source pages must be a 1-D sequence"),
    ({"c4": [0]}, "pool 'c4': expected \\(source pages, destination pages\\)"),
    ({"nope": ([0], [0])}, "no pool 'nope' in layout \\(pools: \\['c4', 'c128'\\]\\)"),
    ({"c4": (np.array([2**63], dtype=np.uint64), [0])}, "pool 'c4': source page 9223372036854775808 is out"),
])
def test_bad_pages_are_refused_with_a_precise_message(sides, pages, message) -> None:
    src, dst = sides
    with pytest.raises(PlanError, match=message):
        plan_transfer(src, dst, pages)


def test_unknown_buffer_in_restriction(sides) -> None:
    with pytest.raises(PlanError, match="no buffer 'c4.kv.L9' in layout"):
        plan_transfer(*sides, {"c4": ([0], [0])}, buffers=["c4.kv.L0", "c4.kv.L9"])


def test_shape_mismatch_names_the_difference(salad_layout: Layout) -> None:
    fp8 = Layout([Pool("c4", [b if b.kind != "index_k" else Buffer(b.name, 64 * 132, b.num_pages, "fp8",
                                                                         b.kind, b.layer)
                              for b in salad_layout.pool("c4").buffers], 256), salad_layout.pool("c128")])
    with pytest.raises(PlanError, match="pool 'c4', buffer 'c4.idx.L0': page_bytes differs: local 16384, remote 8448"):
        plan_transfer(KVMemory.allocate(salad_layout), KVMemory.allocate(fp8), {"c4": ([0], [0])})


def test_empty_requests_and_restrictions_give_empty_plans(sides) -> None:
    plan = plan_transfer(*sides, {"c4": ([], [])})
    assert plan.num_descriptors == 0 and plan.nbytes == 0 and plan.src_descs.shape == (0, 3)
    plan = plan_transfer(*sides, {"c4": ([1], [2])}, buffers=["c128.kv.L0"])
    assert plan.num_descriptors == 0
    src_idx, dst_idx = plan.page_selectors()
    assert len(src_idx) == len(dst_idx) == 0


def test_layer_by_layer_restriction(sides) -> None:
    src, dst = sides
    plan = plan_transfer(src, dst, {"c4": ([0, 1], [3, 4]), "c128": ([0], [0])},
                         buffers=["c4.kv.L1", "c4.idx.L1"])
    assert plan.buffer_names == ("c4.kv.L1", "c4.idx.L1")
    assert plan.num_descriptors == 2 and plan.num_pages == {"c4": 2}


def test_plan_does_not_freeze_or_alias_caller_arrays(sides) -> None:
    s, d = np.array([0, 1]), np.array([3, 4])
    plan_transfer(*sides, {"c4": (s, d)})
    s[0] = 5  # still writable
    assert s.flags.writeable
