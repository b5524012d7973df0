"""Wire protocol, states and leases in isolation; raw and random messages against live endpoints."""

from __future__ import annotations

import contextlib
import time
from collections.abc import Iterator
from typing import Any

import msgspec
import numpy as np
import pytest
import zmq
from hypothesis import assume, given
from hypothesis import strategies as st

from kvferry import IncompatiblePeer, KVMemory, LeaseError, PeerLost
from kvferry.control import DecodeEndpoint, EndpointOptions, PrefillEndpoint, RequestState, wire
from kvferry.control.core.leases import LeaseTable
from kvferry.control.core.states import TERMINAL, TRANSITIONS, advance, can_advance
from kvferry.errors import InternalError, RequestFailed

from .control_peer import fill, make_layout, run_prefill, workload

# Silence decides here: these tests stall a thread, not a process (the default transport_liveness would
# keep a peer whose libzmq still answers).
OPTS = EndpointOptions(heartbeat_interval=0.1, peer_timeout=0.6, lease_grace=0.5, transport_liveness=False)


# -- pure units ----------------------------------------------------------------------------------------------
def test_states_only_move_forward() -> None:
    for state in TERMINAL:
        assert not TRANSITIONS[state]
    assert not can_advance(RequestState.BOOTSTRAPPING, RequestState.DONE)
    assert not can_advance(RequestState.WAITING_FOR_INPUT, RequestState.DONE)
    with pytest.raises(InternalError, match="illegal state transition failed -> done"):
        advance(RequestState.FAILED, RequestState.DONE, "r")


def test_messages_round_trip_and_versions_are_checked() -> None:
    msg = wire.Announce("r1", 7, wire.encode_pages({"main": np.array([3, 1, 2])}))
    back = wire.decode(wire.encode(msg))
    assert back == msg
    assert wire.decode_pages(back.pages)["main"].tolist() == [3, 1, 2]
    newer = wire.PROTOCOL_VERSION + 1   # was the literal 2 while the protocol was at version 1
    with pytest.raises(wire.ProtocolError, match=f"protocol version {newer} is not supported"):
        wire.decode(wire.encode(msg, version=newer))
    reject = wire.decode(wire.encode(wire.Reject("go away"), version=99))  # readable across versions
    assert isinstance(reject, wire.Reject)
    with pytest.raises(wire.ProtocolError, match="malformed 'announce'"):
        wire.decode(msgspec.msgpack.encode([wire.PROTOCOL_VERSION, "announce", [1, 2]]))
    with pytest.raises(wire.ProtocolError, match="whole number of int64"):
        wire.decode_pages({"main": b"\x00" * 7})


def test_several_messages_travel_as_one_batch_frame() -> None:
    msgs = [wire.Announce(f"r{i}", i, wire.encode_pages({"main": np.array([i, i + 1])})) for i in range(5)]
    msgs.append(wire.Result("r0", 0, True, ""))
    frames = wire.batches([wire.encode(m) for m in msgs])
    assert len(frames) == 1
    batch = wire.decode(frames[0])
    assert isinstance(batch, wire.Batch) and wire.unbatch(batch) == msgs     # in order, each typed
    assert wire.batches([wire.encode(msgs[0])]) == [wire.encode(msgs[0])]     # one goes alone, unwrapped
    # Split by count and by bytes; a message above the byte budget goes alone, in its place.
    many = [wire.encode(wire.Heartbeat())] * (wire.MAX_BATCH + 3)
    assert [len(wire.unbatch(wire.decode(f))) for f in wire.batches(many)] == [wire.MAX_BATCH, 3]
    big = wire.encode(wire.Welcome("w", b"m" * wire.BATCH_BYTES, b"", b"", 1.0, "off"))
    frames = wire.batches([many[0], many[0], big, many[0]])
    assert [type(wire.decode(f)).__name__ for f in frames] == ["Batch", "Welcome", "Heartbeat"]


