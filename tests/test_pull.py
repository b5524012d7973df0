"""Pull mode (issue 11) in one process over the local transport: decode reads prefill's pages.

Every test that moves bytes checks the bytes that arrived. The mode handshake refuses a mismatch before any
byte moves; a stalled prefill writes nothing into decode (it never writes); aborts on either side end the
decode lease and prefill's source hold; a reused source page under a slow reader is caught by digests.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from typing import Any

import numpy as np
import pytest

from kvferry import KVMemory, ModeMismatch, PeerLost
from kvferry.control import DecodeEndpoint, EndpointOptions, PrefillEndpoint, RequestState, wire
from kvferry.errors import IntegrityError, RequestFailed, TransportError, UsageError
from kvferry.plan import TransferPlan, plan_transfer
from kvferry.transport import LocalTransport
from kvferry.transport.local import LocalHandle

from .control_peer import announce, run_prefill, snapshot, verify, wait_all, workload
from .test_control_local import OPTS, SEED, CopyingTransport, _assert_idle, _memories, _until
from .test_fencing import PAGES_A, SRC_A, _block, _holds, _memory


@pytest.fixture
def pulling() -> Iterator[tuple[PrefillEndpoint, DecodeEndpoint]]:
    src, dst = _memories()
    prefill = PrefillEndpoint(src, "local", options=OPTS, mode="pull")
    decode = DecodeEndpoint(dst, "local", options=OPTS, mode="pull")
    decode.connect(prefill.address)
    yield prefill, decode
    decode.close()
    prefill.close()


class NoWrites(LocalTransport):
    """Prefill's transport in pull mode: any write is a bug, so it fails the test where it happens."""

    def __init__(self) -> None:
        super().__init__()
        self.writes = 0

    def write(self, plan: TransferPlan, peer: str, notif: bytes, label: str = "") -> LocalHandle:
        self.writes += 1
        raise TransportError(f"pull mode must not write ({label!r})")


# -- the transport's read -------------------------------------------------------------------------------
def test_local_read_copies_from_the_peer_and_checks_both_sides() -> None:
    src, dst = _memories()
    before = snapshot(dst)
    with LocalTransport() as source, LocalTransport() as reader:
        source.register(src)
        reader.add_peer(source.register(src))
        reader_meta = reader.register(dst)
        source.add_peer(reader_meta)
        remote = KVMemory.from_manifest(src.manifest())
        plan = plan_transfer(remote, dst, {"main": ([3, 4, 5], [7, 8, 9]), "c4": ([1], [2])})
        with reader.read(plan, source.agent_name, "r") as handle:
            assert handle.poll()
        for pool, (s, d) in {"main": ([3, 4, 5], [7, 8, 9]), "c4": ([1], [2])}.items():
            for buf in dst.layout.pool(pool).buffers:
                assert np.array_equal(dst.array(buf.name)[d], src.array(buf.name)[s])
        assert source.get_notifications() == []   # the source hears nothing of a read
        # A plan whose source rows lie outside the peer's registered regions is refused, nothing copied.
        mark = {k: v.copy() for k, v in snapshot(dst).items()}
        bad = plan_transfer(remote, dst, {"main": ([3], [11])})
        rows = bad.src_descs.copy()
        rows[0, 0] += 1 << 40

        class Shifted(TransferPlan):
            @property
            def src_descs(self) -> np.ndarray:
                return rows

        shifted = Shifted(bad.src_memory, bad.dst_memory, bad.pools)
        with pytest.raises(TransportError, match="source row 0 .* outside every registered source region"):
            reader.read(shifted, source.agent_name, "bad")
        assert all(np.array_equal(dst.array(k), v) for k, v in mark.items())
    assert not np.array_equal(dst.array("main.kv.L0")[[7, 8, 9]], before["main.kv.L0"][[7, 8, 9]])


