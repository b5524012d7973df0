"""Cancel: decode failed a request before announcing it, and prefill hears of it at once (issue 26)."""

from __future__ import annotations

import time

import pytest

from kvferry import KVMemory, LeaseError, UsageError
from kvferry.control import DecodeEndpoint, EndpointOptions, PrefillEndpoint, RequestState
from kvferry.errors import RequestFailed

from .control_peer import fill, make_layout

# Generous peer timeouts: nothing here tests peer death, and a loaded machine must not fail these.
OPTS = EndpointOptions(heartbeat_interval=0.2, peer_timeout=5.0, lease_grace=0.4, request_timeout=20.0)
# For the timed test: a short heartbeat, but a peer_timeout a loaded 2-core machine does not trip; the bound
# is one heartbeat plus MARGIN_S for thread scheduling there (the message itself takes milliseconds).
TIMED = EndpointOptions(heartbeat_interval=0.25, peer_timeout=5.0, lease_grace=0.4, request_timeout=20.0)
MARGIN_S = 0.15


def _memories() -> tuple[KVMemory, KVMemory]:
    src, dst = KVMemory.allocate(make_layout("prefill")), KVMemory.allocate(make_layout("decode"))
    fill(src, 11)
    fill(dst, 999)
    return src, dst


def test_a_cancel_fails_the_request_on_prefill_at_once() -> None:
    """Decode failed a request before announcing it (issue 26): prefill hears of it within a message, not
    at its deadline, whether its ``send`` came before or comes after; a request another decode announced is
    left alone."""
    src, dst = _memories()
    with PrefillEndpoint(src, "local", options=OPTS) as prefill, DecodeEndpoint(dst, "local", options=OPTS) as decode:
        decode.connect(prefill.address)
        prefill.send("early", {"main": [1]})
        started = time.monotonic()
        decode.cancel("early", "no room")
        with pytest.raises(RequestFailed, match=r"cancelled by .* before it announced the request: no room"):
            prefill.wait("early", timeout=5)
        assert time.monotonic() - started < 1.0      # request_timeout is 20 s
        decode.cancel("late", "refused hand-off")
        deadline = time.monotonic() + 5
        while True:
            try:
                if prefill.poll("late") is RequestState.FAILED:
                    break
            except UsageError:
                pass
            assert time.monotonic() < deadline
            time.sleep(0.005)
        with pytest.raises(RequestFailed, match="refused hand-off"):
            prefill.send("late", {"main": [2]})
        decode.announce("live", {"main": [3]})
        with pytest.raises(LeaseError, match=r"request 'live' is live here"):
            decode.cancel("live", "x")
        prefill.send("live", {"main": [4]})
        decode.wait("live", timeout=5)


def _until_failed(endpoint: DecodeEndpoint | PrefillEndpoint, request_id: str, limit: float) -> float:
    """Seconds until ``endpoint`` reports ``request_id`` FAILED (an unknown id counts as not yet); fails the
    test past ``limit``."""
    started = time.monotonic()
    while True:
        try:
            if endpoint.poll(request_id) is RequestState.FAILED:
                return time.monotonic() - started
        except UsageError:
            pass
        assert time.monotonic() - started < limit, f"{request_id!r} not FAILED within {limit} s"
        time.sleep(0.002)


def test_a_prefill_abort_before_any_announce_reaches_decode_within_a_heartbeat() -> None:
    """The reverse (issue 26): prefill fails a request no decode announced yet, one it sent and one it never
    heard of. Every decode peer has it FAILED within one heartbeat (0.25 s here, plus MARGIN_S), with
    prefill's reason, holding nothing; an announce that comes later is refused at once
    and its lease ends; a request decode announced is not touched by it."""
    src, dst = _memories()
    with PrefillEndpoint(src, "local", options=TIMED) as prefill, DecodeEndpoint(dst, "local", options=TIMED) as decode:
        decode.connect(prefill.address)
        prefill.send("sent", {"main": [1]})
        for request_id in ("sent", "unheard"):
            prefill.abort(request_id, "scheduler dropped it")
            bound = TIMED.heartbeat_interval + MARGIN_S
            assert _until_failed(decode, request_id, bound) < bound
            assert "aborted by prefill: scheduler dropped it" in str(decode.failure(request_id))
        assert decode.num_leased_pages == 0 and prefill.counters()["live_requests"] == 0
        decode.announce("unheard", {"main": [5]})     # an engine that announces anyway: refused at once
        with pytest.raises(RequestFailed, match="aborted by prefill"):
            decode.wait("unheard", timeout=TIMED.heartbeat_interval + MARGIN_S)
        deadline = time.monotonic() + 2
        while decode.num_leased_pages:
            assert time.monotonic() < deadline, "the refused announce's lease did not end"
            time.sleep(0.005)
        decode.announce("live", {"main": [3]})
        prefill.send("live", {"main": [4]})
        decode.wait("live", timeout=5)
        prefill.abort("live", "too late")            # ended: a no-op, decode keeps DONE
        time.sleep(2 * TIMED.heartbeat_interval)
        assert decode.poll("live") is RequestState.DONE
