"""The kvferry CLI: audit, sizing and presets through ``main([...])``, tables and JSON, errors."""

from __future__ import annotations

import argparse
import json
import subprocess
import sys

import pytest

from kvferry.cli.args import parse_size
from kvferry.cli.main import build_parser, main
from kvferry.diagnostics.audit import audit, buffer_role, describe_state, sizing
from kvferry.errors import LayoutError
from kvferry.layout import Buffer, Layout, Pool
from kvferry.layout.presets import PRESETS, get_preset
from kvferry.layout.state import StateGeometry


def run(capsys: pytest.CaptureFixture[str], *argv: str) -> tuple[int, str, str]:
    code = main(list(argv))
    out, err = capsys.readouterr()
    return code, out, err


def run_json(capsys: pytest.CaptureFixture[str], *argv: str) -> dict:
    code, out, err = run(capsys, *argv, "--json")
    assert code == 0, err
    return json.loads(out)  # exactly one JSON document: json.loads rejects trailing text


# -- presets -----------------------------------------------------------------------------------------------
def test_presets_lists_every_preset(capsys: pytest.CaptureFixture[str]) -> None:
    code, out, _ = run(capsys, "presets")
    assert code == 0
    for name in PRESETS:
        assert name in out


def test_presets_json(capsys: pytest.CaptureFixture[str]) -> None:
    data = run_json(capsys, "presets")
    assert data["default"] == "deepseek_v4"
    assert [p["name"] for p in data["presets"]] == list(PRESETS)
    v4 = next(p for p in data["presets"] if p["name"] == "deepseek_v4")
    assert v4["knobs"]["indexer_dtype"] == "bf16"


# -- audit -------------------------------------------------------------------------------------------------
def test_audit_token_salad_warns_about_page_counts(capsys: pytest.CaptureFixture[str]) -> None:
    code, out, _ = run(capsys, "audit", "--preset", "token_salad", "--pages", "20000")
    assert code == 0
    assert "c4.idx.L0" in out  # few buffers: one row each
    assert ("warning: pool c4: buffers differ in page count (c4.kv.*: 20000, c4.idx.*: 10000) — a sender "
            "that computes slot counts from buffer 0 (c4.kv.L0) will write the wrong addresses") in out
    assert "pool c128" not in out  # c128 is uniform


def test_audit_json_has_rows_and_warnings(capsys: pytest.CaptureFixture[str]) -> None:
    data = run_json(capsys, "audit", "--preset", "token_salad", "--pages", "20000")
    assert data["preset"] == "token_salad"
    rows = {r["buffer"]: r for r in data["buffers"]}
    assert set(rows) == {"c4.kv.L0", "c4.kv.L2", "c4.idx.L0", "c4.idx.L2", "c128.kv.L1", "c128.kv.L3"}
    idx = rows["c4.idx.L0"]
    assert idx == {"pool": "c4", "buffer": "c4.idx.L0", "kind": "index_k", "dtype": "bf16", "layer": 0,
                   "page_bytes": 16384, "num_pages": 10000, "bytes_per_token": 64.0,
                   "total_bytes": 16384 * 10000}
    assert data["total_bytes"] == sum(r["total_bytes"] for r in data["buffers"])
    assert any("differ in page count" in w for w in data["warnings"])
    assert len(data["shape_fingerprint"]) == 32


def test_audit_collapses_many_layers_unless_all(capsys: pytest.CaptureFixture[str]) -> None:
    _, collapsed, _ = run(capsys, "audit", "--preset", "llama3_8b", "--pages", "100")
    assert "32 (0..31)" in collapsed and "L17.k" not in collapsed
    _, full, _ = run(capsys, "audit", "--preset", "llama3_8b", "--pages", "100", "--all")
    assert "L17.k" in full
    data = run_json(capsys, "audit", "--preset", "llama3_8b", "--pages", "100")
    assert len(data["buffers"]) == 64
    assert [(r["role"], len(r["layers"])) for r in data["roles"]] == [("*.k", 32), ("*.v", 32)]


def test_audit_default_is_deepseek_v4_in_a_4gib_budget(capsys: pytest.CaptureFixture[str]) -> None:
    data = run_json(capsys, "audit")
    assert data["preset"] == "deepseek_v4"
    assert data["total_bytes"] <= 4 << 30
    assert any(w.startswith("pool c4: buffers differ in page count") for w in data["warnings"])


