"""``scripts/setup-engines.sh`` as ``make test`` runs it, around stand-ins for the two engine set-ups (the real
ones take minutes and PyPI): both run, each line says whose it is, and a failure of either fails the whole
with exit status 1 after the other finished."""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]


def _tree(tmp_path: Path, vllm_rc: int, sglang_rc: int) -> Path:
    """A copy of setup-engines.sh whose engine set-ups print a line and exit with the given status."""
    (tmp_path / "scripts").mkdir()
    shutil.copy(REPO / "scripts" / "setup-engines.sh", tmp_path / "scripts")
    for name, rc in (("setup-vllm.sh", vllm_rc), ("setup-sglang.sh", sglang_rc)):
        (tmp_path / "scripts" / name).write_text(f"echo {name} ran\nsleep 0.2\nexit {rc}\n")
    python = tmp_path / ".venv" / "bin" / "python"   # .venv exists: setup.sh is not run
    python.parent.mkdir(parents=True)
    python.write_text("#!/bin/sh\nexit 0\n")
    python.chmod(0o755)
    return tmp_path


@pytest.mark.parametrize(("vllm_rc", "sglang_rc"), [(0, 0), (3, 0), (0, 4)])
def test_setup_engines_runs_both_and_fails_when_either_fails(tmp_path: Path, vllm_rc: int, sglang_rc: int) -> None:
    tree = _tree(tmp_path, vllm_rc, sglang_rc)
    run = subprocess.run(["bash", str(tree / "scripts" / "setup-engines.sh")], capture_output=True, text=True,
                         timeout=60)
    out = run.stdout
    assert "[setup-vllm] setup-vllm.sh ran" in out and "[setup-sglang] setup-sglang.sh ran" in out, out
    if vllm_rc == sglang_rc == 0:
        assert run.returncode == 0 and "setup-engines: done in" in out, out
    else:
        assert run.returncode == 1 and "setup-engines: FAILED in" in out, out
        failed = "setup-vllm" if vllm_rc else "setup-sglang"
        assert f"[{failed}] failed with exit status {vllm_rc or sglang_rc}" in out, out
