"""The deterministic simulator (kvferry.simulation, docs/simulation.md): the real protocol cores under faults.

Within ``make test``'s budget: a fixed CPU budget of seeds with faults (no invariant may break; a smaller one
of seeds at TP 4 and 8), the seeds kept in tests/simulation_regressions.txt replayed, exact replay, and the
mutation check: each bug class switched on by patching a core method is found within a few seconds of seeds
and named by the invariant it breaks. The long runs are marked slow.
"""

from __future__ import annotations

import ctypes
import hashlib
import os
import re
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import replace
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvferry.cli import main
from kvferry.control.core.prefill_announces import Announces
from kvferry.control.core.prefill_writer import Writer
from kvferry.control.core.states import RequestState
from kvferry.errors import ProtocolError
from kvferry.layout.memory import KVMemory
from kvferry.plan import plan_decode_rank
from kvferry.simulation import MUTATIONS, SimConfig, run_many, run_seed, shrink
from kvferry.simulation.cluster import World
from kvferry.simulation.config import DATA_STORM, FAULT_KINDS, PAGE_PAIRS, READ_STORM, Swarm, draw_page_sizes
from kvferry.simulation.decode_node import DecodeNode
from kvferry.simulation.mutations import EXPECTED
from kvferry.simulation.node import FRAMES, QUEUED
from kvferry.simulation.tp import (
    STATE_POOL,
    TP_PAIRS,
    WIDE_PAIRS,
    draw_tp,
    fill_content,
    page_content,
    rank_layout,
)
from kvferry.simulation.world import Net, Pending, Rows, Sim, Transport, some_rows

REGRESSIONS = Path(__file__).with_name("simulation_regressions.txt")
SEEDS_BUDGET_S = 16.0       # CPU seconds of fresh seeds with faults per test run (20 before the stopped readers'
                            # and the two fence mutations' tests came, to keep the file's time)
WIDE_BUDGET_S = 8.0         # and of fresh seeds at TP 4 and 8 (SimConfig.wide_tp), smaller ones
MUTATION_BUDGET_S = 10.0    # CPU seconds each mutation may take to be found (the slowest, announce_copy_answered,
                            # takes 3-4 s quiet and ran past 5 s at load 6; a find stops early, so only a miss
                            # pays it)
FRESH_FROM = 1000           # fresh seeds start here, past those the regression list and mutation check use


def _regressions() -> list[tuple[int, str | None, str | None, tuple[int, int] | None]]:
    out = []
    for line in REGRESSIONS.read_text().splitlines():
        fields = line.split("#")[0].split()
        if fields:
            tp = tuple(int(x) for x in fields[3].split(":")) if len(fields) > 3 else None
            out.append((int(fields[0]), fields[1] if len(fields) > 1 else None, fields[2] if len(fields) > 2 else None,
                        tp))
    return out  # type: ignore[return-value]


def test_seeds_with_faults_break_no_invariant() -> None:
    """As many seeds as the budget allows, every fault on in some of them: no invariant breaks, and the
    faults did bite (requests failed, and others still completed)."""
    results = run_many(range(FRESH_FROM, FRESH_FROM + 100_000), budget_s=SEEDS_BUDGET_S)
    broken = [r for r in results if not r.ok]
    assert not broken, "\n".join(f"seed {r.seed}: {r.violation}\n" + "\n".join(r.trace) for r in broken[:3])
    assert len(results) >= 20   # 192 requests each (SimConfig), TP groups of up to 8 nodes
    assert sum(r.done for r in results) > 0 and sum(r.failed for r in results) > 0
    assert {r.tp for r in results} == set(TP_PAIRS)   # every TP pair drawn
    assert any(r.page_sizes for r in results)   # and some seeds with different page sizes on the two sides


def test_wide_seeds_with_faults_break_no_invariant() -> None:
    """Seeds at TP 4 and 8 (every seed wide, 48 requests each: a TP 8 seed runs up to 32 rank nodes): no
    invariant breaks, and the faults bit."""
    cfg = SimConfig(wide_tp=1.0, requests=48)
    results = run_many(range(FRESH_FROM, FRESH_FROM + 100_000), cfg, budget_s=WIDE_BUDGET_S)
    broken = [r for r in results if not r.ok]
    assert not broken, "\n".join(f"{r.replay_command()}: {r.violation}\n" + "\n".join(r.trace) for r in broken[:3])
    assert len(results) >= 5 and all(r.tp in WIDE_PAIRS for r in results)
    assert sum(r.done for r in results) > 0 and sum(r.failed for r in results) > 0


def test_wide_pairs_leave_every_other_seed_as_it_was() -> None:
    """A share of wide seeds changes only those seeds' pair: every other seed draws what it drew without
    (the regression list and the figures name seeds), and a seed wide at one share is wide at a larger one."""
    seeds = range(4000)
    before = [draw_tp(s) for s in seeds]
    quarter, half = [draw_tp(s, 0.25) for s in seeds], [draw_tp(s, 0.5) for s in seeds]
    assert set(before) == set(TP_PAIRS) and set(quarter) == set(TP_PAIRS) | set(WIDE_PAIRS)
    for old, q, h in zip(before, quarter, half):
        assert q == old or q in WIDE_PAIRS
        assert h == old or h in WIDE_PAIRS
        assert q not in WIDE_PAIRS or h == q
    assert 900 < sum(q in WIDE_PAIRS for q in quarter) < 1100
    eights = sum(8 in pair for pair in half if pair in WIDE_PAIRS) / sum(pair in WIDE_PAIRS for pair in half)
    assert 0.25 < eights < 0.42   # TP 8 pairs weighted half (5 of 15)


