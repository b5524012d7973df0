"""Prefill's batched writes (control.write_batch): chunks ready together for one decode go as one write,
and each request still completes, fails and aborts on its own. Bytes checked on every path."""

from __future__ import annotations

import contextlib
import threading
import time
from collections.abc import Iterator
from typing import Any

import numpy as np
import pytest

from kvferry import KVMemory, plan_transfer
from kvferry.control import DecodeEndpoint, EndpointOptions, PrefillEndpoint, RequestState, wire
from kvferry.control.core.write_batch import NOTIF_BYTES, Queued, group_cap, joinable, write_groups
from kvferry.errors import PlanError, RequestFailed, TransportError, UsageError
from kvferry.plan import TransferPlan
from kvferry.plan.planner import concat_plans
from kvferry.transport import LocalTransport
from kvferry.transport.local import LocalHandle

from .control_peer import announce, run_prefill, snapshot, verify, wait_all, workload
from .test_control_local import OPTS, SEED, CopyingTransport, GatedTransport, _memories, _until
from .test_control_local import _assert_idle as _idle


def _heard(prefill: PrefillEndpoint, reqs: list[Any]) -> None:
    """Prefill has bound every announce (its chunks can be posted the moment they are queued)."""
    def bound() -> bool:
        with prefill._lock:
            return all(getattr(prefill.core.records.get(r.rid), "session", None) is not None for r in reqs)
    _until(bound)


def _send_together(prefill: PrefillEndpoint, reqs: list[Any]) -> None:
    """Every chunk of ``reqs`` queued while the progress thread waits for the lock, as after an iteration
    that posted several (under load): one iteration then posts them all, batched from the first."""
    with prefill._lock:
        prefill.core.batches.batching = True
        run_prefill(prefill, reqs)


class Recording(LocalTransport):
    """A local transport that remembers each write's notification (what was batched with what)."""

    def __init__(self) -> None:
        super().__init__()
        self.notifs: list[bytes] = []

    def write(self, plan: TransferPlan, peer: str, notif: bytes, label: str = "") -> LocalHandle:
        self.notifs.append(bytes(notif))
        return super().write(plan, peer, notif, label)

    def chunks_per_write(self) -> list[int]:
        return [len(m.messages) if isinstance(m, wire.Batch) else 1 for m in map(wire.decode, self.notifs)]


@contextlib.contextmanager
def _pushed(transport: LocalTransport, reqs: list[Any], opts: EndpointOptions = OPTS,
            digest_mode: str = "sampled") -> Iterator[tuple[PrefillEndpoint, DecodeEndpoint, dict[str, np.ndarray]]]:
    """A prefill on ``transport`` and a local decode; decode announces ``reqs``, then prefill sends them
    all together (``_send_together``). Yields both and decode's memory as it was before."""
    src, dst = _memories()
    before = snapshot(dst)
    with PrefillEndpoint(src, transport, options=opts, digest_mode=digest_mode) as prefill, \
            DecodeEndpoint(dst, "local", options=opts, digest_mode=digest_mode) as decode:
        decode.connect(prefill.address)
        announce(decode, reqs)
        _heard(prefill, reqs)
        _send_together(prefill, reqs)
        yield prefill, decode, before
    transport.close()


@pytest.fixture
def recorded() -> Iterator[tuple[PrefillEndpoint, DecodeEndpoint, Recording]]:
    src, dst = _memories()
    transport = Recording()
    with PrefillEndpoint(src, transport, options=OPTS) as prefill, \
            DecodeEndpoint(dst, "local", options=OPTS) as decode:
        decode.connect(prefill.address)
        yield prefill, decode, transport
    transport.close()


# -- end to end -------------------------------------------------------------------------------------------
@pytest.mark.parametrize("digest_mode", ["sampled", "full", "off"])
def test_chunks_ready_together_go_as_one_write_and_every_request_completes(digest_mode: str) -> None:
    transport = Recording()
    reqs = workload(24, seed=31)
    with _pushed(transport, reqs, digest_mode=digest_mode) as (prefill, decode, before):
        assert set(wait_all(decode, [r.rid for r in reqs], 10).values()) == {"done"}
        assert set(wait_all(prefill, [r.rid for r in reqs], 10).values()) == {"done"}
        verify(decode.memory, SEED, reqs, before)
        _idle(prefill, decode)
        assert decode.counters()["bad_messages"] == decode.counters()["stray_notifications"] == 0
    per_write = transport.chunks_per_write()
    assert sum(per_write) == sum(len(r.sends) for r in reqs)      # every chunk written once
    # Full writes of half the window (24 announced: two writes share it; group_cap), not of the default cap.
    assert max(per_write) == group_cap(OPTS.batch_chunks, len(reqs)) == len(reqs) // 2
    assert len(per_write) < sum(per_write) // 4


