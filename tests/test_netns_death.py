"""A prefill on another host killed for good with requests half written: what decode holds, and for how long.

The prefill runs in a network namespace and a UTS namespace of its own (another hostname, so decode cannot
take it for a process of its own host whose death it could confirm from ``/proc``), decode in another
network namespace, joined by a veth; both over NIXL (UCX on TCP over the veth). Prefill writes the first
chunk of each request and is killed (SIGKILL) with the rest never sent. Decode reports its quarantined and
leased pages four times a second for ``WATCH_S`` seconds.

* Push (prefill writes): decode fails the requests within ``peer_timeout`` and quarantines their pages,
  since nothing proves the dead prefill's writes cannot still land; no acknowledgement will ever come, so the
  pages stay quarantined to the end of the watch (and, by the fence's argument, forever: docs/fencing.md).
* Auto, decode's default: the prefill's address is not loopback, so decode asks for pull; decode's pages are
  only ever written by decode, so the failed requests' leases end at once: nothing is held.
"""

from __future__ import annotations

import importlib.util
import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest

from .netns_peer import Side
from .test_netns import _readline, veth_pair  # noqa: F401 (the fixture)

pytestmark = [pytest.mark.nixl,
              pytest.mark.skipif(importlib.util.find_spec("nixl") is None, reason="nixl is not installed"),
              pytest.mark.skipif(shutil.which("unshare") is None, reason="unshare (util-linux) is not installed")]

PEER = Path(__file__).with_name("netns_death_peer.py")
N = 6
WATCH_S = 6.0      # past the failure (peer_timeout 1.5 s) by several peer_timeouts of reconnect attempts


class _Peer:
    def __init__(self, prefix: list[str], cfg: dict[str, Any], log: Path) -> None:
        env = {**os.environ, "PYTHONPATH": str(PEER.parents[1] / "src")}
        with log.open("wb") as err:
            self.proc = subprocess.Popen([*prefix, sys.executable, str(PEER), json.dumps(cfg)], stdin=subprocess.PIPE,
                                         stdout=subprocess.PIPE, stderr=err, env=env, bufsize=0)
        self.log = log

    def read(self, deadline: float) -> dict[str, Any]:
        assert self.proc.stdout is not None
        while (line := _readline(self.proc.stdout, deadline)) is not None:
            if line.startswith(b"{"):
                return json.loads(line)
        pytest.fail(f"peer gave no answer (exit {self.proc.poll()}); stderr:\n{self.log.read_text()[-3000:]}")

    def kill(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
        self.proc.wait(10)


def run_death(pair: tuple[Side, Side], tmp: Path, mode: str) -> tuple[str, list[dict[str, Any]], float]:
    """Decode's samples after prefill's death, the mode decode asked for, and when the kill happened
    (seconds into decode's watch)."""
    pre_ns, dec_ns = pair
    deadline = time.monotonic() + 60
    # Another hostname: the host identity decode compares is hostname + boot id (control.liveness)
    other_host = [*pre_ns.prefix(), "unshare", "--uts", "sh", "-c", 'hostname kvferry-other-host && exec "$@"', "-"]
    prefill = _Peer(other_host, {"role": "prefill", "host": pre_ns.ip, "n": N, "seed": 5}, tmp / f"prefill-{mode}.log")
    decode = None
    try:
        address = prefill.read(deadline)["address"]
        decode = _Peer(dec_ns.prefix(), {"role": "decode", "address": address, "mode": mode, "n": N, "seed": 5,
                                         "watch": WATCH_S + 4}, tmp / f"decode-{mode}.log")
        started = decode.read(deadline)
        assert started["announced"]
        assert prefill.proc.stdin is not None
        prefill.proc.stdin.write(b"go\n")
        assert prefill.read(deadline) == {"sent": N}
        samples = [decode.read(deadline)]
        prefill.kill()   # SIGKILL: for good, its half-written requests with it
        killed_at = samples[-1]["t"]
        while samples[-1]["t"] < killed_at + WATCH_S:
            samples.append(decode.read(deadline))
        return started["mode"], samples, killed_at
    finally:
        for peer in (prefill, decode):
            if peer is not None:
                peer.kill()


def test_push_holds_quarantined_pages_and_auto_pulls_and_holds_none(veth_pair: tuple[Side, Side],  # noqa: F811
                                                                     tmp_path: Path) -> None:
    mode, push, killed = run_death(veth_pair, tmp_path, "push")
    assert mode == "push"
    after = [s for s in push if s["t"] >= killed + 4.0]   # failure seen (peer_timeout 1.5 s) and settled
    assert after and all(s["failed"] == N for s in after), push[-1]
    held = [s["quarantined"] for s in after]
    assert min(held) > 0 and held[-1] == held[0], f"push: quarantined pages over time {held}"
    mode, auto, killed = run_death(veth_pair, tmp_path, "auto")
    assert mode == "pull"        # another host: decode's default asks for pull
    after = [s for s in auto if s["t"] >= killed + 4.0]
    assert after and all(s["failed"] == N for s in after), auto[-1]
    assert all(s["quarantined"] == 0 and s["leased"] == 0 for s in after), auto[-1]
    assert max(s["quarantined"] for s in auto) == 0
    first_free = next(s["t"] for s in auto if s["t"] > killed and s["leased"] == 0)
    # The figures docs/fencing.md quotes, printed for the record (pytest -s)
    print(f"push: {held[0]} pages quarantined from the failure to the end of the watch ({WATCH_S:.0f} s after the "
          f"kill); auto (pull): all {auto[0]['leased']} leased pages free {first_free - killed:.2f} s after the kill")
