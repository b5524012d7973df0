"""The SGLang plugin: makes ``--disaggregation-transfer-backend kvferry`` resolve to kvferry's classes.

Loaded by SGLang's ``load_plugins()`` from the entry point ``kvferry`` in group ``sglang.srt.plugins``
(enable with ``SGLANG_PLUGINS=kvferry``). SGLang's ``TransferBackend`` enum is closed and ``get_kv_class``
is an if/elif chain, so the plugin (1) adds ``kvferry`` to the server argument's choices, (2) replaces the
enum with an equal one plus ``KVFERRY`` (SGLang's hook registry rebinds every module that imported it,
so ``TransferBackend("nixl")`` keeps working everywhere) and (3) wraps ``get_kv_class``.
"""

from __future__ import annotations

import enum
from typing import Any

BACKEND = "kvferry"
_ENUM = "sglang.srt.disaggregation.utils.TransferBackend"
_GET_KV_CLASS = "sglang.srt.disaggregation.utils.get_kv_class"


def extended_transfer_backend(original: type[enum.Enum]) -> type[enum.Enum]:
    """SGLang's enum with ``KVFERRY = "kvferry"`` added (members keep their names and values)."""
    if BACKEND in {m.value for m in original}:
        return original
    members = {m.name: m.value for m in original}
    members["KVFERRY"] = BACKEND
    extended = enum.Enum(original.__name__, members)  # type: ignore[misc]
    extended.__module__ = original.__module__
    extended.__qualname__ = original.__qualname__
    return extended


def get_kv_class_around(original: Any, transfer_backend: Any, class_type: Any) -> Any:
    """``get_kv_class`` for ``kvferry``; every other backend goes to SGLang's own chain."""
    if getattr(transfer_backend, "value", transfer_backend) != BACKEND:
        return original(_as_original(transfer_backend), class_type)
    from sglang.srt.disaggregation.utils import KVClassType

    from kvferry.integrations.sglang import conn

    if class_type == KVClassType.KVARGS:  # every backend shares SGLang's KVArgs container
        return original(transfer_backend, class_type)
    return {KVClassType.MANAGER: conn.KVFerryKVManager, KVClassType.SENDER: conn.KVFerryKVSender,
            KVClassType.RECEIVER: conn.KVFerryKVReceiver,
            KVClassType.BOOTSTRAP_SERVER: conn.KVFerryKVBootstrapServer}.get(class_type)


def _as_original(backend: Any) -> Any:
    # get_kv_class compares against whatever TransferBackend its module holds now; pass a member of it.
    from sglang.srt.disaggregation import utils

    return utils.TransferBackend(getattr(backend, "value", backend))


def register() -> None:
    """The entry point SGLang calls: register the hooks (``load_plugins`` applies them)."""
    from sglang.srt.arg_groups.choices import DISAGG_TRANSFER_BACKEND_CHOICES
    from sglang.srt.disaggregation import utils
    from sglang.srt.plugins.hook_registry import HookRegistry, HookType

    if BACKEND not in DISAGG_TRANSFER_BACKEND_CHOICES:
        DISAGG_TRANSFER_BACKEND_CHOICES.append(BACKEND)
    HookRegistry.register(_ENUM, extended_transfer_backend(utils.TransferBackend), HookType.REPLACE)
    HookRegistry.register(_GET_KV_CLASS, get_kv_class_around, HookType.AROUND)