def test_forged_batches_are_refused_by_name() -> None:
    hb = wire.encode(wire.Heartbeat())

    def batch(items: list[bytes]) -> bytes:
        return msgspec.msgpack.encode([wire.PROTOCOL_VERSION, "batch", [items]])

    with pytest.raises(wire.ProtocolError, match=f"MAX_BATCH={wire.MAX_BATCH}"):
        wire.decode(batch([hb] * (wire.MAX_BATCH + 1)))
    with pytest.raises(wire.ProtocolError, match="malformed 'batch'"):
        wire.decode(msgspec.msgpack.encode([wire.PROTOCOL_VERSION, "batch", [[1, 2]]]))
    with pytest.raises(wire.ProtocolError, match=f"protocol version {wire.PROTOCOL_VERSION + 1}"):
        wire.decode(msgspec.msgpack.encode([wire.PROTOCOL_VERSION + 1, "batch", [[hb, hb]]]))
    # Inside a batch, each message is checked as if it came alone; a bad one stands in its place.
    newer = wire.encode(wire.Heartbeat(), version=wire.PROTOCOL_VERSION + 1)
    out = wire.unbatch(wire.decode(batch([hb, newer, batch([hb, hb]), b"\x93junk", hb])))
    assert isinstance(out[0], wire.Heartbeat) and isinstance(out[4], wire.Heartbeat)
    assert "protocol version" in str(out[1]) and "a Batch inside a Batch" in str(out[2])
    assert isinstance(out[3], wire.ProtocolError)


def test_lease_table_is_all_or_nothing() -> None:
    table = LeaseTable(make_layout("decode"))
    table.acquire(1, "a", {"main": [1, 2], "c4": [0]})
    with pytest.raises(LeaseError, match="page 2 is leased to live request 'a'"):
        table.acquire(2, "b", {"c4": [1], "main": [2, 3]})
    assert table.num_leases == 1 and table.num_leased_pages == 3   # b's c4 page was not taken
    table.release(1)
    table.acquire(2, "b", {"c4": [1], "main": [2, 3]})
    assert table.num_leased_pages == 3


# -- raw peers ---------------------------------------------------------------------------------------------
@pytest.fixture
def prefill() -> Iterator[PrefillEndpoint]:
    src = KVMemory.allocate(make_layout("prefill"))
    fill(src, 7)
    with PrefillEndpoint(src, "local", options=OPTS) as ep:
        yield ep


@pytest.fixture
def ctx() -> Iterator[zmq.Context]:
    c = zmq.Context()
    yield c
    c.destroy(linger=0)


def _dealer(ctx: zmq.Context, address: str) -> zmq.Socket:
    sock = ctx.socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    sock.setsockopt(zmq.RCVTIMEO, 2000)
    sock.connect(address)
    return sock


def _serves(prefill: PrefillEndpoint, rid: str) -> None:
    """A real decode still completes a request against ``prefill``, bytes checked."""
    dst = KVMemory.allocate(make_layout("decode"))
    with DecodeEndpoint(dst, "local", options=OPTS) as decode:
        decode.connect(prefill.address, timeout=5)
        req = workload(1, seed=11, prefix=rid)[0]
        decode.announce(req.rid, req.dst)
        run_prefill(prefill, [req])
        decode.wait(req.rid, 5)
        for buf in dst.layout.pools[0].buffers:
            assert np.array_equal(dst.array(buf.name)[req.dst["main"]],
                                  prefill.memory.array(buf.name)[req.src["main"]])


def test_wrong_protocol_version_gets_a_readable_reject(prefill: PrefillEndpoint, ctx: zmq.Context) -> None:
    sock = _dealer(ctx, prefill.address)
    hello = wire.Hello("s" * 8, b"", "local", b"", b"n" * 16, "off", 1.0)
    sock.send(wire.encode(hello, version=wire.PROTOCOL_VERSION + 1))
    reply = wire.decode(sock.recv())
    assert isinstance(reply, wire.Reject)
    assert f"protocol version {wire.PROTOCOL_VERSION + 1} is not supported" in reply.reason
    _serves(prefill, "after-version")


