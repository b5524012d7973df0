"""The simulator tells prefill whose connection dropped, as its shell does since issue 49's fix (the frame's
``ZMQ_SRCFD`` and the monitor's descriptor, ``control.router``): named when a frame of that connection reached
prefill, unnamed otherwise."""

from __future__ import annotations

from dataclasses import replace

import pytest

from kvferry.control.core.prefill import PrefillCore
from kvferry.simulation import SimConfig, run_seed


def test_drops_are_named_by_the_connection_that_carried_frames(monkeypatch: pytest.MonkeyPatch) -> None:
    calls: list[tuple[PrefillCore, list[bytes] | None]] = []
    real = PrefillCore.connection_dropped

    def record(self: PrefillCore, now: float, identities: list[bytes] | None = None) -> None:
        calls.append((self, None if identities is None else list(identities)))
        real(self, now, identities)

    monkeypatch.setattr(PrefillCore, "connection_dropped", record)
    results = [run_seed(seed, replace(SimConfig(), requests=48)) for seed in range(20)]
    assert all(r.ok for r in results)
    named = [ids for _, ids in calls if ids is not None]
    assert named, "no drop was named in 20 seeds"
    assert all(len(ids) == 1 and ids[0] for ids in named)
