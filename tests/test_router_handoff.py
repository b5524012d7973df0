"""What kvferry's vLLM connector does with routers that do not know it (issue 49), without vLLM or the routers.

* A decode-only instance (``kv_consumer``) given a request without kvferry's hand-off says so
  (``SchedulerSide.unhanded``): smg 1.13.0 runs a vLLM worker whose connector it does not know in pass-through,
  sends prefill no ``do_remote_decode`` and decode nothing, and decode recomputes every prompt with no other
  sign (tests/test_smg.py shows it with real servers).
* Dynamo's vLLM worker resolves a PD connector by name in its own table; ``kvferry.integrations.dynamo`` adds
  kvferry's there (the real table: tests/test_dynamo.py).
"""

from __future__ import annotations

import sys
import types
from abc import ABC, abstractmethod
from typing import Any

import pytest

from kvferry.integrations import dynamo
from kvferry.integrations.vllm.layout import GroupSpec
from kvferry.integrations.vllm.scheduler import SKIPPED_KEY, SchedulerSide, missing_handoff, transfer_params

KVFERRY = transfer_params("tcp://127.0.0.1:7000", "req-1", 40)


@pytest.mark.parametrize(("params", "why"), [
    (None, "no kv_transfer_params"),
    ({}, "no kv_transfer_params"),
    ({"do_remote_prefill": True, "remote_engine_id": "e", "remote_block_ids": [[1]]}, "another connector's"),
    ({"do_remote_decode": False, "do_remote_prefill": False}, "kv_transfer_params that ask for no remote prefill"),
])
def test_a_request_without_kvferrys_handoff_is_named(params: dict[str, Any] | None, why: str) -> None:
    got = missing_handoff(params)
    assert got is not None and got.startswith(why)


def test_kvferrys_handoff_and_a_prefill_that_said_why_are_not() -> None:
    assert missing_handoff(KVFERRY) is None
    assert missing_handoff({"do_remote_prefill": False, "do_remote_decode": False, SKIPPED_KEY: "window"}) is None


def test_decode_warns_on_the_first_then_each_power_of_ten() -> None:
    side = SchedulerSide((GroupSpec(("layer.0",), 16),))
    warned = [n for n in range(1, 1001) if side.unhanded(f"r{n}", None, 64) is not None]
    assert warned == [1, 10, 100, 1000]
    assert side.unhanded_requests == 1000
    first = SchedulerSide((GroupSpec(("layer.0",), 16),)).unhanded("cmpl-7", {}, 64)
    assert first is not None and "cmpl-7" in first and "64 prompt tokens" in first and "NixlConnector" in first
    assert side.unhanded("r-kvferry", KVFERRY, 64) is None and side.unhanded_requests == 1000


# -- Dynamo's table, as dynamo.vllm.kv_connector_protocols 1.6.1 has it --------------------------------------
class _Protocol(ABC):
    produces_kv_transfer_params = True

    def __init__(self, vllm_config: Any) -> None:
        self._vllm_config = vllm_config

    @abstractmethod
    def prefill_request_kv_transfer_params(self) -> dict[str, Any]: ...

    @abstractmethod
    def decode_request_kv_transfer_params(self, prefill_response: Any) -> dict[str, Any] | None: ...


def _table() -> types.ModuleType:
    module = types.ModuleType(dynamo.PROTOCOLS_MODULE)
    module.KvConnectorProtocol = _Protocol   # type: ignore[attr-defined]
    module.KV_CONNECTOR_PROTOCOLS = {"NixlConnector": _Protocol}   # type: ignore[attr-defined]
    return module


def test_kvferry_joins_dynamos_table_with_its_handoff() -> None:
    table = _table()
    assert dynamo.register_with(table)
    cls = table.KV_CONNECTOR_PROTOCOLS["KVFerryConnector"]
    protocol = cls(vllm_config=None)
    assert protocol.prefill_request_kv_transfer_params() == {"do_remote_decode": True, "do_remote_prefill": False}
    assert protocol.decode_request_kv_transfer_params(types.SimpleNamespace(kv_transfer_params=KVFERRY)) == KVFERRY
    assert dynamo.register_with(table) and table.KV_CONNECTOR_PROTOCOLS["KVFerryConnector"] is cls   # once


def test_the_plugin_registers_only_where_dynamo_loaded_its_table(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delitem(sys.modules, dynamo.PROTOCOLS_MODULE, raising=False)
    dynamo.register()   # a plain vLLM process: nothing to do, nothing imported
    assert dynamo.PROTOCOLS_MODULE not in sys.modules
    table = _table()
    monkeypatch.setitem(sys.modules, dynamo.PROTOCOLS_MODULE, table)
    dynamo.register()
    assert "KVFerryConnector" in table.KV_CONNECTOR_PROTOCOLS
