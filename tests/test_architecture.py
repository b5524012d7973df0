"""The architecture test: the layers in pyproject.toml's import-linter contracts hold, and would fail.

The layer order is written once, in ``[tool.importlinter]``; this test runs import-linter (``lint-imports``)
on the package as installed, then on a copy with one upward import and one circle planted, which must
break both contracts, and a clock imported into the protocol core, which must break the third (so a green
run means something).
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
LINT = Path(sys.executable).parent / "lint-imports"

pytestmark = pytest.mark.skipif(not LINT.exists(), reason="import-linter is not installed (pip install -e .[dev])")


def lint(src: Path) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "PYTHONPATH": str(src)}
    return subprocess.run([str(LINT), "--config", str(ROOT / "pyproject.toml"), "--no-cache"], cwd=src,
                          env=env, capture_output=True, text=True, timeout=120)


def test_every_import_runs_downward_and_nothing_is_circular() -> None:
    done = lint(ROOT / "src")
    assert done.returncode == 0, done.stdout + done.stderr
    assert "3 kept, 0 broken" in done.stdout


def test_an_upward_import_and_a_circle_break_the_contracts(tmp_path: Path) -> None:
    shutil.copytree(ROOT / "src" / "kvferry", tmp_path / "kvferry")
    # Upward: the layout layer reaching into the control plane.
    spec = tmp_path / "kvferry" / "layout" / "spec.py"
    spec.write_text(spec.read_text() + "\nfrom kvferry.control import wire  # planted\n")
    # A circle inside the control plane: the lease table importing the endpoint that imports it.
    leases = tmp_path / "kvferry" / "control" / "core" / "leases.py"
    leases.write_text(leases.read_text() + "\nfrom kvferry.control import decode  # planted\n")
    # A clock inside the protocol core.
    states = tmp_path / "kvferry" / "control" / "core" / "states.py"
    states.write_text(states.read_text() + "\nimport time  # planted\n")
    done = lint(tmp_path)
    assert done.returncode != 0
    assert "0 kept, 3 broken" in done.stdout, done.stdout
    assert "kvferry.control.core.states -> time" in done.stdout
    assert "kvferry.layout.spec -> kvferry.control.wire" in done.stdout
