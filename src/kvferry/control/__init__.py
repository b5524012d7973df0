"""The control plane: prefill and decode endpoints, their wire protocol, leases and request states.

Layer 5 of kvferry (above ``transport`` and ``integrity``). ``zmq`` is imported here and nowhere lower.

Exported: ``PrefillEndpoint``, ``DecodeEndpoint``, ``RequestState``, ``EndpointOptions``,
``PROTOCOL_VERSION``.
"""

from __future__ import annotations

from .decode import DecodeEndpoint
from .endpoints import EndpointOptions
from .prefill import PrefillEndpoint
from .states import RequestState
from .wire import PROTOCOL_VERSION

__all__ = ["PROTOCOL_VERSION", "DecodeEndpoint", "EndpointOptions", "PrefillEndpoint", "RequestState"]
