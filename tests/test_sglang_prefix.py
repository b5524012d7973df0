"""Decode-side prefixes through SGLang's classes, the heavier variants (``tests/test_sglang.py`` has the
default ones): the DSA pool with fp8 index keys, prefixes across attention TP sizes, and SGLang's own NIXL
backend on the same cases for comparison. Marked slow: ``make test-sglang-slow`` runs it.
"""

from __future__ import annotations

from collections import Counter

import pytest

pytest.importorskip("sglang.srt.disaggregation.common.conn")
pytest.importorskip("nixl")
pytestmark = [pytest.mark.sglang, pytest.mark.nixl, pytest.mark.slow]

from tests.test_sglang import N_PREFIX, assert_prefix_case, run_ranks  # noqa: E402


def test_kvferry_backend_prefix_dsa_fp8() -> None:
    prefills, decodes = run_ranks("kvferry", "dsa_fp8", n=N_PREFIX, prefix=True, chunk_pages=2)
    assert_prefix_case(prefills, decodes)


@pytest.mark.parametrize(("pool", "prefill_tp", "decode_tp"), [("mla", 2, 1), ("v4", 2, 1), ("dsa_bf16", 1, 2)])
def test_kvferry_backend_prefix_across_tp_sizes(pool: str, prefill_tp: int, decode_tp: int) -> None:
    """The prefix cases between attention TP sizes, a process per rank: every prefill rank's sender pops
    the prefix (the dummy's of TP 2 -> 1 too) and concludes Success; with decode TP 2 both decode ranks
    announce it to the one prefill rank. Bytes from exactly the rank that must write each decode rank."""
    prefills, decodes = run_ranks("kvferry", pool, prefill_tp=prefill_tp, decode_tp=decode_tp, n=N_PREFIX,
                                  prefix=True, chunk_pages=2)
    assert_prefix_case(prefills, decodes)


@pytest.mark.parametrize("pool", ["mla", "dsa_bf16", "v4"])
def test_sglang_nixl_backend_prefix_same_cases(pool: str) -> None:
    """SGLang's own NIXL backend on the default prefix cases (its VRAM->DRAM shim, as in test_sglang.py):
    decode's bytes and held pages. Asserted as observed; this test fails the day that changes."""
    prefills, decodes = run_ranks("nixl", pool, n=N_PREFIX, prefix=True, chunk_pages=2, deadline=20)
    for d in decodes:
        assert "refused" not in d, d
        print(pool, Counter(d["outcomes"].values()), d["check"]["num_bad_pages"], d["check"]["num_held_changed"])
    assert_prefix_case(prefills, decodes)