def test_a_lone_chunk_is_written_at_once_and_the_second_of_an_iteration_starts_batching(
        recorded: tuple[PrefillEndpoint, DecodeEndpoint, Recording]) -> None:
    """Not under load (the last iteration posted one chunk or none), the first chunk of an iteration is
    written at once, alone; the chunks after it in the same iteration share writes."""
    prefill, decode, transport = recorded
    before = snapshot(decode.memory)
    reqs = [r for r in workload(24, seed=38) if len(r.sends) == 1]   # eight of one chunk
    announce(decode, reqs)
    _heard(prefill, reqs)
    run_prefill(prefill, reqs[:1])
    decode.wait(reqs[0].rid, 5)
    prefill.wait(reqs[0].rid, 5)   # ended on both sides: out of the window
    with prefill._lock:
        assert not prefill.core.batches.batching
        run_prefill(prefill, reqs[1:])
    assert set(wait_all(decode, [r.rid for r in reqs], 10).values()) == {"done"}
    verify(decode.memory, SEED, reqs, before)
    # Seven in flight after the first: writes of three (group_cap), so the last six go as two.
    assert transport.chunks_per_write() == [1, 1, 3, 3]


def test_one_chunk_per_write_when_batching_is_off() -> None:
    transport = Recording()
    opts = EndpointOptions(heartbeat_interval=0.1, peer_timeout=1.0, request_timeout=20.0, batch_chunks=1)
    reqs = workload(9, seed=32)
    with _pushed(transport, reqs, opts) as (_, decode, before):
        assert set(wait_all(decode, [r.rid for r in reqs], 10).values()) == {"done"}
        verify(decode.memory, SEED, reqs, before)
    assert transport.chunks_per_write() == [1] * sum(len(r.sends) for r in reqs)


class FailBatches(Recording):
    """Refuses every write that carries more than one chunk, before a byte moves."""

    def write(self, plan: TransferPlan, peer: str, notif: bytes, label: str = "") -> LocalHandle:
        if isinstance(wire.decode(notif), wire.Batch):
            raise TransportError(f"write {label!r} to peer {peer!r} refused by the test")
        return super().write(plan, peer, notif, label)


def test_a_failed_batched_write_fails_every_request_in_it_on_both_sides() -> None:
    transport = FailBatches()
    whole = [r for r in workload(16, seed=33) if len(r.sends) == 1]   # six of one chunk: two refused writes
    with _pushed(transport, whole) as (prefill, decode, before):
        for req in whole:
            for ep in (prefill, decode):
                with pytest.raises(RequestFailed, match="refused by the test"):
                    ep.wait(req.rid, 5)
        _idle(prefill, decode)                          # every lease freed once the Fail said settled
        assert transport.notifs == []                   # nothing was written...
        for buf in decode.memory.layout.buffers:        # ...and no byte of decode's memory changed
            assert np.array_equal(decode.memory.array(buf.name), before[buf.name])
        labels = wait_all(prefill, [r.rid for r in whole], 1).values()
        named = [{r.rid for r in whole if r.rid in label} for label in labels]
        assert all(len(n) == 3 for n in named)          # the error names every request of its write...
        assert set().union(*named) == {r.rid for r in whole}   # ... of the two writes


def test_abort_of_one_request_in_a_batched_write_waits_for_that_write() -> None:
    """Two writes in flight carry three requests each (half the window of six); prefill aborts one. Decode
    keeps every lease while the writes are in flight; once they land the others complete with their bytes,
    and the aborted one's pages are freed only then."""
    transport = GatedTransport()
    reqs = [r for r in workload(16, seed=34) if len(r.sends) == 1][:6]
    with _pushed(transport, reqs) as (prefill, decode, before):
        _until(lambda: prefill.num_live_handles == 6)   # six records, two writes
        prefill.abort(reqs[1].rid, "changed my mind")
        with pytest.raises(RequestFailed, match="aborted by prefill"):
            prefill.wait(reqs[1].rid, 5)
        time.sleep(0.3)                                 # heartbeats pass: nothing settles under the write
        assert decode.num_live_leases == 6 and prefill.holds_source(reqs[1].rid)
        transport.gate.set()
        for req in reqs[:1] + reqs[2:]:
            decode.wait(req.rid, 5)
            prefill.wait(req.rid, 5)
        with pytest.raises(RequestFailed, match="aborted"):
            decode.wait(reqs[1].rid, 5)
        _idle(prefill, decode)
        verify(decode.memory, SEED, reqs, before)       # the aborted request's bytes landed too, whole


