"""Real SGLang servers for the tests: a tiny random-weights model written on the spot, a plain server, a
prefill + decode pair with a chosen transfer backend, and SGLang's router in front of them.

Every server is an OS process group of its own (``start_new_session``): ``stop`` ends the HTTP process and
the scheduler and detokenizer processes it spawned together. Flags are the ones that run SGLang 0.5.23 on
a CPU torch (docs/sglang.md, "SGLang servers in the tests").
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import requests

from .ports import server_port

REPO = Path(__file__).resolve().parent.parent
HOST = "127.0.0.1"

# A BPE vocabulary trained here on this text: no download, and the same ids on every machine.
_CORPUS = [
    "the quick brown fox jumps over the lazy dog while the cat sleeps on the warm mat",
    "prefill computes the prompt and decode generates one token at a time from the cache",
    "pages of key value cache move between servers over the network without a copy",
    "a radix tree shares the common prefix of many requests so that later turns reuse it",
    "numbers 0 1 2 3 4 5 6 7 8 9 10 11 12 13 14 15 16 17 18 19 20 and punctuation , . ! ? : ;",
    "User: hello there, how are you today? Assistant: I am fine, thank you for asking.",
]
CHAT_TEMPLATE = ("{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] }}\n{% endfor %}"
                 "{% if add_generation_prompt %}<|assistant|>{% endif %}")


def free_port() -> int:
    """A port for a server (``tests/ports.py``: outside the ephemeral range, where the ~40 s before a server
    binds it could see it given to someone's outgoing connection)."""
    return server_port(HOST)


def write_tokenizer(path: Path) -> int:
    """A byte-level BPE tokenizer trained locally, saved as a transformers fast tokenizer; its vocab size."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    specials = ["<|bos|>", "<|eos|>", "<|pad|>"]
    tok.train_from_iterator(_CORPUS * 4, trainers.BpeTrainer(
        vocab_size=384, special_tokens=specials, initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<|bos|>", eos_token="<|eos|>",
                                   pad_token="<|pad|>")
    fast.chat_template = CHAT_TEMPLATE
    fast.save_pretrained(path)
    return int(tok.get_vocab_size())


def write_tiny_model(path: Path, arch: str = "llama", seed: int = 0) -> Path:
    """A tiny random-weights causal LM in Hugging Face format (safetensors, float32) with the tokenizer.

    ``llama``: hidden 64, 2 layers, 4 heads, 2 KV heads (GQA). ``deepseek_v2``: the same size with MLA
    (kv_lora_rank 32, rope head dim 16) and dense MLPs. Weights are drawn wider than the usual 0.02 so the
    logits are peaked: greedy tokens then do not hinge on float rounding between batch shapes."""
    import torch
    import transformers

    path.mkdir(parents=True, exist_ok=True)
    vocab = write_tokenizer(path)
    common: dict[str, Any] = dict(vocab_size=vocab, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                  num_attention_heads=4, max_position_embeddings=4096, initializer_range=0.25,
                                  bos_token_id=0, eos_token_id=1, pad_token_id=2, tie_word_embeddings=False,
                                  torch_dtype="float32")
    if arch == "llama":
        config = transformers.LlamaConfig(num_key_value_heads=2, **common)
        cls = transformers.LlamaForCausalLM
    elif arch == "deepseek_v2":
        config = transformers.DeepseekV2Config(
            num_key_value_heads=4, kv_lora_rank=32, q_lora_rank=None, qk_rope_head_dim=16, qk_nope_head_dim=16,
            v_head_dim=16, n_routed_experts=4, num_experts_per_tok=2, n_shared_experts=1, moe_intermediate_size=32,
            first_k_dense_replace=2, moe_layer_freq=1, topk_method="greedy", n_group=1, topk_group=1,
            # SGLang's CPU rotary embedding for MLA is DeepSeek's YaRN only (get_rope_cpu); factor 1 = plain
            rope_parameters={"rope_type": "yarn", "rope_theta": 10000.0, "factor": 1.0, "beta_fast": 32.0,
                             "beta_slow": 1.0, "mscale": 1.0, "mscale_all_dim": 1.0,
                             "original_max_position_embeddings": 4096}, **common)
        cls = transformers.DeepseekV2ForCausalLM
    elif arch == "gemma4":
        # SGLang serves Gemma4 with its hybrid sliding-window pool (two KV pools: full and SWA layers)
        text = {k: v for k, v in common.items() if k not in ("bos_token_id", "pad_token_id")}
        config = transformers.Gemma4TextConfig(
            num_key_value_heads=2, head_dim=16, sliding_window=8,
            layer_types=["sliding_attention", "full_attention"], hidden_size_per_layer_input=16,
            vocab_size_per_layer_input=vocab, bos_token_id=0, pad_token_id=2, **text)
        config.architectures = ["Gemma4ForCausalLM"]
        cls = transformers.Gemma4ForCausalLM
    else:
        raise ValueError(f"unknown arch {arch!r}")
    torch.manual_seed(seed)
    model = cls(config).to(torch.float32)
    model.save_pretrained(path, safe_serialization=True)
    return path


SITECUSTOMIZE = REPO / "tests" / "sglang_sitecustomize"


def server_env(extra: dict[str, str] | None = None, patches: Sequence[str] = ()) -> dict[str, str]:
    """The environment a CPU SGLang server needs here, with this checkout's kvferry first on the path.
    ``patches``: switches of tests/sglang_sitecustomize (``KVFERRY_TEST_NIXL_DRAM``,
    ``KVFERRY_TEST_MLA_ABSORBED``), which then goes first on the path."""
    env = dict(os.environ)
    paths = [str(SITECUSTOMIZE)] if patches else []
    env.update({
        "SGLANG_USE_CPU_ENGINE": "1",             # else is_cpu() is False and start-up imports vLLM's ops
        "SGLANG_CPU_OMP_THREADS_BIND": "all",
        "SGLANG_PLUGINS": "kvferry",
        "PYTHONPATH": os.pathsep.join([*paths, str(REPO / "src"), str(REPO), env.get("PYTHONPATH", "")]
                                      ).rstrip(os.pathsep),
        "OMP_NUM_THREADS": env.get("OMP_NUM_THREADS", "1"),
        "TOKENIZERS_PARALLELISM": "false",
        "HF_HUB_OFFLINE": "1",
        "TRANSFORMERS_OFFLINE": "1",
    })
    env.update({p: "1" for p in patches})
    env.update(extra or {})
    return env


def server_args(model: Path, port: int, page_size: int, *, extra: Sequence[str] = ()) -> list[str]:
    """``--max-total-tokens`` sizes the KV pool. ``--mem-fraction-static`` only has to pass SGLang's start-up
    check (the memory left after loading weights minus ``(1 - fraction)`` of the memory before must stay
    positive): on a CPU that memory is the machine's, which the other servers starting beside this one
    draw on meanwhile, so the fraction is high to tolerate them."""
    return [sys.executable, "-m", "sglang.launch_server", "--model-path", str(model), "--device", "cpu",
            "--attention-backend", "torch_native", "--disable-cuda-graph", "--tp", "1", "--host", HOST,
            "--port", str(port), "--skip-server-warmup", "--max-total-tokens", "8192",
            "--mem-fraction-static", "0.8", "--page-size", str(page_size), "--dtype", "float32",
            "--enable-metrics", "--log-level", "info", *extra]


@dataclass
class Server:
    """One server (or router) process group, its port and its log."""

    name: str
    argv: list[str]
    port: int
    log_path: Path
    env: dict[str, str]
    proc: subprocess.Popen[bytes] | None = None
    ready_path: str = "/health"
    extra: dict[str, Any] = field(default_factory=dict)

    @property
    def url(self) -> str:
        return f"http://{HOST}:{self.port}"

    def start(self) -> Server:
        log = open(self.log_path, "ab")   # noqa: SIM115 - the child holds it; closed with the process
        self.proc = subprocess.Popen(self.argv, stdout=log, stderr=subprocess.STDOUT, env=self.env,
                                     start_new_session=True, cwd=str(REPO))
        log.close()
        return self

    def log(self) -> str:
        try:
            return self.log_path.read_text(errors="replace")
        except FileNotFoundError:
            return ""

    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def wait_ready(self, timeout: float) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if not self.alive():
                raise RuntimeError(f"{self.name} exited ({self.proc and self.proc.returncode}) before it was "
                                   f"ready:\n{self.log()[-4000:]}")
            with contextlib.suppress(requests.RequestException):
                if requests.get(self.url + self.ready_path, timeout=5).status_code == 200:
                    return
            time.sleep(0.5)
        raise TimeoutError(f"{self.name} not ready after {timeout:.0f} s:\n{self.log()[-4000:]}")

    def stop(self, sig: int = signal.SIGTERM, grace: float = 15.0) -> None:
        """End the whole process group; SIGKILL after ``grace`` seconds."""
        if self.proc is None:
            return
        with contextlib.suppress(ProcessLookupError):
            os.killpg(self.proc.pid, sig)
        with contextlib.suppress(subprocess.TimeoutExpired):
            self.proc.wait(timeout=grace)
        with contextlib.suppress(ProcessLookupError):
            os.killpg(self.proc.pid, signal.SIGKILL)   # the scheduler children too, whatever the parent did
        with contextlib.suppress(subprocess.TimeoutExpired):
            self.proc.wait(timeout=10)

    def cpu_seconds(self) -> float:
        """CPU seconds (user + system) of the live process tree so far (0 once it has ended)."""
        import psutil

        if not self.alive():
            return 0.0
        total = 0.0
        with contextlib.suppress(psutil.Error):
            root = psutil.Process(self.proc.pid)   # type: ignore[union-attr]
            for p in [root, *root.children(recursive=True)]:
                with contextlib.suppress(psutil.Error):
                    t = p.cpu_times()
                    total += t.user + t.system + t.children_user + t.children_system
        return total

    def kill(self) -> None:
        self.stop(signal.SIGKILL, grace=5.0)

    def metrics(self) -> dict[str, float]:
        """SGLang's Prometheus counters and gauges, summed over labels other than ``mode``."""
        text = requests.get(self.url + "/metrics", timeout=10).text
        out: dict[str, float] = {}
        for line in text.splitlines():
            if not line.startswith("sglang:"):
                continue
            name_labels, _, value = line.rpartition(" ")
            name = name_labels.split("{", 1)[0]
            if 'mode="' in name_labels:
                name += "." + name_labels.split('mode="', 1)[1].split('"', 1)[0]
            out[name] = out.get(name, 0.0) + float(value)
        return out


@dataclass
class PD:
    """A prefill server, a decode server and SGLang's router in front of them."""

    prefill: Server
    decode: Server
    router: Server
    backend: str
    page_size: int
    transport: str = "nixl"   # what kvferry's backend moves pages with (KVFERRY_SGLANG_TRANSPORT)
    decode_page_size: int | None = None   # decode's --page-size (None: page_size, as set by pd_servers)

    @property
    def url(self) -> str:
        return self.router.url

    def all(self) -> list[Server]:
        return [self.router, self.decode, self.prefill]

    def stop(self) -> None:
        for s in self.all():
            s.stop()


def plain_server(model: Path, page_size: int, log_dir: Path, *, patches: Sequence[str] = (),
                 extra: Sequence[str] = ()) -> Server:
    port = free_port()
    return Server("plain", server_args(model, port, page_size, extra=extra), port,
                  log_dir / f"plain-{model.name}-p{page_size}.log", server_env(patches=patches))


def pd_servers(model: Path, page_size: int, backend: str, log_dir: Path, *, decode_radix: bool = True,
               prefill_radix: bool = True, patches: Sequence[str] = (), transport: str = "nixl",
               mode: str = "push", decode_page_size: int | None = None) -> PD:
    """Prefill, decode and router (not started). ``backend``: ``kvferry`` or SGLang's ``nixl``. With
    ``prefill_radix`` off, the cached tokens decode reports are decode's own radix hits only. ``transport``:
    what kvferry's backend moves pages with (``KVFERRY_SGLANG_TRANSPORT`` on both servers: ``nixl`` or
    ``mooncake``). ``mode``: ``pull`` makes kvferry's decode read prefill's pages (``KVFERRY_SGLANG_MODE``).
    ``decode_page_size``: decode's ``--page-size`` where it differs from prefill's ``page_size``."""
    dpage = page_size if decode_page_size is None else decode_page_size
    pport, dport, bport, rport = free_port(), free_port(), free_port(), free_port()
    common = ["--disaggregation-transfer-backend", backend, "--disable-overlap-schedule"]
    patches = list(patches)
    env_extra: dict[str, str] = {}
    if transport != "nixl":
        assert backend == "kvferry", "the transport is kvferry's backend's choice"
        env_extra["KVFERRY_SGLANG_TRANSPORT"] = transport
    if mode != "push":
        assert backend == "kvferry", "the mode is kvferry's backend's choice"
        env_extra["KVFERRY_SGLANG_MODE"] = mode
    if backend == "nixl":
        # SGLang's nixl registers KV as VRAM whatever the device; UCX refuses that on a CPU (the patch maps
        # it to DRAM at run time, tests/sglang_sitecustomize). Its UCX backend, as on SGLang's CPU tests.
        patches.append("KVFERRY_TEST_NIXL_DRAM")
        env_extra["SGLANG_DISAGGREGATION_NIXL_BACKEND"] = "UCX"
    tag = (f"{model.name}-{backend}{'' if transport == 'nixl' else '-' + transport}"
           f"{'' if mode == 'push' else '-' + mode}-p{page_size}{'' if dpage == page_size else f'-d{dpage}'}")
    prefill_flags = [*common, "--disaggregation-mode", "prefill", "--disaggregation-bootstrap-port", str(bport)]
    if not prefill_radix:
        prefill_flags.append("--disable-radix-cache")
    prefill = Server("prefill", server_args(model, pport, page_size, extra=prefill_flags),
                     pport, log_dir / f"prefill-{tag}.log", server_env(env_extra, patches),
                     extra={"bootstrap_port": bport})
    decode_flags = [*common, "--disaggregation-mode", "decode",
                    "--disaggregation-decode-retraction-backup", "cpu_tensor"]
    if decode_radix:
        decode_flags.append("--disaggregation-decode-enable-radix-cache")
    decode = Server("decode", server_args(model, dport, dpage, extra=decode_flags), dport,
                    log_dir / f"decode-{tag}.log", server_env(env_extra, patches))
    router = Server("router", [sys.executable, "-m", "sglang_router.launch_router", "--pd-disaggregation",
                               "--mini-lb", "--prefill", prefill.url, str(bport), "--decode", decode.url,
                               "--host", HOST, "--port", str(rport)],
                    rport, log_dir / f"router-{tag}.log", server_env(), ready_path="/health")
    return PD(prefill, decode, router, backend, page_size, transport, dpage)


def start_all(servers: Sequence[Server], timeout: float = 400.0) -> None:
    """Start every server at once (their imports overlap), then wait for each; on failure stop them all."""
    try:
        for s in servers:
            s.start()
        for s in servers:
            s.wait_ready(timeout)
    except BaseException:
        for s in servers:
            s.stop()
        raise


# ---------------------------------------------------------------------------------------------- clients


def generate(url: str, input_ids: list[int], max_new_tokens: int, timeout: float = 120.0,
             **extra: Any) -> dict[str, Any]:
    """``/generate`` with greedy sampling and EOS ignored: the output ids and SGLang's meta_info."""
    body = {"input_ids": input_ids, "sampling_params": {"temperature": 0.0, "max_new_tokens": max_new_tokens,
                                                        "ignore_eos": True}, **extra}
    r = requests.post(url + "/generate", json=body, timeout=timeout)
    r.raise_for_status()
    return r.json()


def generate_stream(url: str, input_ids: list[int], max_new_tokens: int, timeout: float = 120.0) -> list[int]:
    """``/generate`` streamed: the output ids of the last chunk."""
    body = {"input_ids": input_ids, "stream": True,
            "sampling_params": {"temperature": 0.0, "max_new_tokens": max_new_tokens, "ignore_eos": True}}
    ids: list[int] = []
    with requests.post(url + "/generate", json=body, timeout=timeout, stream=True) as r:
        r.raise_for_status()
        for chunk in _sse(r.iter_lines()):
            # every chunk carries the ids so far (SGLang's default; --incremental-streaming-output is off)
            ids = list(chunk.get("output_ids") or ids)
    return ids


def _sse(lines: Iterator[bytes]) -> Iterator[dict[str, Any]]:
    for raw in lines:
        if not raw or not raw.startswith(b"data:"):
            continue
        data = raw[5:].strip()
        if data == b"[DONE]":
            return
        yield json.loads(data)


def chat(url: str, messages: list[dict[str, str]], max_tokens: int, *, stream: bool = False,
         timeout: float = 120.0) -> str:
    body = {"model": "tiny", "messages": messages, "max_tokens": max_tokens, "temperature": 0.0,
            "ignore_eos": True, "stream": stream}
    if not stream:
        r = requests.post(url + "/v1/chat/completions", json=body, timeout=timeout)
        r.raise_for_status()
        return str(r.json()["choices"][0]["message"]["content"])
    parts: list[str] = []
    with requests.post(url + "/v1/chat/completions", json=body, timeout=timeout, stream=True) as r:
        r.raise_for_status()
        for chunk in _sse(r.iter_lines()):
            for choice in chunk.get("choices", ()):
                parts.append(choice.get("delta", {}).get("content") or "")
    return "".join(parts)