def test_without_faults_every_request_is_done() -> None:
    for seed in range(3):
        result = run_seed(seed, SimConfig(faults=False))
        assert result.ok, result.violation
        assert result.done == result.requests * result.tp[1] and result.failed == 0   # DONE on every decode rank


@pytest.mark.parametrize(("seed", "mutate", "invariant", "tp"), _regressions())
def test_regression_seeds_replay(seed: int, mutate: str | None, invariant: str | None,
                                 tp: tuple[int, int] | None) -> None:
    result = run_seed(seed, SimConfig(tp=tp), mutate=mutate)
    if invariant is None:
        assert result.ok, f"{result.violation}\n" + "\n".join(result.trace)
    else:
        assert result.violation is not None and result.violation.invariant == invariant, result.violation


def test_a_seed_replays_exactly() -> None:
    """The same seed gives the same run: events, outcomes, and for a failure the same violation and trace."""
    a, b = run_seed(7), run_seed(7)
    assert (a.events, a.done, a.failed, a.sim_time) == (b.events, b.done, b.failed, b.sim_time)
    tp1 = SimConfig(tp=(1, 1))
    bad_a, bad_b = run_seed(0, tp1, mutate="planner_buffer0"), run_seed(0, tp1, mutate="planner_buffer0")
    assert bad_a.violation is not None and bad_a.violation == bad_b.violation and bad_a.trace == bad_b.trace


@pytest.mark.parametrize("name", sorted(MUTATIONS))
def test_each_mutation_is_found_and_named(name: str) -> None:
    """A bug class switched on is found within MUTATION_BUDGET_S of seeds, by the invariant it breaks; and
    the real method is back afterwards (the same seeds pass again)."""
    start = time.process_time()
    found = None
    seed = 0
    while time.process_time() - start < MUTATION_BUDGET_S:
        result = run_seed(seed, mutate=name)
        if not result.ok:
            found = result
            break
        seed += 1
    assert found is not None, f"{name}: not found in {seed} seeds"
    assert found.violation is not None and found.violation.invariant in EXPECTED[name], found.violation
    assert run_seed(found.seed).ok


@pytest.mark.parametrize("tp", [*TP_PAIRS, (8, 4), (2, 8), (8, 8)])
def test_every_tp_pair_delivers_every_rank_its_heads(tp: tuple[int, int]) -> None:
    """Without faults, every decode rank of every group verifies every request (its heads, checked byte
    for byte by ``b_done_bytes``); with faults, no invariant breaks at that TP pair."""
    clean = run_seed(0, SimConfig(tp=tp, faults=False, requests=16))
    assert clean.ok, clean.violation
    assert clean.tp == tp and clean.done == clean.requests * tp[1] and clean.failed == 0
    faulty = run_seed(1, SimConfig(tp=tp, requests=24))
    assert faulty.ok, f"{faulty.violation}\n" + "\n".join(faulty.trace)
    assert "--tp" in faulty.replay_command()


def test_a_wide_seed_replays_at_its_pair() -> None:
    """A seed drawn wide (``wide_tp``) replays with ``--tp P:D``: the same run."""
    drawn = run_seed(FRESH_FROM, SimConfig(wide_tp=1.0, requests=16))
    pair = f"{drawn.tp[0]}:{drawn.tp[1]}"
    assert drawn.tp in WIDE_PAIRS and f"--tp {pair}" in drawn.replay_command()
    again = run_seed(FRESH_FROM, SimConfig(tp=drawn.tp, requests=16))
    assert (again.events, again.done, again.failed, again.sim_time) == (drawn.events, drawn.done, drawn.failed,
                                                                         drawn.sim_time)


@pytest.mark.parametrize("pair", PAGE_PAIRS)
def test_every_page_size_pair_lands_every_token_and_replays(pair: tuple[int, int]) -> None:
    """A seed at each (prefill, decode) page-size pair: without faults every request is DONE (every token of
    every leased page checked by ``b_done_bytes``); with faults no invariant breaks, and the seed replays with
    ``--page-sizes TS:TD``."""
    clean = run_seed(0, SimConfig(page_sizes=pair, faults=False, requests=16))
    assert clean.ok, clean.violation
    assert clean.page_sizes == pair and clean.tp == (1, 1) and clean.done == clean.requests and clean.failed == 0
    faulty = run_seed(1, SimConfig(page_sizes=pair, requests=24))
    assert faulty.ok, f"{faulty.violation}\n" + "\n".join(faulty.trace)
    assert f"--page-sizes {pair[0]}:{pair[1]}" in faulty.replay_command()


def test_page_sizes_leave_every_other_seed_as_it_was() -> None:
    """A share of the seeds draws a page-size pair (and runs TP 1:1), from a stream of its own: a seed that
    draws none at one share draws none at a smaller one, and one that draws a pair draws it at a larger."""
    seeds = range(4000)
    quarter, half = [draw_page_sizes(s, 0.25) for s in seeds], [draw_page_sizes(s, 0.5) for s in seeds]
    assert all(q is None or h == q for q, h in zip(quarter, half))
    assert 900 < sum(q is not None for q in quarter) < 1100 and {q for q in quarter if q} == set(PAGE_PAIRS)
    assert all(draw_page_sizes(s, 0.0) is None for s in seeds)



