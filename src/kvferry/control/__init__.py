"""The control plane: prefill and decode endpoints, their wire protocol, leases and request states.

Above ``transport`` and ``integrity``, beside ``diagnostics``; below ``workload`` and ``cli``. ``zmq`` is
imported here and nowhere lower.

Exported: ``PrefillEndpoint``, ``DecodeEndpoint``, ``RequestState``, ``EndpointOptions``,
``EndpointStats`` (what the endpoints' ``stats()`` return), ``PROTOCOL_VERSION``.
"""

from __future__ import annotations

from kvferry.control.core.states import RequestState
from kvferry.control.decode import DecodeEndpoint
from kvferry.control.endpoints import EndpointOptions
from kvferry.control.prefill import PrefillEndpoint
from kvferry.control.stats import EndpointStats
from kvferry.control.wire import PROTOCOL_VERSION

__all__ = ["PROTOCOL_VERSION", "DecodeEndpoint", "EndpointOptions", "EndpointStats", "PrefillEndpoint", "RequestState"]
