import re
from pathlib import Path

import kvferry

# Pinned: the public surface later layers and outside callers rely on. Change it deliberately.
FOUNDATION = {
    "Buffer", "Pool", "Layout", "KVMemory", "Region", "TransferPlan", "Row", "plan_transfer",
    "shape_difference", "KVFerryError", "LayoutError", "PlanError", "HandshakeError", "IncompatiblePeer",
    "LeaseError", "TransportError", "TransferTimeout", "PeerLost", "RequestFailed", "IntegrityError",
    "HeadGeometry", "model_difference", "tp_compatible",
    "PrefillEndpoint", "DecodeEndpoint", "RequestState", "EndpointOptions", "PROTOCOL_VERSION",
    "UsageError", "EndpointClosed", "ProtocolError", "PageMismatchError",
}


def test_exported_names_are_pinned() -> None:
    assert set(kvferry.__all__) >= FOUNDATION
    for name in kvferry.__all__:
        assert hasattr(kvferry, name), name


def test_errors_form_one_hierarchy() -> None:
    import inspect

    from kvferry import errors

    for name in errors.__all__:  # every exception kvferry defines lives in kvferry.errors
        assert issubclass(getattr(errors, name), kvferry.KVFerryError), name
    for path in (Path(kvferry.__file__).parent).rglob("*.py"):
        module_text = path.read_text()
        assert path.name == "errors.py" or not re.search(r"^class \w+\((\w+Error|KVFerryError|Exception)\b",
                                                         module_text, re.M), f"{path}: an exception outside errors.py"
    assert inspect.getdoc(errors).count("├──") + inspect.getdoc(errors).count("└──") >= len(errors.__all__) - 1
    assert issubclass(kvferry.IncompatiblePeer, kvferry.HandshakeError)
    assert issubclass(kvferry.TransferTimeout, kvferry.TransportError)
    assert issubclass(kvferry.PeerLost, kvferry.TransportError)


def test_import_stays_light() -> None:
    """The planner and CLI must not pay for zmq, nixl, torch or vLLM at import time."""
    import subprocess
    import sys

    code = "import sys, kvferry; print(sorted(m for m in ('zmq', 'nixl', 'torch', 'vllm') if m in sys.modules))"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "[]"