def test_a_chunk_skipped_by_the_engine_fails_its_request_on_page_size_seeds_only() -> None:
    """Page-size seeds with faults have prefill engines skip a chunk of some requests (``Swarm.skip_chunk``,
    from a stream of its own): seed 1 (48 -> 32) skips some, and requests left short fail instead of
    reaching DONE (no invariant breaks); with ``page_gap_accepted`` (the coverage check between page sizes
    off) the same seed breaks ``b_done_bytes`` on tokens no write of the request reached. Seeds at equal
    sizes, and ``--without skip_chunk``, skip none, and draw what they drew."""
    world, whole = World(1, SimConfig()), World(1, SimConfig(), without=("skip_chunk",))
    assert world.page_sizes == (48, 32) and world.swarm.skip_chunk > 0 and whole.swarm.skip_chunk == 0
    skipped = {a.rid for a, b in zip(world.requests, whole.requests) if a.chunks != b.chunks}
    assert skipped and all(len(a.chunks) == len(b.chunks) - (a.rid in skipped)
                           for a, b in zip(world.requests, whole.requests))
    world.run()
    done = {rid for (_, rid, _), state in world.outcome_d.items() if state is RequestState.DONE}
    assert skipped - done   # some requests left short failed (one whose skipped chunk lay in decode's prefix may not)
    assert World(0, SimConfig()).swarm.skip_chunk == 0 and World(0, SimConfig()).page_sizes is None
    found = run_seed(1, mutate="page_gap_accepted")
    assert found.violation is not None and found.violation.invariant == "b_done_bytes"
    assert "was last written by" in found.violation.detail
    assert run_seed(1, mutate="page_gap_accepted", without=("skip_chunk",)).ok

@pytest.mark.parametrize("tp", [*TP_PAIRS[1:], *WIDE_PAIRS, (1, 8), (8, 1)])
def test_rank_content_is_what_the_real_planner_moves(tp: tuple[int, int]) -> None:
    """The simulator's content model agrees with ``plan_decode_rank``: prefill ranks filled with their
    heads of a request, copied by the real TP plans, give each decode rank exactly ``page_content``, and a
    slice shifted by one head would not; the state pool's channel sections likewise, section by section."""
    srcs = [KVMemory.allocate(rank_layout("prefill", tp, r, 32, state=True)) for r in range(tp[0])]
    pages = {"kv": (np.array([3, 1, 4]), np.array([7, 0, 2])), "c": (np.array([5]), np.array([9])),
             STATE_POOL: (np.array([2]), np.array([6]))}
    for mem in srcs:
        for pool, (src, _) in pages.items():
            fill_content(mem, "r9", pool, src, 2)
    for d in range(tp[1]):
        dst = KVMemory.allocate(rank_layout("decode", tp, d, 32, state=True))
        for plan in plan_decode_rank(srcs, dst, pages).values():
            for (s, n, _), (t, _, _) in zip(plan.src_descs.tolist(), plan.dst_descs.tolist()):
                ctypes.memmove(t, s, n)
        for pool, (_, dst_pages) in pages.items():
            for buf in dst.layout.pool(pool).buffers:
                for i, page in enumerate(dst_pages.tolist()):
                    want = page_content("r9", 2 + i, dst.buffer_index[buf.name], buf, d, tp[1])
                    assert np.array_equal(dst.array(buf.name)[page], want), (tp, d, buf.name, page)
                    if buf.state is not None or (buf.heads is not None and not buf.heads.replicated):
                        other = page_content("r9", 2 + i, dst.buffer_index[buf.name], buf, d + 1, tp[1])
                        assert not np.array_equal(dst.array(buf.name)[page], other)


