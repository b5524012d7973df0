"""What a workload run is given and what it reports: ``WorkloadConfig`` and ``WorkloadResult``.

The bottom of the workload package: the runner, its supervisor and both sides import it; it imports
nothing of theirs (it used to live in ``runner``, which its own sides then imported back).
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Any

from kvferry.errors import UsageError
from kvferry.integrity import DigestMode
from kvferry.layout.presets import DEFAULT_PRESET, get_preset
from kvferry.layout.spec import Layout
from kvferry.workload.sim import WorkloadSpec

__all__ = ["DEFAULT_BUDGET", "WorkloadConfig", "WorkloadResult"]

# Per side: small enough for two copies plus the pattern work on a 2-core, 8 GiB CI box, large enough
# that the default workload keeps a dozen requests in flight and reuses every page many times.
DEFAULT_BUDGET = 512 << 20


@dataclass(frozen=True, slots=True)
class WorkloadConfig:
    """What to run. Picklable (it crosses to spawned processes); validated when made.

    ``num_pages`` or ``budget_bytes`` sizes the preset (``DEFAULT_BUDGET`` when neither is given);
    ``knobs`` are extra preset keyword arguments. ``inject`` names a fault from ``kvferry.diagnostics.faults``,
    applied on the prefill side only. ``timeout_s`` bounds the whole run, startup included;
    ``request_timeout_s`` bounds each request from announce to completion. ``peer_timeout_s`` and
    ``lease_grace_s`` set the endpoints' options of those names when given. ``mode`` is the transfer mode
    of both endpoints: ``"push"`` (prefill writes) or ``"pull"`` (decode reads; prefill frees a request's
    pages only once decode is done with them). ``reuse_prefix``: decode keeps each session's whole pages
    between turns and announces only the pages it lacks (``workload.reuse`` says which pages, per pool).
    """

    workload: WorkloadSpec = field(default_factory=WorkloadSpec)
    preset: str = DEFAULT_PRESET
    num_pages: int | None = None
    budget_bytes: int | None = None
    knobs: tuple[tuple[str, Any], ...] = ()
    transport: str = "nixl"
    digest_mode: str = "full"
    inject: str | None = None
    timeout_s: float = 600.0
    request_timeout_s: float = 60.0
    # Liveness knobs of both endpoints (None: EndpointOptions' defaults); the chaos run makes them short.
    peer_timeout_s: float | None = None
    lease_grace_s: float | None = None
    mode: str = "push"
    reuse_prefix: bool = False

    def __post_init__(self) -> None:
        if self.transport not in ("nixl", "mooncake", "local"):
            raise UsageError(f"transport must be 'nixl', 'mooncake' or 'local', got {self.transport!r}")
        if self.mode not in ("push", "pull"):
            raise UsageError(f"mode must be 'push' or 'pull', got {self.mode!r}")
        if self.mode == "pull" and self.inject is not None:
            raise UsageError(f"fault {self.inject!r} corrupts prefill's writes; in pull mode prefill writes "
                             "nothing (use --mode push)")
        DigestMode.parse(self.digest_mode)
        if self.timeout_s <= 0 or self.request_timeout_s <= 0:
            raise UsageError("timeout_s and request_timeout_s must be > 0")

    def layout(self) -> Layout:
        """The preset layout both sides allocate (same shape and capacity)."""
        sizing: dict[str, int] = ({"num_pages": self.num_pages} if self.num_pages is not None
                                  else {"budget_bytes": self.budget_bytes or DEFAULT_BUDGET})
        return get_preset(self.preset, **sizing, **dict(self.knobs))


@dataclass(frozen=True)
class WorkloadResult:
    """What a run did. ``ok`` is the verdict: every request done, no page corrupted, nothing failed.

    ``pages_verified`` and ``corrupted_pages`` count buffer pages (a pool page of a pool with 42 buffers
    is 42 buffer pages); ``bytes`` and ``gbps`` count the bytes of completed requests over ``seconds``,
    the time from the first announce to the last completion (process start-up excluded, reported as
    ``startup_seconds``). ``corrupted_by_buffer`` maps each buffer with a corrupted page to the count, in
    layout order (the first key is where a misaddressing fault starts). ``silent_corruptions`` are
    corrupted pages in requests kvferry reported done: corruption its digests missed.

    ``per_turn``: per turn (0-based), requests done, how many had a prefix kept by decode, and the pool
    pages and bytes moved against those of the whole prompt's KV (equal without ``reuse_prefix``).
    ``reuse``: with ``reuse_prefix``, ``evictions`` (idle sessions whose kept pages decode freed to make
    room), ``pages_rechecked`` (kept buffer pages checked again when evicted; also counted in
    ``corrupted_pages`` when wrong), and prefill's ``whole_sends`` and ``suffix_sends``.
    """

    preset: str
    transport: str
    digest_mode: str
    inject: str | None
    sessions: int
    turns: int
    requests: int
    requests_expected: int
    failed_requests: int
    pages_verified: int
    corrupted_pages: int
    silent_corruptions: int
    corrupted_by_buffer: dict[str, int]
    bytes: int
    seconds: float
    startup_seconds: float
    gbps: float
    p50_ms: float
    p99_ms: float
    failures: dict[str, int]
    first_failure: str | None
    layout: dict[str, Any]
    error: str | None = None
    latencies_ms: tuple[float, ...] = ()  # per request, announce to verified; left out of to_dict
    mode: str = "push"
    reuse_prefix: bool = False
    per_turn: tuple[dict[str, Any], ...] = ()
    reuse: dict[str, int] = field(default_factory=dict)
    # Each side's endpoint stats at its end (role -> EndpointStats.to_dict(), see docs/metrics.md).
    stats: dict[str, Any] = field(default_factory=dict)

    @property
    def ok(self) -> bool:
        return (self.error is None and self.corrupted_pages == 0 and self.failed_requests == 0
                and self.requests == self.requests_expected)

    def to_dict(self) -> dict[str, Any]:
        """JSON-ready, with ``ok`` included (per-request latencies stay on the object: thousands of them)."""
        out = asdict(self)
        del out["latencies_ms"]
        return {**out, "ok": self.ok}