# -- the control plane ----------------------------------------------------------------------------------
@pytest.mark.parametrize("digest_mode", ["sampled", "full"])
def test_many_requests_chunked_and_layered(digest_mode: str) -> None:
    src, dst = _memories()
    before = snapshot(dst)
    reqs = workload(64, seed=1)
    writer = NoWrites()
    with PrefillEndpoint(src, writer, options=OPTS, digest_mode=digest_mode, mode="pull") as prefill, \
            DecodeEndpoint(dst, "local", options=OPTS, digest_mode=digest_mode, mode="pull") as decode:
        decode.connect(prefill.address)
        announce(decode, reqs[:32])
        sender = threading.Thread(target=run_prefill, args=(prefill, reqs))
        sender.start()
        announce(decode, reqs[32:])
        sender.join()
        assert set(wait_all(decode, [r.rid for r in reqs], 20).values()) == {"done"}
        assert set(wait_all(prefill, [r.rid for r in reqs], 20).values()) == {"done"}
        verify(dst, SEED, reqs, before)
        assert not any(prefill.holds_source(r.rid) for r in reqs)   # decode's Result released every hold
        assert decode.num_quarantined_pages == 0 and decode.peak_quarantined_pages == 0
        _assert_idle(prefill, decode)
        assert prefill.counters()["source_holds"] == 0
    assert writer.writes == 0
    writer.close()


def test_mode_is_chosen_per_pair() -> None:
    """One decode, two prefills: push with one, pull with the other, each request's bytes checked."""
    src1, src2, dst = _memory("prefill", 7), _memory("prefill", 7), _memory("decode", 999)
    before = snapshot(dst)
    reqs = workload(8, seed=3)
    with PrefillEndpoint(src1, "local", options=OPTS) as pusher, \
            PrefillEndpoint(src2, "local", options=OPTS, mode=("push", "pull")) as either, \
            DecodeEndpoint(dst, "local", options=OPTS) as decode:
        decode.connect(pusher.address)
        decode.connect(either.address, mode="pull")
        for i, req in enumerate(reqs):
            decode.announce(req.rid, req.dst, peer=(pusher if i % 2 else either).address)
        run_prefill(pusher, reqs[1::2])
        run_prefill(either, reqs[0::2])
        assert set(wait_all(decode, [r.rid for r in reqs], 10).values()) == {"done"}
        verify(dst, 7, reqs, before)
        with pytest.raises(ModeMismatch, match="connected in transfer mode 'pull', asked for 'push'"):
            decode.connect(either.address, mode="push")


@pytest.mark.parametrize(("prefill_mode", "decode_mode"), [("push", "pull"), ("pull", "push")])
def test_mode_mismatch_is_refused_before_anything_moves(prefill_mode: str, decode_mode: str) -> None:
    src, dst = _memories()
    before = snapshot(dst)
    with PrefillEndpoint(src, "local", options=OPTS, mode=prefill_mode) as prefill, \
            DecodeEndpoint(dst, "local", options=OPTS, mode=decode_mode) as decode:
        with pytest.raises(ModeMismatch) as info:
            decode.connect(prefill.address, timeout=5)
        text = str(info.value)
        assert prefill.address in text and f"asked for {decode_mode!r}" in text
        assert f"accepts [{prefill_mode!r}]" in text
        assert decode.peers == [] and prefill.peers == []
        with pytest.raises(PeerLost):
            decode.announce("x", {"main": [1]})
    assert all(np.array_equal(dst.array(k), v) for k, v in before.items())


