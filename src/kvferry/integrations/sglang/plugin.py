"""The SGLang plugin: makes ``--disaggregation-transfer-backend kvferry`` resolve to kvferry's classes.

Loaded by SGLang's ``load_plugins()`` from the entry point ``kvferry`` in group ``sglang.srt.plugins``
(enable with ``SGLANG_PLUGINS=kvferry``). SGLang's ``TransferBackend`` enum is closed and ``get_kv_class``
is an if/elif chain, so the plugin (1) adds ``kvferry`` to the server argument's choices, (2) replaces the
enum with an equal one plus ``KVFERRY`` (SGLang's hook registry rebinds every module that imported it,
so ``TransferBackend("nixl")`` keeps working everywhere), (3) wraps ``get_kv_class`` and (4) wraps the two
places SGLang creates a request's sender and receiver, to bind each kvferry transfer to the request's input
ids (``bind_tokens``): SGLang hands the transfer classes a bootstrap room, never the request.
"""

from __future__ import annotations

import enum
from typing import Any

BACKEND = "kvferry"
_ENUM = "sglang.srt.disaggregation.utils.TransferBackend"
_GET_KV_CLASS = "sglang.srt.disaggregation.utils.get_kv_class"
_CREATE_SENDER = "sglang.srt.disaggregation.prefill.PrefillBootstrapQueue.create_sender"
_CREATE_RECEIVER = "sglang.srt.disaggregation.decode.DecodePreallocQueue._create_receiver_and_enqueue"


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


def create_sender_around(original: Any, queue: Any, req: Any, *args: Any, **kwargs: Any) -> Any:
    """SGLang's ``create_sender``, then the sender bound to the request's input ids (kvferry's only)."""
    created = original(queue, req, *args, **kwargs)
    _bind(getattr(req, "disagg_kv_sender", None), req)
    return created


def create_receiver_around(original: Any, queue: Any, req: Any, *args: Any, **kwargs: Any) -> Any:
    """SGLang's ``_create_receiver_and_enqueue``, then the receiver bound to the request's input ids."""
    decode_req = original(queue, req, *args, **kwargs)
    _bind(getattr(decode_req, "kv_receiver", None), req)
    return decode_req


def _bind(transfer: Any, req: Any) -> None:
    bind = getattr(transfer, "bind_tokens", None)   # kvferry's sender or receiver; other backends have none
    if bind is not None:
        bind(req.origin_input_ids, str(getattr(req, "rid", "")))


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
    HookRegistry.register(_CREATE_SENDER, create_sender_around, HookType.AROUND)
    HookRegistry.register(_CREATE_RECEIVER, create_receiver_around, HookType.AROUND)
