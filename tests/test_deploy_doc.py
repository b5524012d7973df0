"""docs/deploy.md's router commands are the ones the slow suites run (``tests/deploy_commands.py``).

The page's ``bash`` blocks are read as a shell would join them (backslash continuations); each router line is
rebuilt with the builder the tests use, from the URLs and port the page shows, and must come out word for
word the same. A page edited without the tests, or the tests without the page, fails here.
"""

from __future__ import annotations

import re
import shlex
from pathlib import Path

from .deploy_commands import sglang_gateway_argv, vllm_router_argv

PAGE = Path(__file__).resolve().parents[1] / "docs" / "deploy.md"


def commands() -> list[list[str]]:
    """Every command line of the page's bash blocks, split as the shell splits it."""
    out = []
    for block in re.findall(r"```bash\n(.*?)```", PAGE.read_text(), re.S):
        for line in block.replace("\\\n", " ").splitlines():
            line = line.strip()
            if line and not line.startswith("#"):
                out.append(shlex.split(line.rstrip("&").strip()))
    return out


def values(argv: list[str], flag: str, width: int = 1) -> list[list[str]]:
    return [argv[i + 1:i + 1 + width] for i, word in enumerate(argv) if word == flag]


def test_the_vllm_router_line_is_the_tested_one() -> None:
    [argv] = [c for c in commands() if c[0] == "vllm-router"]
    prefills = [v[0] for v in values(argv, "--prefill")]
    decodes = [v[0] for v in values(argv, "--decode")]
    assert len(prefills) == len(decodes) == 2
    [[policy]], [[port]] = values(argv, "--policy"), values(argv, "--port")
    [[metrics]] = values(argv, "--prometheus-port")
    assert argv == vllm_router_argv("vllm-router", policy, prefills, decodes, int(port), int(metrics))


def test_the_sglang_gateway_line_is_the_tested_one() -> None:
    [argv] = [c for c in commands() if c[:3] == ["python", "-m", "sglang_router.launch_router"]]
    prefills = [(url, int(bootstrap)) for url, bootstrap in values(argv, "--prefill", 2)]
    decodes = [v[0] for v in values(argv, "--decode")]
    assert len(prefills) == len(decodes) == 2
    [[policy]], [[port]] = values(argv, "--policy"), values(argv, "--port")
    assert argv == sglang_gateway_argv("python", policy, prefills, decodes, int(port))


def test_each_server_line_names_kvferry() -> None:
    """Every server the page starts moves its KV with kvferry: vLLM's through ``$KV`` (kvferry's connector),
    SGLang's with ``--disaggregation-transfer-backend kvferry`` and the plugin exported."""
    page = PAGE.read_text()
    servers = [c for c in commands() if c[:2] == ["vllm", "serve"] or "sglang.launch_server" in c]
    assert len(servers) >= 8
    for argv in servers:
        if argv[0] == "vllm":
            assert argv[argv.index("--kv-transfer-config") + 1] in ("$KV", "${KV/kv_producer/kv_consumer}"), argv
        else:
            assert argv[argv.index("--disaggregation-transfer-backend") + 1] == "kvferry", argv
    assert '"kv_connector": "KVFerryConnector"' in page and "export SGLANG_PLUGINS=kvferry" in page
