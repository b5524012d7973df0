"""kvferry's vLLM connector as a PD connector of NVIDIA Dynamo's vLLM worker (``python -m dynamo.vllm``).

Dynamo's prefill handler asks ``dynamo.vllm.kv_connector_protocols.make_kv_connector_protocol`` how to hand a
request from prefill to decode, by the engine's ``kv_transfer_config.kv_connector``; a name missing from its
``KV_CONNECTOR_PROTOCOLS`` fails the request (``ValueError: Unsupported kv_connector='KVFerryConnector' for
PD``, the client gets 400). kvferry's hand-off has NixlConnector's shape (the toy proxy's, vllm-router's):
prefill gets ``{"do_remote_decode": true}`` and returns kvferry's ``kvferry_address``,
``kvferry_request_id``, ``remote_num_tokens``, which decode must get as they came. ``register`` adds
``KVFerryConnector`` to that table.

Two ways it runs, neither a launcher the user writes:

* ``vllm.general_plugins`` (pyproject.toml): vLLM loads kvferry's plugin in every process when its engine
  arguments are built; in a Dynamo worker, whose handlers have imported the table by then, it registers;
  elsewhere it does nothing and imports nothing. ``python -m dynamo.vllm ... --kv-transfer-config
  '{"kv_connector": "KVFerryConnector", ...}'`` then works as it is.
* ``python -m kvferry.integrations.dynamo ARGS``: registers, then runs ``python -m dynamo.vllm ARGS``; for
  a deployment that narrows vLLM's plugins (``VLLM_PLUGINS``) without naming ``kvferry_dynamo``.

Within ``MultiConnector`` (or Dynamo's ``PdConnector``), Dynamo picks the one child named in the table:
kvferry beside a save-only connector resolves too. See docs/deploy.md.
"""

from __future__ import annotations

import logging
import sys
from typing import Any

CONNECTOR_NAME = "KVFerryConnector"
PROTOCOLS_MODULE = "dynamo.vllm.kv_connector_protocols"

logger = logging.getLogger(__name__)


def kvferry_protocol_class(base: type) -> type:
    """Dynamo's ``KvConnectorProtocol`` for kvferry, on Dynamo's own base class ``base``."""

    class KVFerryConnectorProtocol(base):  # type: ignore[misc, valid-type]
        """Prefill is asked to hand off; decode gets what kvferry's prefill returned, unchanged (kvferry's
        producer names its address and transfer there: nothing is allocated before prefill runs)."""

        produces_kv_transfer_params = True

        def prefill_request_kv_transfer_params(self) -> dict[str, Any]:
            return {"do_remote_decode": True, "do_remote_prefill": False}

        def decode_request_kv_transfer_params(self, prefill_response: Any) -> dict[str, Any] | None:
            return getattr(prefill_response, "kv_transfer_params", None)

    return KVFerryConnectorProtocol


def register_with(protocols: Any) -> bool:
    """Add kvferry to the Dynamo module ``protocols``' table (once; a name already there is left as it is).
    True when kvferry's entry is there afterwards."""
    table = protocols.KV_CONNECTOR_PROTOCOLS
    if CONNECTOR_NAME not in table:
        table[CONNECTOR_NAME] = kvferry_protocol_class(protocols.KvConnectorProtocol)
        logger.info("kvferry: %s registered as a Dynamo PD connector (%s)", CONNECTOR_NAME, PROTOCOLS_MODULE)
    return getattr(table[CONNECTOR_NAME], "__name__", "") == "KVFerryConnectorProtocol"


def register() -> None:
    """vLLM's general-plugin hook: register with Dynamo when this process is a Dynamo worker (its protocol
    table already imported), and do nothing, importing nothing, in any other vLLM process."""
    protocols = sys.modules.get(PROTOCOLS_MODULE)
    if protocols is not None:
        register_with(protocols)


def main(argv: list[str] | None = None) -> None:
    """``python -m dynamo.vllm`` with kvferry registered first (``argv``: Dynamo's arguments)."""
    import importlib
    import runpy

    register_with(importlib.import_module(PROTOCOLS_MODULE))
    sys.argv = ["dynamo.vllm", *(sys.argv[1:] if argv is None else argv)]
    runpy.run_module("dynamo.vllm", run_name="__main__", alter_sys=True)