def test_unknown_mode_is_a_usage_error() -> None:
    src, dst = _memories()
    with pytest.raises(UsageError, match="transfer mode must be one of"):
        DecodeEndpoint(dst, "local", mode="carrier-pigeon")
    with pytest.raises(UsageError, match="at least one transfer mode"):
        PrefillEndpoint(src, "local", mode=())
    tight = EndpointOptions(heartbeat_interval=0.4, peer_timeout=1.0)   # fence 0.6 s: heartbeats would trip it
    with pytest.raises(UsageError, match=r"pull mode needs peer_timeout >= 3 x heartbeat_interval"):
        DecodeEndpoint(dst, "local", mode="pull", options=tight)
    with DecodeEndpoint(dst, "local", options=tight) as decode, \
            pytest.raises(UsageError, match=r"peer_timeout 1 s, heartbeat_interval 0.4 s"):
        decode.connect("tcp://127.0.0.1:9", mode="pull")


def test_states_and_source_hold(pulling: tuple[PrefillEndpoint, DecodeEndpoint]) -> None:
    prefill, decode = pulling
    req = workload(1, seed=2)[0]
    prefill.send(req.rid, {"main": req.src["main"][:2]}, last=False)
    assert not prefill.holds_source(req.rid)               # nothing offered yet
    decode.announce(req.rid, req.dst)
    _until(lambda: decode.poll(req.rid) is RequestState.TRANSFERRING)
    assert prefill.holds_source(req.rid)                   # offered: decode may read it
    prefill.send(req.rid, {"main": req.src["main"][2:], "c4": req.src["c4"]}, offset={"main": 2}, last=True)
    decode.wait(req.rid, 5)
    prefill.wait(req.rid, 5)
    assert not prefill.holds_source(req.rid)
    assert _holds(decode.memory, prefill.memory, req.dst, req.src)
    _assert_idle(prefill, decode)


@pytest.mark.parametrize("side", ["decode", "prefill"])
def test_abort_ends_the_lease_and_the_source_hold(pulling: tuple[PrefillEndpoint, DecodeEndpoint],
                                                  side: str) -> None:
    prefill, decode = pulling
    req = workload(3, seed=5)[1]                            # sent in two chunks
    decode.announce(req.rid, req.dst)
    prefill.send(req.rid, **_first_chunk(req))
    _until(lambda: decode.poll(req.rid) is RequestState.TRANSFERRING)
    assert prefill.holds_source(req.rid) and decode.holds_lease(req.rid)
    (decode if side == "decode" else prefill).abort(req.rid, "changed my mind")
    for ep in (decode, prefill):
        with pytest.raises(RequestFailed, match=f"aborted by {side}"):
            ep.wait(req.rid, 5)
    _until(lambda: not decode.holds_lease(req.rid) and not prefill.holds_source(req.rid), 2)
    assert decode.peak_quarantined_pages == 0               # nothing but decode writes its pages
    decode.announce("reuse", req.dst)                       # the pages are free again at once
    prefill.send("reuse", req.src)
    decode.wait("reuse", 5)
    assert _holds(decode.memory, prefill.memory, req.dst, req.src)
    _assert_idle(prefill, decode)


def _first_chunk(req: Any) -> dict[str, Any]:
    first = req.sends[0]
    return {"pages": first["pages"], "offset": first["offset"], "last": first["last"], "buffers": first["buffers"]}


def test_source_page_reused_under_a_slow_reader_is_caught() -> None:
    """Prefill's engine overwrites a source page after offering it and before decode reads it: the bytes
    decode reads are not those prefill hashed, and full digests fail the request on both sides."""
    src, dst = _memories()

    class SlowReader(LocalTransport):
        def read(self, plan: TransferPlan, peer: str, label: str = "") -> LocalHandle:
            src.array("main.kv.L1")[int(SRC_A["main"][2])] ^= 0x5A   # reused under the reader
            return super().read(plan, peer, label)

    reader = SlowReader()
    with PrefillEndpoint(src, "local", options=OPTS, mode="pull", digest_mode="full") as prefill, \
            DecodeEndpoint(dst, reader, options=OPTS, mode="pull", digest_mode="full") as decode:
        decode.connect(prefill.address)
        decode.announce("a", PAGES_A)
        prefill.send("a", SRC_A)
        for ep in (decode, prefill):
            with pytest.raises(RequestFailed) as info:
                ep.wait("a", 5)
            assert isinstance(info.value.__cause__, IntegrityError), info.value.__cause__
        assert "main.kv.L1" in str(decode.failure("a"))
        _until(lambda: not decode.holds_lease("a") and not prefill.holds_source("a"))
    reader.close()


