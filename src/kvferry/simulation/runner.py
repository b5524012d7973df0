"""Running seeds: one (``run_seed``), many within a budget (``run_many``), and shrinking a failure.

Part of ``simulation``, above ``cluster``. A run is a pure function of (seed, config, fault mix, mutation):
``run_seed(seed)`` again gives the same events, the same trace and the same verdict.
"""

from __future__ import annotations

import gc
import time
from collections.abc import Iterable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, replace

from kvferry.simulation.cluster import World
from kvferry.simulation.config import FAULT_KINDS, SimConfig, Swarm
from kvferry.simulation.mutations import mutation
from kvferry.simulation.tp import TP_PAIRS
from kvferry.simulation.world import Sim, Violation, ViolationFound

__all__ = ["RunResult", "format_trace", "run_many", "run_seed", "shrink"]


@dataclass(frozen=True, slots=True)
class RunResult:
    seed: int
    violation: Violation | None
    requests: int
    done: int
    failed: int
    disagreements: int
    events: int
    sim_time: float
    cpu_s: float
    swarm: Swarm
    config: SimConfig
    trace: tuple[str, ...]
    without: tuple[str, ...] = ()   # fault kinds switched off in this seed's draw (shrinking)
    mutate: str | None = None
    tp: tuple[int, int] = (1, 1)     # (prefill TP, decode TP) the seed ran (``simulation.tp``)
    split: int = 0                   # decode group attempts DONE on one rank, FAILED on another
    held: int = 0                    # transfers held by a partitioned data path (``Swarm.data_partition``)
    timed_out: int = 0               # of those, failed after DATA_TIMEOUT rather than landing late
    faults: tuple[tuple[str, int], ...] = ()   # faults injected, by kind (``FAULT_KINDS``' names), in that order
    partial: int = 0   # held transfers part of which crossed before the path went (``Transport._split``)
    on_wire: int = 0   # messages on the wire when a partition began, held until its heal (``Net._hold``)
    page_sizes: tuple[int, int] | None = None   # a page-size seed's kv (prefill, decode) tokens per page
    state: bool = False   # the layouts held the state pool (``SimConfig.state_share``, ``tp.draw_state``)

    def replay_command(self) -> str:
        """The command line that runs exactly this again."""
        parts = [f"kvferry simulate --seed {self.seed}"]
        if self.config.requests != SimConfig().requests:
            parts.append(f"--requests {self.config.requests}")
        # A wide seed (``SimConfig.wide_tp``) replays at its pair: the pair is all the share changes of a run.
        tp = self.config.tp or (self.tp if self.tp not in TP_PAIRS else None)
        if tp is not None:
            parts.append(f"--tp {tp[0]}:{tp[1]}")
        if self.page_sizes is not None:   # a page-size seed replays at its pair, as a wide one does
            parts.append(f"--page-sizes {self.page_sizes[0]}:{self.page_sizes[1]}")
        if self.config.state_share != SimConfig().state_share:   # the share decides which seeds hold state
            parts.append(f"--state-share {self.config.state_share:g}")
        parts += [f"--without {kind}" for kind in self.without]
        if self.mutate:
            parts.append(f"--mutate {self.mutate}")
        return " ".join(parts)

    @property
    def ok(self) -> bool:
        return self.violation is None


def format_trace(sim: Sim, last: int) -> tuple[str, ...]:
    return tuple(f"{t:10.5f} {who:>10} {what}" for t, who, what in list(sim.trace)[-last:])


def run_seed(seed: int, config: SimConfig | None = None, swarm: Swarm | None = None, mutate: str | None = None,
             trace: int = 40, without: tuple[str, ...] = ()) -> RunResult:
    """Run one seed to rest (or to its first violation). ``without``: fault kinds switched off in the
    seed's own fault mix (the rest of the draw unchanged)."""
    cfg = config or SimConfig()
    start = time.process_time()
    with mutation(mutate), _collector_paused():
        world = World(seed, cfg, swarm, without)
        violation = None
        try:
            world.run()
        except ViolationFound as found:
            violation = found.violation
    return RunResult(seed, violation, len(world.requests), world.done, world.failed, world.disagreements,
                     world.sim.events, world.sim.now, time.process_time() - start, world.swarm, cfg,
                     format_trace(world.sim, trace) if violation is not None else (), tuple(without), mutate,
                     world.tp, world.split, world.transport.held, world.transport.timed_out,
                     tuple((kind, world.sim.faults[kind]) for kind in FAULT_KINDS if world.sim.faults[kind]),
                     world.transport.partial, world.net.on_wire, world.page_sizes, world.state)


@contextmanager
def _collector_paused() -> Iterator[None]:
    """Python's cyclic garbage collector off while a seed runs: a run allocates hundreds of thousands of
    objects (events, messages, records), and the collector's passes over the young ones cost several percent of
    the run while finding almost nothing to free; what a run leaves is freed at the next collection after it
    (a few MB meanwhile). Nothing of a run depends on when objects are freed."""
    if not gc.isenabled():
        yield
        return
    gc.disable()
    try:
        yield
    finally:
        gc.enable()


def run_many(seeds: Iterable[int], config: SimConfig | None = None, mutate: str | None = None,
             budget_s: float | None = None, stop_at_first: bool = False) -> list[RunResult]:
    """Run seeds in order until they run out or ``budget_s`` of CPU time is spent."""
    out: list[RunResult] = []
    start = time.process_time()
    for seed in seeds:
        if budget_s is not None and time.process_time() - start >= budget_s:
            break
        result = run_seed(seed, config, mutate=mutate)
        out.append(result)
        if stop_at_first and not result.ok:
            break
    return out


def shrink(result: RunResult, mutate: str | None = None, budget_s: float = 20.0) -> RunResult:
    """A smaller run with the same seed that breaks the same invariant: fewer requests, faults switched off
    one kind at a time; greedy, within ``budget_s`` of CPU time."""
    assert result.violation is not None
    want = result.violation.invariant
    best = result
    start = time.process_time()

    def same(candidate: RunResult) -> bool:
        return candidate.violation is not None and candidate.violation.invariant == want

    for kind in FAULT_KINDS:
        if time.process_time() - start > budget_s:
            break
        if getattr(best.swarm, kind):
            cand = run_seed(best.seed, best.config, mutate=mutate, without=(*best.without, kind))
            if same(cand):
                best = cand
    n = best.config.requests
    while n > 1 and time.process_time() - start <= budget_s:
        n //= 2
        cand = run_seed(best.seed, replace(best.config, requests=n), mutate=mutate, without=best.without)
        if not same(cand):
            break
        best = cand
    return best