def test_a_request_aborted_while_queued_for_a_later_write_is_not_written() -> None:
    """Four chunks queued together, two per write: while the first write copies (the lock let go) prefill
    aborts the fourth request. It is not written, no byte of its pages changes, and decode frees them."""
    transport = CopyingTransport()
    opts = EndpointOptions(heartbeat_interval=0.1, peer_timeout=1.0, request_timeout=20.0, batch_chunks=2)
    reqs = [r for r in workload(16, seed=36) if len(r.sends) == 1][:4]
    with _pushed(transport, reqs, opts) as (prefill, decode, before):
        assert transport.copying.wait(5)
        assert prefill.holds_source(reqs[3].rid)        # queued for the next write: as good as in flight
        prefill.abort(reqs[3].rid, "changed my mind")
        transport.done.set()
        for req in reqs[:3]:
            decode.wait(req.rid, 5)
        with pytest.raises(RequestFailed, match="aborted by prefill"):
            decode.wait(reqs[3].rid, 5)
        _idle(prefill, decode)
        verify(decode.memory, SEED, reqs[:3], before)   # and the fourth request's pages are untouched


def test_decode_reads_a_batched_notification_chunk_by_chunk(
        recorded: tuple[PrefillEndpoint, DecodeEndpoint, Recording]) -> None:
    """A Batch notification's bad item is counted and dropped; the chunks beside it are handled (here one
    for no lease: a stray notification, counted as such)."""
    prefill, decode, transport = recorded
    stray = wire.encode(wire.Chunk("nobody", 1, 0, True, 1, b""))
    frame = wire.batch_frame([wire.encode(wire.Heartbeat()), stray])
    agent = decode.transport.agent_name
    with prefill._lock:
        prefill.core.call_soon(lambda: transport.send_notification(agent, frame))
        prefill._done_with_call()
    _until(lambda: decode.counters()["bad_messages"] == 1 and decode.counters()["stray_notifications"] == 1)


# -- pull mode: decode's reads, batched the same way ----------------------------------------------------
class RecordingReads(LocalTransport):
    """A local transport that remembers how many chunks each read carried (its label names each)."""

    def __init__(self, refuse_batches: bool = False) -> None:
        super().__init__()
        self.reads: list[int] = []
        self.tried: list[int] = []   # every read asked for, refused or not
        self.refuse_batches = refuse_batches

    def read(self, plan: TransferPlan, peer: str, label: str = "") -> LocalHandle:
        chunks = label.count(", ") + 1
        self.tried.append(chunks)
        if self.refuse_batches and chunks > 1:
            raise TransportError(f"read {label!r} from peer {peer!r} refused by the test")
        self.reads.append(chunks)
        return super().read(plan, peer, label)


def _batching_until_read(decode: DecodeEndpoint) -> None:
    """Decode's progress iterations that read no Ready leave ``batching`` as the test set it; the first that
    reads one goes on as the library does. Decode's thread may have polled its sockets before the Readys
    came, then waited for the lock: the iteration it runs on that poll's answer reads none of them and would
    clear the flag (it posted nothing), so the next, reading them all, would post its first read alone."""
    batches = decode.core.batches
    real = batches.next_iteration

    def next_iteration() -> None:
        if batches._seen:   # this iteration read Readys: the library's own from now on
            del batches.next_iteration
            real()

    batches.next_iteration = next_iteration   # type: ignore[method-assign]


def _offer_together(prefill: PrefillEndpoint, decode: DecodeEndpoint, reqs: list[Any]) -> None:
    """Prefill offers every chunk (its Readys) while decode's progress thread waits for the lock: decode's
    first iteration that reads a Ready reads them all, batched from the first."""
    with decode._lock:
        decode.core.batches.batching = True
        # Not only the flag: once, on a loaded host, decode read the six Readys of the refused-reads test in
        # an iteration that followed one on a stale poll, which had cleared it: reads of 1, 3 and 2 chunks,
        # and the lone one was not refused (DID NOT RAISE).
        _batching_until_read(decode)
        run_prefill(prefill, reqs)
        _until(lambda: all(prefill.poll(r.rid) is RequestState.TRANSFERRING for r in reqs))
        # The last Readys reach decode's socket: handed to ZMQ (prefill's outbox empty), then its I/O thread
        # delivers them. Once, a loaded CI host took longer than the 50 ms alone this had: decode read two
        # Readys in one iteration and the rest in the next, and the test's "queued" read was never queued.
        _until(lambda: not prefill.core.outbox)
        time.sleep(0.1)


