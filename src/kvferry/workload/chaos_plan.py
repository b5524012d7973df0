"""What a chaos run is given, which faults it injects when, the endless request stream, and what it reports.

Part of the workload layer, above ``config`` and ``sim``, below ``chaos_sides`` and ``chaos``. Pure and
deterministic: ``fault_schedule(config)`` is the same list of faults for the same seed, and
``RequestStream`` the same requests, on every side and in every restarted process.

The load is the seed's workload (``WorkloadSpec``: many multi-turn sessions) played over and over for the
run's duration: a session that finished its last turn starts a new conversation (an "epoch") with the
same prompt lengths but new bytes, so pages keep being reused and every request id is new.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Any

import numpy as np

from kvferry.errors import UsageError
from kvferry.workload.config import WorkloadConfig
from kvferry.workload.sim import RequestSpec, build_schedule

__all__ = ["FAULT_KINDS", "ChaosConfig", "ChaosResult", "FaultEvent", "RequestStream", "fault_schedule"]

FAULT_KINDS = ("stop", "kill", "cut")
SIDES = ("decode", "prefill")


@dataclass(frozen=True, slots=True)
class ChaosConfig:
    """A chaos run: ``workload`` (its transport ``nixl`` or ``mooncake``: faults need processes) for ``duration_s``.

    Faults start after ``warmup_s``, ``min_gap_s`` plus an exponential gap of mean ``mean_gap_s`` apart
    (a killed side needs a moment to start again before the next fault means anything), and end
    ``quiet_s`` before the duration is up. A stall (SIGSTOP) lasts ``stall_floor_s`` plus
    ``stall_extra_s`` (drawn uniformly from that range), so the other side always gives the stalled one
    up. ``weights`` are the odds of stop, kill and cut. ``drain_s`` bounds the drain after the duration.
    ``scribble_at_s`` (tests only) has decode flip one byte of a page a DONE request left, at that moment
    or as soon as one has: the run must then report exactly that byte wrong.
    """

    workload: WorkloadConfig
    duration_s: float = 60.0
    warmup_s: float = 3.0
    mean_gap_s: float = 4.0
    min_gap_s: float = 1.5
    quiet_s: float = 3.0
    stall_extra_s: tuple[float, float] = (0.3, 1.5)
    weights: tuple[float, float, float] = (0.4, 0.3, 0.3)
    drain_s: float = 30.0
    scribble_at_s: float | None = None   # tests only, see above

    def __post_init__(self) -> None:
        wl = self.workload
        if wl.transport not in ("nixl", "mooncake"):
            raise UsageError("a chaos run stops and kills processes: its transport must be 'nixl' or 'mooncake'")
        if wl.peer_timeout_s is None or wl.lease_grace_s is None:
            raise UsageError("a chaos run needs peer_timeout_s and lease_grace_s set (stalls are sized by them)")
        if self.duration_s <= 0 or self.mean_gap_s <= 0 or self.drain_s <= 0 or self.min_gap_s < 0:
            raise UsageError("duration_s, mean_gap_s and drain_s must be > 0, min_gap_s >= 0")
        low, high = self.stall_extra_s
        if not 0 < low <= high:
            raise UsageError(f"stall_extra_s must be 0 < low <= high, got {self.stall_extra_s}")
        if len(self.weights) != len(FAULT_KINDS) or min(self.weights) < 0 or sum(self.weights) <= 0:
            raise UsageError(f"weights must be {len(FAULT_KINDS)} non-negative odds, not all 0")

    @property
    def seed(self) -> int:
        return self.workload.workload.seed

    @property
    def stall_floor_s(self) -> float:
        """A stall at least this long outlasts the other side's patience: peer_timeout + lease_grace. In
        pull mode, also prefill's source hold after it declared a stalled decode dead (two more
        peer_timeouts: ``control.pull.source_hold_s``), so a stalled reader resumes after its source pages
        may have been reused: the case decode's fence exists for."""
        wl = self.workload
        pt, grace = float(wl.peer_timeout_s or 0.0), float(wl.lease_grace_s or 0.0)
        return 3 * pt + grace if wl.mode == "pull" else pt + grace


@dataclass(frozen=True, slots=True)
class FaultEvent:
    """One fault: at ``at_s`` after the run started, ``kind`` (stop, kill, cut) hits ``side``.

    ``hold_s``: how long a stopped side stays stopped (0 for kill and cut). ``side`` is ``control`` for a
    cut (the relay drops every control connection at once).
    """

    at_s: float
    kind: str
    side: str
    hold_s: float = 0.0

    def describe(self) -> str:
        hold = f" for {self.hold_s:.2f} s" if self.hold_s else ""
        return f"t+{self.at_s:.2f} s {self.kind} {self.side}{hold}"