def test_stalled_prefill_writes_nothing_into_reused_pages() -> None:
    """Issue 11's defect in pull mode: prefill 1 stalls (its progress thread holds its lock) with decode's
    pages X offered; decode declares it dead, frees X at once (no writer but itself), serves a second
    prefill's requests on X, verified. Prefill 1 resumes: nothing it does can change decode's memory."""
    opts = EndpointOptions(heartbeat_interval=0.2, peer_timeout=1.0, lease_grace=0.2, request_timeout=30.0,
                           transport_liveness=False)   # a thread's stall standing for a process's: silence decides
    src1, src2, dst = _memory("prefill", 7), _memory("prefill", 8), _memory("decode", 999)
    writer = NoWrites()
    with PrefillEndpoint(src1, writer, options=opts, mode="pull") as p1, \
            PrefillEndpoint(src2, "local", options=opts, mode="pull") as p2, \
            DecodeEndpoint(dst, "local", options=opts, mode="pull") as decode:
        decode.connect(p1.address)
        decode.connect(p2.address)
        decode.announce("a", PAGES_A, peer=p1.address)
        _until(lambda: _known(p1, "a"), 5)
        stall = threading.Thread(target=_hold_lock, args=(p1, 3.0))
        stall.start()
        with pytest.raises(RequestFailed) as info:
            decode.wait("a", 5)
        assert isinstance(info.value.__cause__, PeerLost)
        _until(lambda: not decode.holds_lease("a"), 1)      # no quarantine in pull mode
        decode.announce("x", PAGES_A, peer=p2.address)
        p2.send("x", SRC_A)
        decode.wait("x", 5)
        assert _holds(dst, src2, PAGES_A, SRC_A)
        served = 0
        while stall.is_alive():                              # more reuse while prefill 1 is stalled
            s, d = _block(served)
            decode.announce(f"b{served}", d, peer=p2.address)
            p2.send(f"b{served}", s)
            decode.wait(f"b{served}", 5)
            served += 1
        stall.join()
        with pytest.raises(RequestFailed):                  # prefill 1 resumes and hands its KV over
            p1.send("a", SRC_A)
            p1.wait("a", 5)
        time.sleep(3 * opts.heartbeat_interval)
        assert _holds(dst, src2, PAGES_A, SRC_A)             # X still holds the second prefill's bytes
        assert served > 0 and writer.writes == 0
    writer.close()


def _known(ep: PrefillEndpoint, rid: str) -> bool:
    try:
        ep.poll(rid)
    except UsageError:
        return False
    return True


def _hold_lock(ep: Any, seconds: float) -> None:
    """Stall ``ep``'s progress thread: hold the endpoint's lock, as a GC pause or SIGSTOP would."""
    with ep._lock:
        time.sleep(seconds)


