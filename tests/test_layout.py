from __future__ import annotations

import msgspec
import pytest

from kvferry import Buffer, Layout, LayoutError, Pool, shape_difference
from kvferry.layout import MANIFEST_VERSION


def _layout(idx_dtype: str = "bf16", idx_pages: int = 24, kv_pages: int = 40) -> Layout:
    return Layout([
        Pool("c4", [Buffer("kv", 64, kv_pages, "fp8", "kv", 0),
                    Buffer("idx", 256, idx_pages, idx_dtype, "index_k", 0)], tokens_per_page=256),
        Pool("state", [Buffer("mamba", 1000, 8, "fp32", "state", 0)]),
    ])


@pytest.mark.parametrize("kwargs, message", [
    (dict(name="b", page_bytes=0, num_pages=1), "page_bytes must be in 1.."),
    (dict(name="b", page_bytes=-4, num_pages=1), "page_bytes must be in 1.."),
    (dict(name="b", page_bytes=8, num_pages=0), "num_pages must be in 1.."),
    (dict(name="b", page_bytes=8.0, num_pages=1), "page_bytes must be an int, got float"),
    (dict(name="b", page_bytes=True, num_pages=1), "page_bytes must be an int, got bool"),
    (dict(name="", page_bytes=8, num_pages=1), "buffer name must be a non-empty string"),
    (dict(name="b", page_bytes=8, num_pages=1, dtype=""), "buffer 'b': dtype must be a non-empty string"),
    (dict(name="b", page_bytes=8, num_pages=1, layer=-1), "buffer 'b': layer must be None or an int >= 0"),
])
def test_buffer_rejects_bad_values(kwargs: dict, message: str) -> None:
    with pytest.raises(LayoutError, match=message):
        Buffer(**kwargs)


def test_pool_and_layout_reject_bad_structure() -> None:
    with pytest.raises(LayoutError, match="pool 'p' has no buffers"):
        Pool("p", [])
    with pytest.raises(LayoutError, match="pool 'p': tokens_per_page must be in 1"):
        Pool("p", [Buffer("a", 1, 1)], tokens_per_page=0)
    with pytest.raises(LayoutError, match="layout has no pools"):
        Layout([])
    with pytest.raises(LayoutError, match="duplicate pool name 'p'"):
        Layout([Pool("p", [Buffer("a", 1, 1)]), Pool("p", [Buffer("b", 1, 1)])])
    with pytest.raises(LayoutError, match="duplicate buffer name 'a' \\(in pool 'q'\\)"):
        Layout([Pool("p", [Buffer("a", 1, 1)]), Pool("q", [Buffer("a", 1, 1)])])


def test_buffers_keep_their_own_geometry() -> None:
    layout = _layout()
    assert [b.name for b in layout.buffers] == ["kv", "idx", "mamba"]
    assert layout.pool("c4").min_pages == 24
    assert not layout.pool("c4").uniform_pages
    assert layout.buffer("idx").num_pages == 24
    assert layout.pool_of["mamba"] == "state"
    with pytest.raises(LayoutError, match="no pool 'nope'"):
        layout.pool("nope")
    with pytest.raises(LayoutError, match="no buffer 'nope'"):
        layout.buffer("nope")


def test_manifest_round_trips_exactly() -> None:
    layout = _layout()
    data = layout.to_manifest()
    again = Layout.from_manifest(data)
    assert again == layout
    assert again.to_manifest() == data
    assert again.shape_fingerprint == layout.shape_fingerprint
    assert again.instance_fingerprint == layout.instance_fingerprint


def test_shape_fingerprint_ignores_capacity_but_not_dtype() -> None:
    base = _layout()
    assert _layout(idx_pages=5, kv_pages=7).shape_fingerprint == base.shape_fingerprint
    assert _layout(idx_pages=5).instance_fingerprint != base.instance_fingerprint
    fp8 = _layout(idx_dtype="fp8")
    assert fp8.shape_fingerprint != base.shape_fingerprint
    assert shape_difference(base, fp8) == (
        "pool 'c4', buffer 'idx': dtype differs: local 'bf16', remote 'fp8'")
    assert shape_difference(base, _layout(idx_pages=3)) is None


def test_shape_difference_names_pool_sets_and_page_sizes() -> None:
    a = _layout()
    b = Layout([a.pools[0]])
    assert shape_difference(a, b) == "pool set differs: local ['c4', 'state'], remote ['c4']"
    c = Layout([Pool("c4", [Buffer("kv", 64, 40, "fp8", "kv", 0),
                            Buffer("idx", 132, 24, "bf16", "index_k", 0)], 256), a.pools[1]])
    assert shape_difference(a, c) == "pool 'c4', buffer 'idx': page_bytes differs: local 256, remote 132"


def test_with_capacities() -> None:
    layout = _layout().with_capacities({"idx": 3})
    assert layout.buffer("idx").num_pages == 3
    assert layout.buffer("kv").num_pages == 40
    with pytest.raises(LayoutError, match="no buffers named \\['zz'\\]"):
        _layout().with_capacities({"zz": 1})


@pytest.mark.parametrize("data, message", [
    (b"", "malformed manifest"),
    (b"\xff\x00garbage", "malformed manifest"),
    (msgspec.msgpack.encode({"version": MANIFEST_VERSION + 1, "pools": []}), f"version {MANIFEST_VERSION + 1} is not"),
    (msgspec.msgpack.encode({"version": MANIFEST_VERSION, "pools": []}), "layout has no pools"),
    (msgspec.msgpack.encode({"version": MANIFEST_VERSION,
                             "pools": [["p", None, [["a", -1, 1, "u8", "kv", None]]]]}),
     "buffer 'a': page_bytes must be in"),
    (msgspec.msgpack.encode({"version": MANIFEST_VERSION, "pools": [["p", None, []]], "extra": 1}),
     "malformed manifest"),
])
def test_untrusted_manifest_is_validated(data: bytes, message: str) -> None:
    with pytest.raises(LayoutError, match=message):
        Layout.from_manifest(data)
