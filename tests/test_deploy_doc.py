"""docs/deploy.md's router commands are the ones the slow suites run (``tests/deploy_commands.py``).

The page's ``bash`` blocks are read as a shell would join them (backslash continuations); each router line is
rebuilt with the builder the tests use, from the URLs and port the page shows, and must come out word for
word the same. A page edited without the tests, or the tests without the page, fails here.
"""

from __future__ import annotations

import json
import re
import shlex
from pathlib import Path

from .deploy_commands import (
    dynamo_frontend_argv,
    dynamo_worker_argv,
    sglang_gateway_argv,
    smg_argv,
    smg_worker,
    vllm_router_argv,
)

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


def test_the_dynamo_lines_are_the_tested_ones() -> None:
    """The frontend and both workers as tests/test_dynamo.py builds them (its CPU flags after the page's words),
    the prefill with ``$KV`` (kvferry's connector), the decode with its consumer twin."""
    [frontend] = [c for c in commands() if c[:3] == ["python", "-m", "dynamo.frontend"]]
    [[port]] = values(frontend, "--http-port")
    assert frontend == dynamo_frontend_argv("python", int(port))
    workers = {values(c, "--disaggregation-mode")[0][0]: c for c in commands()
               if c[:3] == ["python", "-m", "dynamo.vllm"]}
    assert sorted(workers) == ["decode", "prefill"]
    assert workers["prefill"] == dynamo_worker_argv("python", "MODEL", "prefill", "$KV")
    assert workers["decode"] == dynamo_worker_argv("python", "MODEL", "decode", "${KV/kv_producer/kv_consumer}")


def test_the_smg_lines_are_the_tested_ones() -> None:
    """smg started without workers, then every vLLM server of the page registered with the body
    tests/test_smg.py posts (kvferry's hand-off under NixlConnector's name)."""
    [launch] = [c for c in commands() if c[:2] == ["smg", "launch"]]
    [[port]], [[metrics]] = values(launch, "--port"), values(launch, "--prometheus-port")
    assert launch == smg_argv("smg", int(port), int(metrics))
    posts = [c for c in commands() if c[:3] == ["curl", "-X", "POST"]]
    assert len(posts) == 4
    for argv in posts:
        assert argv[3] == f"http://127.0.0.1:{port}/workers"
        [[body]] = values(argv, "-d")
        got = json.loads(body)
        assert got == smg_worker(got["url"], got["worker_type"]), got
    kinds = sorted(json.loads(values(c, "-d")[0][0])["worker_type"] for c in posts)
    assert kinds == ["decode", "decode", "prefill", "prefill"]