@pytest.mark.parametrize("read_fails", [False, True])
def test_announce_and_abort_are_served_while_a_read_copies(read_fails: bool) -> None:
    """Decode lets go of its lock while a read copies: ``announce`` and ``abort`` answer at once, and an
    abort that came during the copy ends the lease only once that read is over (landed or failed)."""
    src, dst = _memories()
    before = snapshot(dst)
    reader = CopyingTransport()
    with PrefillEndpoint(src, "local", options=OPTS, mode="pull") as prefill, \
            DecodeEndpoint(dst, reader, options=OPTS, mode="pull") as decode:
        decode.connect(prefill.address)
        decode.announce("a", PAGES_A)
        prefill.send("a", SRC_A)
        assert reader.copying.wait(5)
        threading.Timer(2.0, reader.done.set).start()   # so that a decode holding its lock fails, not hangs
        t0 = time.monotonic()
        decode.announce("b", {"main": [40, 41]})         # accepted while the first read copies
        decode.abort("a", "changed my mind")
        assert time.monotonic() - t0 < 1.0
        assert decode.poll("a") is RequestState.FAILED and decode.holds_lease("a")
        if read_fails:
            reader.fail.set()
        reader.done.set()
        _until(lambda: not decode.holds_lease("a") and not prefill.holds_source("a"))
        prefill.send("b", {"main": [50, 51]})
        decode.wait("b", 5)
        _assert_idle(prefill, decode)
    a_dst = {} if read_fails else PAGES_A
    a_src = {} if read_fails else SRC_A
    for pool, b_dst, b_src in (("main", [40, 41], [50, 51]), ("c4", [], [])):
        landed = np.concatenate([a_dst.get(pool, []), b_dst]).astype(np.int64)
        sources = np.concatenate([a_src.get(pool, []), b_src]).astype(np.int64)
        for buf in dst.layout.pool(pool).buffers:
            got = dst.array(buf.name)
            assert np.array_equal(got[landed], src.array(buf.name)[sources]), buf.name
            untouched = np.setdiff1d(np.arange(len(got)), landed)
            assert np.array_equal(got[untouched], before[buf.name][untouched]), buf.name
    reader.close()


class StallingReader(LocalTransport):
    """Decode's transport whose first read sleeps ``stall`` seconds before copying: decode's progress thread
    stalls exactly between its last check (link current) and the read."""

    def __init__(self, stall: float) -> None:
        super().__init__()
        self.stall = stall
        self.stalled = threading.Event()

    def read(self, plan: TransferPlan, peer: str, label: str = "") -> LocalHandle:
        if not self.stalled.is_set():
            self.stalled.set()
            time.sleep(self.stall)
        return super().read(plan, peer, label)


def test_stalled_reader_accepts_nothing_prefill_released() -> None:
    """The late reader: decode stalls between its check and its read for longer than prefill's source hold
    after the session's death. Prefill releases, its engine reuses the source pages, decode then copies the
    new bytes, and its fence (not digests: they are off here) refuses them; the request is never DONE."""
    opts = EndpointOptions(heartbeat_interval=0.2, peer_timeout=1.0, lease_grace=0.2, request_timeout=30.0,
                           transport_liveness=False)   # a thread's stall standing for a process's: silence decides
    src, dst = _memory("prefill", 7), _memory("decode", 999)
    reader = StallingReader(stall=1.0 + 2 * 1.0 + 0.2 + 1.5)   # death (1 s) + hold (2.2 s) + a margin
    with PrefillEndpoint(src, "local", options=opts, mode="pull", digest_mode="off") as prefill, \
            DecodeEndpoint(dst, reader, options=opts, mode="pull", digest_mode="off") as decode:
        decode.connect(prefill.address)
        send = prefill.core.send_msg
        # Prefill's Bye would tell decode at once; drop it, so that only decode's own fence stands between
        # the reused bytes and a DONE (a Bye can be lost: a connection cut, a relay).
        prefill.core.send_msg = lambda session, msg: None if isinstance(msg, wire.Bye) else send(session, msg)
        decode.announce("a", PAGES_A)
        prefill.send("a", SRC_A)
        assert reader.stalled.wait(5)
        with pytest.raises(RequestFailed) as info:
            prefill.wait("a", 5)                               # decode silent: prefill declares it dead
        assert isinstance(info.value.__cause__, PeerLost)
        _until(lambda: not prefill.holds_source("a"), reader.stall)
        for pool in src.layout.pools:                        # the engine reuses the released pages
            for buf in pool.buffers:
                src.array(buf.name)[SRC_A[pool.name]] ^= 0xFF
        with pytest.raises(RequestFailed) as info:
            decode.wait("a", 10)
        assert isinstance(info.value.__cause__, PeerLost), info.value.__cause__
        assert "stalled" in str(info.value.__cause__)
        _until(lambda: not decode.holds_lease("a"), 2)
    reader.close()


