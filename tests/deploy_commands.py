"""The router command lines docs/deploy.md shows, built here once: the slow suites run them
(``tests/test_vllm_router.py``, ``tests/test_sglang_gateway.py``) and ``tests/test_deploy_doc.py`` checks the page
says the same, word for word but for the binary's path, the URLs and the port. No engine is imported here."""

from __future__ import annotations

from collections.abc import Sequence


def vllm_router_argv(binary: str, policy: str, prefills: Sequence[str], decodes: Sequence[str],
                     port: int, metrics_port: int) -> list[str]:
    """vllm-router in front of vLLM servers with kvferry's connector: its NIXL-style hand-off (``--kv-connector
    nixl``) is the one kvferry's transfer parameters follow. ``metrics_port``: its Prometheus exporter's (29000
    unless given; a second router on the host must be given another)."""
    cmd = [binary, "--vllm-pd-disaggregation"]
    for url in prefills:
        cmd += ["--prefill", url]
    for url in decodes:
        cmd += ["--decode", url]
    return [*cmd, "--policy", policy, "--kv-connector", "nixl", "--host", "127.0.0.1", "--port", str(port),
            "--prometheus-port", str(metrics_port)]


def sglang_gateway_argv(python: str, policy: str, prefills: Sequence[tuple[str, int]], decodes: Sequence[str],
                        port: int) -> list[str]:
    """SGLang's gateway (``sglang_router``'s Rust router, not ``--mini-lb``): each prefill with its bootstrap port."""
    cmd = [python, "-m", "sglang_router.launch_router", "--pd-disaggregation", "--policy", policy]
    for url, bootstrap in prefills:
        cmd += ["--prefill", url, str(bootstrap)]
    for url in decodes:
        cmd += ["--decode", url]
    return [*cmd, "--host", "127.0.0.1", "--port", str(port)]


def dynamo_frontend_argv(python: str, port: int) -> list[str]:
    """NVIDIA Dynamo's HTTP frontend (its router: a prefill, then a decode, per request); one machine, its file
    discovery (no etcd or NATS)."""
    return [python, "-m", "dynamo.frontend", "--http-port", str(port), "--discovery-backend", "file"]


def dynamo_worker_argv(python: str, model: str, mode: str, kv_transfer_config: str,
                       extra: Sequence[str] = ()) -> list[str]:
    """Dynamo's vLLM worker as a ``prefill`` or ``decode`` with kvferry's connector: the plain ``dynamo.vllm``
    (kvferry's vLLM plugin registers it as a PD connector there). ``extra``: engine flags (a CPU's)."""
    return [python, "-m", "dynamo.vllm", "--model", model, "--discovery-backend", "file", "--disaggregation-mode",
            mode, "--kv-transfer-config", kv_transfer_config, *extra]


def smg_argv(binary: str, port: int, metrics_port: int, prefills: Sequence[str] = (),
             decodes: Sequence[str] = ()) -> list[str]:
    """smg (SGLang Model Gateway) in PD mode. With vLLM's HTTP servers, started without workers: each worker is
    then registered with its connector (``smg_worker``); workers given here carry none, and smg runs them in
    pass-through (decode recomputes every prompt). ``metrics_port``: its Prometheus exporter's."""
    cmd = [binary, "launch", "--pd-disaggregation"]
    for url in prefills:
        cmd += ["--prefill", url]
    for url in decodes:
        cmd += ["--decode", url]
    return [*cmd, "--policy", "round_robin", "--host", "127.0.0.1", "--port", str(port),
            "--prometheus-port", str(metrics_port)]


def smg_worker(url: str, worker_type: str) -> dict[str, str]:
    """The body of smg's ``POST /workers`` for a vLLM server with kvferry's connector: smg must be told the
    connector, and it knows kvferry's hand-off by NixlConnector's name (prefill tagged ``do_remote_decode``,
    its returned ``kv_transfer_params`` relayed to decode unchanged)."""
    return {"url": url, "worker_type": worker_type, "kv_connector": "NixlConnector"}
