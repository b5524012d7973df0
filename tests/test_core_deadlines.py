"""``DeadlineHeap`` and ``RecordSet``: the earliest live deadline, as a scan of the records would give it."""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from kvferry.control.core.base import RequestRecord
from kvferry.control.core.ordered import RecordSet
from kvferry.control.core.states import RequestState

# (op, index, deadline): 0 add a new record, 1 end record i, 2 discard record i, 3 re-add record i
OPS = st.lists(st.tuples(st.integers(0, 3), st.integers(0, 40), st.integers(0, 20)), max_size=120)


@settings(max_examples=300, deadline=None)
@given(OPS)
def test_record_set_earliest_live_equals_a_scan(ops: list[tuple[int, int, int]]) -> None:
    records: list[RequestRecord] = []
    active = RecordSet()
    for op, i, deadline in ops:
        if op == 0 or not records:
            rec = RequestRecord(f"r{len(records)}", RequestState.BOOTSTRAPPING, float(deadline), 0.0)
            records.append(rec)
            active.add(rec)
        else:
            rec = records[i % len(records)]
            if op == 1:
                rec.state = RequestState.FAILED
            elif op == 2:
                active.discard(rec)
            else:
                active.add(rec)
        live = [r.deadline for r in active if r.is_live]
        assert active.earliest_live() == (min(live) if live else None)
    # Ended records do not pile up: the heap stays within a bound of the set's size.
    assert len(active._by_deadline) <= 2 * len(active) + 64 + 1
