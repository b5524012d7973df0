"""Diagnostics: byte diff classification, indexer top-k Jaccard, plan dumps, rendering and `kvferry diff`."""

from __future__ import annotations

import argparse
import json

import numpy as np
import pytest
from rich.console import Console

from kvferry import Buffer, KVMemory, Layout, Pool, plan_transfer
from kvferry.cli import diff as diagnose_cmd
from kvferry.diagnostics.diff import decode_index_keys, diff_pages, fp8_e4m3_table, indexer_topk_jaccard, plan_dump
from kvferry.diagnostics.faults import buffer0_slot_count_descs
from kvferry.diagnostics.render import diff_summary_table, diff_table, jaccard_table, plan_table

from .conftest import fill_random, memmove_plan

PAGES = {"c4": ([0, 1, 2, 3, 8, 9], [10, 11, 12, 13, 2, 3]), "c128": ([0, 1], [5, 6])}


def layout(index_bytes: int = 256) -> Layout:
    return Layout([
        Pool("c4", [Buffer("c4.kv.L0", 64 * 64, 20, "fp8_e4m3", "kv", 0),
                    Buffer("c4.idx.L0", 64 * index_bytes, 14, "bf16" if index_bytes == 256 else "fp8_e4m3",
                           "index_k", 0),
                    Buffer("c4.idx.L1", 64 * index_bytes, 14, "bf16" if index_bytes == 256 else "fp8_e4m3",
                           "index_k", 1)], 256),
        Pool("c128", [Buffer("c128.kv.L1", 4096, 8, "fp8_e4m3", "kv", 1)], 256),
    ])


@pytest.fixture
def moved() -> tuple[KVMemory, KVMemory]:
    src, dst = KVMemory.allocate(layout()), KVMemory.allocate(layout())
    fill_random(src, 4)
    memmove_plan(plan_transfer(src, dst, PAGES))
    return src, dst


def test_clean_copy_has_no_diffs(moved) -> None:
    src, dst = moved
    np.testing.assert_array_equal(dst.array("c4.idx.L1")[[10, 11, 12, 13, 2, 3]], src.array("c4.idx.L1")[:4].tolist()
                                  + src.array("c4.idx.L1")[8:10].tolist())
    report = diff_pages(src, dst, PAGES)
    assert report.clean and report.pages_compared == 6 * 3 + 2 and report.by_buffer() == {}


def test_diff_classifies_zeros_misplaced_and_partial(moved) -> None:
    src, dst = moved
    dst.array("c4.kv.L0")[11] = 0                                  # never written
    dst.array("c4.idx.L0")[12] = src.array("c4.idx.L0")[9]         # src page 9 belongs at dst page 3
    dst.array("c4.idx.L1")[2] = src.array("c4.idx.L0")[0]         # a page of another buffer
    dst.array("c128.kv.L1")[6, 100:103] ^= 0xFF                    # three bytes flipped
    report = diff_pages(src, dst, PAGES)
    got = {(d.buffer, d.dst_page): d for d in report.diffs}
    assert set(got) == {("c4.kv.L0", 11), ("c4.idx.L0", 12), ("c4.idx.L1", 2), ("c128.kv.L1", 6)}
    assert got["c4.kv.L0", 11].kind == "zeros"
    mis = got["c4.idx.L0", 12]
    assert (mis.kind, mis.found_buffer, mis.found_src_page, mis.found_dst_page) == ("misplaced", "c4.idx.L0", 9, 3)
    other = got["c4.idx.L1", 2]
    assert (other.kind, other.found_buffer, other.found_src_page, other.found_dst_page) == (
        "misplaced", "c4.idx.L0", 0, 10)
    part = got["c128.kv.L1", 6]
    assert (part.kind, part.first_byte, part.last_byte, part.num_bytes, part.layer) == ("partial", 100, 102, 3, 1)
    assert report.by_buffer()["c4.idx.L0"] == {"zeros": 0, "misplaced": 1, "partial": 0}
    assert json.loads(json.dumps(report.to_dict()))["pages_differing"] == 4


def test_diff_restricted_to_buffers(moved) -> None:
    src, dst = moved
    dst.array("c4.kv.L0")[11] = 0
    assert diff_pages(src, dst, PAGES, buffers=["c4.idx.L0"]).clean
    assert not diff_pages(src, dst, PAGES, buffers=["c4.kv.L0"]).clean


def test_fp8_table_matches_e4m3fn() -> None:
    t = fp8_e4m3_table()
    assert (t[0x38], t[0x40], t[0xB8], t[0x01], t[0x08], t[0x7E]) == (1.0, 2.0, -1.0, 2.0**-9, 2.0**-6, 448.0)
    assert np.isnan(t[0x7F]) and np.isnan(t[0xFF]) and t[0x80] == 0.0


def test_decode_index_keys_bf16_and_fp8() -> None:
    keys = np.arange(2 * 128, dtype=np.float32).reshape(2, 128) / 7
    bf16 = (keys.view(np.uint32) >> 16).astype(np.uint16)  # truncation: exact in bf16 up to rounding
    page = bf16.view(np.uint8).reshape(1, -1)
    np.testing.assert_allclose(decode_index_keys(page, "bf16"), keys, rtol=1 / 128)
    fp8 = np.zeros((1, 2 * 132), dtype=np.uint8)
    fp8[0, :128] = 0x38               # token 0: all 1.0
    fp8[0, 128:256] = 0x40            # token 1: all 2.0
    fp8[0, 256:264] = np.array([0.5, 3.0], "<f4").view(np.uint8)  # per-token scales after the values
    out = decode_index_keys(fp8, "fp8")
    np.testing.assert_array_equal(out, np.stack([np.full(128, 0.5), np.full(128, 6.0)]).astype(np.float32))
    with pytest.raises(Exception, match="whole number"):
        decode_index_keys(np.zeros((1, 100), np.uint8), "bf16")


