"""kvferry: move paged, heterogeneous KV cache from a prefill worker to a decode worker.

Every buffer owns its geometry and its index space; the planner validates before it plans; transports
move bytes; the control plane leases pages and fails closed; digests prove what arrived.
"""

from kvferry.errors import (
    BindingMismatch,
    EndpointClosed,
    HandshakeError,
    IncompatiblePeer,
    IntegrityError,
    KVFerryError,
    LayoutError,
    LeaseError,
    ModeMismatch,
    PageMismatchError,
    PeerLost,
    PlanError,
    ProtocolError,
    RequestAborted,
    RequestFailed,
    TransferTimeout,
    TransportError,
    UnknownRequest,
    UsageError,
)
from kvferry.integrity.binding import Binding, token_binding
from kvferry.layout import (
    Buffer,
    HeadGeometry,
    KVMemory,
    Layout,
    Pool,
    Region,
    model_difference,
    shape_difference,
    tp_compatible,
)
from kvferry.plan import Row, TransferPlan, plan_transfer
from kvferry.version import __version__

# The endpoints import zmq; resolve them on first use so ``import kvferry`` (planner, CLI) stays light.
_LAZY = {"PrefillEndpoint": "control", "DecodeEndpoint": "control", "RequestState": "control",
         "EndpointOptions": "control", "PROTOCOL_VERSION": "control", "EndpointStats": "control"}


def __getattr__(name: str) -> object:
    if name in _LAZY:
        import importlib

        return getattr(importlib.import_module(f"kvferry.{_LAZY[name]}"), name)
    raise AttributeError(f"module 'kvferry' has no attribute {name!r}")

__all__ = [
    "PROTOCOL_VERSION",
    "Binding",
    "BindingMismatch",
    "Buffer",
    "DecodeEndpoint",
    "EndpointClosed",
    "EndpointOptions",
    "EndpointStats",
    "HandshakeError",
    "HeadGeometry",
    "IncompatiblePeer",
    "IntegrityError",
    "KVFerryError",
    "KVMemory",
    "Layout",
    "LayoutError",
    "LeaseError",
    "ModeMismatch",
    "PageMismatchError",
    "PeerLost",
    "PlanError",
    "Pool",
    "PrefillEndpoint",
    "ProtocolError",
    "Region",
    "RequestAborted",
    "RequestFailed",
    "RequestState",
    "Row",
    "TransferPlan",
    "TransferTimeout",
    "TransportError",
    "UnknownRequest",
    "UsageError",
    "__version__",
    "model_difference",
    "plan_transfer",
    "shape_difference",
    "token_binding",
    "tp_compatible",
]
