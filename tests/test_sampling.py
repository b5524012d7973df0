"""Sampled digests' page draws: k distinct pages per buffer, uniform over k-subsets, drawn in blocks."""

from __future__ import annotations

import itertools
import threading
from collections import Counter

import numpy as np
import pytest
import xxhash
from hypothesis import given, settings
from hypothesis import strategies as st

from kvferry import Buffer, KVMemory, Layout, Pool
from kvferry.integrity import digest_pages
from kvferry.integrity.sampling import PageSampler, _floyd, _smallest_keys, draw

shapes = st.lists(st.tuples(st.integers(1, 6), st.integers(1, 40), st.integers(1, 5)), min_size=1, max_size=4).map(
    lambda pools: tuple((b, n, min(k, n)) for b, n, k in pools))


def split(row: np.ndarray, shape: tuple[tuple[int, int, int], ...]) -> list[np.ndarray]:
    """A draw's row as one [buffers, picks] array per pool."""
    out, at = [], 0
    for buffers, _, picks in shape:
        out.append(row[at:at + buffers * picks].reshape(buffers, picks))
        at += buffers * picks
    assert at == len(row)
    return out


@settings(max_examples=200, deadline=None)
@given(shapes, st.sampled_from([1, 9, 300]), st.integers(0, 2**32))
def test_each_buffer_gets_its_picks_distinct_in_range_and_ascending(shape, rows: int, seed: int) -> None:
    block = draw(np.random.default_rng(seed), shape, rows)
    assert block.shape == (rows, sum(b * k for b, _, k in shape)) and block.dtype == np.int64
    for row in block:
        for (_, pages, picks), per_buffer in zip(shape, split(row, shape)):
            assert per_buffer.min() >= 0 and per_buffer.max() < pages
            assert (np.diff(per_buffer, axis=1) > 0).all()           # distinct and ascending
            if picks == pages:
                assert (per_buffer == np.arange(pages)).all()        # every page: nothing drawn


@pytest.mark.parametrize("method", [_smallest_keys, _floyd])
def test_every_k_subset_is_about_equally_likely(method) -> None:
    n, k, rows = 6, 3, 60_000
    block = method(np.random.default_rng(7), rows, n, k)
    counts = Counter(map(tuple, block.tolist()))
    subsets = list(itertools.combinations(range(n), k))
    assert set(counts) == set(subsets)
    expected = rows / len(subsets)     # 3,000; a 5-sigma band is about +-270
    assert all(abs(counts[s] - expected) < 5 * expected ** 0.5 for s in subsets), counts


def test_buffers_are_drawn_independently() -> None:
    block = draw(np.random.default_rng(3), ((4, 50, 2),), 500)
    per_buffer = block.reshape(500, 4, 2)
    # Were the buffers of a row given the same pages, every row would repeat; independent, few do.
    same = (per_buffer == per_buffer[:, :1, :]).all(axis=(1, 2)).sum()
    assert same < 5


def test_a_sampler_hands_out_fresh_rows_in_growing_blocks() -> None:
    sampler = PageSampler(np.random.default_rng(0))
    shape = ((3, 100, 2),)
    rows = [sampler.take(shape) for _ in range(64)]
    assert all(not r.flags.writeable for r in rows)
    assert len({tuple(r.tolist()) for r in rows}) > 60
    assert len(sampler._blocks[shape].rows) == 64   # 1, 2, 4, ..., 32 used up, then a block of 64
    other = ((1, 5, 5),)
    assert sampler.take(other).tolist() == [0, 1, 2, 3, 4]


def test_a_sampler_is_safe_to_share_between_threads() -> None:
    sampler = PageSampler(np.random.default_rng(1))
    shape = ((2, 30, 2), (1, 3, 2))
    got: list[np.ndarray] = []
    lock = threading.Lock()

    def worker() -> None:
        mine = [sampler.take(shape) for _ in range(500)]
        with lock:
            got.extend(mine)

    threads = [threading.Thread(target=worker) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert len(got) == 2000
    for row in got:
        for (_, pages, _), per_buffer in zip(shape, split(row, shape)):
            assert per_buffer.max() < pages and (np.diff(per_buffer, axis=1) > 0).all()


def test_digest_pages_with_a_sampler_hashes_the_pages_it_names() -> None:
    layout = Layout([Pool("p", [Buffer("a", 64, 40, "uint8", "kv", 0), Buffer("b", 32, 40, "uint8", "kv", 0)], 16)])
    mem = KVMemory.allocate(layout)
    for name in ("a", "b"):
        mem.array(name)[...] = np.random.default_rng(len(name)).integers(0, 256, mem.array(name).shape, np.uint8)
    pages = {"p": np.array([3, 9, 17, 21, 30], dtype=np.int64)}
    sampler = PageSampler(np.random.default_rng(2))
    for _ in range(20):
        d = digest_pages(mem, pages, "sampled", seed=sampler)
        assert len(d) == 4   # 2 buffers x 2 pages
        for name_id, pos, digest in zip(d.buffer_ids.tolist(), d.positions.tolist(), d.digests.tolist()):
            page = int(pages["p"][pos])
            assert digest == xxhash.xxh3_64_intdigest(mem.array(d.buffer_names[name_id])[page].tobytes())
