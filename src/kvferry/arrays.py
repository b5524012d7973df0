"""Two numpy helpers shared by the layers that build frozen plans and digests (at the bottom,
beside ``codec``, just above ``errors``)."""

from __future__ import annotations

import numpy as np

__all__ = ["cat_int", "readonly"]


def readonly(a: np.ndarray) -> np.ndarray:
    """Freeze ``a`` in place and return it: plans and bindings hand out arrays nobody may change."""
    a.setflags(write=False)  # what ``a.flags.writeable = False`` does, at two thirds of the cost
    return a


def cat_int(parts: list[np.ndarray]) -> np.ndarray:
    """Concatenate index arrays as int64; an empty list gives an empty int64 array."""
    return np.concatenate(parts).astype(np.int64) if parts else np.zeros(0, dtype=np.int64)
