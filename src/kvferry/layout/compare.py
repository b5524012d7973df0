"""Comparing layouts: the first difference in shape, or in model across TP sizes, spelled out.

Part of the layout layer, above ``spec``. The handshake and both planners refuse mismatched layouts with
these messages, which name the pool, the buffer, the field and both values.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator

from kvferry.layout.spec import Buffer, Layout

__all__ = ["model_difference", "shape_difference", "tp_compatible"]


def shape_difference(local: Layout, remote: Layout) -> str | None:
    """The first difference in shape between two layouts, spelled out, or None when they match.

    The message names the pool, the buffer, the field, and both values, so an operator can see at once
    that, say, decode holds its indexer keys in bf16 while prefill sends fp8.
    """
    if local.tp_size != remote.tp_size:
        return (f"tp_size differs: local {local.tp_size}, remote {remote.tp_size} "
                "(plan across TP sizes with kvferry.plan.tp; model_difference says whether it can)")
    return _first_difference(local, remote, _shape_attrs)


def model_difference(local: Layout, remote: Layout) -> str | None:
    """Like ``shape_difference``, but for two layouts of one model at possibly different TP sizes.

    Sharded buffers must agree on total heads (``num_heads x tp_size``), head bytes, tokens per page and
    major; replicated buffers on their whole geometry and page size. A buffer without head geometry can
    only be moved between equal TP sizes (nothing says how to cut it).
    """
    return _first_difference(local, remote, lambda lb, rb: _model_attrs(lb, rb, local.tp_size, remote.tp_size))


def tp_compatible(a: Layout, b: Layout) -> bool:
    """True when ``kvferry.plan.tp`` can move KV between ``a`` and ``b`` (same model, any TP sizes)."""
    return model_difference(a, b) is None


def _shape_attrs(lb: Buffer, rb: Buffer) -> Iterator[tuple[str, object, object]]:
    for attr in ("name", "page_bytes", "dtype", "kind", "layer", "heads"):
        yield attr, getattr(lb, attr), getattr(rb, attr)


def _model_attrs(lb: Buffer, rb: Buffer, ltp: int, rtp: int) -> Iterator[tuple[str, object, object]]:
    for attr in ("name", "dtype", "kind", "layer"):
        yield attr, getattr(lb, attr), getattr(rb, attr)
    lh, rh = lb.heads, rb.heads
    if lh is None or rh is None:
        yield "head geometry", lh, rh
        # Nothing says how to cut such a buffer, so it can only go rank to rank.
        yield "tp_size (the buffer has no head geometry to cut it by)", ltp, rtp
        yield "page_bytes", lb.page_bytes, rb.page_bytes
        return
    for attr in ("replicated", "head_bytes", "tokens_per_page", "major"):
        yield attr, getattr(lh, attr), getattr(rh, attr)
    if lh.replicated:
        yield "num_heads (replicated)", lh.num_heads, rh.num_heads
    else:
        yield "total heads (num_heads x tp_size)", lh.num_heads * ltp, rh.num_heads * rtp


def _first_difference(local: Layout, remote: Layout, attrs: Callable[[Buffer, Buffer], Iterable[
        tuple[str, object, object]]]) -> str | None:
    local_pools = [p.name for p in local.pools]
    remote_pools = [p.name for p in remote.pools]
    if local_pools != remote_pools:
        return f"pool set differs: local {local_pools}, remote {remote_pools}"
    for lp, rp in zip(local.pools, remote.pools):
        for attr in ("tokens_per_page", "window_tokens"):
            if getattr(lp, attr) != getattr(rp, attr):
                return (f"pool {lp.name!r}: {attr} differs: local {getattr(lp, attr)}, "
                        f"remote {getattr(rp, attr)}")
        if len(lp.buffers) != len(rp.buffers):
            return (f"pool {lp.name!r}: buffer count differs: local {len(lp.buffers)}, remote {len(rp.buffers)}")
        for lb, rb in zip(lp.buffers, rp.buffers):
            for attr, lv, rv in attrs(lb, rb):
                if lv != rv:
                    return (f"pool {lp.name!r}, buffer {lb.name!r}: {attr} differs: "
                            f"local {lv!r}, remote {rv!r}")
    return None
