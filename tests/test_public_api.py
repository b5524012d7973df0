import kvferry

# Pinned: the public surface later layers and outside callers rely on. Change it deliberately.
FOUNDATION = {
    "Buffer", "Pool", "Layout", "KVMemory", "Region", "TransferPlan", "Row", "plan_transfer",
    "shape_difference", "KVFerryError", "LayoutError", "PlanError", "HandshakeError", "IncompatiblePeer",
    "LeaseError", "TransportError", "TransferTimeout", "PeerLost", "RequestFailed", "IntegrityError",
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
