"""Chunk digests as the control plane carries them: prefill makes them, decode checks them.

Part of the control plane, above ``integrity``. Prefill hashes a chunk's source pages on the caller's thread
(``source_digests``), keys them by decode's pages when the chunk is posted (``chunk_digests``, else it
hashes the plan itself), and ships the bytes in the chunk's notification; decode checks them against
its own pages (``verify_chunk``). Digest bytes from the wire are untrusted: any failure to read them is
an ``IntegrityError``, never an exception on the progress thread.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import numpy as np

from kvferry.control import wire
from kvferry.control.core.links import Link
from kvferry.errors import IntegrityError, KVFerryError, PageMismatchError
from kvferry.integrity import DigestMode, PageDigests, digest_pages, digest_plan, verify_digests
from kvferry.integrity.sampling import PageSampler
from kvferry.layout.memory import KVMemory
from kvferry.plan.contract import Plan

__all__ = ["chunk_digests", "source_digests", "verify_chunk"]


def source_digests(memory: KVMemory, mode: DigestMode, src: Mapping[str, np.ndarray], buffers: tuple[str, ...] | None,
                   sampler: PageSampler) -> Any:
    """A chunk's source digests in ``mode`` (None when off); keyed at posting time.

    Sampling draws from one endpoint ``PageSampler`` (thread-safe, so callers on several threads are
    safe): a fresh choice per chunk, drawn in blocks for chunks of one shape."""
    if mode == "off":
        return None
    return digest_pages(memory, src, mode, seed=sampler, buffers=buffers)


def chunk_digests(mode: DigestMode, src: Any, pairs: Mapping[str, tuple[np.ndarray, np.ndarray]],
                  plan: Plan, generation: int, index: int) -> bytes:
    """Digest bytes for a chunk's notification in the session's ``mode``: ``src`` (``source_digests``)
    keyed by decode's pages when they fit (whole pages, that mode), else hashed here from the plan."""
    if src is None or mode == "off" or not plan.whole_pages or src.mode.value != mode:
        return _plan_digests(mode, plan, generation, index)
    return bytes(src.keyed({pool: dst for pool, (_, dst) in pairs.items()}).to_bytes())


def _plan_digests(mode: DigestMode, plan: Plan, generation: int, index: int) -> bytes:
    if mode == "off":
        return b""
    seed = (generation << 16) ^ index
    # A TPPlan gets slice digests: across TP a decode page is written by several prefill ranks.
    return bytes(digest_plan(plan, mode, seed=seed).to_bytes())


def verify_chunk(memory: KVMemory, mode: DigestMode, link: Link, msg: wire.Chunk,
                 stats: Any) -> KVFerryError | None:
    """Decode side: why the chunk's landed bytes do not match its digests (an ``IntegrityError``), or None.
    A chunk without digests passes only when this side's ``mode`` is off. ``stats`` counts the page
    digests that matched, or those that did not (by pool and buffer kind)."""
    if not msg.digests:
        if mode == "off":
            return None
        return IntegrityError(f"chunk {msg.chunk} from prefill {link.address} carried no digests; this "
                              f"decode requires {mode!r}")
    try:
        digests = PageDigests.from_bytes(msg.digests)
        # Across TP the digests cover only the slices this prefill rank writes here (link.slices).
        verify_digests(memory, digests, link.slices)
    except PageMismatchError as exc:
        stats.digest_failed(exc.mismatches)
        return exc
    except KVFerryError as exc:
        return exc if isinstance(exc, IntegrityError) else IntegrityError(str(exc))
    except Exception as exc:  # untrusted digest bytes must not kill the progress thread
        return IntegrityError(f"malformed digests from prefill {link.address}: {exc!r}")
    stats.verified(len(digests))
    return None