@pytest.mark.parametrize("index_bytes", [256, 132])
def test_jaccard_is_one_when_clean_and_drops_on_corruption(index_bytes: int) -> None:
    lay = layout(index_bytes)
    src, dst = KVMemory.allocate(lay), KVMemory.allocate(lay)
    rng = np.random.default_rng(0)
    dtype = "bf16" if index_bytes == 256 else "fp8"
    for name in ("c4.idx.L0", "c4.idx.L1"):  # plausible keys: finite values, positive scales
        src.array(name)[...] = _plausible_keys(rng, src.array(name).shape, dtype)
    memmove_plan(plan_transfer(src, dst, PAGES))
    queries = rng.standard_normal((4, 128)).astype(np.float32)
    clean = indexer_topk_jaccard(src, dst, PAGES, queries, k=32, dtype=dtype)
    assert clean == {"c4.idx.L0": 1.0, "c4.idx.L1": 1.0}
    dst.array("c4.idx.L1")[[10, 11]] = 0  # two of six pages lost
    hit = indexer_topk_jaccard(src, dst, PAGES, queries, k=32, dtype=dtype)
    assert hit["c4.idx.L0"] == 1.0 and hit["c4.idx.L1"] < 0.9


def _plausible_keys(rng: np.random.Generator, shape: tuple[int, int], dtype: str) -> np.ndarray:
    if dtype == "bf16":
        vals = rng.standard_normal(shape[0] * shape[1] // 2).astype(np.float32)
        return (vals.view(np.uint32) >> 16).astype(np.uint16).view(np.uint8).reshape(shape)
    tokens = shape[1] // 132
    out = np.empty(shape, dtype=np.uint8)
    out[:, :tokens * 128] = rng.choice(np.r_[0:0x7F, 0x80:0xFF], size=(shape[0], tokens * 128))
    out[:, tokens * 128:] = rng.uniform(0.5, 2, (shape[0], tokens)).astype("<f4").view(np.uint8)
    return out


def test_plan_dump_traces_rows_and_shows_where_faulty_rows_land() -> None:
    lay = Layout([Pool("p", [Buffer("a", 64, 8), Buffer("b", 32, 4), Buffer("c", 64, 8)])])
    src, dst = KVMemory.allocate(lay), KVMemory.allocate(lay)
    pages = {"p": ([0, 1, 3], [2, 3, 0])}
    rows = plan_dump(plan_transfer(src, dst, pages))
    assert [(r["buffer"], r["src_pages"], r["dst_pages"], r["nbytes"]) for r in rows[:2]] == [
        ("a", [0, 1], [2, 3], 128), ("a", [3, 3], [0, 0], 64)]
    assert rows[0]["dst_offset"] == 128 and rows[0]["dst_hits"] == "a[2]"
    assert all(r["dst_hits"] == f"{r['buffer']}[{r['dst_pages'][0]}]" for r in rows)
    bad = plan_dump(buffer0_slot_count_descs(src, dst, pages))
    c_rows = [r for r in bad if r["buffer"] == "c"]  # c's block assumed at 2 x 8, really at 8 + 4
    assert [r["dst_hits"] for r in c_rows] == ["c[6]", "c[7]", "c[4]"]  # pages 2, 3, 0 shifted by 16 - 12
    assert all(r["dst_hits"] == f"{r['buffer']}[{r['dst_pages'][0]}]" for r in bad if r["buffer"] != "c")
    text = _render(plan_table(bad))
    assert "dst lands in" in text and "c" in text


def test_render_tables(moved) -> None:
    src, dst = moved
    dst.array("c4.kv.L0")[11] = 0
    report = diff_pages(src, dst, PAGES)
    text = _render(diff_summary_table(report)) + _render(diff_table(report))
    assert "c4.kv.L0" in text and "zeros" in text
    assert "0.5000" in _render(jaccard_table({"c4.idx.L0": 0.5}))


def _render(table: object) -> str:
    console = Console(width=200, record=True, file=open("/dev/null", "w"))  # noqa: SIM115
    console.print(table)
    return console.export_text()


def _run(argv: list[str], capsys: pytest.CaptureFixture[str]) -> tuple[int, str]:
    parser = argparse.ArgumentParser(prog="kvferry")
    diagnose_cmd.add_parser(parser.add_subparsers(dest="command"))
    args = parser.parse_args(argv)
    code = args.handler(args)
    return code, capsys.readouterr().out


def test_cli_diff_clean_and_faulted(capsys: pytest.CaptureFixture[str]) -> None:
    code, out = _run(["diff", "--preset", "token_salad", "--json"], capsys)
    clean = json.loads(out)
    assert code == 0 and clean["clean"] and clean["digests"]["ok"] and clean["pages_compared"] > 0
    assert set(clean["jaccard"].values()) == {1.0}
    code, out = _run(["diff", "--preset", "token_salad", "--inject", "buffer0-slots", "--json"], capsys)
    bad = json.loads(out)
    assert code == 1 and not bad["clean"] and "c4.idx.L2" in bad["by_buffer"]
    assert "c4.idx.L0" not in bad["by_buffer"] and bad["jaccard"]["c4.idx.L2"] < 1.0
    assert "c4.idx.L2" in bad["digests"]["error"]
    code, out = _run(["diff", "--preset", "token_salad", "--inject", "flip:c4.kv.L0", "--plan"], capsys)
    assert code == 1 and "c4.kv.L0" in out and "partial" in out and "Plan rows" in out

