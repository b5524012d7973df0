"""A simulated process: the real protocol core in a shell of simulated I/O (``Node``), what prefill's and
decode's share.

Part of ``simulation``, above ``world``. Each ``Node`` does what its real shell does (``control.prefill``,
``control.decode``, ``control.endpoints``' progress loop), in the same order, against the simulated
network and transport instead of sockets and NIXL: an iteration checks silence first, runs the deferred
calls, reads the frames that arrived (stamped with the time the iteration started, as the shell stamps
them with the poll's return), feeds back completed transfers and notifications, ticks the timers, and
carries out every action between events. A node stalled (SIGSTOP) handles nothing until it resumes; its
transfers already posted go on. A crashed node is gone; it restarts as a new process (new core, memory,
transport agent and process identity) at the same address. The two sides: ``prefill_node``,
``decode_node``.
"""

from __future__ import annotations

import heapq
import math
import zlib
from collections import deque
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import numpy as np

from kvferry.control import wire
from kvferry.control.core.base import FlushNow, Transfer
from kvferry.control.core.process import ProcessIdentity
from kvferry.control.core.states import TERMINAL, RequestState
from kvferry.errors import InternalError, KVFerryError

if TYPE_CHECKING:
    from kvferry.simulation.cluster import World

__all__ = ["DEADLINE_SLACK", "Node", "Stalled"]


# A request must have ended this long after its deadline (or after its node resumed from a stall): the
# cores look at deadlines every 10 ms.
DEADLINE_SLACK = 0.05


# ``Node.phase``: where in its iteration the shell is.
FRAMES, QUEUED = "frames", "queued"


class Stalled(BaseException):  # control flow: no `except Exception` in the code under test may swallow it
    pass


class Deadlines:
    """The records a core holds, earliest deadline first, so that the deadline invariant (d) looks at one
    record per step rather than at all of them. A record's deadline never changes once made; a record is
    pushed as the core adds it to its container (``tracked_set``/``TrackedDict`` below) and dropped lazily
    once it ended or left the container (a record added again is pushed again). The cores keep a heap of
    their own (``control.core.deadlines``); this one is separate on purpose, so that invariant (d) does not
    rest on the code it checks."""

    __slots__ = ("heap", "seq")

    def __init__(self) -> None:
        self.heap: list[tuple[float, int, Any]] = []
        self.seq = 0

    def push(self, rec: Any) -> None:
        heapq.heappush(self.heap, (rec.deadline, self.seq, rec))
        self.seq += 1

    def earliest(self, holds: Callable[[Any], bool]) -> Any:
        """The live record held (``holds``) with the earliest deadline, or None."""
        heap = self.heap
        while heap:
            rec = heap[0][2]
            if rec.is_live and holds(rec):
                return rec
            heapq.heappop(heap)
        return None


_TRACKED: dict[type, type] = {}


def tracked_set(container: Any, deadlines: Deadlines) -> Any:
    """For prefill's empty ``active``: an empty set of the core's own type (its iteration order stays the
    core's) whose ``add`` also tells ``deadlines`` of each record added."""
    base = type(container)
    cls = _TRACKED.get(base)
    if cls is None:
        def add(self: Any, rec: Any) -> None:
            if rec not in self:
                self.deadlines.push(rec)
            base.add(self, rec)
        cls = _TRACKED[base] = type(f"Tracked{base.__name__}", (base,), {"add": add, "__slots__": ("deadlines",)})
    assert not container, "the core's records must be tracked from its start"
    out = cls()
    out.deadlines = deadlines
    return out


class TrackedDict(dict):  # type: ignore[type-arg]
    """Decode's ``by_gen`` dict, telling ``Deadlines`` of each record set."""

    def __init__(self, deadlines: Deadlines) -> None:
        super().__init__()
        self.deadlines = deadlines

    def __setitem__(self, key: Any, rec: Any) -> None:
        self.deadlines.push(rec)
        super().__setitem__(key, rec)


class FreePages:
    """An engine's free pages of one pool, a heap: it hands out the lowest first. A page given back twice is
    there twice (and counted twice, so that the at-rest check sees it)."""

    __slots__ = ("heap",)

    def __init__(self, num_pages: int) -> None:
        self.heap = list(range(num_pages))

    def __len__(self) -> int:
        return len(self.heap)

    def take(self, n: int) -> np.ndarray:
        return np.array([heapq.heappop(self.heap) for _ in range(n)], dtype=np.int64)

    def give(self, pages: np.ndarray) -> None:
        for page in pages.tolist():
            heapq.heappush(self.heap, page)


