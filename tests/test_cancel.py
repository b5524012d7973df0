"""Cancel: decode failed a request before announcing it, and prefill hears of it at once (issue 26)."""

from __future__ import annotations

import time

import pytest

from kvferry import KVMemory, LeaseError, UsageError
from kvferry.control import DecodeEndpoint, EndpointOptions, PrefillEndpoint, RequestState
from kvferry.errors import RequestFailed

from .control_peer import fill, make_layout

OPTS = EndpointOptions(heartbeat_interval=0.1, peer_timeout=0.6, lease_grace=0.4, request_timeout=20.0)


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
