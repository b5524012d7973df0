"""Every ``kvferry`` command as a user runs it: a subprocess, tiny arguments, its exit status asserted (issue 31).

The other tests call ``cli.main([...])`` inside pytest's process, which never exits through the paths a user's
process does (interpreter shutdown, library destructors: tests/test_exit_status.py shows such a crash). Here each
command runs once as ``python -m kvferry ...`` with this checkout's ``src`` first on the path. The vLLM commands
(``vllm-proxy``, ``vllm-chaos``) are in tests/test_vllm_commands.py, run under .venv-vllm. ``bench`` runs here
without matplotlib (a stand-in package that fails to import hides it): the figures still go to bench.json and the
exit status is 0 (``bench --tiny`` with matplotlib runs as a subprocess in tests/test_bench_cmd.py).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
SMALL = ("--sessions", "4", "--turns", "2", "--first-tokens", "512", "--turn-tokens", "128", "--max-tokens", "4096",
         "--budget", "128MiB", "--seed", "3")


def kvferry(*argv: str, timeout: float = 120, path: tuple[Path, ...] = ()) -> subprocess.CompletedProcess[str]:
    """``python -m kvferry ARGV`` with this checkout's ``src`` (and ``path``) first on the import path."""
    env = dict(os.environ)
    paths = [*map(str, path), str(ROOT / "src"), env.get("PYTHONPATH", "")]
    env["PYTHONPATH"] = os.pathsep.join(p for p in paths if p)
    started = time.monotonic()
    done = subprocess.run([sys.executable, "-m", "kvferry", *argv], cwd=ROOT, env=env, capture_output=True,
                          text=True, timeout=timeout)
    print(f"kvferry {' '.join(argv)}: exit {done.returncode} in {time.monotonic() - started:.1f} s")
    return done


def explain(done: subprocess.CompletedProcess[str]) -> str:
    return f"exit status {done.returncode}\nstdout tail:\n{done.stdout[-1500:]}\nstderr tail:\n{done.stderr[-1500:]}"


@pytest.mark.parametrize("argv", [
    ("presets", "--json"),
    ("audit", "--preset", "token_salad", "--json"),
    ("sizing", "--preset", "llama3_8b", "--tokens", "4096", "--json"),
    ("diff", "--preset", "token_salad", "--json"),
], ids=lambda argv: argv[0])
def test_a_layout_command_exits_0_with_one_json_document(argv: tuple[str, ...]) -> None:
    done = kvferry(*argv)
    assert done.returncode == 0, explain(done)
    assert isinstance(json.loads(done.stdout), (dict, list))


@pytest.mark.nixl
@pytest.mark.parametrize("command", ["demo", "stress"])
def test_a_workload_command_exits_0_and_reports_every_request_done(command: str) -> None:
    """Two processes over NIXL where the nixl package is installed (the default transport), as users run it."""
    done = kvferry(command, "--json", *SMALL, timeout=180)
    assert done.returncode == 0, explain(done)
    report = json.loads(done.stdout)
    assert report, report


def test_chaos_exits_0() -> None:
    """A short chaos run (its endpoints restarted and faulted on a seeded schedule): no wrong byte, exit 0.
    Its duration counts from the start of its processes: under 4-8 s no request completed on a 2-core
    machine at load ~28 (the command then rightly fails), so 15."""
    done = kvferry("chaos", "--duration", "15", "--sessions", "4", "--turns", "2", "--budget", "64MiB", "--json",
                   timeout=180)
    assert done.returncode == 0, explain(done)
    assert json.loads(done.stdout)


def test_a_failing_run_exits_1() -> None:
    """The exit status says when a run failed: a demo whose prefill computes the wrong slot count."""
    done = kvferry("demo", "--json", "--transport", "local", "--inject", "buffer0-slots", *SMALL, timeout=180)
    assert done.returncode == 1, explain(done)


def test_bench_without_matplotlib_writes_its_json_and_exits_0(tmp_path: Path) -> None:
    """Issue 31: ``pip install -e .[nixl]`` has no matplotlib. bench says so before the work starts, writes
    bench.json and the tables (no PNG), and exits 0."""
    hidden = tmp_path / "hide"
    (hidden / "matplotlib").mkdir(parents=True)
    (hidden / "matplotlib" / "__init__.py").write_text('raise ImportError("No module named \'matplotlib\'")\n')
    out = tmp_path / "out"
    done = kvferry("bench", "--tiny", "--out", str(out), timeout=300, path=(hidden,))
    assert done.returncode == 0, explain(done)
    assert done.stderr.lstrip().startswith("kvferry bench: no plots: matplotlib is not importable"), done.stderr[:300]
    assert "pip install 'kvferry[bench]'" in done.stderr
    data = json.loads((out / "bench.json").read_text())
    assert data["files"] == {"json": str(out / "bench.json")} and "matplotlib" in data["plots_skipped"]
    assert data["bandwidth"]["rows"] and not list(out.glob("*.png"))


def test_simulate_exits_0_clean_and_1_on_a_violation() -> None:
    """``kvferry simulate`` as a user runs it: 0 when no seed breaks an invariant, 1 when one does (a known
    bug switched on), naming the invariant and the replay line."""
    clean = kvferry("simulate", "--seeds", "2", "--seed", "0")
    assert clean.returncode == 0, explain(clean)
    assert "0 with a violation" in clean.stdout, explain(clean)
    broken = kvferry("simulate", "--seeds", "3", "--seed", "0", "--mutate", "done_before_verdict")
    assert broken.returncode == 1, explain(broken)
    assert "b_prefill_done_before_verdict" in broken.stdout + broken.stderr, explain(broken)
    assert "kvferry simulate --seed" in broken.stdout + broken.stderr, explain(broken)
    # --tp forces every group's TP sizes; the replay line carries it (a bug only TP shows).
    tp = kvferry("simulate", "--seed", "0", "--tp", "2:1", "--mutate", "tp_slice_offset")
    assert tp.returncode == 1, explain(tp)
    assert "b_done_bytes" in tp.stdout and "replay: kvferry simulate --seed 0 --tp 2:1" in tp.stdout, explain(tp)
    # --wide-tp: a share of the seeds at TP 4 and 8 (here all); a share outside 0..1 is a usage error.
    wide = kvferry("simulate", "--seeds", "2", "--seed", "3", "--wide-tp", "1", "--requests", "16")
    assert wide.returncode == 0, explain(wide)
    assert "0 with a violation" in wide.stdout and "2:4 1, 8:8 1;" in wide.stdout, explain(wide)
    bad = kvferry("simulate", "--wide-tp", "2")
    assert bad.returncode == 2 and "expected a share from 0 to 1, got '2'" in bad.stderr, explain(bad)
