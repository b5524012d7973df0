"""kvferry chaos: the relay, the fault schedule, the request stream, the oracle's pieces, and short runs in
both transfer modes."""

from __future__ import annotations

import importlib.util
import itertools
import multiprocessing
import socket
import threading
import time

import numpy as np
import pytest

from kvferry.errors import UsageError
from kvferry.layout.presets import get_preset
from kvferry.workload.chaos_plan import ChaosConfig, FaultEvent, RequestStream, fault_schedule
from kvferry.workload.chaos_sides import PageLedger
from kvferry.workload.config import WorkloadConfig
from kvferry.workload.relay import Relay
from kvferry.workload.sim import WorkloadSpec, fill_pages, page_keys, wrong_bytes

needs_nixl = pytest.mark.skipif(importlib.util.find_spec("nixl") is None, reason="nixl is not installed")


def chaos_config(mode: str = "push", **overrides: object) -> ChaosConfig:
    workload = WorkloadConfig(workload=WorkloadSpec(num_sessions=80, num_turns=4, seed=3), budget_bytes=128 << 20,
                              transport="nixl", request_timeout_s=10.0, peer_timeout_s=1.0, lease_grace_s=0.5,
                              mode=mode)
    fields: dict[str, object] = {"workload": workload, "duration_s": 60.0}
    fields.update(overrides)
    return ChaosConfig(**fields)  # type: ignore[arg-type]


# -- relay -------------------------------------------------------------------------------------------------
class EchoServer:
    """An upstream for the relay: accepts connections, echoes bytes back, records what it accepted."""

    def __init__(self) -> None:
        self.sock = socket.create_server(("127.0.0.1", 0))
        self.port = self.sock.getsockname()[1]
        self.conns: list[socket.socket] = []
        self.thread = threading.Thread(target=self._serve, daemon=True)
        self.thread.start()

    def _serve(self) -> None:
        self.sock.settimeout(5.0)
        try:
            while True:
                conn, _ = self.sock.accept()
                self.conns.append(conn)
                threading.Thread(target=self._echo, args=(conn,), daemon=True).start()
        except OSError:
            return

    @staticmethod
    def _echo(conn: socket.socket) -> None:
        try:
            while data := conn.recv(65536):
                conn.sendall(data)
        except OSError:
            pass

    def close(self) -> None:
        self.sock.close()
        for conn in self.conns:
            conn.close()


def recv_exactly(sock: socket.socket, n: int) -> bytes:
    out = bytearray()
    while len(out) < n:
        chunk = sock.recv(n - len(out))
        if not chunk:
            break
        out += chunk
    return bytes(out)


def test_relay_carries_bytes_both_ways_intact() -> None:
    server = EchoServer()
    try:
        with Relay(("127.0.0.1", server.port)) as relay:
            payload = np.random.default_rng(0).integers(0, 256, 3 << 20, dtype=np.uint8).tobytes()
            with socket.create_connection(("127.0.0.1", relay.port), timeout=10) as client:
                sender = threading.Thread(target=client.sendall, args=(payload,))
                sender.start()  # more than the relay buffers per direction: back-pressure must work
                echoed = recv_exactly(client, len(payload))
                sender.join(10)
            assert echoed == payload
            assert relay.connections == 1
    finally:
        server.close()


def test_relay_cut_closes_both_ends_and_new_connections_still_work() -> None:
    server = EchoServer()
    try:
        with Relay(("127.0.0.1", server.port)) as relay:
            client = socket.create_connection(("127.0.0.1", relay.port), timeout=5)
            client.sendall(b"ping")
            assert recv_exactly(client, 4) == b"ping"
            assert relay.cut() == 1
            assert relay.num_open == 0
            with _closed_ok():
                assert client.recv(16) == b""  # an RST surfaces as ConnectionResetError, also fine
            upstream = server.conns[0]
            upstream.settimeout(5)
            with _closed_ok():
                assert upstream.recv(16) == b""
            client.close()
            with socket.create_connection(("127.0.0.1", relay.port), timeout=5) as again:
                again.sendall(b"pong")
                assert recv_exactly(again, 4) == b"pong"
            assert relay.cuts == 1 and relay.connections == 2
    finally:
        server.close()


