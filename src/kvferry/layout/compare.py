"""Comparing layouts: the first difference in shape, or in model across TP sizes, spelled out.

Part of the layout layer, above ``spec``. The handshake and both planners refuse mismatched layouts with
these messages, which name the pool, the buffer, the field and both values.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator

from kvferry.layout.spec import Buffer, Layout, Pool

__all__ = ["model_difference", "shape_difference", "tp_compatible", "translation_difference"]


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
    for attr in ("name", "page_bytes", "dtype", "kind", "layer", "heads", "state"):
        yield attr, getattr(lb, attr), getattr(rb, attr)


def _named_attrs(lb: Buffer, rb: Buffer) -> Iterator[tuple[str, object, object]]:
    """What must match whatever the geometry: across TP sizes, and for a buffer whose page size is translated
    (its geometry then checked by ``_translatable``)."""
    for attr in ("name", "dtype", "kind", "layer"):
        yield attr, getattr(lb, attr), getattr(rb, attr)


def _model_attrs(lb: Buffer, rb: Buffer, ltp: int, rtp: int) -> Iterator[tuple[str, object, object]]:
    yield from _named_attrs(lb, rb)
    if lb.state is not None or rb.state is not None:
        yield from _state_attrs(lb, rb, ltp, rtp)
        return
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


def _state_attrs(lb: Buffer, rb: Buffer, ltp: int, rtp: int) -> Iterator[tuple[str, object, object]]:
    """A state buffer's sections across TP sizes: equal in number, and each of equal rows, bytes per channel and
    model-wide channels. A section replicated on one side and sharded over several ranks on the other is
    refused: a decode rank would need every prefill rank's channels, and it reaches only those overlapping
    it. Offsets, strides and padding are each rank's own."""
    ls, rs = lb.state, rb.state
    if ls is None or rs is None:
        yield "state geometry", ls, rs
        return
    yield "state sections (count)", len(ls.sections), len(rs.sections)
    for i, (a, b) in enumerate(zip(ls.sections, rs.sections)):
        yield f"state section {i}: repeats (rows)", a.repeats, b.repeats
        yield f"state section {i}: channel_bytes", a.channel_bytes, b.channel_bytes
        yield (f"state section {i}: model channels (channels x tp_size when sharded)", a.total_channels(ltp),
               b.total_channels(rtp))
        if a.sharded != b.sharded and (ltp if a.sharded else rtp) > 1:
            yield f"state section {i}: sharded (over more than one rank on one side only)", a.sharded, b.sharded


def _first_difference(local: Layout, remote: Layout, attrs: Callable[[Buffer, Buffer], Iterable[
        tuple[str, object, object]]], translate: Callable[[Pool, Pool], Iterable[tuple[str, object, object]]]
        | None = None) -> str | None:
    """``translate``: when given, a pool's tokens per page may differ if it yields no difference, and then its
    buffers are compared by ``attrs`` with their page sizes and head geometries' tokens per page left out."""
    local_pools = [p.name for p in local.pools]
    remote_pools = [p.name for p in remote.pools]
    if local_pools != remote_pools:
        return f"pool set differs: local {local_pools}, remote {remote_pools}"
    for lp, rp in zip(local.pools, remote.pools):
        if len(lp.buffers) != len(rp.buffers):
            return (f"pool {lp.name!r}: buffer count differs: local {len(lp.buffers)}, remote {len(rp.buffers)}")
        translated = translate is not None and lp.tokens_per_page != rp.tokens_per_page
        for what, lv, rv in translate(lp, rp) if translated else ():   # type: ignore[misc]
            return f"pool {lp.name!r}: {what} cannot be translated: local {lv}, remote {rv}"
        if lp.aliases != rp.aliases:   # which page space a pool shares decides what its pages may hold
            return f"pool {lp.name!r}: aliases differs: local {lp.aliases}, remote {rp.aliases}"
        for attr in ("tokens_per_page", "window_tokens")[translated:]:
            if getattr(lp, attr) != getattr(rp, attr):
                return (f"pool {lp.name!r}: {attr} differs: local {getattr(lp, attr)}, "
                        f"remote {getattr(rp, attr)}")
        for lb, rb in zip(lp.buffers, rp.buffers):
            for attr, lv, rv in attrs(lb, rb) if not translated else _named_attrs(lb, rb):
                if lv != rv:
                    return (f"pool {lp.name!r}, buffer {lb.name!r}: {attr} differs: "
                            f"local {lv!r}, remote {rv!r}")
    return None


