"""Simulated processes: a prefill and a decode, each the real protocol core in a shell of simulated I/O.

Part of ``simulation``, above ``world``. Each ``Node`` does what its real shell does (``control.prefill``,
``control.decode``, ``control.endpoints``' progress loop), in the same order, against the simulated
network and transport instead of sockets and NIXL: an iteration checks silence first, runs the deferred
calls, reads the frames that arrived (stamped with the time the iteration started, as the shell stamps
them with the poll's return), feeds back completed transfers and notifications, ticks the timers, and
carries out every action between events. A node stalled (SIGSTOP) handles nothing until it resumes; its
transfers already posted go on. A crashed node is gone; it restarts as a new process (new core, memory,
transport agent and process identity) at the same address.

Each node also plays its engine: prefill sends chunks of its requests (whole, chunked, layer by layer),
aborts some, and reuses a request's source pages as soon as the core says it may (``may_free``); decode
leases pages, announces (with a prefix), aborts, cancels, and announces a failed request again under the
same id, and reuses pages once the lease ends.
"""

from __future__ import annotations

import heapq
import math
import zlib
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import numpy as np

from kvferry.control import wire
from kvferry.control.core.base import AddPeer, CheckProcess, FlushNow, RemovePeer, Transfer
from kvferry.control.core.decode import CheckWriter, CloseLink, DecodeCore, DecodeSetup, OpenLink, TakeNotifications
from kvferry.control.core.prefill import PrefillCore, PrefillSetup
from kvferry.control.core.prefill_requests import make_spec, may_free
from kvferry.control.core.process import ProcessIdentity
from kvferry.control.core.states import TERMINAL, LinkState, RequestState
from kvferry.control.stats import NullRecorder
from kvferry.errors import InternalError, KVFerryError, LeaseError, PeerLost, TransportError
from kvferry.integrity import DigestMode
from kvferry.layout.memory import KVMemory
from kvferry.simulation.tp import (
    DecodeGroup,
    SliceProvenance,
    all_are,
    fill_content,
    needed_ranks,
    page_rows,
    rank_layout,
)
from kvferry.simulation.world import PageMap

if TYPE_CHECKING:
    from kvferry.simulation.cluster import Request, World

__all__ = ["DecodeNode", "Node", "PrefillNode"]

# A request must have ended this long after its deadline (or after its node resumed from a stall): the
# cores look at deadlines every 10 ms.
DEADLINE_SLACK = 0.05


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
        core.post_queued()
        if core.effects or core.transfers:
            self.between(now)
        if core.outbox:
            self.flush(now)
        frames, on_frame = self.frames, self.on_frame
        while frames:
            self.guard(on_frame, now, *frames.popleft())
            if core.effects or core.transfers:
                self.between(now)
        core.post_queued()
        if core.effects or core.transfers:
            self.between(now)
        if core.outbox:
            self.flush(now)
        self.pump(now)
        if core.effects or core.transfers:
            self.between(now)
        core.batches.next_iteration()
        core.tick(now)
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
        raise NotImplementedError

    def carry_out(self, transfer: Transfer, now: float) -> None:
        raise NotImplementedError

    def engine(self, now: float) -> None:
        raise NotImplementedError


# -- prefill ------------------------------------------------------------------------------------------------
@dataclass
class PAttempt:
    """One try at sending a request from this prefill: its source pages and the record it went to."""

    req: Request
    retry: bool
    src: dict[str, np.ndarray] | None = None
    rec: Any = None
    sent: int = 0         # chunks sent so far
    give_up: float = 0.0
    expires: bool = False  # its give-up is scheduled (once it first waited)
    done: bool = False
    prev: Any = None      # a retry: the record of the try before, which decode's new announce replaces