def test_malformed_manifest_is_rejected(prefill: PrefillEndpoint, ctx: zmq.Context) -> None:
    sock = _dealer(ctx, prefill.address)
    sock.send(wire.encode(wire.Hello("s" * 8, b"\x93garbage", "local", b"", b"n" * 16, "off", 1.0)))
    reply = wire.decode(sock.recv())
    assert isinstance(reply, wire.Reject) and "malformed manifest" in reply.reason


_BLOBS = st.one_of(
    st.binary(max_size=256),
    st.builds(lambda k, b: msgspec.msgpack.encode([wire.PROTOCOL_VERSION, k, b]),
              st.sampled_from(sorted(wire.KINDS)), st.binary(max_size=64)),
    st.builds(lambda k, v: msgspec.msgpack.encode([wire.PROTOCOL_VERSION, k, v]),
              st.sampled_from(sorted(wire.KINDS)),
              st.lists(st.one_of(st.integers(-2**63, 2**64 - 1), st.text(max_size=8), st.binary(max_size=8), st.none(),
                                 st.booleans(), st.dictionaries(st.text(max_size=4), st.binary(max_size=16))),
                       max_size=8)),
)


@given(st.lists(_BLOBS, min_size=1, max_size=5))
def test_random_messages_do_not_hurt_prefill(prefill_for_fuzz: tuple[PrefillEndpoint, zmq.Socket],
                                             blobs: list[bytes]) -> None:
    ep, sock = prefill_for_fuzz
    for blob in blobs:
        sock.send_multipart([blob] if len(blob) % 3 else [blob, b"extra"])
    assert ep.counters()["live_requests"] == 0


@pytest.fixture(scope="module")
def prefill_for_fuzz() -> Iterator[tuple[PrefillEndpoint, zmq.Socket]]:
    src = KVMemory.allocate(make_layout("prefill"))
    fill(src, 7)
    ctx = zmq.Context()
    with PrefillEndpoint(src, "local", options=OPTS) as ep:
        yield ep, _dealer(ctx, ep.address)
        time.sleep(0.1)
        assert ep.num_bad_messages > 0
        _serves(ep, "after-fuzz")           # still alive and correct
    ctx.destroy(linger=0)


# -- a fake prefill: handshake by hand, then misbehave ---------------------------------------------------------
class FakePrefill:
    """A ROUTER speaking just enough protocol to be accepted, then doing whatever the test says."""

    def __init__(self, ctx: zmq.Context) -> None:
        self.mem = KVMemory.allocate(make_layout("prefill"))
        from kvferry.transport import LocalTransport

        self.transport = LocalTransport()
        self.meta = self.transport.register(self.mem)
        self.sock = ctx.socket(zmq.ROUTER)
        self.sock.setsockopt(zmq.LINGER, 0)
        self.sock.setsockopt(zmq.RCVTIMEO, 3000)
        self.sock.bind("tcp://127.0.0.1:0")
        self.address = self.sock.getsockopt_string(zmq.LAST_ENDPOINT)
        self.identity = b""
        self.pending: list[Any] = []   # the rest of a Batch decode sent

    def recv(self) -> Any:
        if self.pending:
            return self.pending.pop(0)
        self.identity, data = self.sock.recv_multipart()
        msg = wire.decode(data)
        if isinstance(msg, wire.Batch):
            self.pending = wire.unbatch(msg)
            return self.pending.pop(0)
        return msg

    def send(self, msg: Any, version: int = wire.PROTOCOL_VERSION) -> None:
        self.sock.send_multipart([self.identity, wire.encode(msg, version=version)])

    def send_raw(self, data: bytes) -> None:
        self.sock.send_multipart([self.identity, data])

    def welcome(self) -> None:
        assert isinstance(self.recv(), wire.Hello)
        self.send(wire.Welcome("fake", self.mem.manifest(), self.meta, b"", 1.0, "off"))


