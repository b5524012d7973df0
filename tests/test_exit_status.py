"""Processes that used NIXL exit 0, as users run them (subprocesses, exit status asserted).

On a host with the system's RDMA libraries (Debian's ``libibverbs1`` and ``ibverbs-providers``: every
InfiniBand/RoCE host, and what Mooncake's Transfer Engine needs), UCX's EFA module in the nixl wheel pulls the
system's ``libnl-route`` into the dlopen group of the wheel's bundled copy, and the process died with SIGSEGV
at exit (status 139, ``rtnl_tc_unregister`` from ``_dl_fini``) once it had created an agent
(``kvferry.transport.nixl.ENV_DEFAULTS`` says why and what kvferry sets). ``pytest`` itself never exits
through that path, so only a subprocess shows it.

How these tests behave without those libraries: the crash cannot happen, they pass, and
``test_control_without_the_default_crashes`` skips, saying so. With them (``scripts/setup.sh`` installs them
where it can), that control shows the crash is real on this host: the same child, with kvferry's default
overridden by ``UCX_MODULES=*``, dies with SIGSEGV. So the other tests here can fail. ``kvferry bench --tiny``
runs as a subprocess in tests/test_bench_cmd.py, exit status asserted.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("nixl")
pytestmark = pytest.mark.nixl

ROOT = Path(__file__).resolve().parents[1]
SYSTEM_LIBEFA = [Path(d) / "libefa.so.1" for d in ("/lib/x86_64-linux-gnu", "/usr/lib/x86_64-linux-gnu",
                                                   "/lib64", "/usr/lib64", "/lib/aarch64-linux-gnu")]

def _env(**extra: str) -> dict[str, str]:
    env = dict(os.environ)
    src = str(ROOT / "src")
    env["PYTHONPATH"] = src + (os.pathsep + env["PYTHONPATH"] if env.get("PYTHONPATH") else "")
    env.update(extra)
    return env


def _run(args: list[str], timeout: float, **extra: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(args, cwd=ROOT, env=_env(**extra), capture_output=True, text=True, timeout=timeout)


def _explain(proc: subprocess.CompletedProcess[str]) -> str:
    died = f" (killed by {signal.Signals(-proc.returncode).name})" if proc.returncode < 0 else ""
    return (f"exit status {proc.returncode}{died}\nstdout tail:\n{proc.stdout[-1500:]}\n"
            f"stderr tail:\n{proc.stderr[-1500:]}")


# A library user: one side's memory registered with an agent, the transport closed, a plain exit. It prints
# the libnl-route copies mapped, so a failure says whether both were there.
AGENT_CHILD = """
from kvferry import Buffer, KVMemory, Layout, Pool
from kvferry.transport.nixl import NixlTransport
memory = KVMemory.allocate(Layout([Pool("p", [Buffer("p.kv", 4096, 64, "bf16", "kv", 0)])]))
t = NixlTransport()
t.register(memory)
t.close()
maps = open("/proc/self/maps").read()
print("libnl-route copies mapped:", sorted({l.split()[-1] for l in maps.splitlines() if "libnl-route" in l}))
"""


def test_library_user_creating_and_closing_an_agent_exits_0() -> None:
    proc = _run([sys.executable, "-c", AGENT_CHILD], timeout=60)
    assert proc.returncode == 0, _explain(proc)


def test_control_without_the_default_crashes() -> None:
    """The control: kvferry's UCX_MODULES default overridden, on a host with the system libraries."""
    if not any(p.exists() for p in SYSTEM_LIBEFA):
        pytest.skip("no system libefa (ibverbs-providers) here: the crash cannot happen, the tests above pass "
                    "without showing the fix")
    proc = _run([sys.executable, "-c", AGENT_CHILD], timeout=60, UCX_MODULES="*")
    if proc.returncode == 0:
        pytest.skip("with every UCX module loaded the child still exits 0: this nixl wheel no longer mixes "
                    "the two libnl-route copies, so the default is no longer needed")
    assert proc.returncode in (-signal.SIGSEGV, 128 + signal.SIGSEGV), _explain(proc)


def test_bench_control_quick_exits_0() -> None:
    proc = _run([sys.executable, "bench/control.py", "--quick"], timeout=240)
    assert proc.returncode == 0, _explain(proc)