class PrefillNode(Node):
    kind = "prefill"

    def __init__(self, world: World, name: str, address: str, rank: int = 0) -> None:
        self.address = address
        self.rank = rank
        super().__init__(world, name)

    def start(self) -> None:
        world = self.world
        self.memory = KVMemory.allocate(rank_layout("prefill", world.tp, self.rank, world.cfg.pages))
        world.graveyard.append(self.memory)   # late copies never touch freed memory
        self.pages = PageMap(self.memory)
        self.src_owner = {p.name: np.full(p.min_pages, -1, dtype=np.int64) for p in self.memory.layout.pools}
        self.free = {p.name: FreePages(p.min_pages) for p in self.memory.layout.pools}
        setup = PrefillSetup(self.address, "sim", "dlist", self.agent.encode(), self.process, None,
                             frozenset({"push", "pull"}))
        self.core = PrefillCore(self.memory, setup, world.options, DigestMode(world.swarm.digest),
                                NullRecorder("prefill", self.memory.layout), self.entropy)
        self.deadlines = Deadlines()
        self.core.active = tracked_set(self.core.active, self.deadlines)
        self.watch(self.core)
        self.settled: deque[tuple[int, str | None]] = deque()
        self.attempts: dict[int, PAttempt] = {}       # id -> attempt, from its first send until its pages are back
        self.live: dict[int, list[PAttempt]] = {}     # id of a live record -> the attempts it holds
        self.finished: list[PAttempt] = []            # attempts whose record ended: pages back once may_free
        self.ended_recs: list[Any] = []               # records that ended since the engine last looked
        world.agents[self.agent] = self

    # -- the shell ---------------------------------------------------------------------------------------
    def send_frame(self, now: float, peer: Any, frame: bytes) -> None:
        self.world.net.to_decode(peer, frame)
        self.core.frame_sent(now, peer)

    def on_frame(self, now: float, kind: str, peer: Any, data: bytes) -> None:
        if kind == "dropped":
            self.core.connection_dropped(now)
        else:
            self.core.on_frame(now, peer, data)

    def has_news(self) -> bool:
        return bool(self.settled)

    def holds_record(self, rec: Any) -> bool:
        return rec in self.core.active

    def tracks_records(self) -> bool:
        return getattr(self.core.active, "deadlines", None) is self.deadlines

    def record_ended(self, rec: Any) -> None:
        super().record_ended(rec)
        self.ended_recs.append(rec)

    def pump(self, now: float) -> None:
        core = self.core
        while self.settled:
            ticket, error = self.settled.popleft()
            core.write_settled(now, ticket, None if error is None else TransportError(f"sim: {error}"))
        core.settle_dirty(now)

    def completed(self, ticket: int, error: str | None) -> None:
        if not self.crashed:
            self.settled.append((ticket, error))
            self.kick()

    def apply(self, effect: Any, now: float) -> None:
        core = self.core
        if isinstance(effect, AddPeer):
            core.peer_added(now, effect.peer, effect.meta.decode(), None)
        elif isinstance(effect, RemovePeer):
            pass
        elif isinstance(effect, CheckProcess):
            if effect.process in self.world.dead_processes:
                core.process_gone(now, effect.process)
        elif isinstance(effect, FlushNow):
            self.flush(now, effect.peer)
            if effect.raw:
                self.send_frame(now, effect.peer, effect.raw)
        else:
            raise AssertionError(f"no shell for {effect!r}")

    def carry_out(self, transfer: Transfer, now: float) -> None:
        write = self.core.start_write(now, transfer)
        if write is not None:
            self.stalled_posting(lambda t: self.post_write(t, transfer, write))

    def post_write(self, now: float, transfer: Transfer, write: Any) -> None:
        core = self.core
        recs = write.records
        for rec in recs:
            rec.posting = False
        if self.world.refuse_post():
            core.write_failed(now, write, TransportError("sim: the write could not be posted"))
            return
        parts = []
        for q in transfer.group:
            if any(q.rec is r for r in recs):
                dec = q.rec.session.identity.split(b"|")[0].decode()
                parts.append((self.world.tag(dec, q.rec.request_id, q.rec.generation), q.rec.request_id,
                              q.rec.generation, q.plan))
        ticket = self.world.transport.post("write", self, write.agent, parts, write.notification)
        core.write_posted(write, ticket)
        self.sim.log(self.name, f"posted write {ticket} ({write.label}) to {write.agent}")

    # -- the engine --------------------------------------------------------------------------------------------
    def plan_send(self, req: Request, t: float, *, retry: bool = False) -> None:
        att = PAttempt(req, retry, give_up=t + self.world.options.request_timeout)
        if retry:
            att.prev = self.core.records.get(req.rid)
        self.call_at(t, lambda now: self.send_next(now, att))

    def send_next(self, now: float, att: PAttempt) -> None:
        core, req = self.core, att.req
        if att.done:
            return
        if att.sent == 0:
            rec = core.records.get(req.rid)
            if att.retry and (rec is att.prev or (rec is not None and not rec.is_live)):
                self.wait(now, att)   # a retry waits for decode's new announce to replace the ended record
                return
            if att.src is None and not self.allocate(att):
                self.wait(now, att)
                return
        elif core.records.get(req.rid) is not att.rec:
            att.done = True   # decode announced it again meanwhile: the rest belongs to the retry's send
            return
        assert att.src is not None
        chunk = req.chunks[att.sent]
        pages = {pool: att.src[pool][lo:hi] for pool, (lo, hi) in chunk.ranges.items() if hi > lo}
        offsets = {pool: lo for pool, (lo, hi) in chunk.ranges.items() if hi > lo}
        last = att.sent == len(req.chunks) - 1
        try:
            spec = make_spec(self.memory, pages, offsets, last, chunk.buffers)
            core.send(now, req.rid, spec, None)
        except KVFerryError as exc:
            self.sim.log(self.name, f"send {req.rid} refused: {exc}")
            att.done = True
            if att.rec is None:   # nothing of this attempt was handed over: its pages are the engine's
                self.release(att)
            return
        if att.rec is None:
            att.rec = rec = core.records[req.rid]
            self.attempts[id(att)] = att
            if rec.is_live:
                self.live.setdefault(id(rec), []).append(att)
            else:
                self.finished.append(att)
        att.sent += 1
        self.sim.log(self.name, f"send {req.rid} chunk {att.sent}/{len(req.chunks)}")
        if att.sent < len(req.chunks):
            self.call_at(now + self.sim.rng_work.random() * 0.05, lambda t: self.send_next(t, att))
        else:
            att.done = True

    def allocate(self, att: PAttempt) -> bool:
        req = att.req
        if any(len(self.free[pool]) < n for pool, n in req.total.items()):
            return False
        att.src = {}
        rid_id = self.world.rid_id(req.rid)
        for pool, n in req.total.items():
            pages = self.free[pool].take(n)
            fill_content(self.memory, req.rid, pool, pages, 0, self.pages.arrays)
            self.src_owner[pool][pages] = rid_id
            att.src[pool] = pages
        return True

    def release(self, att: PAttempt) -> None:
        """The engine takes the source pages back (and will write other requests' KV there)."""
        if att.src is None:
            return
        for pool, pages in att.src.items():
            self.src_owner[pool][pages] = -1
            page_list = pages.tolist()
            for buf in self.memory.layout.pool(pool).buffers:
                view = self.pages.arrays[buf.name]
                for page in page_list:   # a few pages: one at a time costs less than numpy's fancy indexing
                    view[page] = 0       # reused at once: what a late read gets is not the KV
            self.free[pool].give(pages)
        att.src = None
        self.changes += 1

    def can_go(self, att: PAttempt) -> bool:
        rec = self.core.records.get(att.req.rid)
        if att.retry and (rec is att.prev or (rec is not None and not rec.is_live)):
            return False
        return att.src is not None or all(len(self.free[pool]) >= n for pool, n in att.req.total.items())

    def go(self, now: float, att: PAttempt) -> None:
        self.send_next(now, att)

    def give_up(self, att: PAttempt) -> None:
        att.done = True

    def abort_at(self, t: float, rid: str) -> None:
        self.call_at(t, lambda now: self.core.abort(now, rid, "engine abort"))

    def engine(self, now: float) -> None:
        """Reuse the source pages of every request the core says may be freed (``prefill_requests.may_free``,
        what ``PrefillEndpoint.may_free`` answers)."""
        if self.ended_recs:   # only an ended record's pages may be freed: the others are not looked at
            for rec in self.ended_recs:
                self.finished.extend(self.live.pop(id(rec), ()))
            self.ended_recs.clear()
        keep = []
        for att in self.finished:
            if may_free(att.rec):
                att.done = True   # ended: a chunk not sent yet never will be
                del self.attempts[id(att)]
                self.release(att)
            else:
                keep.append(att)
        self.finished = keep


