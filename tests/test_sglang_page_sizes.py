"""Prefill and decode at different page sizes through SGLang's classes (``--page-size`` differs): SGLang's
real MHA pool (``MHATokenToKVPool``, 4 KV heads, ``[page * page_size + token][head][dim]``) and MLA pool
(``MLATokenToKVPool``, ``[slot][1][dim]``) on CPU, a process per side (tests/sglang_peer.py,
``cfg["pages"]``), requests of 1 to 160 tokens, a third with a decode prefix. Decode checks every token row
of every KV entry against prefill's row of that token, aux whole, every other row untouched.

SGLang's own decode refuses a prefill of another page size before any transfer
(``CommonKVManager.try_ensure_parallel_info``, ``RuntimeError: Page size mismatch``); kvferry's bootstrap
server does not state one, and kvferry's handshake translates the pages instead (docs/sglang.md).
"""

from __future__ import annotations

from collections import Counter

import pytest

pytest.importorskip("sglang.srt.disaggregation.common.conn")
pytest.importorskip("nixl")
pytestmark = [pytest.mark.sglang, pytest.mark.nixl]

from tests.test_sglang import run_pair  # noqa: E402

N_PAGES = 24
PAIRS = [(1, 16), (16, 1), (16, 64), (64, 16)]
# make test runs one direction of each pair per pool kind and MHA 128 -> 16 (where the two sides' token
# bindings were once cut at their own page sizes); make test-sglang-slow the rest (7-14 s a case on 2 busy
# cores).
CASES = [("mha", 1, 16), ("mha", 64, 16), ("mha", 128, 16), ("mla", 16, 1), ("mla", 16, 64)]


def _cases() -> list:
    every = [(pool, ts, td) for pool in ("mha", "mla") for ts, td in PAIRS] + [("mha", 128, 16)]
    return [c if c in CASES else pytest.param(*c, marks=pytest.mark.slow) for c in every]


def _ok(report: dict) -> int:
    return sum(v == "ok" for v in report["outcomes"].values())


@pytest.mark.parametrize(("pool", "ts", "td"), _cases())
def test_kvferry_backend_between_page_sizes(pool: str, ts: int, td: int) -> None:
    """Every request Success on both sides, bound to its input ids on both (``bind_tokens``), every token
    exact; prefill popped decode's prefix cut to whole pages of its own."""
    prefill, decode = run_pair("kvferry", pool, n=N_PAGES, pages=[ts, td], prefix=True, chunk_pages=2, bind=True)
    assert "refused" not in decode and "refused" not in prefill, (prefill, decode)
    assert (prefill["page_size"], decode["page_size"]) == (ts, td)
    assert _ok(prefill) == N_PAGES and _ok(decode) == N_PAGES, (Counter(prefill["outcomes"].values()),
                                                                Counter(decode["outcomes"].values()))
    check = decode["check"]
    assert check["tokens_checked"] > 0 and check["num_bad_rows"] == 0, check
    # SGLang's prefill started each request where the sender said: decode's prefix cut to whole prefill pages
    assert any(v for v in prefill["popped"].values()) and all(v % ts == 0 for v in prefill["popped"].values())


@pytest.mark.slow   # SGLang's own refusal, not kvferry's code: make test-sglang-slow
def test_sglang_nixl_backend_refuses_another_page_size() -> None:
    """SGLang's nixl backend, prefill page size 16, decode 64: its decode raises before any transfer (in a
    server this exception ends the decode scheduler on the first request from that prefill)."""
    prefill, decode = run_pair("nixl", "mha", n=2, pages=[16, 64], deadline=3.0)
    assert "RuntimeError: Page size mismatch: prefill server has page_size=16, but decode server has " \
        "page_size=64" in decode["refused"], decode
    assert _ok(prefill) == 0