def test_a_partitioned_data_path_holds_transfers_until_the_heal_or_the_timeout(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """Partitions that hold the transport too (``Swarm.data_partition``): nothing lands while its data path is
    partitioned; a held transfer lands after the heal or fails after DATA_TIMEOUT; no invariant breaks."""
    cut: list[tuple[float, str, int]] = []

    def checked(land: Callable[[Transport, Pending, Any], None]) -> Callable[[Transport, Pending, Any], None]:
        def land_checked(self: Transport, pend: Pending, world: Any) -> None:
            if self._cut_off(pend):
                cut.append((self.sim.now, pend.kind, pend.ticket))
            land(self, pend, world)
        return land_checked

    monkeypatch.setattr(Transport, "_land_write", checked(Transport._land_write))
    monkeypatch.setattr(Transport, "_land_read", checked(Transport._land_read))
    swarm = Swarm(partition_rate=3.0, partition_max=1.5, data_partition=1.0, pull=0.5)
    cfg = SimConfig(tp=(1, 1), requests=96)
    results = [run_seed(seed, cfg, swarm=swarm) for seed in range(FRESH_FROM, FRESH_FROM + 3)]
    assert all(r.ok for r in results), [(r.seed, r.violation) for r in results]
    held, timed_out = sum(r.held for r in results), sum(r.timed_out for r in results)
    assert timed_out > 0 and held > timed_out   # some timed out, others went on after the heal
    assert not cut, f"landed while the data path was partitioned: {cut[:5]}"
    assert sum(r.done for r in results) > 0 and sum(r.failed for r in results) > 0


def test_a_data_path_cut_alone_holds_transfers_while_messages_flow(monkeypatch: pytest.MonkeyPatch) -> None:
    """The transport between a pair cut with its messages flowing (``Swarm.fabric_rate``): no message is held,
    transfers are (some time out, the others land after the heal), some of them split (some of their rows,
    not only a prefix, crossed before the cut, landing then: writes and reads both; the rest waits, each row
    once), and no invariant breaks."""
    split: list[tuple[str, int, int]] = []
    scattered = 0

    def rows(pend: Pending) -> list[tuple[int, ...]]:
        return [tuple(row) for p in pend.parts for row in p[3].dst_descs.tolist()]

    def recorded(orig: Callable[[Transport, Pending], None]) -> Callable[[Transport, Pending], None]:
        def split_recorded(self: Transport, pend: Pending) -> None:
            nonlocal scattered
            before = rows(pend)
            orig(self, pend)
            after = rows(pend)
            if len(after) < len(before):
                split.append((pend.kind, len(before) - len(after), len(after)))
                assert set(after) <= set(before) and len(set(after)) == len(after)   # rows left, each once
                scattered += bool(after) and after != before[len(before) - len(after):]
        return split_recorded

    monkeypatch.setattr(Transport, "_split", recorded(Transport._split))
    swarm = Swarm(fabric_rate=3.0, fabric_max=1.5, pull=0.5, slow_transfer=0.2, slow_max=1.0)
    cfg = SimConfig(tp=(1, 1), requests=96)
    results = [run_seed(seed, cfg, swarm=swarm) for seed in range(FRESH_FROM, FRESH_FROM + 3)]
    assert all(r.ok for r in results), [(r.seed, r.violation) for r in results]
    assert all(dict(r.faults).get("fabric_rate", 0) > 0 and "partition_rate" not in dict(r.faults) for r in results)
    held, timed_out = sum(r.held for r in results), sum(r.timed_out for r in results)
    assert timed_out > 0 and held > timed_out
    assert sum(r.partial for r in results) == len(split) > 0
    assert {kind for kind, _, _ in split} == {"write", "read"}
    assert any(rest for _, _, rest in split) and any(not rest for _, _, rest in split)   # the rest waits, or none
    assert scattered > 0   # rows crossed out of order: what is left is not the transfer's tail
    assert sum(r.done for r in results) > 0 and sum(r.failed for r in results) > 0


@given(st.lists(st.integers(1, 9), max_size=6), st.data())
@settings(max_examples=200, deadline=None)
def test_some_rows_takes_each_row_once_on_one_side(sizes: list[int], data: st.DataObject) -> None:
    """``some_rows`` (a split or failed transfer's rows that landed, and the rest): ``n`` rows on one side,
    the others on the other, every row of every part exactly once, each part's rows in their own chunk."""
    parts = [(tag, f"r{tag}", 1, Rows(np.arange(n * 3).reshape(n, 3) + 1000 * tag,
                                       np.arange(n * 3).reshape(n, 3) + 1000 * tag + 500))
             for tag, n in enumerate(sizes)]
    n = data.draw(st.integers(0, sum(sizes)))
    head, tail = some_rows(parts, n, data.draw(st.integers(0, 2**64 - 1)))

    def rows(side: list[Any]) -> list[tuple[int, tuple[int, ...], tuple[int, ...]]]:
        return [(tag, tuple(s), tuple(d)) for tag, _, _, plan in side
                for s, d in zip(plan.src_descs.tolist(), plan.dst_descs.tolist(), strict=True)]
    assert len(rows(head)) == n
    assert sorted(rows(head) + rows(tail)) == sorted(rows(parts))
    assert all(d[0] - s[0] == 500 for _, s, d in rows(head) + rows(tail))   # source and target stay paired


class _Wire:
    """What the simulated network carried, per connection and direction: the frames sent (``Net.to_prefill``,
    ``Net.to_decode``) and those that reached the node, in order, and when each reached it while its own
    direction (``early``) or only the other (``flowing``) was held."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch) -> None:
        self.sent: dict[tuple[Any, str], list[bytes]] = {}
        self.arrived: dict[tuple[Any, str], list[bytes]] = {}
        self.early: list[tuple[str, float]] = []
        self.flowing = {"to_p": 0, "to_d": 0}
        for way, send, deliver in (("to_p", "to_prefill", "_deliver_p"), ("to_d", "to_decode", "_deliver_d")):
            monkeypatch.setattr(Net, send, self._sent(way, getattr(Net, send)))
            monkeypatch.setattr(Net, deliver, self._delivered(lambda _, w=way: w, getattr(Net, deliver)))
        monkeypatch.setattr(Net, "_release", self._delivered(lambda to_p: "to_p" if to_p else "to_d", Net._release))

    def _sent(self, way: str, orig: Callable[..., None]) -> Callable[..., None]:
        def send(net: Net, key: Any, frame: bytes, *args: Any) -> None:
            conn = net.by_link.get(key) if way == "to_p" else net.by_identity.get(key)
            if conn is not None:
                self.sent.setdefault((conn, way), []).append(frame)
            orig(net, key, frame, *args)
        return send

    def _delivered(self, way_of: Callable[[Any], str], orig: Callable[..., None]) -> Callable[..., None]:
        """``orig`` (``Net``'s handing over of a frame, or of a held queue), recording what reached the node."""
        def deliver(net: Net, conn: Any, arg: Any, *args: Any) -> None:
            way = way_of(arg)
            node = conn.prefill if way == "to_p" else conn.decode
            before = len(node.frames) if node is not None else 0
            orig(net, conn, arg, *args)
            if node is None or len(node.frames) == before:
                return   # lost, or held for the heal
            got = [frame for _, _, frame in list(node.frames)[before:]]
            self.arrived.setdefault((conn, way), []).extend(got)
            pair, now = (conn.decode.name, conn.prefill.name), net.sim.now
            held, other = (net.held_to_p, net.held_to_d) if way == "to_p" else (net.held_to_d, net.held_to_p)
            if held.get(pair, 0.0) > now:
                self.early.append((way, now))
            elif other.get(pair, 0.0) > now:
                self.flowing[way] += len(got)
        return deliver

    def out_of_order(self) -> list[tuple[str, int]]:
        """The connections whose frames did not arrive as a prefix of those sent, in order (a connection's
        loss is its tail: a close or a crash ends it)."""
        return [(way, len(got)) for (conn, way), got in self.arrived.items()
                if any(a is not b for a, b in zip(got, self.sent[(conn, way)], strict=False))
                or len(got) > len(self.sent[(conn, way)])]


def test_a_one_way_partition_holds_what_one_side_sends_while_the_other_is_heard(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """Partitions one way only (``Swarm.oneway``): nothing arrives the cut way before the heal; what is sent
    the other way meanwhile goes on arriving; both directions get cut; a link decode closes meanwhile reaches
    prefill late; with ZMTP heartbeats or without, pushing and pulling, no invariant breaks."""
    wire = _Wire(monkeypatch)
    fins_held: list[str] = []
    log = Sim.log

    def logged(self: Sim, who: str, what: str) -> None:
        if what.endswith("(its FIN held)"):
            fins_held.append(what)
        log(self, who, what)

    monkeypatch.setattr(Sim, "log", logged)
    results = [run_seed(seed, SimConfig(tp=(1, 1), requests=96),
                        swarm=Swarm(partition_rate=3.0, partition_max=1.5, oneway=1.0, pull=pull, zmtp=zmtp,
                                    decode_abort=0.2, prefill_abort=0.2, retry=0.5))
               for seed, (pull, zmtp) in enumerate([(0.0, False), (1.0, False), (0.0, True), (1.0, True)],
                                                   FRESH_FROM)]
    assert all(r.ok for r in results), [(r.seed, r.violation) for r in results]
    assert all(dict(r.faults)["oneway"] == dict(r.faults)["partition_rate"] > 0 for r in results)
    assert not wire.early, f"arrived the cut way before the heal: {wire.early[:5]}"
    assert wire.flowing["to_p"] > 0 and wire.flowing["to_d"] > 0, wire.flowing
    assert fins_held   # decode closed a link while what it sends was held: prefill heard of it late
    assert not wire.out_of_order()
    assert sum(r.done for r in results) > 0 and sum(r.failed for r in results) > 0


def test_a_partition_holds_the_messages_already_on_the_wire_and_keeps_each_connection_in_order(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """A message sent before a partition began and still on the wire when it did (long delays: TCP's
    retransmits) arrives only after the heal, as TCP sends it again once the route is back, and behind it
    the connection's later messages, in the order sent: what arrives on each connection is a prefix of what
    was sent. Both ways and one way, with spikes; no invariant breaks."""
    wire = _Wire(monkeypatch)
    results = [run_seed(seed, SimConfig(tp=(1, 1), requests=96),
                        swarm=Swarm(delay_max=0.01, spike=0.1, spike_max=0.4, partition_rate=3.0,
                                    partition_max=0.5, oneway=oneway, pull=pull, decode_abort=0.2,
                                    prefill_abort=0.2))
               for seed, (oneway, pull) in enumerate([(0.0, 0.0), (0.0, 1.0), (1.0, 0.0), (0.5, 1.0)],
                                                     FRESH_FROM)]
    assert all(r.ok for r in results), [(r.seed, r.violation) for r in results]
    assert all(r.on_wire > 0 for r in results), [r.on_wire for r in results]
    assert not wire.early, f"arrived while its way was held: {wire.early[:5]}"
    assert not wire.out_of_order(), wire.out_of_order()[:5]
    assert sum(len(got) for got in wire.arrived.values()) > 1000


def test_copied_messages_are_acted_on_once(monkeypatch: pytest.MonkeyPatch) -> None:
    """Messages copied (``Swarm.duplicate``), the copy right behind the original or up to a second later:
    prefill drops each copy of an announce unanswered (its Fail would settle the generation being written,
    or a late copy would start a write into pages leased again), and no invariant breaks, pushing and
    pulling, TP 1 and 2. ``announce_copy_answered`` (the mutation check) is the same runs without the drop."""
    copies: list[int] = []
    orig = Announces.on_announce

    def on_announce(self: Announces, session: Any, msg: Any) -> None:
        try:
            orig(self, session, msg)
        except ProtocolError:
            copies.append(msg.generation)
            raise
    monkeypatch.setattr(Announces, "on_announce", on_announce)
    results = [run_seed(seed, SimConfig(tp=tp, requests=96),
                        swarm=Swarm(duplicate=0.2, duplicate_max=late, pull=pull, decode_abort=0.2, prefill_abort=0.2,
                                    retry=0.5, cut_rate=0.5, slow_transfer=0.1, slow_max=0.5))
               for seed, (late, pull, tp) in enumerate([(0.0, 0.0, (1, 1)), (1.0, 0.0, (1, 1)), (0.0, 1.0, (2, 2)),
                                                        (1.0, 1.0, (1, 2))], FRESH_FROM)]
    assert all(r.ok for r in results), [(r.seed, r.violation) for r in results]
    assert all(dict(r.faults)["duplicate"] > 0 for r in results)
    assert len(copies) > 20
    assert sum(r.done for r in results) > 0 and sum(r.failed for r in results) > 0


def test_faults_are_counted_by_kind_only_where_the_seed_drew_them() -> None:
    """``RunResult.faults``: each kind counted is one the seed's fault mix switched on (the kinds are the
    ``Swarm``'s fields), and over a few seeds every kind shows up; a run without faults counts none."""
    results = [run_seed(seed) for seed in range(7000, 7012)]
    seen: set[str] = set()
    for r in results:
        for kind, n in r.faults:
            assert n > 0 and getattr(r.swarm, kind), (r.seed, kind, n, r.swarm.describe())
            seen.add(kind)
    assert seen >= set(FAULT_KINDS) - {"data_partition", "crash_rate"}, set(FAULT_KINDS) - seen
    assert run_seed(0, SimConfig(faults=False)).faults == ()


# The steps that follow ``Swarm.draw`` in ``World``, each with the stream it draws from, in that order.
_DRAW_STEPS = (("with_liveness", "rng_live"), ("with_data_path", "rng_data"), ("with_fabric", "rng_fabric"),
               ("with_oneway", "rng_oneway"), ("with_duplicates", "rng_dup"), ("with_read_stalls", "rng_read"))


def _step_drawn(step: str, *fields: str) -> list[tuple[Swarm, Swarm]]:
    """800 seeds' fault mixes as ``World`` draws them, before and after ``step``, asserting that it changed
    nothing but ``fields``: a step draws from a stream of its own, so that adding it moved no other draw."""
    out = []
    for seed in range(800):
        sim = Sim(seed)
        swarm = Swarm.draw(sim.rng_fault)
        for name, rng in _DRAW_STEPS:
            before, swarm = swarm, getattr(swarm, name)(getattr(sim, rng))
            if name == step:
                assert replace(swarm, **{f: getattr(before, f) for f in fields}) == before, (seed, step)
                out.append((before, swarm))
                break
    return out


def test_the_data_path_draw_moves_no_other_draw() -> None:
    """``Swarm.data_partition`` only for seeds with partitions; one seed in eight a storm (partitions often,
    each holding the data path)."""
    drawn = _step_drawn("with_data_path", *DATA_STORM)
    storms = [after for before, after in drawn if after.partition_rate != before.partition_rate]
    assert all(s.partition_rate >= 1.0 and s.data_partition == 1.0 and s.slow_transfer >= 0.2 for s in storms)
    assert all(replace(after, data_partition=0.0) == before and (before.partition_rate or not after.data_partition)
               for before, after in drawn if after.partition_rate == before.partition_rate)
    assert {0.0, 0.5, 1.0} == {after.data_partition for _, after in drawn} and 60 < len(storms) < 140


def test_the_data_path_cut_alone_is_drawn_from_its_own_stream() -> None:
    """``Swarm.with_fabric`` in about a quarter of the seeds."""
    drawn = [after for before, after in _step_drawn("with_fabric", "fabric_rate", "fabric_max") if after != before]
    assert all(0.3 <= s.fabric_rate <= 1.5 and s.fabric_max in (0.3, 1.0, 2.0) for s in drawn)
    assert 150 < len(drawn) < 250


def test_the_one_way_draw_moves_no_other_draw() -> None:
    """``Swarm.with_oneway`` in about half the seeds with partitions, none other."""
    pairs = _step_drawn("with_oneway", "oneway")
    drawn = [(before, after) for before, after in pairs if after.oneway]
    assert all(before.partition_rate and after.oneway in (0.5, 1.0) for before, after in drawn)
    partitioned = sum(bool(before.partition_rate) for before, _ in pairs)
    assert 0.35 * partitioned < len(drawn) < 0.65 * partitioned


def test_the_copies_draw_moves_no_other_draw() -> None:
    """``Swarm.with_duplicates`` in about a quarter of the seeds."""
    drawn = [after for _, after in _step_drawn("with_duplicates", "duplicate", "duplicate_max") if after.duplicate]
    assert all(0.01 <= s.duplicate <= 0.1 and s.duplicate_max in (0.0, 0.1, 1.0) for s in drawn)
    assert 150 < len(drawn) < 250


def test_the_read_stall_draw_moves_no_other_draw() -> None:
    """``Swarm.with_read_stalls`` in about half the seeds; a late-reader storm (ZMTP on, a fifth of the reads'
    posts stopped for 1 to 4 s) only in seeds whose decodes pull with digests off."""
    pairs = _step_drawn("with_read_stalls", *READ_STORM)
    drawn = [(before, after) for before, after in pairs if after.stall_read]
    storms = [(before, after) for before, after in drawn if after.stall_read == 0.2]
    assert all(before.pull and before.digest == "off" and after.zmtp and after.stall_read_max == 4.0
               for before, after in storms)
    assert all(replace(after, stall_read=0.0, stall_read_max=0.0) == before and 0.02 <= after.stall_read <= 0.1
               and after.stall_read_max in (2.5, 4.0) for before, after in drawn if (before, after) not in storms)
    assert 320 < len(drawn) < 480 and 10 < len(storms) < len(drawn) // 3


def _stopped_readers(monkeypatch: pytest.MonkeyPatch, seeds: range
                     ) -> tuple[list[Any], list[tuple[str, list[str], bool]]]:
    """Seeds at TP 1:1 and 2:2 whose decodes all pull with digests off and ZMTP on, a third of the reads'
    posts stopped for 1 to 4 s; each resume's phase, the kinds of what it read before its pump, and whether
    a drop notice was left for the next iteration."""
    resumes: list[tuple[str, list[str], bool]] = []
    orig_carry_on, orig_finish = DecodeNode.carry_on, DecodeNode.finish
    reading: list[list[str] | None] = [None]
    phases: list[str] = []

    def carry_on(self: DecodeNode, now: float, phase: str) -> None:
        reading[0] = []
        phases.append(phase)
        try:
            orig_carry_on(self, now, phase)
        finally:
            reading[0] = None   # stopped again before its pump, or done

    def finish(self: DecodeNode, now: float) -> None:
        if reading[0] is not None:   # the pump of a resumed iteration: what was read before it
            resumes.append((phases[-1], reading[0], any(f[0] == "dropped" for f in self.frames)))
            reading[0] = None
        orig_finish(self, now)

    def on_frame(self: DecodeNode, now: float, kind: str, peer: Any, data: bytes) -> None:
        if reading[0] is not None:
            reading[0].append(kind)
        orig_on_frame(self, now, kind, peer, data)

    orig_on_frame = DecodeNode.on_frame
    monkeypatch.setattr(DecodeNode, "carry_on", carry_on)
    monkeypatch.setattr(DecodeNode, "finish", finish)
    monkeypatch.setattr(DecodeNode, "on_frame", on_frame)
    results = []
    for seed in seeds:
        cfg = SimConfig(tp=((1, 1), (2, 2))[seed % 2], requests=96)
        swarm = replace(World(seed, cfg).swarm, pull=1.0, digest="off", zmtp=True, stall_read=0.3, stall_read_max=4.0)
        results.append(run_seed(seed, cfg, swarm=swarm))
    return results, resumes


def test_a_reader_stopped_inside_its_post_goes_on_with_that_iteration(monkeypatch: pytest.MonkeyPatch) -> None:
    """``Swarm.stall_read``: back from a stop inside a read's post, the decode's shell finishes that iteration
    (``Node.carry_on``): stopped after the drain, it reads nothing before its pump; stopped in the middle of
    it, it reads on but leaves drop notices (the monitor's socket) for the next poll. With the real fence no
    invariant breaks (the mutation check finds ``pull_fence_off`` and ``pull_fence_link_only`` in the default
    draw: regression seeds 3 and 4)."""
    results, resumes = _stopped_readers(monkeypatch, range(400000, 400004))
    assert all(r.ok for r in results), [(r.replay_command(), r.violation) for r in results if not r.ok]
    assert sum(dict(r.faults).get("stall_read", 0) for r in results) >= 12
    assert {phase for phase, _, _ in resumes} == {FRAMES, QUEUED}
    assert all(not kinds for phase, kinds, _ in resumes if phase == QUEUED)
    assert all("dropped" not in kinds for _, kinds, _ in resumes)
    assert any(kinds for phase, kinds, _ in resumes if phase == FRAMES)
    assert any(left for phase, _, left in resumes if phase == FRAMES)   # a drop notice waited for the next poll


def test_a_live_records_session_is_the_one_its_transfers_were_queued_under(monkeypatch: pytest.MonkeyPatch) -> None:
    """Why prefill's pre-write check compares no sessions (docs/fencing.md, "One check, not two"): whenever a
    record is still live at the check, its session is the transfer's. Push and pull, cuts, partitions, crashes,
    aborts from both sides and retries under the same id (reconnects, Aborts answered on new sessions)."""
    checks: list[bool] = []
    orig = Writer.check_current

    def check_current(self: Writer, rec: Any, session: Any) -> None:
        if rec.is_live:
            checks.append(rec.session is session)
        orig(self, rec, session)
    monkeypatch.setattr(Writer, "check_current", check_current)
    for seed in range(500000, 500002):
        cfg = SimConfig(tp=((1, 1), (1, 2))[seed % 2], requests=96)
        swarm = replace(World(seed, cfg).swarm, pull=0.5, cut_rate=1.5, crash_rate=0.2, partition_rate=0.5,
                        partition_max=1.0, decode_abort=0.2, prefill_abort=0.2, retry=0.8, stall_rate=0.5,
                        stall_max=2.0)
        assert run_seed(seed, cfg, swarm=swarm).ok
    assert len(checks) > 300 and all(checks)


def test_the_mutation_finds_script_exits_0_found_and_1_not_found() -> None:
    """bench/mutation_finds.py as it is run: a mutation found within the seeds allowed exits 0 with its row;
    one not found within them exits 1, naming it."""
    script = str(Path(__file__).parents[1] / "bench" / "mutation_finds.py")
    env = {**os.environ, "PYTHONPATH": str(Path(__file__).parents[1] / "src")}
    ok = subprocess.run([sys.executable, script, "--mutation", "pull_fence_off", "--max-seeds", "4"],
                        capture_output=True, text=True, env=env, timeout=300)
    assert ok.returncode == 0, ok.stdout + ok.stderr
    assert re.search(r"\| `pull_fence_off` \| 3 \| 4 \| [0-9.]+ \| a_source_released_under_read \|", ok.stdout)
    bad = subprocess.run([sys.executable, script, "--mutation", "pull_fence_link_only", "--max-seeds", "2"],
                         capture_output=True, text=True, env=env, timeout=300)
    assert bad.returncode == 1 and "FAILED pull_fence_link_only: not found in 2 seeds from 0" in bad.stdout, bad.stdout


def test_shrinking_keeps_the_invariant() -> None:
    failed = run_seed(0, mutate="done_before_verdict")
    assert failed.violation is not None
    small = shrink(failed, "done_before_verdict", budget_s=3.0)
    assert small.violation is not None and small.violation.invariant == failed.violation.invariant
    assert small.config.requests <= failed.config.requests
    again = run_seed(small.seed, small.config, mutate="done_before_verdict", without=small.without)
    assert again.violation == small.violation   # what the shrunk run's replay line runs


def test_the_command_reports_seeds_throughput_and_failures(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["simulate", "--seeds", "3", "--seed", "5"]) == 0
    out = capsys.readouterr().out
    assert "3 seeds (5..7), 0 with a violation" in out and "simulated requests per minute" in out
    assert "faults injected: " in out and "connections cut" in out
    assert main(["simulate", "--seed", "0", "--mutate", "done_before_verdict", "--trace", "5"]) == 1
    out = capsys.readouterr().out
    assert "seed 0: invariant b_prefill_done_before_verdict broken" in out
    assert "replay: kvferry simulate --seed 0" in out
    assert main(["simulate", "--seeds", "2", "--seed", "3", "--tp", "8:4", "--requests", "8", "--no-faults"]) == 0
    assert "2 seeds (3..4), 0 with a violation" in capsys.readouterr().out
    assert main(["simulate", "--seeds", "3", "--seed", "3", "--wide-tp", "0.5", "--requests", "8"]) == 0
    out = capsys.readouterr().out
    assert "3 seeds (3..5), 0 with a violation" in out and "1:1 1, 1:2 0, 2:1 0, 2:2 1, 8:8 1;" in out
    by_pair = re.search(r"simulated requests per minute by pair \(a request runs on P \+ D rank cores\): "
                        r"1:1 ([\d,]+), 2:2 ([\d,]+), 8:8 ([\d,]+)\n", out)
    assert by_pair and all(int(n.replace(",", "")) > 0 for n in by_pair.groups())   # only the pairs that ran
    for bad in (["--tp", "3:1"], ["--tp", "16:8"], ["--tp", "4"], ["--wide-tp", "2"]):
        assert main(["simulate", *bad]) == 2
    assert "expected P:D, each one of 1, 2, 4, 8, got '3:1'" in capsys.readouterr().err


def test_the_command_replays_a_page_size_seed_at_its_pair(capsys: pytest.CaptureFixture[str]) -> None:
    """A page-size seed's failure names its pair in the replay line, and the line replays it; a pair that is
    not tokens per page is a usage error."""
    assert main(["simulate", "--seed", "1", "--mutate", "page_index_paired", "--trace", "3"]) == 1
    out = capsys.readouterr().out
    assert "seed 1: invariant b_done_bytes broken" in out and "(48 -> 32 tokens per page)" in out
    assert "replay: kvferry simulate --seed 1 --page-sizes 48:32 --mutate page_index_paired" in out
    assert main(["simulate", "--seed", "1", "--page-sizes", "48:32", "--mutate", "page_index_paired"]) == 1
    assert main(["simulate", "--seed", "1", "--page-share", "0", "--mutate", "page_index_paired"]) == 0
    capsys.readouterr()
    assert main(["simulate", "--page-sizes", "48:7"]) == 2
    assert "expected TS:TD, tokens per page each a multiple of 16, got '48:7'" in capsys.readouterr().err


def test_the_storm_script_exits_0_and_1_with_a_bug_named() -> None:
    """bench/simulate_storm.py as it is run: its seeds pass (1:2 of 192 requests, 4:1 of 96), and a
    patched-in bug fails it, named."""
    script = str(Path(__file__).parents[1] / "bench" / "simulate_storm.py")
    ok = subprocess.run([sys.executable, script, "700003", "2"], capture_output=True, text=True, timeout=120)
    assert ok.returncode == 0, ok.stdout + ok.stderr
    assert "storm 700003..700004: 0 with a violation, 288 requests" in ok.stdout
    bad = subprocess.run([sys.executable, script, "700003", "1", "--mutation", "abort_frees_lease"],
                         capture_output=True, text=True, timeout=120)
    assert bad.returncode == 1, bad.stdout + bad.stderr
    assert "seed 700003 tp 1:2: a_lease at " in bad.stdout and "1 with a violation" in bad.stdout
    assert "  replay: python bench/simulate_storm.py 700003 1 --mutation abort_frees_lease\n" in bad.stdout


@pytest.mark.slow
@pytest.mark.skipif(not os.environ.get("KVFERRY_SIM_LONG"),
                    reason="the long run (2,000 seeds of 192 requests, TP groups drawn) runs with KVFERRY_SIM_LONG=1 "
                           "(make test-sim-long; several minutes: make test-slow leaves it out too)")
@pytest.mark.timeout(1800)   # 2,000 seeds at about 0.3 s of CPU each: past the suite's default timeout
def test_a_long_run_breaks_no_invariant() -> None:
    results = run_many(range(10_000, 12_000))
    broken = [r for r in results if not r.ok]
    assert not broken, "\n".join(f"seed {r.seed}: {r.violation}\n" + "\n".join(r.trace) for r in broken[:3])


@pytest.mark.slow
@pytest.mark.skipif(not os.environ.get("KVFERRY_SIM_LONG"),
                    reason="the long run at TP 4 and 8 (300 seeds of 96 requests, every seed wide) runs with "
                           "KVFERRY_SIM_LONG=1 (make test-sim-long)")
def test_a_long_run_at_tp_4_and_8_breaks_no_invariant() -> None:
    results = run_many(range(20_000, 20_300), SimConfig(wide_tp=1.0, requests=96))
    broken = [r for r in results if not r.ok]
    assert not broken, "\n".join(f"{r.replay_command()}: {r.violation}\n" + "\n".join(r.trace) for r in broken[:3])
    assert {r.tp for r in results} == set(WIDE_PAIRS)


def test_a_seed_replays_exactly_in_another_process() -> None:
    """The replay line works from a fresh process too (another hash seed, other addresses): the trace and
    the event count are the same."""
    code = ("import hashlib; from kvferry.simulation import run_seed; "
            "r = run_seed(11, mutate='quarantine_timer', trace=400); "
            "print(r.events, hashlib.sha1(repr(r.trace).encode()).hexdigest())")
    here = run_seed(11, mutate="quarantine_timer", trace=400)
    want = f"{here.events} {hashlib.sha1(repr(here.trace).encode()).hexdigest()}"
    src = str(Path(__file__).parents[1] / "src")
    for hash_seed in ("1", "2"):
        env = {**os.environ, "PYTHONHASHSEED": hash_seed, "PYTHONPATH": src}
        out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True)
        assert out.stdout.strip() == want
