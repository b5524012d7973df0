"""The simulator with pulling decodes across TP sizes (new on 2026-12-05: before, a seed whose TP sizes
differed made every decode push). Seed 1004 at 2:4 found prefill's source hold outliving the run: decode
rank 0's Result ended nothing once decode rank 1's late announce of the failed request had made a new record
(fixed in ``prefill_announces.on_result``; ``tests/test_prefill_core_pull.py`` pins it without the simulator)."""

from __future__ import annotations

from dataclasses import replace

import pytest

from kvferry.simulation import SimConfig, run_seed


@pytest.mark.parametrize(("seed", "tp"), [(1004, (2, 4)), (1000, (1, 2)), (1003, (2, 1)), (1004, (4, 2))])
def test_pulling_across_tp_sizes_breaks_no_invariant(seed: int, tp: tuple[int, int]) -> None:
    result = run_seed(seed, replace(SimConfig(), tp=tp))
    assert result.ok, (result.violation, result.replay_command())
    assert result.swarm.pull > 0   # these seeds draw pulling decodes