def _pulling(decode_transport: LocalTransport, **opts: Any) -> tuple[PrefillEndpoint, DecodeEndpoint, Any]:
    src, dst = _memories()
    options = EndpointOptions(heartbeat_interval=0.1, peer_timeout=1.0, request_timeout=20.0, **opts)
    prefill = PrefillEndpoint(src, "local", options=options, mode="pull")
    decode = DecodeEndpoint(dst, decode_transport, options=options, mode="pull")
    decode.connect(prefill.address)
    return prefill, decode, snapshot(dst)


def test_pull_reads_ready_together_go_as_one_read_and_every_request_completes() -> None:
    transport = RecordingReads()
    prefill, decode, before = _pulling(transport)
    reqs = workload(24, seed=41)
    with prefill, decode:
        announce(decode, reqs)
        _heard(prefill, reqs)
        _offer_together(prefill, decode, reqs)
        assert set(wait_all(decode, [r.rid for r in reqs], 10).values()) == {"done"}
        assert set(wait_all(prefill, [r.rid for r in reqs], 10).values()) == {"done"}
        verify(decode.memory, SEED, reqs, before)
        _idle(prefill, decode)
        assert sum(prefill.holds_source(r.rid) for r in reqs) == 0
    assert sum(transport.reads) == sum(len(r.sends) for r in reqs)
    assert max(transport.reads) == group_cap(OPTS.batch_chunks, len(reqs)) == len(reqs) // 2   # half the window
    assert len(transport.reads) < sum(transport.reads) // 4
    transport.close()


def test_a_failed_batched_read_fails_every_request_in_it() -> None:
    transport = RecordingReads(refuse_batches=True)
    prefill, decode, before = _pulling(transport)
    reqs = [r for r in workload(16, seed=42) if len(r.sends) == 1]   # six of one chunk: two refused reads
    with prefill, decode:
        announce(decode, reqs)
        _heard(prefill, reqs)
        _offer_together(prefill, decode, reqs)
        # What the test needs: the six Readys read in one iteration, as two reads of three (half the window).
        _until(lambda: sum(transport.tried) >= len(reqs))
        assert transport.tried == [3, 3], f"decode did not read the Readys together: reads of {transport.tried} chunks"
        for req in reqs:
            for ep in (decode, prefill):
                with pytest.raises(RequestFailed, match="refused by the test"):
                    ep.wait(req.rid, 5)
        _idle(prefill, decode)
        _until(lambda: sum(prefill.holds_source(r.rid) for r in reqs) == 0)
        for buf in decode.memory.layout.buffers:
            assert np.array_equal(decode.memory.array(buf.name), before[buf.name])
    transport.close()


def test_a_request_aborted_while_its_read_is_queued_is_not_read() -> None:
    """Four chunks ready together, two per read: while the first read copies, decode aborts the fourth
    request. It is not read, its pages are untouched and free again, and prefill lets go of its source."""
    transport = CopyingTransport()
    prefill, decode, before = _pulling(transport, batch_chunks=2)
    reqs = [r for r in workload(16, seed=43) if len(r.sends) == 1][:4]
    with prefill, decode:
        announce(decode, reqs)
        _heard(prefill, reqs)
        _offer_together(prefill, decode, reqs)
        assert transport.copying.wait(5)
        decode.abort(reqs[3].rid, "changed my mind")
        assert decode.num_live_leases == 4          # its read is queued: the lease waits for it
        transport.done.set()
        for req in reqs[:3]:
            decode.wait(req.rid, 5)
        with pytest.raises(RequestFailed, match="aborted"):
            prefill.wait(reqs[3].rid, 5)
        _idle(prefill, decode)
        _until(lambda: not prefill.holds_source(reqs[3].rid))
        verify(decode.memory, SEED, reqs[:3], before)
    transport.close()


# -- the pieces -------------------------------------------------------------------------------------------
def _plans(n: int, pages: int = 2) -> tuple[KVMemory, KVMemory, list[TransferPlan]]:
    src, dst = _memories()
    rng = np.random.default_rng(5)
    cap = min(src.layout.pool("main").min_pages, dst.layout.pool("main").min_pages)
    picks = rng.permutation(cap)[: 2 * n * pages].reshape(n, 2, pages)
    return src, dst, [plan_transfer(src, dst, {"main": (p[0], p[1])}) for p in picks]


def test_concat_plans_refuses_plans_between_other_memories() -> None:
    src, dst, plans = _plans(2)
    other = plan_transfer(src, KVMemory.allocate(dst.layout), {"main": ([0], [0])})
    with pytest.raises(PlanError, match="same two memories"):
        concat_plans([plans[0], other])