class _closed_ok:
    """Accept either an orderly EOF (the assertion inside) or a reset: both mean the end was closed."""

    def __enter__(self) -> None:
        return None

    def __exit__(self, kind: object, exc: object, tb: object) -> bool:
        return kind is ConnectionResetError


def test_relay_close_is_bounded_and_refuses_afterwards() -> None:
    relay = Relay(("127.0.0.1", 9)).start()
    port = relay.port
    started = time.monotonic()
    relay.close()
    relay.close()
    assert time.monotonic() - started < 3
    with pytest.raises(OSError):
        socket.create_connection(("127.0.0.1", port), timeout=1).close()


# -- schedule, stream, oracle ------------------------------------------------------------------------------
def test_fault_schedule_is_deterministic_from_the_seed() -> None:
    a, b = fault_schedule(chaos_config()), fault_schedule(chaos_config())
    assert a == b and len(a) >= 5
    other = fault_schedule(chaos_config(workload=WorkloadConfig(
        workload=WorkloadSpec(seed=4), transport="nixl", peer_timeout_s=1.0, lease_grace_s=0.5)))
    assert other != a


def test_fault_schedule_stalls_outlast_peer_timeout_plus_lease_grace_and_never_overlap() -> None:
    config = chaos_config(duration_s=600.0)
    events = fault_schedule(config)
    assert {e.kind for e in events} == {"stop", "kill", "cut"}
    assert {e.side for e in events if e.kind != "cut"} == {"decode", "prefill"}
    for event in events:
        assert isinstance(event, FaultEvent)
        assert (event.hold_s > 1.5) == (event.kind == "stop")
    for first, second in itertools.pairwise(events):
        assert second.at_s >= first.at_s + first.hold_s + config.min_gap_s - 1e-3
    assert events[-1].at_s < config.duration_s - config.quiet_s


def test_chaos_config_refuses_what_cannot_be_run() -> None:
    with pytest.raises(UsageError, match="nixl"):
        ChaosConfig(workload=WorkloadConfig(transport="local", peer_timeout_s=1.0, lease_grace_s=0.5))
    with pytest.raises(UsageError, match="peer_timeout_s"):
        ChaosConfig(workload=WorkloadConfig(transport="nixl"))


def test_request_stream_replays_sessions_with_new_ids_and_bytes() -> None:
    stream = RequestStream(WorkloadConfig(workload=WorkloadSpec(num_sessions=5, num_turns=3, seed=1)))
    n = len(stream.schedule)
    for session in stream.sessions:
        specs = [stream.spec(stream.index(session, k)) for k in range(7)]
        assert [s.session for s in specs] == [session] * 7
        assert [s.turn for s in specs] == list(range(7))  # the k-th request has turn k: ids never repeat
        assert specs[3].num_tokens == specs[0].num_tokens and specs[3].index == specs[0].index + n
    ids = {stream.spec(g).request_id for g in range(4 * n)}
    assert len(ids) == 4 * n


def test_wrong_bytes_counts_every_differing_byte() -> None:
    view = np.zeros((6, 100), dtype=np.uint8)
    pages = np.array([4, 1, 2])
    keys = page_keys(0, 7, np.array([0]), 3)[0]
    fill_pages(view, pages, keys)
    assert wrong_bytes(view, pages, keys).tolist() == [0, 0, 0]
    view[1, 10:13] ^= 0xFF
    view[2, 99] ^= 1
    assert wrong_bytes(view, pages, keys).tolist() == [0, 3, 1]


def test_page_ledger_tracks_the_last_done_owner_per_page() -> None:
    layout = get_preset("deepseek_v4", num_pages=16)
    ledger = PageLedger({p.name: p.min_pages for p in layout.pools})
    pool = layout.pools[0].name
    ledger.own(5, {pool: np.array([3, 7, 1])})
    ledger.own(9, {pool: np.array([2])})
    held = ledger.holders(pool, np.array([1, 2, 4, 7]))
    assert sorted(held) == [5, 9]
    assert held[5][0].tolist() == [1, 7] and held[5][1].tolist() == [2, 1]  # pages in the order asked
    ledger.forget({pool: np.array([7, 2])})
    assert ledger.all_owned()[pool].tolist() == [1, 3]