class Node:
    """What both simulated processes share: the event plumbing, stalls, crashes, the action loop."""

    kind = "node"
    core: Any
    rank = 0   # its place in its TP group (``simulation.tp``)
    deadlines: Deadlines

    def __init__(self, world: World, name: str) -> None:
        self.world = world
        self.sim = world.sim
        self.name = name
        self.inc = 0
        self.crashed = False
        self.stalled_until = 0.0
        self.starving = False
        self.resumed_at = 0.0
        self.pending_wake = math.inf
        self.wake_token = 0
        self.resume_between = False   # stalled between two transfers: carry out the rest first
        self.resume_post: Callable[[float], None] | None = None   # stalled inside a post: finish it first
        # Where the shell's iteration is (``iterate``): FRAMES while it reads what arrived, QUEUED while it
        # posts what those messages queued, "" elsewhere. A stop there (``Swarm.stall_read``) sets
        # ``resume_rest``: the shell goes on with the rest of that iteration when it resumes (``carry_on``).
        self.phase = ""
        self.resume_rest = ""
        self.frames: deque[tuple[str, Any, bytes]] = deque()
        self.ended: list[tuple[Any, RequestState]] = []   # records that ended in the last step
        self.waiting: list[Any] = []   # engine commands waiting for pages, a link or a record's end
        self.changes = 0               # records ended, pages freed: news for the waiting commands
        self.seen: tuple[Any, ...] = ()
        self.start()

    # -- identity ------------------------------------------------------------------------------------------
    @property
    def ident(self) -> str:
        return f"{self.name}.{self.inc}"

    @property
    def agent(self) -> str:
        return f"agent:{self.ident}"

    @property
    def process(self) -> ProcessIdentity:
        return ProcessIdentity("simhost", 1000 + zlib.crc32(self.name.encode()) % 1000, self.inc + 1)

    def start(self) -> None:
        raise NotImplementedError

    def entropy(self, n: int) -> bytes:
        return self.sim.rng_lat.getrandbits(8 * n).to_bytes(n, "little")

    def watch(self, core: Any) -> None:
        """Hear every record's end as it happens (the invariants look at them after the step)."""
        orig = core.set_state

        def set_state(rec: Any, state: RequestState) -> None:
            orig(rec, state)
            if state in TERMINAL:
                self.ended.append((rec, state))
                self.record_ended(rec)
        core.set_state = set_state

    def record_ended(self, rec: Any) -> None:
        """A record of the core ended (as it happened, inside the core's call)."""
        self.changes += 1

    # -- the engine's waits ----------------------------------------------------------------------------------
    # An engine command that cannot go on yet (no free pages, no link, the last generation not ended) waits
    # for what it needs rather than polling: it is tried again right after the first step that changed
    # something it may need (``retry_waiting``), and given up at its ``give_up`` time.
    def wait(self, now: float, att: Any) -> None:
        if now >= att.give_up:
            self.give_up(att)
            return
        self.waiting.append(att)
        if not att.expires:
            att.expires = True
            self.sim.at(att.give_up, self._expire, self.inc, att)

    def _expire(self, inc: int, att: Any) -> None:
        if self.crashed or inc != self.inc or att not in self.waiting:
            return
        if self.sim.now < self.stalled_until:   # a stopped engine gives up nothing
            self.sim.at(self.stalled_until, self._expire, inc, att)
            return
        self.waiting.remove(att)
        self.give_up(att)
        self.changes += 1
        if self.waiting:
            self.kick()

    def retry_waiting(self, now: float) -> None:
        """Run the waiting commands that may go on now, in the order they began to wait."""
        if not self.waiting:
            return
        seen = self.changed_since()
        if seen == self.seen:
            return
        self.seen = seen
        ready = [att for att in self.waiting if self.can_go(att)]
        if ready:
            self.waiting = [att for att in self.waiting if not any(att is r for r in ready)]
            for att in ready:
                self.go(now, att)
            self.kick()   # what they queued leaves with the next iteration

    def changed_since(self) -> tuple[Any, ...]:
        """What a waiting command may need, summed up: equal while nothing it needs changed."""
        return (self.changes, self.deadlines.seq)

    def can_go(self, att: Any) -> bool:
        raise NotImplementedError

    def go(self, now: float, att: Any) -> None:
        raise NotImplementedError

    def give_up(self, att: Any) -> None:
        raise NotImplementedError

    # -- scheduling ----------------------------------------------------------------------------------------
    def kick(self) -> None:
        self.schedule(self.sim.now)

    def schedule(self, t: float) -> None:
        if self.crashed:
            return
        t = max(t, self.stalled_until)
        if t < self.pending_wake:
            # Only the earliest wake counts (a later one it replaced is stale): one chain of wakes per node.
            self.pending_wake = t
            self.wake_token += 1
            self.sim.at(t, self.wake, self.wake_token)

    def call_at(self, t: float, fn: Callable[[float], None], *, work: bool = True) -> None:
        """An engine command at ``t`` (deferred while the process is stopped). ``work``: part of the workload
        (the run is not at rest before it), not a periodic chore."""
        if work:
            self.world.last_work = max(self.world.last_work, t)
        self.sim.at(t, self._run_call, self.inc, fn)

    def _run_call(self, inc: int, fn: Callable[[float], None]) -> None:
        if self.crashed or inc != self.inc:
            return
        if self.sim.now < self.stalled_until:
            self.sim.at(self.stalled_until, self._run_call, inc, fn)
            return
        fn(self.sim.now)
        self.step(self.sim.now)   # the progress loop takes it at once (as a wake now would, one event sooner)

    def wake(self, token: int) -> None:
        if self.crashed or token != self.wake_token or self.sim.now < self.stalled_until:
            return
        self.step(self.sim.now)

    def step(self, now: float) -> None:
        """One iteration of the shell's loop, the invariants after it, and the next wake."""
        self.pending_wake = math.inf
        try:
            if self.resume_post is not None:
                post, self.resume_post = self.resume_post, None
                post(now)
            if self.resume_between:
                self.resume_between = False
                self.between(now)
            if self.resume_rest:
                rest, self.resume_rest = self.resume_rest, ""
                self.carry_on(now, rest)
            else:
                self.iterate(now)
        except Stalled:
            return
        self.after(now)
        core = self.core
        if core.calls or self.frames or self.has_news():
            self.schedule(now)
        else:
            self.schedule(max(core.next_deadline(), now + 1e-4))

    def after(self, now: float) -> None:
        self.world.after_step(self, now)   # first: the engine takes back the pages of what ended
        self.engine(now)
        self.retry_waiting(now)

    def has_news(self) -> bool:
        return False

    def holds_record(self, rec: Any) -> bool:
        """Whether ``rec`` is among the records the core still holds (those the deadline invariant reads)."""
        raise NotImplementedError

    def tracks_records(self) -> bool:
        """Whether the core's record container is still the tracked one (a core that made itself a new one
        would hide its records from the deadline invariant)."""
        raise NotImplementedError

    # -- faults --------------------------------------------------------------------------------------------
    def stall(self, seconds: float, *, starving: bool = False) -> None:
        """Handle nothing for ``seconds``: stopped (SIGSTOP: libzmq stopped too), or only ``starving`` (its
        Python gets no CPU; libzmq's I/O thread still answers heartbeats). A stop within a starvation stops."""
        if self.crashed:
            return
        if self.sim.now >= self.stalled_until:
            self.starving = starving
        elif not starving:
            self.starving = False
        self.stalled_until = max(self.stalled_until, self.sim.now + seconds)
        self.resumed_at = self.stalled_until
        self.pending_wake = math.inf
        self.schedule(self.stalled_until)
        self.sim.log(self.name, f"{'starved' if starving else 'stalled'} until {self.stalled_until:.4f}")
        if not starving:
            self.world.stopped(self)

    def crash(self) -> None:
        if self.crashed:
            return
        self.sim.log(self.name, f"crashed ({self.ident})")
        self.crashed = True
        self.world.dead_processes.add(self.process)
        self.world.dead_agents.add(self.agent)
        self.world.transport.crashed(self)
        self.world.node_crashed(self)

    def restart(self) -> None:
        self.inc += 1
        self.crashed = False
        self.stalled_until = self.resumed_at = self.sim.now
        self.pending_wake = math.inf
        self.resume_between = False
        self.resume_post = None
        self.resume_rest = ""
        self.frames.clear()
        self.ended.clear()
        self.waiting.clear()
        self.seen = ()
        self.start()
        self.sim.log(self.name, f"restarted as {self.ident}")
        self.kick()

    # -- the shell's loop ------------------------------------------------------------------------------------
    def between(self, now: float) -> None:
        """Carry out what the last event decided: effects, then transfers (``actions.ActionRunner.run``)."""
        core = self.core
        while core.effects or core.transfers:
            while core.effects:
                self.apply(core.effects.popleft(), now)
            if core.transfers:
                transfer = core.transfers.popleft()
                if self.world.stall_in_post(self):
                    # SIGSTOP between the decision and the start of its posting: checked again on resume.
                    core.transfers.appendleft(transfer)
                    self.resume_between = True
                    raise Stalled
                self.carry_out(transfer, now)

    def stalled_posting(self, post: Callable[[float], None]) -> None:
        """SIGSTOP inside the post call, after the core's last check (``start_write``/``start_read``):
        the transfer goes out when the process resumes, however late (the stalled writer)."""
        if self.world.stall_in_post(self):
            self.resume_post = post
            self.resume_between = True
            raise Stalled
        post(self.sim.now)

    def iterate(self, now: float) -> None:
        # ``between`` and ``flush`` are called only when there is something to carry out or send (most events
        # decide nothing): the same order, without the calls.
        core = self.core
        core.check_silence(now)
        if core.effects or core.transfers:
            self.between(now)
        for fn in core.run_calls(now):
            self.guard(fn)
            if core.effects or core.transfers:
                self.between(now)
        self.post_queued(now)
        self.phase = FRAMES
        frames, on_frame = self.frames, self.on_frame
        while frames:
            self.guard(on_frame, now, *frames.popleft())
            if core.effects or core.transfers:
                self.between(now)
        self.phase = QUEUED
        self.post_queued(now)
        self.phase = ""
        self.finish(now)

    def finish(self, now: float) -> None:
        """The end of an iteration: completed transfers fed back, the timers, what is left to send."""
        core = self.core
        self.pump(now)
        if core.effects or core.transfers:
            self.between(now)
        core.batches.next_iteration()
        core.tick(now)
        if core.effects or core.transfers:
            self.between(now)
        if core.outbox:
            self.flush(now)

    def carry_on(self, now: float, phase: str) -> None:
        """Back from a stop inside a post made at ``phase`` of an iteration (``Swarm.stall_read``): the rest of
        that iteration, as the shell's ``_step`` goes on after the call that stopped. In the middle of the
        messages (FRAMES) it restamps (``_restamp``: our own silence judged first) and reads on, stamping
        from now; a drop notice comes on the monitor's socket, which the poll before the stop did not find
        ready, so it waits for the next poll. After them (QUEUED) nothing more is read before the pump: what
        came meanwhile waits in its socket for the next poll."""
        core = self.core
        self.phase = ""
        if phase == FRAMES:
            core.check_silence(now)
            if core.effects or core.transfers:
                self.between(now)
            notices = [f for f in self.frames if f[0] == "dropped"]
            if notices:
                self.frames = deque(f for f in self.frames if f[0] != "dropped")
            try:
                while self.frames:
                    self.guard(self.on_frame, now, *self.frames.popleft())
                    if core.effects or core.transfers:
                        self.between(now)
            finally:
                self.frames.extend(notices)   # read at the next iteration (step schedules it)
            self.post_queued(now)
        elif core.outbox:
            self.flush(now)   # ``actions.flush()`` between the posts and the pump
        self.finish(now)

    def post_queued(self, now: float) -> None:
        """The core's queued posts, carried out, and what they said sent."""
        core = self.core
        core.post_queued()
        if core.effects or core.transfers:
            self.between(now)
        if core.outbox:
            self.flush(now)

    def guard(self, fn: Callable[..., None], *args: Any) -> None:
        """An event handled as the shell handles it: a peer's bad message is counted, a bug is loud."""
        try:
            fn(*args)
        except InternalError as exc:
            self.core.log_internal(exc)
            self.world.internal(self, exc)
        except KVFerryError:
            self.core.num_bad_messages += 1

    def flush(self, now: float, only: Any = None) -> None:
        core = self.core
        if only is None and not core.outbox:
            return
        for peer in [only] if only is not None else list(core.outbox):
            for frame in wire.batches(core.take_out(peer)):
                self.send_frame(now, peer, frame)

    # -- per side --------------------------------------------------------------------------------------------
    def send_frame(self, now: float, peer: Any, frame: bytes) -> None:
        raise NotImplementedError

    def on_frame(self, now: float, kind: str, peer: Any, data: bytes) -> None:
        raise NotImplementedError

    def pump(self, now: float) -> None:
        raise NotImplementedError

    def apply(self, effect: Any, now: float) -> None:
        """The effects both sides' shells carry out alike (each side handles its own first)."""
        if isinstance(effect, FlushNow):
            self.flush(now, effect.peer)
            if effect.raw:
                self.send_frame(now, effect.peer, effect.raw)
        else:
            raise AssertionError(f"no shell for {effect!r}")

    def carry_out(self, transfer: Transfer, now: float) -> None:
        raise NotImplementedError

    def engine(self, now: float) -> None:
        raise NotImplementedError