# -- decode ------------------------------------------------------------------------------------------------
@dataclass
class DAttempt:
    req: Request
    n: int                       # 0: the first announce, then each retry
    pages: dict[str, np.ndarray] | None = None
    gen: int = -1
    rec: Any = None
    give_up: float = 0.0
    expires: bool = False        # its give-up is scheduled (once it first waited)
    decided: bool = False        # whether to announce it again was decided (once it ended)


class DecodeNode(Node):
    kind = "decode"

    def __init__(self, world: World, name: str, mode: str, rank: int = 0) -> None:
        self.mode = mode
        self.rank = rank
        self.group: DecodeGroup | None = None   # the engine over this rank's TP group (decode TP > 1)
        super().__init__(world, name)

    def start(self) -> None:
        world = self.world
        self.memory = KVMemory.allocate(rank_layout("decode", world.tp, self.rank, world.cfg.pages))
        world.graveyard.append(self.memory)
        self.pages = PageMap(self.memory)
        self.slice_prov = SliceProvenance(self.memory)
        self.slice_tags = [self.slice_prov.tags[name] for name in self.pages.names]   # ``World.apply`` marks by
        # ``PageMap.find_all``'s buffer number
        self.free = {p.name: FreePages(p.min_pages) for p in self.memory.layout.pools}
        setup = DecodeSetup("sim", self.agent.encode(), self.process, None)
        self.core = DecodeCore(self.memory, setup, world.options, DigestMode(world.swarm.digest),
                               NullRecorder("decode", self.memory.layout), self.entropy)
        self.deadlines = Deadlines()
        self.core.by_gen = TrackedDict(self.deadlines)
        self.watch(self.core)
        self.reads_done: deque[tuple[int, str | None, list[Any]]] = deque()
        self.notifs: deque[tuple[str, bytes]] = deque()
        self.attempts: dict[int, DAttempt] = {}    # generation -> attempt, until its lease ends
        self.ending: set[int] = set()              # generations of those attempts whose record ended
        self.ended_gens: list[int] = []            # records that ended since the engine last looked
        self.released: list[int] = []              # leases that ended since the engine last looked
        self.watch_leases(self.core.leases)
        world.agents[self.agent] = self
        self.call_at(self.sim.now, self.connect, work=False)

    # -- the shell ---------------------------------------------------------------------------------------
    def send_frame(self, now: float, peer: Any, frame: bytes) -> None:
        if peer in self.world.net.by_link:   # a closed socket sends nothing (and says nothing left)
            self.world.net.to_prefill(peer, frame)
            self.core.frame_sent(now, peer)

    def on_frame(self, now: float, kind: str, peer: Any, data: bytes) -> None:
        if kind == "dropped":
            if peer.state in (LinkState.CONNECTING, LinkState.ESTABLISHED):
                self.core.dropped(now, peer, "sim: connection cut")
        else:
            self.core.on_frame(now, peer, data)

    def has_news(self) -> bool:
        return bool(self.reads_done or self.notifs)

    def holds_record(self, rec: Any) -> bool:
        return self.core.by_gen.get(rec.generation) is rec

    def tracks_records(self) -> bool:
        return getattr(self.core.by_gen, "deadlines", None) is self.deadlines

    def watch_leases(self, leases: Any) -> None:
        """Hear every lease that ends (the engine takes its pages back then)."""
        orig = leases.release

        def release(lease_id: int) -> None:
            orig(lease_id)
            self.released.append(lease_id)
        leases.release = release

    def record_ended(self, rec: Any) -> None:
        super().record_ended(rec)
        gen = getattr(rec, "generation", None)
        if gen is not None:
            self.ended_gens.append(gen)

    def pump(self, now: float) -> None:
        core = self.core
        while self.reads_done:
            ticket, error, tainted = self.reads_done.popleft()
            entries = list(core.reads.get(ticket, ()))
            core.read_settled(now, ticket, None if error is None else TransportError(f"sim: {error}"))
            for rec, part, read in entries:
                if any(t[1] == rec.request_id and t[2] == rec.generation for t in tainted) and \
                        read.chunk.chunk in part.chunks_seen and rec.state is not RequestState.FAILED:
                    self.sim.fail("a_source_released_under_read",
                                  f"{self.name}: read of {rec.request_id!r} gen {rec.generation} chunk "
                                  f"{read.chunk.chunk} took bytes from source pages prefill had released, and "
                                  "decode accepted it")
        self.take_notifications(now)

    def take_notifications(self, now: float) -> None:
        while self.notifs:
            agent, data = self.notifs.popleft()
            self.guard(self.core.on_notification, now, agent, data)

    def notified(self, target: str, agent: str, data: bytes) -> None:
        if not self.crashed and target == self.agent:
            self.notifs.append((agent, data))
            self.kick()

    def read_completed(self, inc: int, ticket: int, error: str | None, tainted: list[Any]) -> None:
        if not self.crashed and inc == self.inc:
            self.reads_done.append((ticket, error, tainted))
            self.kick()

    def apply(self, effect: Any, now: float) -> None:
        core, net = self.core, self.world.net
        if isinstance(effect, OpenLink):
            net.open(self, effect.link)
            self.send_frame(now, effect.link, effect.hello)
        elif isinstance(effect, CloseLink):
            core.take_out(effect.link)
            net.close(effect.link, tell_decode=False)
        elif isinstance(effect, AddPeer):
            core.peer_added(now, effect.peer, effect.meta.decode(), None)
        elif isinstance(effect, RemovePeer):
            pass
        elif isinstance(effect, CheckWriter):
            link = effect.link
            gone = link.agent in self.world.dead_agents or link.process in self.world.dead_processes
            core.writer_checked(now, link, gone)
        elif isinstance(effect, TakeNotifications):
            self.take_notifications(now)
            core.notifications_taken(now)
        elif isinstance(effect, FlushNow):
            self.flush(now, effect.peer)
            if effect.raw:
                self.send_frame(now, effect.peer, effect.raw)
        else:
            raise AssertionError(f"no shell for {effect!r}")

    def carry_out(self, transfer: Transfer, now: float) -> None:
        job = self.core.start_read(now, transfer)
        if job is not None:
            self.stalled_posting(lambda t: self.post_read(t, job))

    def post_read(self, now: float, job: Any) -> None:
        core = self.core
        for part in job.parts:
            part.posting = False
        if self.world.refuse_post():
            core.read_failed(now, job, TransportError("sim: the read could not be posted"))
            return
        parts = [(self.world.tag(self.ident, q.rec.request_id, q.rec.generation), q.rec.request_id,
                  q.rec.generation, q.plan) for q in job.group]
        ticket = self.world.transport.post("read", self, job.agent, parts)
        core.read_posted(job, ticket)
        self.sim.log(self.name, f"posted read {ticket} ({job.label}) from {job.agent}")

    # -- the engine --------------------------------------------------------------------------------------------
    def connect(self, now: float) -> None:
        """Keep a link to every prefill rank this rank needs (as an engine's connect retries do); across TP
        each must say it is the rank asked for (``connect_all``'s ``expect``)."""
        tp = self.world.tp
        for group in self.world.prefill_groups:
            for r in needed_ranks(self.rank, tp):
                link = self.core.links.get(group[r].address)
                expect = None if tp == (1, 1) else (r, tp[0])
                if link is None or link.state in (LinkState.DEAD, LinkState.FAILED):
                    self.guard(lambda a=group[r].address, e=expect: self.core.start_link(
                        now, a, self.world.options.handshake_timeout, e, self.mode))
        self.call_at(now + 0.25, self.connect, work=False)

    def plan_announce(self, req: Request, t: float, n: int = 0) -> None:
        att = DAttempt(req, n, give_up=t + self.world.options.request_timeout)
        self.call_at(t, lambda now: self.announce(now, att))

    def announce(self, now: float, att: DAttempt) -> None:
        req, core = att.req, self.core
        if self.group is not None and self.group.is_stale(req.rid, att.n):
            self.release(att)   # the engine failed this attempt on another rank meanwhile
            return
        if att.pages is None and not self.allocate(att):
            self.wait(now, att)
            return
        assert att.pages is not None
        address = self.world.announce_peer(self, req)
        try:
            if req.cancel:
                core.cancel(now, req.rid, "engine cancel", address)
                self.sim.faults["cancel"] += 1
                self.sim.log(self.name, f"cancel {req.rid}")
                self.release(att)
                return
            core.announce(now, req.rid, att.pages, address, dict(req.prefix), ([], ""))
        except (PeerLost, LeaseError) as exc:
            self.sim.log(self.name, f"announce {req.rid} not yet: {exc}")
            self.wait(now, att)
            return
        rec = core.records[req.rid]
        att.rec, att.gen = rec, rec.generation
        self.attempts[att.gen] = att
        if not rec.is_live:
            self.ended_gens.append(att.gen)
        pages = {p: a.tolist() for p, a in att.pages.items()}   # lists: numpy's repr costs more than the step
        self.sim.log(self.name, f"announce {req.rid} gen {att.gen} pages {pages} prefix {dict(req.prefix)}")
        if req.decode_abort is not None and att.n == 0:
            self.call_at(now + req.decode_abort, lambda t: self.abort(t, att))
            self.sim.faults["decode_abort"] += 1

    def changed_since(self) -> tuple[Any, ...]:
        return (self.changes, self.deadlines.seq, *(link.state for link in self.core.links.values()))

    def can_go(self, att: DAttempt) -> bool:
        req, core = att.req, self.core
        if att.pages is None and any(len(self.free[pool]) < n for pool, n in req.leased.items()):
            return False
        peer = self.world.announce_peer(self, req)
        links = [core.links.get(a) for a in ([peer] if isinstance(peer, str) else peer)]
        old = core.records.get(req.rid)
        return all(link is not None and link.established for link in links) and (old is None or not old.is_live)

    def go(self, now: float, att: DAttempt) -> None:
        self.announce(now, att)

    def give_up(self, att: DAttempt) -> None:
        self.release(att)

    def abort(self, now: float, att: DAttempt) -> None:
        if att.rec is not None and att.rec.is_live:
            self.core.abort(now, att.req.rid, "engine abort")

    def engine_abort(self, now: float, rid: str, n: int) -> None:
        """The engine failed attempt ``n`` of ``rid`` on another rank of this group: abort it here too."""
        def abort_here(t: float) -> None:
            for att in list(self.attempts.values()):
                if att.req.rid == rid and att.n == n:
                    self.abort(t, att)
        self.call_at(now, abort_here)

    def allocate(self, att: DAttempt) -> bool:
        req = att.req
        if any(len(self.free[pool]) < n for pool, n in req.leased.items()):
            return False
        att.pages = {}
        for pool, n in req.leased.items():
            pages = self.free[pool].take(n).tolist()
            # Announce order differs from page order: the lease maps positions to any pages.
            self.sim.rng_work.shuffle(pages)
            att.pages[pool] = np.array(pages, dtype=np.int64)
        return True

    def release(self, att: DAttempt) -> None:
        if att.pages is not None:
            for pool, pages in att.pages.items():
                self.free[pool].give(pages)
            att.pages = None
            self.changes += 1

    def engine(self, now: float) -> None:
        """Announce a failed request again (same id, new pages: the old ones may be quarantined) as soon as
        it failed; take pages back once their lease ended."""
        if not self.ended_gens and not self.released:
            return   # no record and no lease ended since the last look: nothing to decide or take back
        leases = self.core.leases
        # Only the attempts whose record just ended, or whose lease just ended after their record: in the
        # order they were announced (generations count up).
        look = {gen for gen in self.ended_gens if gen in self.attempts}
        self.ending |= look
        look.update(gen for gen in self.released if gen in self.ending)
        self.ended_gens.clear()
        self.released.clear()
        for gen in sorted(look):
            att = self.attempts[gen]
            if not att.decided:
                att.decided = True
                req = att.req
                failed = att.rec.state is RequestState.FAILED
                if self.group is not None:
                    self.group.ended(self.rank, req.rid, att.n, att.rec.state)
                    # One decision per attempt for the whole group: the first rank that saw it fail.
                    failed = failed and self.group.failed(self, req.rid, att.n, now)
                if (failed and att.n < 2 and self.world.faults_on()
                        and self.sim.rng_work.random() < self.world.swarm.retry):
                    t = now + self.sim.rng_work.random() * 0.05
                    self.sim.log(self.name, f"retry {req.rid} at {t:.4f}")
                    self.sim.faults["retry"] += 1
                    for node in self.group.ranks if self.group is not None else [self]:
                        node.plan_announce(req, t, att.n + 1)
                    t_send = t + self.sim.rng_work.random() * 0.05
                    for prefill in self.world.prefill_groups[req.prefill]:
                        prefill.plan_send(req, t_send, retry=True)
            if not leases.holds(gen):
                del self.attempts[gen]
                self.ending.discard(gen)
                self.release(att)

    # -- what the invariants read --------------------------------------------------------------------------
    def check_done(self, rec: Any) -> None:
        """(b): a request DONE here has every leased page written by it, byte for byte its source."""
        att = self.attempts.get(rec.generation)
        if att is None or att.pages is None:
            self.sim.fail("b_done_bytes", f"{self.name}: {rec.request_id!r} gen {rec.generation} DONE with no lease")
        assert att is not None and att.pages is not None
        tag = self.world.tag(self.ident, rec.request_id, rec.generation)
        layout = self.memory.layout
        for pool, pages in att.pages.items():
            first = att.req.prefix.get(pool, 0)
            for buf in layout.pool(pool).buffers:
                prov = self.pages.prov[buf.name].take(pages)
                if not all_are(prov, tag):
                    bad = int(pages[np.flatnonzero(prov != tag)[0]])
                    self.sim.fail("b_done_bytes", f"{self.name}: {rec.request_id!r} gen {rec.generation} DONE but "
                                  f"{buf.name} page {bad} was last written by "
                                  f"{self.world.tag_name(int(self.pages.prov[buf.name][bad]))}")
                other = self.slice_prov.first_other(buf.name, pages, tag)
                if other is not None:   # a slice of the page (one prefill rank's heads) not written by it
                    page, byte, by = other
                    self.sim.fail("b_done_bytes", f"{self.name}: {rec.request_id!r} gen {rec.generation} DONE but "
                                  f"{buf.name} page {page} byte {byte} was last written by {self.world.tag_name(by)}")
                got = self.pages.arrays[buf.name].take(pages, axis=0)
                want = page_rows(rec.request_id, first, len(pages), self.pages.layout_index[buf.name], buf, self.rank)
                if got.tobytes() != want.tobytes():   # cheaper than numpy's comparison on a few small rows
                    page = int(pages[np.flatnonzero((got != want).any(axis=1))[0]])
                    self.sim.fail("b_done_bytes", f"{self.name}: {rec.request_id!r} gen {rec.generation} DONE "
                                  f"but {buf.name} page {page} differs from its source (rank {self.rank}'s "
                                  "heads of the request's page)")