def translation_difference(local: Layout, remote: Layout) -> str | None:
    """Like ``shape_difference``, but a pool's ``tokens_per_page`` may differ between the two sides when
    every buffer of that pool says where a token lies in its page (``kvferry.plan.tokens`` then maps token
    ranges between the two page sizes). None when the layouts can be translated; otherwise the first
    difference, naming the pool, the buffer, both values and why.

    What must match: pools, buffer names, dtypes, kinds, layers and TP size; for a pool with equal page
    sizes the whole buffer shape, but for a state buffer's page bytes where its state sections are equal
    (a padded state page: only the sections move); for a pool whose page sizes differ, each buffer's head
    geometry but for its tokens per page (heads, bytes per head, token- or head-major, the parts of a head's
    block, which must be declared) and the tokens each entry of a page stands for (one, or four or 128 for a
    compressed pool), so that bytes per token are equal and lie alike.
    """
    if local.tp_size != remote.tp_size:
        return (f"tp_size differs: local {local.tp_size}, remote {remote.tp_size} (page sizes are translated "
                "between equal TP sizes only)")
    return _first_difference(local, remote, _padded_state_attrs, _translatable)


def _padded_state_attrs(lb: Buffer, rb: Buffer) -> Iterator[tuple[str, object, object]]:
    """``_shape_attrs``, but a state buffer's page may differ in padding alone (vLLM pads a Mamba page to
    its attention page, which the block size sets): its sections, offsets included, must then be equal, and
    only they move (``plan.tokens``). A state without sections says nothing of where its bytes end."""
    if lb.page_bytes == rb.page_bytes or lb.state is None or rb.state is None:
        yield from _shape_attrs(lb, rb)
        return
    for attr in ("name", "dtype", "kind", "layer", "heads"):
        yield attr, getattr(lb, attr), getattr(rb, attr)
    yield (f"state sections (the state pages differ in padding, {lb.page_bytes} and {rb.page_bytes} bytes: "
           "only equal sections can move between them)", lb.state, rb.state)


def _translatable(lp: Pool, rp: Pool) -> Iterator[tuple[str, object, object]]:
    """The differences that make a pool's differing page sizes untranslatable (empty when they can be)."""
    if lp.tokens_per_page is None or rp.tokens_per_page is None:
        yield "tokens_per_page (a state pool has none to translate)", lp.tokens_per_page, rp.tokens_per_page
        return
    for lb, rb in zip(lp.buffers, rp.buffers):
        lh, rh = lb.heads, rb.heads
        if lh is None or rh is None:
            yield (f"tokens_per_page (buffer {lb.name!r} has no head geometry: nothing says where a token "
                   "lies in its page)", lp.tokens_per_page, rp.tokens_per_page)
            return
        for attr in ("num_heads", "head_bytes", "major", "replicated", "parts"):
            if getattr(lh, attr) != getattr(rh, attr):
                yield f"buffer {lb.name!r}: {attr} (tokens per page differ, each token's bytes must not)", \
                    getattr(lh, attr), getattr(rh, attr)
                return
        if lh.parts is None:
            yield (f"tokens_per_page (buffer {lb.name!r}: its kernel's order of a token's bytes inside a head is "
                   "not declared, head geometry parts None)", lp.tokens_per_page, rp.tokens_per_page)
            return
        lc, rc = divmod(lp.tokens_per_page, lh.tokens_per_page), divmod(rp.tokens_per_page, rh.tokens_per_page)
        if lc[1] or rc[1] or lc[0] != rc[0]:
            yield (f"buffer {lb.name!r}: tokens per entry (pool tokens_per_page / the buffer's entries per page; "
                   "compression must be whole and equal)", f"{lp.tokens_per_page}/{lh.tokens_per_page}",
                   f"{rp.tokens_per_page}/{rh.tokens_per_page}")
            return
