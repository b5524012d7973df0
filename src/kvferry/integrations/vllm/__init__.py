"""kvferry as a vLLM v1 KV connector (``kv_connector_module_path="kvferry.integrations.vllm"``).

Above ``control``, beside ``workload``. The modules, bottom up:

* ``layout``: vLLM's per-layer KV tensors and block tables as kvferry layouts and page lists.
* ``scheduler`` / ``worker``: the scheduler-side and worker-side halves of the connector, plain Python over
  kvferry's endpoints.
* ``proxy``: the HTTP proxy in front of two ``vllm serve`` processes (``kvferry vllm-proxy``; aiohttp).
* ``connector``: ``KVFerryConnector``, the class vLLM loads; the only module that imports vLLM.

vLLM's factory imports this package and takes ``KVFerryConnector`` from it, so the connector's names resolve
lazily here (PEP 562): importing ``layout``, ``scheduler`` or ``worker`` never imports vLLM or torch.
See docs/vllm.md.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from kvferry.integrations.vllm.connector import KVFerryConnector, KVFerryHandshake, KVFerryMetadata

__all__ = ["KVFerryConnector", "KVFerryHandshake", "KVFerryMetadata"]


def __getattr__(name: str) -> Any:
    if name in __all__:
        from kvferry.integrations.vllm import connector

        return getattr(connector, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
