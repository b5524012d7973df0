import kvferry

# Pinned: the public surface later layers and outside callers rely on. Change it deliberately.
FOUNDATION = {
    "Buffer", "Pool", "Layout", "KVMemory", "Region", "TransferPlan", "Row", "plan_transfer",
    "shape_difference", "KVFerryError", "LayoutError", "PlanError", "HandshakeError", "IncompatiblePeer",
    "LeaseError", "TransportError", "TransferTimeout", "PeerLost", "RequestFailed", "IntegrityError",
    "HeadGeometry", "model_difference", "tp_compatible",
    "PrefillEndpoint", "DecodeEndpoint", "RequestState", "EndpointOptions", "PROTOCOL_VERSION",
}


def test_exported_names_are_pinned() -> None:
    assert set(kvferry.__all__) >= FOUNDATION
    for name in kvferry.__all__:
        assert hasattr(kvferry, name), name


def test_errors_form_one_hierarchy() -> None:
    for name in ("LayoutError", "PlanError", "HandshakeError", "IncompatiblePeer", "LeaseError",
                 "TransportError", "TransferTimeout", "PeerLost", "RequestFailed", "IntegrityError"):
        assert issubclass(getattr(kvferry, name), kvferry.KVFerryError), name
    assert issubclass(kvferry.IncompatiblePeer, kvferry.HandshakeError)
    assert issubclass(kvferry.TransferTimeout, kvferry.TransportError)
    assert issubclass(kvferry.PeerLost, kvferry.TransportError)


def test_import_stays_light() -> None:
    """The planner and CLI must not pay for zmq, nixl or torch at import time."""
    import subprocess
    import sys

    code = "import sys, kvferry; print(sorted(m for m in ('zmq', 'nixl', 'torch') if m in sys.modules))"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "[]"
