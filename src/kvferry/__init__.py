"""kvferry: move paged, heterogeneous KV cache from a prefill worker to a decode worker.

Every buffer owns its geometry and its index space; the planner validates before it plans; transports
move bytes; the control plane leases pages and fails closed; digests prove what arrived.
"""

from .errors import (
    HandshakeError,
    IncompatiblePeer,
    IntegrityError,
    KVFerryError,
    LayoutError,
    LeaseError,
    PeerLost,
    PlanError,
    RequestFailed,
    TransferTimeout,
    TransportError,
)
from .layout import Buffer, HeadGeometry, Layout, Pool, model_difference, shape_difference, tp_compatible
from .memory import KVMemory, Region
from .plan import Row, TransferPlan, plan_transfer

__version__ = "0.1.0"

# The endpoints import zmq; resolve them on first use so ``import kvferry`` (planner, CLI) stays light.
_LAZY = {"PrefillEndpoint": "control", "DecodeEndpoint": "control", "RequestState": "control",
         "EndpointOptions": "control", "PROTOCOL_VERSION": "control"}


def __getattr__(name: str) -> object:
    if name in _LAZY:
        import importlib

        return getattr(importlib.import_module(f".{_LAZY[name]}", __name__), name)
    raise AttributeError(f"module 'kvferry' has no attribute {name!r}")

__all__ = [
    "PROTOCOL_VERSION",
    "Buffer",
    "DecodeEndpoint",
    "EndpointOptions",
    "HandshakeError",
    "HeadGeometry",
    "IncompatiblePeer",
    "IntegrityError",
    "KVFerryError",
    "KVMemory",
    "Layout",
    "LayoutError",
    "LeaseError",
    "PeerLost",
    "PlanError",
    "Pool",
    "PrefillEndpoint",
    "Region",
    "RequestFailed",
    "RequestState",
    "Row",
    "TransferPlan",
    "TransferTimeout",
    "TransportError",
    "__version__",
    "model_difference",
    "plan_transfer",
    "shape_difference",
    "tp_compatible",
]
