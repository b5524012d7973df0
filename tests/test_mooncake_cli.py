"""The commands over Mooncake's Transfer Engine, as users run them: subprocesses, exit status asserted.

``kvferry stress --transport mooncake`` (push and pull) moves real KV pages between two processes and checks
every page decode received; ``kvferry chaos --transport mooncake`` (slow) does it while a supervisor stops,
kills and restarts the sides. Both must report 0 corrupted pages and exit 0. Skipped without Mooncake.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from kvferry.transport import mooncake_available

pytestmark = [pytest.mark.mooncake,
              pytest.mark.skipif(not mooncake_available(), reason="Mooncake's Transfer Engine is not installed")]

ROOT = Path(__file__).resolve().parents[1]


def _kvferry(*args: str, timeout: float) -> tuple[int, dict]:
    src = str(ROOT / "src")
    env = {**os.environ, "PYTHONPATH": src + os.pathsep + os.environ.get("PYTHONPATH", "")}
    proc = subprocess.run([sys.executable, "-m", "kvferry", *args, "--json"], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=timeout)
    assert proc.stdout.strip(), (proc.returncode, proc.stderr[-2000:])
    return proc.returncode, json.loads(proc.stdout)


@pytest.mark.parametrize("mode", ["push", "pull"])
def test_stress_over_mooncake_is_clean(mode: str) -> None:
    code, data = _kvferry("stress", "--transport", "mooncake", "--mode", mode, "--sessions", "4", "--turns", "3",
                          "--budget", "128MiB", timeout=120)
    assert code == 0, data
    assert data["ok"] and data["transport"] == "mooncake" and data["mode"] == mode
    assert data["corrupted_pages"] == 0 and data["failed_requests"] == 0
    assert data["pages_verified"] > 0


@pytest.mark.slow
def test_chaos_over_mooncake_is_clean() -> None:
    code, data = _kvferry("chaos", "--transport", "mooncake", "--duration", "20", "--mean-gap", "3",
                          timeout=240)
    assert code == 0, data
    assert data["verdict"].startswith("PASS"), data["verdict"]
    assert sum(data["faults"].values()) > 0
