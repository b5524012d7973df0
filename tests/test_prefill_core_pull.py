"""Prefill's pull-mode source holds when a request id's record is replaced (fake clock, no I/O).

A record stops being its request id's current one when another decode rank announces the id after it
failed (across TP sizes, a group member arriving late) or a retry does: the old record's pages stay held
for the decode that read them until that decode's verdict. Its Result must end the hold whichever record is
current (the simulator found the hold outliving the run at TP 2:4: seed 1004).
"""

from __future__ import annotations

from kvferry.control import wire

from .test_prefill_core import Peer


def test_a_result_ends_the_hold_of_a_record_no_longer_current() -> None:
    peer = Peer()
    peer.connect(b"d1", mode="pull")
    peer.connect(b"d2", mode="pull")
    peer.send()
    peer.announce(identity=b"d1", generation=7)
    assert any(isinstance(m, wire.Ready) for m in peer.received(b"d1"))
    old = peer.core.records["r"]
    assert old.source_held
    peer.core.abort(peer.t, "r", "engine abort")   # prefill's engine gives up on it: Fail to d1, still held
    peer.carry_out()
    peer.core.settle_dirty(peer.t)
    peer.carry_out()
    assert any(isinstance(m, wire.Fail) for m in peer.received(b"d1")) and old.source_held
    peer.announce(identity=b"d2", generation=3)    # a late announce of the same id: a record of its own
    assert peer.core.records["r"] is not old
    peer.frame(b"d1", wire.Result("r", 7, True, ""))   # d1 read it all before it heard of the abort
    peer.core.settle_dirty(peer.t)
    assert not old.source_held and old not in peer.core.holds.held
