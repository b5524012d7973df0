"""The integrity layer: page digests made on prefill, checked on decode, mismatches named.

Above ``plan`` (and beside ``transport``: neither imports the other); below ``control`` and
``diagnostics``. Inside: ``hashing`` (xxh3 of pages and head slices, host memory read in place) under
``digests`` (which pages, the wire form, verification).
"""

from kvferry.integrity.digests import (
    DIGESTS_VERSION,
    DigestMode,
    PageDigests,
    PageMismatch,
    SourceDigests,
    digest_pages,
    digest_plan,
    verify_digests,
)
from kvferry.integrity.hashing import hash_pages

__all__ = ["DIGESTS_VERSION", "DigestMode", "PageDigests", "PageMismatch", "SourceDigests", "digest_pages",
           "digest_plan", "hash_pages", "verify_digests"]