def fault_schedule(config: ChaosConfig) -> tuple[FaultEvent, ...]:
    """The run's faults, in order, from its seed alone. Each starts after the previous one's stall ended
    (plus a gap), so at most one fault is active at a time and a killed side has time to restart."""
    rng = np.random.default_rng([config.seed, 11])
    odds = np.asarray(config.weights, dtype=float) / sum(config.weights)
    end = config.duration_s - config.quiet_s
    at = config.warmup_s + config.min_gap_s + float(rng.exponential(config.mean_gap_s))
    out: list[FaultEvent] = []
    while at < end:
        kind = FAULT_KINDS[int(rng.choice(len(FAULT_KINDS), p=odds))]
        side = "control" if kind == "cut" else SIDES[int(rng.integers(len(SIDES)))]
        hold = config.stall_floor_s + float(rng.uniform(*config.stall_extra_s)) if kind == "stop" else 0.0
        out.append(FaultEvent(round(at, 3), kind, side, round(hold, 3)))
        at += hold + config.min_gap_s + float(rng.exponential(config.mean_gap_s))
    return tuple(out)


class RequestStream:
    """The workload's schedule, played again and again: session ``s``'s ``k``-th request, and back.

    A request's global index ``g = epoch * len(schedule) + i`` (``i`` its place in the schedule) keys its
    bytes; its turn counts on across epochs (``turn = epoch * num_turns + t``), so its id is unique.
    """

    def __init__(self, config: WorkloadConfig) -> None:
        self.schedule = build_schedule(config.workload)
        self.num_turns = config.workload.num_turns
        self._where = {(spec.session, spec.turn): spec.index for spec in self.schedule}
        self.sessions = sorted({spec.session for spec in self.schedule})

    def index(self, session: int, k: int) -> int:
        """The global index of session ``session``'s ``k``-th request (k counts from 0, across epochs)."""
        epoch, turn = divmod(k, self.num_turns)
        return epoch * len(self.schedule) + self._where[(session, turn)]

    def spec(self, g: int) -> RequestSpec:
        """The request with global index ``g``."""
        epoch, i = divmod(g, len(self.schedule))
        base = self.schedule[i]
        return RequestSpec(g, base.session, epoch * self.num_turns + base.turn, base.num_tokens)


@dataclass(frozen=True)
class ChaosResult:
    """What a chaos run did and found. ``ok``: no byte wrong anywhere, no lease leaked, no source hold left
    (pull mode), the run ran.

    ``bytes_wrong`` counts bytes that differed from what their page's owner (a request decode reported
    done) must hold: when the request completed, when its page was next reused, and at the end of the run
    for pages not reused since. ``pages_verified`` counts buffer pages checked at completion,
    ``pages_rechecked`` those checked again later. Failed requests are expected under chaos; their pages
    are never counted as wrong (their content is undefined by contract).
    """

    seed: int
    duration_s: float
    seconds: float
    preset: str
    requests_done: int
    requests_failed: int
    failures: dict[str, int]
    first_failure: str | None
    pages_verified: int
    pages_rechecked: int
    bytes_wrong: int
    bytes_wrong_at_completion: int
    bytes_wrong_later: int
    wrong_pages: int
    bytes_moved: int
    leaked_leases: int | None
    quarantined_pages_peak: int
    endpoint_quarantined_pages_peak: int
    faults: dict[str, int]
    fault_log: tuple[str, ...]
    restarts: dict[str, int]
    side_errors: tuple[str, ...]
    options: dict[str, Any]   # peer_timeout_s, lease_grace_s, request_timeout_s, mode
    error: str | None = None
    extra: dict[str, Any] = field(default_factory=dict)
    # Pull mode: prefill's source holds (requests whose pages decode may still read) at the peak, and
    # still held after the drain plus one hold period (None: prefill never reported after the drain).
    source_holds_peak: int = 0
    source_holds_left: int | None = 0

    @property
    def ok(self) -> bool:
        return (self.error is None and self.bytes_wrong == 0 and self.leaked_leases == 0
                and self.requests_done > 0 and self.source_holds_left == 0)

    def to_dict(self) -> dict[str, Any]:
        return {**asdict(self), "fault_log": list(self.fault_log), "side_errors": list(self.side_errors),
                "ok": self.ok}
