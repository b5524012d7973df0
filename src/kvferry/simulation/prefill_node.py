"""A simulated prefill: ``PrefillCore`` in a ``Node``, playing its engine too.

Part of ``simulation``, beside ``decode_node``, above ``node``. The engine sends chunks of its requests
(whole, chunked, layer by layer), aborts some, and reuses a request's source pages as soon as the core says
it may (``may_free``).
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import numpy as np

from kvferry.control.core.base import AddPeer, CheckProcess, RemovePeer, Transfer
from kvferry.control.core.prefill import PrefillCore, PrefillSetup
from kvferry.control.core.prefill_requests import make_spec, may_free
from kvferry.control.stats import NullRecorder
from kvferry.errors import KVFerryError, TransportError
from kvferry.integrity import DigestMode
from kvferry.layout.memory import KVMemory
from kvferry.simulation.tp import (
    fill_content,
    rank_layout,
)
from kvferry.simulation.world import PageMap

if TYPE_CHECKING:
    from kvferry.simulation.cluster import Request, World
from kvferry.simulation.node import Deadlines, FreePages, Node, tracked_set

__all__ = ["PrefillNode"]


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
        self.memory = KVMemory.allocate(rank_layout("prefill", world.tp, self.rank, world.cfg.pages,
                                                    world.page_sizes[0] if world.page_sizes else None,
                                                    world.state))
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
        if kind == "dropped":   # named when a frame of that connection reached this prefill (Net._dropped_p)
            self.core.connection_dropped(now, [peer] if peer else None)
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
        else:
            super().apply(effect, now)

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
            fill_content(self.memory, req.rid, pool, pages, 0, self.pages.arrays,
                         by_token=self.world.page_sizes is not None and pool == "kv")
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