def test_audit_indexer_dtype_and_budget(capsys: pytest.CaptureFixture[str]) -> None:
    data = run_json(capsys, "audit", "--preset", "deepseek_v32", "--budget", "1GiB",
                    "--indexer-dtype", "bf16")
    idx = next(r for r in data["buffers"] if r["kind"] == "index_k")
    assert idx["bytes_per_token"] == 256
    assert data["total_bytes"] <= 1 << 30
    assert not any("page count" in w for w in data["warnings"])


def test_audit_knob(capsys: pytest.CaptureFixture[str]) -> None:
    data = run_json(capsys, "audit", "--preset", "token_salad", "--pages", "10", "--knob", "num_layers=2")
    assert len(data["buffers"]) == 3


def test_audit_state_pool_has_no_bytes_per_token(capsys: pytest.CaptureFixture[str]) -> None:
    data = run_json(capsys, "audit", "--preset", "qwen3_next", "--pages", "64")
    state = [r for r in data["buffers"] if r["kind"] == "state"]
    assert state and all(r["bytes_per_token"] is None for r in state)
    # ... and says what a request holds there instead: one slot of each of its buffers
    [pool] = data["state_pools"]
    per_slot = sum(r["page_bytes"] for r in state)
    assert pool == {"pool": "mamba", "bytes_per_request": per_slot, "slots": min(r["num_pages"] for r in state),
                    "cut": [["*.conv", "[2048 | 2048 | 4096] channels x 6 B, each sharded"],
                            ["*.ssm", "[32] channels x 65536 B, each sharded"]]}
    code, out, _ = run(capsys, "audit", "--preset", "qwen3_next", "--pages", "64")
    assert code == 0 and f"state pool mamba: {per_slot / 2**20:.2f} MiB per request" in out



def test_audit_and_sizing_show_a_state_pool_per_request_as_a_user_runs_them() -> None:
    """``kvferry audit`` and ``kvferry sizing`` on qwen3_next as subprocesses: exit 0, the state pool in bytes per
    request (one slot of each of its 72 buffers: 36 x (48 KiB conv + 2 MiB recurrent) = 73.69 MiB), never per
    token, and audit says how each state role is cut across TP ranks (by channel sections, issue 48)."""
    audit_run = subprocess.run([sys.executable, "-m", "kvferry", "audit", "--preset", "qwen3_next", "--pages", "64"],
                               capture_output=True, text=True, check=False, timeout=120)
    assert audit_run.returncode == 0, audit_run.stderr
    lines = audit_run.stdout.splitlines()
    assert "state pool mamba: 73.69 MiB per request (one slot of each buffer, whatever the request's length), " \
           "1 slots" in lines
    assert "  *.conv: cut across TP ranks by channel: [2048 | 2048 | 4096] channels x 6 B, each sharded" in lines
    assert "  *.ssm: cut across TP ranks by channel: [32] channels x 65536 B, each sharded" in lines
    sizing_run = subprocess.run([sys.executable, "-m", "kvferry", "sizing", "--preset", "qwen3_next", "--pages",
                                 "4096", "--tokens", "5000"], capture_output=True, text=True, check=False, timeout=120)
    assert sizing_run.returncode == 0, sizing_run.stderr
    assert ("state pool mamba: 73.69 MiB per request (one slot of each of its 72 buffers, whatever the request's "
            "length: not per token), 16 slots") in sizing_run.stdout.splitlines()


def test_describe_state_names_rows_replicated_sections_and_units() -> None:
    """A Mamba2-like window-major conv (3 rows of x 16, B 2 and C 2 replicated) then 8 SSM heads."""
    state = StateGeometry.packed([(3, [(16, 2, True), (2, 2, False), (2, 2, False)]), (1, [(8, 64, True)])])
    assert describe_state(state) == ("3 rows of [16 | 2= | 2=] channels x 2 B; [8] channels x 64 B, each sharded "
                                     "but those marked = (replicated)")

# -- sizing ------------------------------------------------------------------------------------------------
def test_sizing_json(capsys: pytest.CaptureFixture[str]) -> None:
    data = run_json(capsys, "sizing", "--preset", "token_salad", "--tokens", "1000", "--pages", "100")
    pools = {p["pool"]: p for p in data["pools"]}
    assert pools["c4"]["pages_needed"] == 4  # ceil(1000 / 256)
    assert pools["c4"]["bytes_per_token"] == 2 * (146 + 64)
    assert pools["c4"]["bytes_needed"] == 4 * 2 * (37376 + 16384)
    assert pools["c4"]["capacity_pages"] == 50  # bounded by the index-K buffers
    assert pools["c4"]["requests_that_fit"] == 12
    assert data["requests_that_fit"] == 12
    assert data["bytes_needed"] == sum(p["bytes_needed"] for p in data["pools"])


