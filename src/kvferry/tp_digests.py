"""Page digests for writes across tensor-parallel sizes: now part of ``kvferry.integrity``.

Kept so existing imports keep working: ``integrity.digest_plan`` takes a ``tp.TPPlan`` (slice digests,
keyed by buffer and destination page) and ``integrity.verify_digests`` takes the link's slices; the
hashing itself is ``page_hash.hash_slices``. New code should import from ``kvferry.integrity``.
"""

from __future__ import annotations

from .integrity import digest_plan as digest_tp_plan
from .integrity import verify_digests as verify_tp_digests
from .page_hash import hash_slices

__all__ = ["digest_tp_plan", "hash_slices", "verify_tp_digests"]
