"""``kvferry demo`` (and ``kvferry stress``) through the CLI: JSON, exit status, verdict, tables."""

from __future__ import annotations

import importlib.util
import json

import pytest

from kvferry import cli

needs_nixl = pytest.mark.skipif(importlib.util.find_spec("nixl") is None, reason="nixl is not installed")

# Small enough for CI on 2 cores, large enough that sessions share and reuse pages.
SMALL = ("--sessions", "6", "--turns", "2", "--first-tokens", "512", "--turn-tokens", "128",
         "--max-tokens", "4096", "--budget", "128MiB", "--seed", "3")


def run(capsys: pytest.CaptureFixture[str], *argv: str) -> tuple[int, str, str]:
    code = cli.main(list(argv))
    out, err = capsys.readouterr()
    return code, out, err


@needs_nixl
@pytest.mark.nixl
def test_demo_json_two_processes_over_nixl_is_clean(capsys: pytest.CaptureFixture[str]) -> None:
    code, out, err = run(capsys, "demo", "--json", *SMALL)
    data = json.loads(out)  # exactly one JSON document on stdout, nothing else
    assert code == 0, (data.get("verdict"), err)
    assert data["ok"] and data["transport"] == "nixl" and data["preset"] == "deepseek_v4"
    assert data["corrupted_pages"] == 0 and data["failed_requests"] == 0
    assert data["requests"] >= data["sessions"] == 6
    for key in ("requests", "sessions", "pages_verified", "bytes", "corrupted_pages", "failed_requests",
                "seconds", "gbps", "p50_ms", "p99_ms"):
        assert key in data
    assert data["verdict"].startswith("PASS")


def test_demo_with_injected_fault_fails_and_names_it(capsys: pytest.CaptureFixture[str]) -> None:
    code, out, _ = run(capsys, "demo", "--json", "--transport", "local", "--inject", "buffer0-slots", *SMALL)
    data = json.loads(out)
    assert code == 1
    assert data["inject"] == "buffer0-slots" and not data["ok"]
    assert data["corrupted_pages"] > 0
    assert "buffer0-slots" in data["verdict"] and "c4.idx" in data["verdict"]


def test_demo_tables_show_verdict_summary_and_layout(capsys: pytest.CaptureFixture[str]) -> None:
    code, out, _ = run(capsys, "demo", "--transport", "local", *SMALL)
    assert code == 0
    for text in ("requests", "GB/s", "p50 / p99", "pages verified", "corrupted pages", "c4.idx.*", "index_k",
                 "16384", "layout moved"):
        assert text in out
    assert out.strip().splitlines()[-1].startswith("PASS")


def test_stress_json_reports_the_contract_fields(capsys: pytest.CaptureFixture[str]) -> None:
    code, out, _ = run(capsys, "stress", "--json", "--transport", "local", *SMALL)
    data = json.loads(out)
    assert code == 0
    assert {"requests", "sessions", "pages_verified", "bytes", "corrupted_pages", "failed_requests", "seconds",
            "gbps"} <= set(data)
    assert data["requests"] == 12


def test_bad_inject_is_a_usage_error(capsys: pytest.CaptureFixture[str]) -> None:
    code, _, err = run(capsys, "demo", "--inject", "bogus")
    assert code == 2 and "invalid fault" in err


def test_demo_without_nixl_runs_in_process_and_says_so(capsys: pytest.CaptureFixture[str],
                                                       monkeypatch: pytest.MonkeyPatch) -> None:
    from kvferry.cli import stress as stress_cmd

    monkeypatch.setattr(stress_cmd, "nixl_available", lambda: False)
    code, out, err = run(capsys, "demo", "--json", *SMALL)
    data = json.loads(out)
    assert code == 0 and data["ok"] and data["transport"] == "local" and data["corrupted_pages"] == 0
    assert "nixl package is not installed" in err