def _pairs(plan: TransferPlan) -> list[tuple[int, ...]]:
    return sorted(map(tuple, np.concatenate([plan.src_descs, plan.dst_descs], axis=1).tolist()))


def test_concat_plans_joins_pools_over_the_same_buffers_and_moves_the_same_rows() -> None:
    """Parts over two pools and two buffer selections (layer by layer): pool plans over the same buffers
    become one, and the joined plan moves exactly the parts' rows (as pairs) and selectors."""
    src, dst = _memories()
    reqs = workload(6, seed=37)
    layer = tuple(b.name for b in src.layout.buffers if b.name.endswith("L0"))
    parts = [plan_transfer(src, dst, {p: (r.src[p], r.dst[p]) for p in r.src}, buffers=layer if i % 2 else None)
             for i, r in enumerate(reqs)]
    joined = concat_plans(parts)
    assert len(joined.pools) == 4                       # (main, c4) x (all buffers, layer 0)
    assert _pairs(joined) == sorted(row for p in parts for row in _pairs(p))
    pick = sorted(zip(*(s.tolist() for s in joined.page_selectors()), strict=True))
    assert pick == sorted(pair for p in parts for pair in zip(*(s.tolist() for s in p.page_selectors()), strict=True))
    assert joined.num_descriptors == sum(p.num_descriptors for p in parts) == len(joined.src_descs)
    assert joined.nbytes == sum(p.nbytes for p in parts)


def test_write_groups_cut_at_every_cap_and_keep_order() -> None:
    _, _, plans = _plans(7)
    queued = [Queued(i, p, b"x" * 10, f"r{i}") for i, p in enumerate(plans)]
    assert [[q.rec for q in g] for g in write_groups(queued, 3, 1 << 30)] == [[0, 1, 2], [3, 4, 5], [6]]
    size = plans[0].nbytes
    assert [len(g) for g in write_groups(queued, 16, 2 * size)] == [2, 2, 2, 1]
    big = [Queued(i, p, b"x" * (NOTIF_BYTES // 2 + 1), "") for i, p in enumerate(plans[:3])]
    assert [len(g) for g in write_groups(big, 16, 1 << 30)] == [1, 1, 1]

    class Slices(TransferPlan):   # not the planner's own type (a TP plan, the fault injector's)
        pass

    odd = Queued("odd", Slices(plans[0].src_memory, plans[0].dst_memory, plans[0].pools), b"", "")
    assert not joinable(odd.plan)
    groups = list(write_groups([*queued[:2], odd, *queued[2:4]], 16, 1 << 30))
    assert [[q.rec for q in g] for g in groups] == [[0, 1], ["odd"], [2, 3]]


@pytest.mark.parametrize("bad", [{"batch_chunks": 0}, {"batch_chunks": wire.MAX_BATCH + 1}, {"batch_bytes": 0},
                                 {"batch_chunks": True}])
def test_batch_options_are_checked(bad: dict[str, Any]) -> None:
    with pytest.raises(UsageError, match=next(iter(bad))):
        EndpointOptions(**bad)


def test_batching_over_nixl_in_one_process() -> None:
    """The same, over NIXL (UCX) between two agents: one write of several chunks lands whole and its Batch
    notification completes each request."""
    pytest.importorskip("kvferry.transport.nixl")
    src, dst = _memories()
    before = snapshot(dst)
    reqs = workload(12, seed=35)
    with PrefillEndpoint(src, "nixl", options=OPTS) as prefill, DecodeEndpoint(dst, "nixl", options=OPTS) as decode:
        decode.connect(prefill.address)
        announce(decode, reqs)
        _heard(prefill, reqs)
        written = threading.Event()
        real = prefill.transport.write

        def spy(plan: Any, peer: str, notif: bytes, label: str = "") -> Any:
            if isinstance(wire.decode(notif), wire.Batch):
                written.set()
            return real(plan, peer, notif, label)

        prefill.transport.write = spy   # type: ignore[method-assign]
        _send_together(prefill, reqs)
        assert set(wait_all(decode, [r.rid for r in reqs], 20).values()) == {"done"}
        assert written.is_set()
        verify(dst, SEED, reqs, before)
        _idle(prefill, decode)


@pytest.mark.parametrize(("max_chunks", "in_flight", "cap"),
                         [(64, 0, 1), (64, 1, 1), (64, 3, 1), (64, 4, 2), (64, 64, 32), (64, 500, 64), (16, 64, 16),
                          (1, 64, 1)])
def test_a_transfer_carries_at_most_half_the_window(max_chunks: int, in_flight: int, cap: int) -> None:
    assert group_cap(max_chunks, in_flight) == cap