def test_sizing_state_pool_needs_one_slot(capsys: pytest.CaptureFixture[str]) -> None:
    data = run_json(capsys, "sizing", "--preset", "qwen3_next", "--tokens", "5000", "--pages", "4096")
    pools = {p["pool"]: p for p in data["pools"]}
    assert pools["full"]["pages_needed"] == 313
    assert pools["mamba"]["pages_needed"] == 1
    assert pools["mamba"]["bytes_per_token"] is None


def test_sizing_table(capsys: pytest.CaptureFixture[str]) -> None:
    code, out, _ = run(capsys, "sizing", "--preset", "llama3_8b", "--tokens", "17", "--pages", "10")
    assert code == 0
    assert "one request of 17 tokens needs 4.00 MiB" in out  # 2 pages x 64 buffers x 32 KiB


def test_sizing_requires_tokens(capsys: pytest.CaptureFixture[str]) -> None:
    code, _, err = run(capsys, "sizing", "--preset", "llama3_8b")
    assert code == 2
    assert "--tokens" in err


# -- errors and plumbing -----------------------------------------------------------------------------------
def test_unknown_preset_fails_with_a_clear_message(capsys: pytest.CaptureFixture[str]) -> None:
    code, out, err = run(capsys, "audit", "--preset", "gpt5")
    assert code != 0
    assert out == ""
    assert "unknown preset 'gpt5'" in err and "deepseek_v4" in err


def test_knob_the_preset_lacks_fails(capsys: pytest.CaptureFixture[str]) -> None:
    code, _, err = run(capsys, "audit", "--preset", "llama3_8b", "--indexer-dtype", "fp8")
    assert code == 2
    assert "does not take indexer_dtype" in err


def test_pages_and_budget_are_exclusive(capsys: pytest.CaptureFixture[str]) -> None:
    code, _, err = run(capsys, "audit", "--pages", "3", "--budget", "1GiB")
    assert code == 2
    assert "not allowed with" in err


@pytest.mark.parametrize("argv", [["--help"], ["audit", "--help"], ["sizing", "--help"],
                                  ["presets", "--help"]])
def test_help_exits_zero(capsys: pytest.CaptureFixture[str], argv: list[str]) -> None:
    code, out, _ = run(capsys, *argv)
    assert code == 0
    assert "usage: kvferry" in out


def test_no_command_is_a_usage_error(capsys: pytest.CaptureFixture[str]) -> None:
    code, _, err = run(capsys)
    assert code == 2
    assert "COMMAND" in err


@pytest.mark.parametrize(("text", "value"), [("4GiB", 4 << 30), ("512MiB", 512 << 20), ("2GB", 2 * 10**9),
                                             ("1.5K", 1536), ("1000", 1000), ("3 gib", 3 << 30)])
def test_parse_size(text: str, value: int) -> None:
    assert parse_size(text) == value


@pytest.mark.parametrize("text", ["", "GiB", "4 parsecs", "-1GiB", "0"])
def test_parse_size_rejects(text: str) -> None:
    with pytest.raises(argparse.ArgumentTypeError):
        parse_size(text)


def test_parser_registers_the_commands() -> None:
    parser = build_parser()
    sub = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    assert {"audit", "sizing", "presets"} <= set(sub.choices)


def test_python_dash_m_kvferry() -> None:
    proc = subprocess.run([sys.executable, "-m", "kvferry", "presets", "--json"], capture_output=True,
                          text=True, check=False)
    assert proc.returncode == 0, proc.stderr
    assert "token_salad" in json.loads(proc.stdout)["presets"][3]["name"]


# -- audit and sizing as a library ---------------------------------------------------------------------------
def test_audit_warns_on_page_bytes_and_ranges() -> None:
    layout = Layout([Pool("p", [Buffer("p.a.L0", 64, 10, layer=0), Buffer("p.a.L1", 64, 12, layer=1),
                                Buffer("p.b.L0", 128, 10, layer=0)], 16)])
    report = audit(layout)
    assert report.warnings == (
        "pool p: buffers differ in page count (p.a.*: 10..12, p.b.*: 10) — a sender that computes slot "
        "counts from buffer 0 (p.a.L0) will write the wrong addresses",
        "pool p: buffers differ in page_bytes (p.a.*: 64, p.b.*: 128) — each buffer needs its own stride; "
        "one item length for the whole pool addresses the others wrongly",
    )
    assert [r.num_buffers for r in report.roles] == [1, 1, 1]  # a.L0 and a.L1 differ in capacity