def _connect_async(decode: DecodeEndpoint, address: str) -> Any:
    import concurrent.futures

    pool = concurrent.futures.ThreadPoolExecutor(1)
    return pool.submit(decode.connect, address, 3.0)


def test_prefill_speaking_another_version_is_refused(ctx: zmq.Context) -> None:
    fake = FakePrefill(ctx)
    with DecodeEndpoint(KVMemory.allocate(make_layout("decode")), "local", options=OPTS) as decode:
        fut = _connect_async(decode, fake.address)
        assert isinstance(fake.recv(), wire.Hello)
        fake.send(wire.Challenge(b"n" * 32), version=wire.PROTOCOL_VERSION + 5)
        with pytest.raises(IncompatiblePeer, match="protocol version"):
            fut.result(5)
    fake.transport.close()


@contextlib.contextmanager
def _decode_and_fake(ctx: zmq.Context) -> Iterator[tuple[DecodeEndpoint, FakePrefill]]:
    """A decode endpoint (digests off) connected to a fake prefill that has welcomed it."""
    fake = FakePrefill(ctx)
    try:
        with DecodeEndpoint(KVMemory.allocate(make_layout("decode")), "local", options=OPTS,
                            digest_mode="off") as decode:
            fut = _connect_async(decode, fake.address)
            fake.welcome()
            fut.result(5)
            yield decode, fake
    finally:
        fake.transport.close()


def test_silent_prefill_fails_requests_and_keeps_leases_for_the_grace(ctx: zmq.Context) -> None:
    with _decode_and_fake(ctx) as (decode, fake):
        decode.announce("r", {"main": [1, 2]})
        assert isinstance(fake.recv(), wire.Announce)
        t0 = time.monotonic()
        with pytest.raises(RequestFailed) as info:       # no heartbeat from the fake: dead after peer_timeout
            decode.wait("r", 5)
        assert isinstance(info.value.__cause__, PeerLost)
        # Never before peer_timeout (the exact instant is the core's, on a fake clock: test_decode_core.py).
        assert time.monotonic() - t0 >= OPTS.peer_timeout * 0.8
        assert decode.num_live_leases == 1               # a write posted before the death may still land
        deadline = time.monotonic() + OPTS.lease_grace + 5   # ends lease_grace after the writer is gone
        while decode.num_live_leases and time.monotonic() < deadline:
            time.sleep(0.01)
        assert decode.num_live_leases == 0


def test_decode_handles_each_message_of_a_batch_and_drops_only_the_bad_one(ctx: zmq.Context) -> None:
    with _decode_and_fake(ctx) as (decode, fake):
        decode.announce("r1", {"main": [1, 2]})
        decode.announce("r2", {"main": [3]})
        gens = {}
        while len(gens) < 2:
            msg = fake.recv()
            if isinstance(msg, wire.Announce):
                gens[msg.request_id] = msg.generation
        bad = decode.num_bad_messages
        fail = [wire.encode(wire.Fail(rid, gens[rid], "no KV", "plan", True)) for rid in ("r1", "r2")]
        forged = wire.encode(wire.Heartbeat(), version=wire.PROTOCOL_VERSION + 1)
        fake.send_raw(wire.batches([fail[0], forged, fail[1], wire.encode(wire.Heartbeat())])[0])
        for rid in ("r1", "r2"):
            with pytest.raises(RequestFailed, match="no KV"):
                decode.wait(rid, 3)
        assert decode.num_bad_messages == bad + 1
        assert decode.num_live_leases == 0            # both Fails were settled: the leases ended
        assert decode.peers == [fake.address]