@pytest.mark.parametrize(("pages", "needle"), [
    ({"main": np.array([0, 1, 2, 399])}, r"source page 399 is out of range"),   # valid for main.kv, not main.idx
    ({"main": np.array([0, 1, 2, 3, 4, 5])}, r"chunk 0 covers positions 0..5, lease has 4"),
])
def test_a_bad_ready_fails_the_request_and_reads_nothing(pages: dict[str, np.ndarray], needle: str) -> None:
    """A Ready is untrusted input: source pages outside prefill's layout, or more pages than the lease,
    fail the request on both sides before anything is read."""
    src, dst = _memories()
    before = snapshot(dst)
    with PrefillEndpoint(src, "local", options=OPTS, mode="pull") as prefill, \
            DecodeEndpoint(dst, "local", options=OPTS, mode="pull") as decode:
        decode.connect(prefill.address)
        send = prefill.core.send_msg

        def forge(session: Any, msg: Any) -> None:
            if isinstance(msg, wire.Ready):
                msg = wire.Ready(msg.request_id, msg.generation, msg.chunk, msg.last, msg.num_chunks,
                                 wire.encode_pages(pages), msg.offsets, msg.buffers, msg.digests)
            send(session, msg)

        prefill.core.send_msg = forge
        decode.announce("a", {"main": PAGES_A["main"]})
        prefill.send("a", {"main": SRC_A["main"]})
        for ep in (decode, prefill):
            with pytest.raises(RequestFailed, match=needle):
                ep.wait("a", 5)
        _until(lambda: not decode.holds_lease("a") and not prefill.holds_source("a"))
    assert all(np.array_equal(dst.array(k), v) for k, v in before.items())


@pytest.mark.parametrize("seed", [11, 12, 13])
def test_randomized_mix_of_modes_and_aborts(seed: int) -> None:
    """One decode, a push prefill and a pull prefill; each request goes to one of them and is completed,
    aborted by decode or aborted by prefill after its first chunk, at random. Every DONE request holds its
    source bytes; at the end no lease, no quarantine, no source hold and no handle is left."""
    import random

    rng = random.Random(seed)
    src_push, src_pull, dst = _memory("prefill", SEED), _memory("prefill", SEED), _memory("decode", 999)
    reqs = workload(48, seed=seed)
    # Liveness is not under test here: a peer_timeout a loaded 2-core box cannot trip by accident.
    opts = EndpointOptions(heartbeat_interval=0.2, peer_timeout=5.0, lease_grace=0.4, request_timeout=20.0)
    with PrefillEndpoint(src_push, "local", options=opts) as pusher, \
            PrefillEndpoint(src_pull, "local", options=opts, mode="pull") as puller, \
            DecodeEndpoint(dst, "local", options=opts) as decode:
        decode.connect(pusher.address)
        decode.connect(puller.address, mode="pull")
        fates: dict[str, str] = {}
        for req in reqs:
            prefill = rng.choice([pusher, puller])
            fate = rng.choices(["done", "decode", "prefill"], weights=[3, 1, 1])[0]
            if fate == "prefill" and len(req.sends) == 1:
                fate = "decode"   # sent in one go: an aborted request sends nothing, prefill never hears of it
            fates[req.rid] = fate
            decode.announce(req.rid, req.dst, peer=prefill.address)
            sends = req.sends if fate == "done" else req.sends[:1]
            for s in sends:
                if s is req.sends[-1] and fate != "done":
                    break   # an aborted request never gets its last chunk
                prefill.send(req.rid, s["pages"], offset=s["offset"], last=s["last"], buffers=s["buffers"])
            if fate != "done":
                (decode if fate == "decode" else prefill).abort(req.rid, "random abort")
        results = wait_all(decode, [r.rid for r in reqs], 20)
        for req in reqs:
            if fates[req.rid] == "done":
                assert results[req.rid] == "done", results[req.rid]
                assert _holds(dst, src_push, req.dst, req.src), req.rid
            else:
                assert f"aborted by {fates[req.rid]}: random abort" in results[req.rid], results[req.rid]
        _until(lambda: decode.num_live_leases == 0 and decode.num_quarantined_pages == 0, 5)
        _until(lambda: not any(p.holds_source(r.rid) for p in (pusher, puller) for r in reqs), 5)
        _assert_idle(pusher, puller, decode)


