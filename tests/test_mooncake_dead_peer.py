"""Mooncake's per-peer worker stops posting to a peer found gone: a killed decode costs prefill no seconds.

Seen on a loaded 2-core host (test_control_nixl's decode killed mid-transfer, over Mooncake): the writes queued
on the dead decode's worker were each posted in turn, and the engine spent about a second retrying the dead
peer on each before failing it, so prefill's writes took seconds to settle. No engine is needed here: a fake
one counts what is posted.
"""

from __future__ import annotations

from typing import Any

import pytest

from kvferry.transport import mooncake


class FakeEngine:
    """Every batch is accepted, then fails (as the engine reports rows to a peer that died)."""

    def __init__(self) -> None:
        self.posted = 0

    def batch_transfer_async_write(self, session: str, local: list[int], remote: list[int],
                                   lengths: list[int]) -> int:
        self.posted += 1
        return 7

    def get_batch_transfer_status(self, batches: list[int]) -> int:
        return -1


def _peer() -> Any:
    return mooncake._Peer("decode", memory=None, session="127.0.0.1:1", push=None, worker=None)  # type: ignore[arg-type]


def test_batches_queued_behind_a_failure_to_a_gone_peer_are_never_posted(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(mooncake, "_reachable", lambda session: False)   # its engine refuses connections
    engine, peer = FakeEngine(), _peer()
    code, _ = mooncake._run_batches(engine, peer, False, [0], [0], [8])
    assert code != 0 and engine.posted == 1
    code, why = mooncake._run_batches(engine, peer, False, [0, 8], [0, 8], [8, 8])
    assert code != 0 and "not posted" in why
    assert engine.posted == 1          # failed without reaching the engine: nothing of it can land


def test_a_peer_found_gone_is_written_to_again_once_it_accepts_connections(monkeypatch: pytest.MonkeyPatch) -> None:
    """A passing outage (its engine refused one connection) does not fail the peer's writes for good."""
    reachable = [False]
    monkeypatch.setattr(mooncake, "_reachable", lambda session: reachable[0])
    engine, peer = FakeEngine(), _peer()
    mooncake._run_batches(engine, peer, False, [0], [0], [8])
    assert peer.gone and engine.posted == 1
    reachable[0] = True
    monkeypatch.setattr(mooncake, "_drain_seconds", lambda: 0.0)
    mooncake._run_batches(engine, peer, False, [0], [0], [8])
    assert engine.posted == 2          # posted again (the fake engine fails it; a live one would judge it)


def test_a_failure_to_a_peer_still_reachable_does_not_stop_later_batches(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(mooncake, "_reachable", lambda session: True)
    monkeypatch.setattr(mooncake, "_drain_seconds", lambda: 0.0)     # the drain wait itself is not the point
    engine, peer = FakeEngine(), _peer()
    mooncake._run_batches(engine, peer, False, [0], [0], [8])
    mooncake._run_batches(engine, peer, False, [0], [0], [8])
    assert engine.posted == 2          # alive: each batch is the engine's to judge
