"""kvferry's SGLang backend behind SGLang's own PD gateway with several prefills and decodes (slow suite).

Two prefill servers and two decode servers, each ``--disaggregation-transfer-backend kvferry``, behind
``sglang_router`` 0.3.2's gateway (its Rust router, the one SGLang ships as the Model Gateway: not the Python
``--mini-lb`` the 1P1D tests use), round robin over both sides, and a plain server for the reference: every
answer, sequential, concurrent and streamed, must be the plain server's greedy tokens, and both prefills and
both decodes must have served (each decode rank then talks to two prefills, each prefill to two decodes).
The tiny random model and tokenizer are the ones ``tests/sglang_servers.py`` writes for the 1P1D tests.
Passed in 255 s on 2026-12-05 (five servers and the gateway started on 2 cores at load average 20-40).
"""

from __future__ import annotations

import concurrent.futures as cf
import random
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

pytest.importorskip("sglang", reason="SGLang is not installed (make test-sglang)")

from . import sglang_servers as ss
from .deploy_commands import sglang_gateway_argv

pytestmark = [pytest.mark.slow, pytest.mark.timeout(1800)]

NEW_TOKENS = 8


def _pd_pair(model: Path, log_dir: Path, index: int) -> tuple[ss.Server, ss.Server]:
    common = ["--disaggregation-transfer-backend", "kvferry", "--disable-overlap-schedule"]
    pport, dport, bport = ss.free_port(), ss.free_port(), ss.free_port()
    prefill = ss.Server(f"prefill{index}", ss.server_args(model, pport, 1, extra=[
        *common, "--disaggregation-mode", "prefill", "--disaggregation-bootstrap-port", str(bport),
        "--disable-radix-cache"]), pport, log_dir / f"gw-prefill{index}.log", ss.server_env(),
        extra={"bootstrap_port": bport})
    decode = ss.Server(f"decode{index}", ss.server_args(model, dport, 1, extra=[
        *common, "--disaggregation-mode", "decode", "--disaggregation-decode-retraction-backup", "cpu_tensor"]),
        dport, log_dir / f"gw-decode{index}.log", ss.server_env())
    return prefill, decode


@pytest.fixture(scope="module")
def gateway(tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, object]]:
    root = tmp_path_factory.mktemp("sglang-gateway")
    model = ss.write_tiny_model(root / "tiny-llama")
    pairs = [_pd_pair(model, root, i) for i in range(2)]
    prefills, decodes = [p for p, _ in pairs], [d for _, d in pairs]
    rport = ss.free_port()
    # docs/deploy.md's line (tests/test_deploy_doc.py checks the page against this builder)
    argv = sglang_gateway_argv(sys.executable, "round_robin", [(p.url, p.extra["bootstrap_port"]) for p in prefills],
                               [d.url for d in decodes], rport)
    router = ss.Server("router", argv, rport, root / "gw-router.log", ss.server_env(), ready_path="/health")
    plain = ss.plain_server(model, 1, root)
    servers = [plain, *prefills, *decodes]
    try:
        ss.start_all(servers)
        ss.start_all([router], timeout=120)
        _until_routed(router.url)
        yield {"url": router.url, "plain": plain, "prefills": prefills, "decodes": decodes, "router": router}
    finally:
        for s in [router, *servers]:
            s.kill()


def _until_routed(url: str, timeout: float = 120.0) -> None:
    """The gateway answers /health at once and adds its workers in the background (its log: "Router ready |
    workers: []", then a workflow per worker): until then a request gets 503. Wait for one to be served."""
    import time

    import requests

    deadline = time.monotonic() + timeout
    while True:
        try:
            ss.generate(url, [5, 6, 7], 1, timeout=60)
            return
        except requests.HTTPError as exc:
            if exc.response is None or exc.response.status_code != 503 or time.monotonic() > deadline:
                raise
            time.sleep(1.0)


def _prompt(rng: random.Random, n: int) -> list[int]:
    return [rng.randrange(3, 380) for _ in range(n)]


def test_two_prefills_two_decodes_behind_the_gateway_answer_as_plain(gateway: dict) -> None:
    rng = random.Random(7)
    plain, url = gateway["plain"], gateway["url"]
    prompts = [_prompt(rng, n) for n in (1, 5, 17, 64, 129, 300, 3, 40)]
    for ids in prompts:   # one at a time: round robin walks both prefills and both decodes
        got = ss.generate(url, ids, NEW_TOKENS)["output_ids"]
        assert got == ss.generate(plain.url, ids, NEW_TOKENS)["output_ids"], f"{len(ids)} tokens"
    many = [_prompt(rng, rng.choice([2, 31, 64, 65, 200])) for _ in range(24)]
    want = [ss.generate(plain.url, ids, NEW_TOKENS)["output_ids"] for ids in many]
    with cf.ThreadPoolExecutor(24) as pool:
        got = list(pool.map(lambda ids: ss.generate(url, ids, NEW_TOKENS)["output_ids"], many))
    bad = [i for i, (g, w) in enumerate(zip(got, want)) if g != w]
    assert not bad, f"{len(bad)} of {len(many)} concurrent answers differ: {bad}"
    ids = _prompt(rng, 90)
    assert ss.generate_stream(url, ids, NEW_TOKENS) == ss.generate(plain.url, ids, NEW_TOKENS)["output_ids"]
    # Every server took part, and no decode computed a prompt token itself (the KV came over kvferry)
    for p in gateway["prefills"]:
        assert p.metrics().get("sglang:realtime_tokens_total.prefill_compute", 0.0) > 0, p.name
    for d in gateway["decodes"]:
        m = d.metrics()
        assert m.get("sglang:generation_tokens_total", m.get("sglang:realtime_tokens_total.decode", 0.0)) > 0, d.name
        assert m.get("sglang:realtime_tokens_total.prefill_compute", 0.0) == 0.0, d.name
