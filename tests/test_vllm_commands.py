"""The vLLM commands as a user runs them: subprocesses, exit status asserted (issue 31; the others are in
tests/test_commands.py). Run under .venv-vllm (``make test-vllm``); skipped where aiohttp or vLLM is missing.

``vllm-proxy`` runs against two addresses where nothing listens: it answers a completion with a 502 naming
the prefill it could not reach, and exits 0 on SIGTERM. ``vllm-chaos --schedule`` prints its fault schedule
without starting a server; the soak itself (three vLLM instances) is the slow test below.
"""

from __future__ import annotations

import json
import signal
import socket
import subprocess
import time
import urllib.error
import urllib.request
from pathlib import Path

import pytest

from .ports import server_port
from .test_commands import ROOT, explain, kvferry

pytestmark = pytest.mark.vllm


def test_vllm_proxy_answers_502_without_servers_and_exits_0_on_sigterm() -> None:
    pytest.importorskip("aiohttp")
    import os
    import sys

    port, dead = server_port(), server_port()
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(p for p in (str(ROOT / "src"), os.environ.get("PYTHONPATH"))
                                                       if p)}
    proc = subprocess.Popen([sys.executable, "-m", "kvferry", "vllm-proxy", "--port", str(port), "--prefill",
                             f"http://127.0.0.1:{dead}", "--decode", f"http://127.0.0.1:{dead}", "--prefill-timeout",
                             "2"], cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        deadline = time.monotonic() + 60
        while True:
            try:
                with socket.create_connection(("127.0.0.1", port), timeout=1):
                    break
            except OSError:
                assert proc.poll() is None and time.monotonic() < deadline, "the proxy did not start listening"
                time.sleep(0.2)
        request = urllib.request.Request(f"http://127.0.0.1:{port}/v1/completions",
                                         json.dumps({"prompt": [1, 2, 3], "max_tokens": 2}).encode(),
                                         {"Content-Type": "application/json"})
        with pytest.raises(urllib.error.HTTPError) as answer:
            urllib.request.urlopen(request, timeout=30)
        assert answer.value.code == 502
        assert f"127.0.0.1:{dead}" in answer.value.read().decode()
        proc.send_signal(signal.SIGTERM)
        out, _ = proc.communicate(timeout=30)
        assert proc.returncode == 0, f"exit status {proc.returncode}: {out[-1500:]}"
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(10)


def test_vllm_chaos_schedule_exits_0() -> None:
    pytest.importorskip("vllm")
    done = kvferry("vllm-chaos", "--schedule", "--duration", "60", "--seed", "1")
    assert done.returncode == 0, explain(done)
    assert "stall" in done.stdout or "kill" in done.stdout, done.stdout


@pytest.mark.slow
@pytest.mark.timeout(1500)
def test_vllm_chaos_short_soak_exits_0(tmp_path: Path) -> None:
    """The soak itself, as short as it goes: a prefill, a decode and a plain vLLM instance, two sessions of
    two turns for 20 s, the default fault schedule; every answer checked, exit 0."""
    pytest.importorskip("vllm")
    done = kvferry("vllm-chaos", "--duration", "20", "--sessions", "2", "--turns", "2", "--work-dir",
                   str(tmp_path), "--json", timeout=1400)
    assert done.returncode == 0, explain(done)
