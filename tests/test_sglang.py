"""kvferry as SGLang's transfer backend, on SGLang's real classes and real CPU memory pools (no model, no
scheduler): prefill and decode as two OS processes over NIXL (tests/sglang_peer.py), 64 concurrent
requests with random pages that reach the top page of every index space, every byte of every buffer
checked. Then SGLang's own NIXL backend on the same pools and requests, for comparison.

Needs SGLang (``make test-sglang`` runs this under .venv-sglang); skipped where it is not importable.
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
from collections import Counter
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("sglang.srt.disaggregation.common.conn")
pytest.importorskip("nixl")
pytestmark = [pytest.mark.sglang, pytest.mark.nixl, pytest.mark.slow]

PEER = Path(__file__).with_name("sglang_peer.py")
ROOT = PEER.parent.parent
POOLS = ["mla", "dsa_fp8", "dsa_bf16", "v4"]
N = 64
RESULTS: dict[tuple[str, str], dict[str, Any]] = {}


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def run_ranks(backend: str, pool: str, *, prefill_tp: int = 1, decode_tp: int = 1, n: int = N,
              env: dict[str, str] | None = None, **cfg: Any) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    """One process per prefill and per decode attention-TP rank for one case; their JSON reports, in rank
    order (prefill's, decode's)."""
    config = json.dumps({"backend": backend, "pool": pool, "n": n, "port": _free_port(), "seed": 11,
                         "prefill_tp": prefill_tp, "decode_tp": decode_tp, **cfg})
    # SGLANG_HOST_IP: SGLang's "local IP" would be this host's interface address; the tests stay on loopback.
    penv = {**os.environ, "PYTHONPATH": str(ROOT / "src"), "SGLANG_PLUGINS": "kvferry",
            "SGLANG_HOST_IP": "127.0.0.1", **(env or {})}
    ranks = [("prefill", r) for r in range(prefill_tp)] + [("decode", r) for r in range(decode_tp)]
    procs = [subprocess.Popen([sys.executable, str(PEER), role, config, str(rank)], stdout=subprocess.PIPE,
                              stderr=subprocess.DEVNULL, text=True, env=penv) for role, rank in ranks]
    outs = []
    for (role, rank), proc in zip(ranks, procs):
        try:
            out, _ = proc.communicate(timeout=240)
        except subprocess.TimeoutExpired:
            for p in procs:
                p.kill()
            raise
        lines = [line for line in out.splitlines() if line.startswith("{")]
        assert lines, f"{backend}/{pool}: {role} rank {rank} printed no report (exit {proc.returncode})"
        outs.append(json.loads(lines[-1]))
    return outs[:prefill_tp], outs[prefill_tp:]


def run_pair(backend: str, pool: str, **kw: Any) -> tuple[dict[str, Any], dict[str, Any]]:
    """Prefill and decode at TP 1, one process each; returns their JSON reports."""
    prefills, decodes = run_ranks(backend, pool, **kw)
    return prefills[0], decodes[0]


def _ok(report: dict[str, Any]) -> int:
    return sum(v == "ok" for v in report["outcomes"].values())


def assert_exact(decode: dict[str, Any]) -> None:
    check = decode["check"]
    assert check["bytes_checked"] > 0 and check["pages_checked"] == sum(decode["slots"])
    assert check["num_bad_pages"] == 0, check["bad_pages"]
    assert check["num_touched_elsewhere"] == 0, check["touched_elsewhere"]


@pytest.mark.parametrize("pool", POOLS)
def test_kvferry_backend_moves_every_byte(pool: str) -> None:
    prefill, decode = run_pair("kvferry", pool)
    assert "refused" not in decode, decode
    assert _ok(prefill) == N and _ok(decode) == N, (Counter(prefill["outcomes"].values()),
                                                    Counter(decode["outcomes"].values()))
    assert_exact(decode)
    # SGLang's transfer metric: its byte count (pages x item lengths) and kvferry's first-send-to-Success time
    for total_bytes, latency in prefill["metrics"].values():
        assert total_bytes > 0 and latency is not None and latency > 0
    RESULTS["kvferry", pool] = decode


@pytest.mark.parametrize("pool", POOLS)
def test_sglang_nixl_backend_same_cases(pool: str) -> None:
    """SGLang's own NIXL backend on the same pools and requests (a VRAM->DRAM shim in its process lets its
    state buffers register on a machine without a GPU; see tests/sglang_peer.py). As of 0.5.23 it moves
    these equal-TP cases byte-exact too; this test says so, and fails the day that changes."""
    prefill, decode = run_pair("nixl", pool)
    assert "refused" not in decode, decode
    assert _ok(prefill) == N and _ok(decode) == N, Counter(decode["outcomes"].values())
    assert_exact(decode)
    RESULTS["nixl", pool] = decode


def test_layout_mismatch_fails_the_request_not_the_bytes() -> None:
    """Prefill with fp8 index keys, decode with bf16 ones: kvferry's handshake refuses the pair with the
    difference spelled out, every request fails on decode with that reason (SGLang's KVTransferError),
    prefill's fail by SGLang's bootstrap timeout, and not one byte of decode's memory changes."""
    prefill, decode = run_pair("kvferry", "dsa_fp8", n=8, decode_pool="dsa_bf16",
                               env={"SGLANG_DISAGGREGATION_BOOTSTRAP_TIMEOUT": "3"})
    reasons = set(decode["outcomes"].values())
    assert _ok(decode) == 0 and _ok(prefill) == 0
    assert any("kvferry handshake with prefill failed" in r for r in reasons), reasons
    assert any("state0.dsa" in r for r in reasons), reasons   # names the buffer that differs
    assert_exact(decode)


def test_abort_on_decode_fails_those_requests_on_both_sides() -> None:
    prefill, decode = run_pair("kvferry", "dsa_bf16", abort_every=4)
    aborted = {str(1000 + i) for i in range(0, N, 4)}
    for room, outcome in decode["outcomes"].items():
        assert (outcome == "ok") == (room not in aborted), (room, outcome)
    for room in aborted:
        assert "Aborted" in decode["outcomes"][room]
        assert prefill["outcomes"][room].startswith("failed")
    assert _ok(prefill) == N - len(aborted)
    assert_exact(decode)


def test_abort_on_prefill_fails_those_requests_on_both_sides() -> None:
    prefill, decode = run_pair("kvferry", "mla", prefill_abort_every=4)
    aborted = {str(1000 + i) for i in range(1, N, 4)}
    for room, outcome in decode["outcomes"].items():
        assert (outcome == "ok") == (room not in aborted), (room, outcome)
    for room in aborted:
        assert "aborted by prefill" in decode["outcomes"][room], decode["outcomes"][room]
        assert "Aborted" in prefill["outcomes"][room]
    assert_exact(decode)


def test_prefill_crash_fails_the_unfinished_requests_on_decode() -> None:
    """Prefill dies (os._exit) right after posting the writes of its 32nd request: decode finishes what
    had arrived, fails the rest with kvferry's reason (the peer is lost) through SGLang's
    KVTransferError, and no page outside the requests' own is touched."""
    prefill, decode = run_pair("kvferry", "v4", die_after=32)
    assert prefill == {"role": "prefill", "died_after": 32}
    failed = [v for v in decode["outcomes"].values() if v != "ok"]
    assert len(decode["outcomes"]) == N and len(failed) >= N - 32, Counter(decode["outcomes"].values())
    assert all("KVTransferError" in v for v in failed), failed[:3]
    # Decode learns of the crash from the dropped connection (a ZMQ socket monitor) or, failing that, from
    # the peer's silence past peer_timeout; either way the reason names the prefill.
    assert any(("silent for" in v and "peer_timeout" in v) or "connection dropped" in v for v in failed), failed[:3]
    assert_exact(decode)


def test_plugin_resolves_kvferry_and_keeps_nixl() -> None:
    """SGLang's load_plugins() with SGLANG_PLUGINS=kvferry: TransferBackend("kvferry") resolves wherever
    SGLang converts the flag, get_kv_class returns kvferry's classes, "nixl" still returns SGLang's."""
    code = """
import os
from sglang.srt.plugins import load_plugins
from sglang.srt.disaggregation import utils
from sglang.srt.managers import disagg_service
from sglang.srt.arg_groups.choices import DISAGG_TRANSFER_BACKEND_CHOICES
load_plugins()
for mod in (utils, disagg_service):
    b = mod.TransferBackend("kvferry")
print(utils.get_kv_class(utils.TransferBackend("kvferry"), utils.KVClassType.MANAGER).__name__)
print(utils.get_kv_class(utils.TransferBackend("kvferry"), utils.KVClassType.RECEIVER).__name__)
print(utils.get_kv_class(utils.TransferBackend("nixl"), utils.KVClassType.MANAGER).__name__)
print("kvferry" in DISAGG_TRANSFER_BACKEND_CHOICES)
"""
    env = {**os.environ, "PYTHONPATH": str(ROOT / "src"), "SGLANG_PLUGINS": "kvferry"}
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.split() == ["KVFerryKVManager", "KVFerryKVReceiver", "NixlKVManager", "True"]


def test_kvargs_of_real_pools_keep_each_entry_slot_count() -> None:
    """The DeepSeek-V4 pool's KVArgs mixes slot counts across kv_data entries; kvferry's layout keeps each
    entry's own ``len // item_len``."""
    code = f"""
import json, sys
sys.path.insert(0, {str(PEER.parent)!r})
import torch
from sglang_peer import build_pool, build_kv_args, setup_context, AUX_SLOTS, AUX_ITEM
from kvferry.integrations.sglang.layout import kvargs_memory
setup_context({{"backend": "kvferry", "port": 1}})
aux = torch.zeros(AUX_SLOTS, AUX_ITEM, dtype=torch.uint8)
args = build_kv_args(build_pool("v4"), aux)
memory, names = kvargs_memory(args)
print(json.dumps({{"want": [n // i for n, i in zip(args.kv_data_lens, args.kv_item_lens)],
                  "got": [b.num_pages for b in memory.layout.pool("kv").buffers], "states": names.states}}))
"""
    env = {**os.environ, "PYTHONPATH": str(ROOT / "src")}
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=180)
    assert out.returncode == 0, out.stderr[-2000:]
    got = json.loads(out.stdout.strip().splitlines()[-1])
    assert got["got"] == got["want"] and len(set(got["want"])) > 1
    assert got["states"] == ["state0.swa", "state1.c128_state"]


def test_zz_report(capsys: pytest.CaptureFixture[str]) -> None:
    """Prints the comparison table (time per request as decode sees it: send_metadata to Success)."""
    if not RESULTS:
        pytest.skip("no transfer ran")
    with capsys.disabled():
        print("\nbackend  pool      requests ok  bytes checked  bad pages  mean s/request")
        for (backend, pool), d in sorted(RESULTS.items()):
            print(f"{backend:8} {pool:9} {_ok(d):>11}  {d['check']['bytes_checked']:>13}  "
                  f"{d['check']['num_bad_pages']:>9}  {d['mean_latency_s']:.4f}")