def test_prefill_refuses_an_oversized_batch_and_serves_on(prefill: PrefillEndpoint, ctx: zmq.Context) -> None:
    from kvferry.transport import LocalTransport

    mem, transport = KVMemory.allocate(make_layout("decode")), LocalTransport()
    sock = _dealer(ctx, prefill.address)
    sock.send(wire.encode(wire.Hello("s" * 16, mem.manifest(), "local", transport.register(mem), b"n" * 32,
                                     "off", 1.0)))
    assert isinstance(wire.decode(sock.recv()), wire.Welcome)
    bad = prefill.num_bad_messages
    hb = wire.encode(wire.Heartbeat())
    sock.send(msgspec.msgpack.encode([wire.PROTOCOL_VERSION, "batch", [[hb] * (wire.MAX_BATCH + 1)]]))
    sock.send(wire.batches([hb, hb])[0])
    deadline = time.monotonic() + 3
    while prefill.num_bad_messages == bad and time.monotonic() < deadline:
        time.sleep(0.01)
    assert prefill.num_bad_messages == bad + 1      # the oversized one; the well-formed batch is fine
    assert len(prefill.peers) == 1
    transport.close()
    _serves(prefill, "after-batch")


def test_a_verdict_batched_with_goodbye_still_completes_the_request(prefill: PrefillEndpoint,
                                                                    ctx: zmq.Context) -> None:
    """Decode's last Result and its Bye in one frame (it closes right after its last request ended): prefill
    reports the verified request DONE, not lost."""
    from kvferry.transport import LocalTransport

    mem, transport = KVMemory.allocate(make_layout("decode")), LocalTransport()
    sock = _dealer(ctx, prefill.address)
    sock.send(wire.encode(wire.Hello("s" * 16, mem.manifest(), "local", transport.register(mem), b"n" * 32,
                                     "off", 1.0)))
    assert isinstance(wire.decode(sock.recv()), wire.Welcome)
    prefill.send("r", {"main": [1, 2]})
    sock.send(wire.encode(wire.Announce("r", 1, wire.encode_pages({"main": np.array([3, 4])}))))
    deadline = time.monotonic() + 3
    while not (prefill.poll("r") is RequestState.TRANSFERRING and prefill.num_live_handles == 0):
        assert time.monotonic() < deadline
        time.sleep(0.005)
    sock.send(wire.batches([wire.encode(wire.Result("r", 1, True, "")), wire.encode(wire.Bye("decode closing"))])[0])
    prefill.wait("r", 3)
    assert prefill.peers == []
    transport.close()


@given(st.lists(_BLOBS, min_size=1, max_size=6))
def test_random_messages_do_not_hurt_decode(decode_for_fuzz: tuple[DecodeEndpoint, FakePrefill],
                                            blobs: list[bytes]) -> None:
    decode, fake = decode_for_fuzz
    # A well-formed Bye is not an attack: the peer has legitimately said goodbye, and decode drops it.
    assume(not any(_is_valid(blob, wire.Bye) for blob in blobs))
    for blob in blobs:
        fake.send_raw(blob)
        fake.send(wire.Heartbeat())
    assert decode.peers == [fake.address]


def _is_valid(blob: bytes, kind: type) -> bool:
    try:
        return isinstance(wire.decode(blob), kind)
    except wire.ProtocolError:
        return False


@pytest.fixture(scope="module")
def decode_for_fuzz() -> Iterator[tuple[DecodeEndpoint, FakePrefill]]:
    ctx = zmq.Context()
    fake = FakePrefill(ctx)
    opts = EndpointOptions(heartbeat_interval=0.1, peer_timeout=30.0)
    decode = DecodeEndpoint(KVMemory.allocate(make_layout("decode")), "local", options=opts, digest_mode="off")
    fut = _connect_async(decode, fake.address)
    fake.welcome()
    fut.result(5)
    yield decode, fake
    decode.announce("still-alive", {"main": [1]})   # the progress thread survived
    assert decode.poll("still-alive") is RequestState.BOOTSTRAPPING
    assert decode.num_bad_messages > 0
    decode.close(timeout=0.1)                        # the fake never settles the lease: do not wait for it
    fake.transport.close()
    ctx.destroy(linger=0)