def test_uniform_layout_has_no_warnings() -> None:
    assert audit(get_preset("llama3_8b", num_pages=4)).warnings == ()


def test_buffer_role() -> None:
    assert buffer_role("c4.kv.L12") == "c4.kv.*"
    assert buffer_role("L3.k") == "*.k"
    assert buffer_role("swa.L0.v") == "swa.*.v"
    assert buffer_role("LL1.x") == "LL1.x"
    assert buffer_role("aux") == "aux"


def test_sizing_rejects_zero_tokens() -> None:
    with pytest.raises(LayoutError, match="tokens must be an int >= 1"):
        sizing(get_preset("llama3_8b", num_pages=4), 0)


def test_every_command_takes_json() -> None:
    """The README says every command that reports has ``--json``: each subcommand's parser accepts it but
    ``vllm-proxy``, a server that reports nothing of its own."""
    sub = next(a for a in build_parser()._actions if isinstance(a, argparse._SubParsersAction))
    lacking = [name for name, parser in sub.choices.items() if name != "vllm-proxy"
               and not any("--json" in action.option_strings for action in parser._actions)]
    assert lacking == []


def _simulate(*argv: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "kvferry", "simulate", *argv], capture_output=True, text=True,
                          check=False, timeout=120)


def test_simulate_state_share_as_a_subprocess() -> None:
    """``--state-share`` as users run it: at 1 every seed at a TP pair other than 1:1 holds the state pool and
    ``tp_state_slice`` is found, its replay line naming the share; at 0 none does and the same mutation has
    nothing to break; a share outside 0..1 is a usage error."""
    every = _simulate("--seeds", "2", "--seed", "3", "--tp", "2:1", "--requests", "16", "--state-share", "1", "--json")
    assert every.returncode == 0, every.stderr
    assert json.loads(every.stdout)["seeds_with_state_pool"] == 2
    text = _simulate("--seeds", "2", "--seed", "3", "--tp", "2:1", "--requests", "16", "--state-share", "1")
    assert text.returncode == 0 and "seeds with a state pool (channel sections sliced across TP): 2 of 2" in text.stdout
    none = _simulate("--seeds", "2", "--seed", "3", "--tp", "2:1", "--requests", "16", "--state-share", "0", "--json")
    assert none.returncode == 0 and json.loads(none.stdout)["seeds_with_state_pool"] == 0, none.stderr
    found = _simulate("--seed", "0", "--tp", "1:2", "--requests", "16", "--state-share", "1", "--mutate",
                      "tp_state_slice", "--trace", "0")
    assert found.returncode == 1, found.stdout + found.stderr
    assert "seed 0: invariant b_done_bytes broken" in found.stdout
    assert "replay: kvferry simulate --seed 0 --requests 16 --tp 1:2 --state-share 1 --mutate tp_state_slice" \
        in found.stdout
    assert _simulate("--seed", "0", "--tp", "1:2", "--requests", "16", "--state-share", "0", "--mutate",
                     "tp_state_slice").returncode == 0
    bad = _simulate("--state-share", "2")
    assert bad.returncode == 2 and "--state-share: expected a share from 0 to 1, got '2'" in bad.stderr

def test_simulate_json_as_a_subprocess() -> None:
    """``kvferry simulate --json`` as users run it: one JSON object, exit 0 on clean seeds and 1 with the
    violation's invariant and replay line when a mutation is found."""
    clean = subprocess.run([sys.executable, "-m", "kvferry", "simulate", "--seeds", "2", "--seed", "5",
                            "--requests", "24", "--json"], capture_output=True, text=True, check=False, timeout=120)
    assert clean.returncode == 0, clean.stderr
    report = json.loads(clean.stdout)
    assert report["seeds"] == {"first": 5, "count": 2} and report["seeds_with_violation"] == 0
    assert report["requests"] == 48 and report["violations"] == [] and report["requests_per_minute"] > 0
    assert sum(report["seeds_by_pair"].values()) == 2
    found = subprocess.run([sys.executable, "-m", "kvferry", "simulate", "--seed", "0", "--mutate",
                            "done_before_verdict", "--trace", "3", "--json"], capture_output=True, text=True,
                           check=False, timeout=120)
    assert found.returncode == 1, found.stderr
    report = json.loads(found.stdout)
    [violation] = report["violations"]
    assert report["seeds_with_violation"] == 1 and report["mutation"] == "done_before_verdict"
    assert violation["invariant"] == "b_prefill_done_before_verdict"
    assert violation["replay"] == "kvferry simulate --seed 0 --mutate done_before_verdict"
    assert len(violation["trace"]) == 3
