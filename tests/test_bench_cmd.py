"""``kvferry bench --tiny``: the suite runs end to end, writes its JSON and PNG files, and its figures are
measured (positive, finite); ``--help`` names every option. The figures' values are not checked here."""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest

from kvferry import cli
from kvferry.benchmark import suite as benchsuite
from kvferry.benchmark.suite import MODES, plan_case, random_runs

PNGS = ("bandwidth.png", "planning.png", "latency.png")
PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


def positive(value: object) -> bool:
    return isinstance(value, (int, float)) and math.isfinite(value) and value > 0


def run_bench(mode: str, out: Path, capsys: pytest.CaptureFixture[str]) -> dict:
    """``kvferry bench --MODE --json --out OUT``; checks the files and returns the JSON written."""
    assert cli.main(["bench", f"--{mode}", "--json", "--out", str(out)]) == 0
    printed = json.loads(capsys.readouterr().out)  # exactly one JSON document on stdout
    data = json.loads((out / "bench.json").read_text())
    assert printed == data
    for name in PNGS:
        assert (out / name).read_bytes()[:8] == PNG_MAGIC
        assert data["files"][name.removesuffix(".png")] == str(out / name)
    return data


def run_bench_process(mode: str, out: Path) -> dict:
    """``python -m kvferry bench --MODE --json --out OUT`` as a user runs it: exit status 0 asserted (a process
    that used NIXL once died with SIGSEGV at exit on hosts with the system's RDMA libraries, after writing its
    figures: tests/test_exit_status.py), then the files checked as ``run_bench`` does."""
    src = str(Path(__file__).resolve().parents[1] / "src")
    env = {**os.environ, "PYTHONPATH": src + os.pathsep + os.environ.get("PYTHONPATH", "")}
    proc = subprocess.run([sys.executable, "-m", "kvferry", "bench", f"--{mode}", "--json", "--out", str(out)],
                          capture_output=True, text=True, env=env, timeout=170)
    assert proc.returncode == 0, (proc.returncode, proc.stderr[-2000:])
    data = json.loads((out / "bench.json").read_text())
    assert json.loads(proc.stdout) == data
    for name in PNGS:
        assert (out / name).read_bytes()[:8] == PNG_MAGIC
    return data


@pytest.mark.slow
@pytest.mark.timeout(180)
def test_bench_quick_writes_json_and_pngs(tmp_path: Path) -> None:
    check_figures(run_bench_process("quick", tmp_path / "out"), "quick")


@pytest.mark.timeout(180)
def test_bench_tiny_writes_json_and_pngs(tmp_path: Path) -> None:
    check_figures(run_bench_process("tiny", tmp_path / "out"), "tiny")


def check_figures(data: dict, mode: str) -> None:
    """Every section present, every figure measured: positive and finite, percentiles in order."""
    assert data["config"]["mode"] == mode
    assert positive(data["seconds"]) and data["machine"]["cores"] >= 1
    bw = data["bandwidth"]["rows"]
    assert len(bw) == len(MODES[mode].sizes_mib)
    for row in bw:
        assert positive(row["nbytes"]) and positive(row["descriptors"])
        raw = ("raw_nixl", "raw_nixl_rows") if data["bandwidth"]["transport"] == "nixl" else ()
        for method in ("kvferry", "memcpy", *raw):
            assert positive(row[f"{method}_gbps"]) and positive(row[f"{method}_ms"]), (method, row)
    plan_rows = data["planning"]["rows"]
    assert [r["pages"] for r in plan_rows] == list(MODES[mode].plan_pages)
    for row in plan_rows:
        for key in ("per_page_us", "runs_loop_us", "kvferry_plan_us", "kvferry_plan_expand_us", "kvferry_plan_post_us"):
            assert positive(row[key]), (key, row)
        assert row["kvferry_rows"] <= row["per_page_rows"]
    rt = data["latency"]["transport"]
    assert rt["requests"] == len(rt["samples_ms"]) == MODES[mode].latency_requests
    assert all(positive(x) for x in rt["samples_ms"])
    assert 0 < rt["p50_ms"] <= rt["p90_ms"] <= rt["p99_ms"] <= rt["max_ms"]
    cp = data["latency"]["control_plane"]
    assert cp["requests"] == MODES[mode].sessions * 4
    assert positive(cp["p50_ms"]) and cp["p50_ms"] <= cp["p99_ms"] and positive(cp["gbps"])
    if cp["samples_ms"] is not None:  # runners that report per-request latencies
        assert len(cp["samples_ms"]) == cp["requests"] and all(positive(x) for x in cp["samples_ms"])


def test_bench_without_nixl_runs_locally(tmp_path: Path, capsys: pytest.CaptureFixture[str],
                                         monkeypatch: pytest.MonkeyPatch) -> None:
    """Without nixl the transfer sections run over LocalTransport and the raw NIXL figures are None.

    The control-plane run is stubbed here: its local mode belongs to ``kvferry.workload.runner`` and is tested there.
    """
    def stub_control_plane(config: benchsuite.SuiteConfig) -> dict:
        samples = [1.0 + i % 3 for i in range(config.sessions * 4)]
        return {"source": "control-plane run (local): stub", "requests": len(samples),
                "nbytes": 3 << 20, "mean_request_bytes": 1 << 20, "gbps": 1.0, "p50_ms": 2.0, "p90_ms": 2.8,
                "p99_ms": 3.0, "mean_ms": 2.0, "max_ms": 3.0, "samples_ms": samples}

    monkeypatch.setattr(benchsuite, "nixl_available", lambda: False)
    monkeypatch.setattr(benchsuite, "control_plane_run", stub_control_plane)
    data = run_bench("tiny", tmp_path, capsys)
    assert data["bandwidth"]["transport"] == "local"
    assert all(row["raw_nixl_gbps"] is None and row["raw_nixl_rows_gbps"] is None
               for row in data["bandwidth"]["rows"])
    assert data["latency"]["transport"]["source"].startswith("transport round trips (local)")
    check_figures(data, "tiny")
    assert cli.main(["bench", "--tiny", "--out", str(tmp_path)]) == 0  # the tables render with gaps
    assert "nixl not installed" in capsys.readouterr().out


def test_bench_help_lists_every_option(capsys: pytest.CaptureFixture[str]) -> None:
    assert cli.main(["bench", "--help"]) == 0
    text = capsys.readouterr().out
    for option in ("--quick", "--tiny", "--out DIR", "--json", "bench/out"):
        assert option in text


def test_python_m_kvferry_bench_help() -> None:
    done = subprocess.run([sys.executable, "-m", "kvferry", "bench", "--help"], capture_output=True, text=True,
                          timeout=60)
    assert done.returncode == 0, done.stderr
    assert "usage: kvferry bench" in done.stdout and "--quick" in done.stdout


def test_quick_and_tiny_exclude_each_other(capsys: pytest.CaptureFixture[str]) -> None:
    assert cli.main(["bench", "--quick", "--tiny"]) == 2
    assert "not allowed with" in capsys.readouterr().err


def test_random_runs_are_distinct_and_in_range() -> None:
    import numpy as np

    pages = random_runs(np.random.default_rng(3), 500, 640, mean_run=4.0)
    assert len(pages) == len(set(pages.tolist())) == 500
    assert pages.min() >= 0 and pages.max() < 640


def test_plan_case_compares_equal_work() -> None:
    row = plan_case(32, capacity=400, max_repeats=3, budget_s=0.0, layers=2)
    assert row["buffers"] == 6 and row["per_page_rows"] == 32 * 6
    assert row["kvferry_rows"] == row["joint_runs"] * 6