# -- the run -----------------------------------------------------------------------------------------------
@needs_nixl
@pytest.mark.nixl
@pytest.mark.slow
@pytest.mark.parametrize("mode", ["push", "pull"])
def test_short_chaos_run_reports_and_cleans_up(mode: str) -> None:
    """20 s of chaos in each transfer mode (push: prefill writes, quarantine fences it; pull: decode
    reads, its own fence and prefill's source hold keep reused pages out): a few faults each (the soaks
    in bench/RESULTS.md run 10 minutes)."""
    from kvferry.workload.chaos import run_chaos

    config = chaos_config(mode, duration_s=20.0)
    started = time.monotonic()
    result = run_chaos(config)
    assert time.monotonic() - started < config.duration_s + config.drain_s + 30
    report = result.to_dict()
    for key in ("requests_done", "requests_failed", "pages_verified", "bytes_wrong", "leaked_leases",
                "quarantined_pages_peak", "faults", "fault_log"):
        assert key in report
    assert result.error is None, result.error
    assert sum(result.faults.values()) == len(fault_schedule(config)) > 0
    assert result.requests_done > 0 and result.pages_verified > 0 and result.pages_rechecked > 0
    assert result.leaked_leases == 0, result.extra
    assert result.options["mode"] == mode
    if mode == "pull":
        assert result.quarantined_pages_peak == 0, "in pull mode nothing but decode writes its pages"
        assert result.source_holds_left == 0 and result.source_holds_peak > 0   # holds happen, and all end
    assert multiprocessing.active_children() == []
    # Strict: every run so far (60 s runs, the ten-minute soak in bench/RESULTS.md) found 0. The known fencing
    # defect (a stalled prefill writing into pages decode re-leased) has not shown on one host, where NIXL
    # copies inside the prefill's write call (a write frozen by SIGSTOP lands right after SIGCONT, before decode
    # can re-lease anything); if it ever does, this is the line that must say so.
    assert result.bytes_wrong == 0, (result.wrong_pages, result.fault_log)


@needs_nixl
@pytest.mark.nixl
def test_the_oracle_counts_a_byte_changed_in_a_finished_requests_free_page() -> None:
    """0 bytes wrong must mean something: one byte flipped in a page a DONE request left behind (what a
    late write would do) is found at the page's reuse or in the final sweep, and fails the run."""
    from kvferry.workload.chaos import run_chaos

    config = chaos_config(duration_s=10.0, mean_gap_s=1e6, scribble_at_s=6.0)
    assert fault_schedule(config) == ()
    result = run_chaos(config)
    assert result.error is None, result.error
    assert (result.bytes_wrong_later, result.wrong_pages, result.bytes_wrong_at_completion) == (1, 1, 0)
    assert not result.ok


def test_decode_reconnecting_before_prefill_notices_keeps_its_transport_peer() -> None:
    """After a cut, decode (short peer_timeout) gives prefill up and reconnects while prefill (long peer_timeout)
    still holds the old session of the same transport agent: the new session must be able to move bytes.
    Found by the chaos soak: retiring the old session removed the transport peer the new one had just added
    (fixed with the fencing work: a peer is removed only when no session uses it and no write targets it)."""
    from kvferry.control import DecodeEndpoint, EndpointOptions, PrefillEndpoint
    from kvferry.layout.memory import KVMemory

    from .control_peer import announce, make_layout, run_prefill, wait_all
    from .control_peer import workload as control_workload

    prefill = PrefillEndpoint(KVMemory.allocate(make_layout("prefill")), "local",
                              options=EndpointOptions(heartbeat_interval=0.1, peer_timeout=30.0))
    decode = DecodeEndpoint(KVMemory.allocate(make_layout("decode")), "local",
                            options=EndpointOptions(heartbeat_interval=0.05, peer_timeout=0.3, lease_grace=0.1))
    host, port = prefill.address.removeprefix("tcp://").rsplit(":", 1)
    try:
        with Relay((host, int(port))) as relay:
            decode.connect(relay.address)
            relay.cut()
            deadline = time.monotonic() + 10
            while decode.peers and time.monotonic() < deadline:
                time.sleep(0.01)
            assert not decode.peers, "decode never noticed the cut"
            decode.connect(relay.address, timeout=5.0)
            reqs = control_workload(2, seed=5)
            announce(decode, reqs)
            run_prefill(prefill, reqs)
            assert wait_all(decode, [r.rid for r in reqs], timeout=10) == {r.rid: "done" for r in reqs}
    finally:
        decode.close()
        prefill.close()