@pytest.mark.parametrize("side", ["decode", "prefill"])
def test_deadline_on_either_side_ends_the_lease_and_the_source_hold(side: str) -> None:
    """Half a request is offered and read, the rest never comes: the side with the short request_timeout
    fails it, the other follows, decode's lease and prefill's source hold both end, no quarantine."""
    src, dst = _memories()
    short = EndpointOptions(heartbeat_interval=0.1, peer_timeout=5.0, request_timeout=0.5)
    long = EndpointOptions(heartbeat_interval=0.1, peer_timeout=5.0, request_timeout=30.0)
    req = workload(3, seed=6)[1]                               # sent in two chunks
    with PrefillEndpoint(src, "local", options=short if side == "prefill" else long, mode="pull") as prefill, \
            DecodeEndpoint(dst, "local", options=short if side == "decode" else long, mode="pull") as decode:
        decode.connect(prefill.address)
        decode.announce(req.rid, req.dst)
        prefill.send(req.rid, **_first_chunk(req))
        _until(lambda: decode.poll(req.rid) is RequestState.TRANSFERRING)
        for ep in (decode, prefill):
            with pytest.raises(RequestFailed) as info:
                ep.wait(req.rid, 5)
            text = str(info.value)
            assert "not done within 0.5 s" in text or "decode deadline passed" in text, text
        _until(lambda: not decode.holds_lease(req.rid) and not prefill.holds_source(req.rid), 2)
        assert decode.peak_quarantined_pages == 0
        _assert_idle(prefill, decode)


@pytest.mark.parametrize(("address", "mode"), [
    ("tcp://127.0.0.1:5555", "push"), ("tcp://127.3.4.5:1", "push"), ("tcp://[::1]:5555", "push"),
    ("tcp://localhost:5555", "push"), ("tcp://10.0.0.5:5555", "pull"), ("tcp://[fd00::2]:5555", "pull"),
    ("tcp://prefill-0.prefill.svc:5555", "pull"), ("tcp://0.0.0.0:5555", "pull")])
def test_auto_pushes_on_loopback_and_pulls_from_any_other_host(address: str, mode: str) -> None:
    """Decode's default mode: push where a dead prefill is certainly dead once its process is gone (this
    host), pull anywhere else, where push would quarantine its pages until it came back (test_netns_death)."""
    from kvferry.control.pull import mode_for

    assert mode_for("auto", address) == mode
    assert mode_for("push", address) == "push" and mode_for("pull", address) == "pull"


def test_default_endpoints_agree_on_push_over_loopback() -> None:
    """Neither side configured: the prefill accepts both modes, decode's auto asks for push on loopback."""
    src, dst = _memories()
    with PrefillEndpoint(src, "local", options=OPTS) as prefill, DecodeEndpoint(dst, "local", options=OPTS) as decode:
        assert prefill.modes == frozenset({"push", "pull"}) and decode.mode == "auto"
        decode.connect(prefill.address)
        with pytest.raises(ModeMismatch, match="connected in transfer mode 'push', asked for 'pull'"):
            decode.connect(prefill.address, mode="pull")
