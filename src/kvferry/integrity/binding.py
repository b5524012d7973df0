"""Token bindings: which tokens a request's KV was computed from, stated by both sides and compared.

Part of the integrity layer (pure: no sockets, no clocks, no memory). Page digests prove the bytes decode
received are the bytes prefill sent; they cannot tell that prefill sent another request's pages. A router
that hands request A's transfer parameters to request B (a retry reusing parameters, two responses mixed
up, a replay) gets B answered from A's context, with every digest correct. Under causal attention the KV of
a page depends on every token up to the page's end, so a transfer is bound to the tokens under it: each
side states a ``Binding`` (one opaque entry per block of the request, in token order), and prefill refuses
a hand-off whose two bindings differ before any byte moves (``control.prefill``), naming both sides'
request ids and the first block that differs (``mismatch``).

kvferry treats the entries as opaque bytes: any engine can bind with what it has (vLLM's per-block prefix
hashes, a hash of the input ids). ``token_binding`` is the helper both integrations use: entry ``j`` is a
chained xxh3-128 of the token ids of blocks ``0..j``, so it covers every token the block's KV depends on.
Every entry both sides stated is compared (the counts must be equal): with chained entries, a decode
prefix hit or a chunked send changes nothing, and a difference anywhere before a moved page shows in it.

A side that states no binding is not checked (the hand-off works as before, unprotected: docs/integration.md).
"""

from __future__ import annotations

import sys
from array import array
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import xxhash

from kvferry.errors import BindingMismatch, UsageError

__all__ = ["MAX_BINDING_BLOCKS", "MAX_ENTRY_BYTES", "Binding", "as_binding", "check_binding", "mismatch",
           "token_binding"]

MAX_BINDING_BLOCKS = 1 << 20   # a million blocks: far above any prompt, far below what exhausts memory
MAX_ENTRY_BYTES = 64           # room for a SHA-512; token_binding's entries are 16 bytes
MAX_LABEL_LEN = 256
_SEED = b"kvferry-binding/1\0"


@dataclass(frozen=True, slots=True)
class Binding:
    """What one side says a request's KV is computed from. ``blocks``: one opaque entry per block of the
    request in token order (equal entries mean equal tokens up to that block's end); ``label``: this side's
    own name for the request (the engine's request id), so that a refusal names both sides' requests."""

    blocks: tuple[bytes, ...]
    label: str = ""

    def __post_init__(self) -> None:
        if len(self.blocks) > MAX_BINDING_BLOCKS:
            raise UsageError(f"a binding of {len(self.blocks)} blocks: at most {MAX_BINDING_BLOCKS}")
        for j, entry in enumerate(self.blocks):
            if not isinstance(entry, bytes) or not 0 < len(entry) <= MAX_ENTRY_BYTES:
                raise UsageError(f"binding block {j}: an entry must be 1 to {MAX_ENTRY_BYTES} bytes, got "
                                 f"{type(entry).__name__} of {len(entry) if isinstance(entry, bytes) else '?'}")
        if len(self.label) > MAX_LABEL_LEN:
            raise UsageError(f"a binding label of {len(self.label)} characters: at most {MAX_LABEL_LEN}")


def as_binding(value: Any) -> Binding | None:
    """A caller's binding argument: None, a ``Binding``, or a sequence of per-block entries (no label)."""
    if value is None or isinstance(value, Binding):
        return value
    if isinstance(value, (bytes, str)) or not isinstance(value, Sequence):
        raise UsageError(f"a binding is a Binding or a sequence of per-block bytes, got {type(value).__name__}")
    return Binding(tuple(value))


def token_binding(token_ids: Any, block_tokens: int, label: str = "") -> Binding:
    """The binding of a request whose tokens are ``token_ids``, in blocks of ``block_tokens`` (the last block
    may be partial): entry ``j`` is xxh3-128 of entry ``j-1`` and block ``j``'s token ids (int64)."""
    if isinstance(block_tokens, bool) or not isinstance(block_tokens, int) or block_tokens < 1:
        raise UsageError(f"block_tokens must be an int >= 1, got {block_tokens!r}")
    raw = _token_bytes(token_ids)
    step = block_tokens * 8
    blocks: list[bytes] = []
    prev = _SEED
    for start in range(0, len(raw), step):
        prev = xxhash.xxh3_128_digest(prev + raw[start:start + step])
        blocks.append(prev)
    return Binding(tuple(blocks), label)


def _token_bytes(token_ids: Any) -> bytes:
    """Token ids as little-endian int64 bytes. Engines keep them as Python lists (vLLM's
    ``prompt_token_ids``, SGLang's ``origin_input_ids``): ``array`` reads those about half again as fast as
    numpy does, and reading the ints is most of a binding's cost."""
    try:
        if isinstance(token_ids, list) and sys.byteorder == "little":
            return array("q", token_ids).tobytes()
        return np.ascontiguousarray(np.asarray(token_ids, dtype="<i8").reshape(-1)).tobytes()
    except (TypeError, ValueError, OverflowError) as exc:
        raise UsageError(f"token ids must be integers that fit int64: {exc}") from exc


def mismatch(decode: Binding | None, prefill: Binding | None) -> tuple[int, str] | None:
    """Where two bindings of one transfer first differ, as (block, what), or None when they agree or
    either side stated none (nothing to compare: unbound)."""
    if decode is None or prefill is None:
        return None
    for j, (ours, theirs) in enumerate(zip(decode.blocks, prefill.blocks, strict=False)):
        if ours != theirs:
            return j, f"block {j} differs (decode {ours.hex()[:16]}, prefill {theirs.hex()[:16]})"
    if len(decode.blocks) != len(prefill.blocks):
        j = min(len(decode.blocks), len(prefill.blocks))
        return j, (f"block {j} is stated by one side only (decode states {len(decode.blocks)} blocks, "
                   f"prefill {len(prefill.blocks)})")
    return None


def check_binding(request_id: str, decode: Binding | None, prefill: Binding | None) -> BindingMismatch | None:
    """The refusal of a transfer whose bindings differ (``mismatch``), naming the transfer, both sides'
    requests and the first differing block; None when they agree or one side is unbound."""
    found = mismatch(decode, prefill)
    if found is None or decode is None or prefill is None:
        return None
    return BindingMismatch(
        f"transfer {request_id!r}: decode's request {decode.label or request_id!r} is bound to other tokens than "
        f"prefill's request {prefill.label or request_id!r} computed its KV from: {found[1]}; refused before any "
        "byte moved (decode would have answered from another prompt's context)")
