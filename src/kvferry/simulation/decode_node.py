"""A simulated decode: ``DecodeCore`` in a ``Node``, playing its engine too.

Part of ``simulation``, beside ``prefill_node``, above ``node``. The engine leases pages, announces (with a
prefix), aborts, cancels, announces a failed request again under the same id, and reuses pages once the
lease ends.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import numpy as np

from kvferry.control.core.base import AddPeer, RemovePeer, Transfer
from kvferry.control.core.decode import CheckWriter, CloseLink, DecodeCore, DecodeSetup, OpenLink, TakeNotifications
from kvferry.control.core.states import LinkState, RequestState
from kvferry.control.stats import NullRecorder
from kvferry.errors import LeaseError, PeerLost, TransportError
from kvferry.integrity import DigestMode
from kvferry.layout.memory import KVMemory
from kvferry.simulation.tp import (
    DecodeGroup,
    SliceProvenance,
    all_are,
    needed_ranks,
    page_rows,
    rank_layout,
    token_rows,
)
from kvferry.simulation.world import PageMap

if TYPE_CHECKING:
    from kvferry.simulation.cluster import Request, World
from kvferry.simulation.node import Deadlines, FreePages, Node, Stalled, TrackedDict

__all__ = ["DecodeNode"]


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
        self.memory = KVMemory.allocate(rank_layout("decode", world.tp, self.rank, world.cfg.pages,
                                                    world.page_sizes[1] if world.page_sizes else None,
                                                    world.state))
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
        else:
            super().apply(effect, now)

    def carry_out(self, transfer: Transfer, now: float) -> None:
        job = self.core.start_read(now, transfer)
        if job is None:
            return
        if self.phase and self.world.stop_in_read(self):
            # SIGSTOP inside the post, after start_read's check; on resume the read goes out and completes
            # at once, and the shell goes on with the rest of this iteration (``Node.carry_on``).
            self.resume_post = lambda t: self.post_read(t, job, at_once=True)
            self.resume_between = True
            self.resume_rest = self.phase
            raise Stalled
        self.stalled_posting(lambda t: self.post_read(t, job))

    def post_read(self, now: float, job: Any, at_once: bool = False) -> None:
        core = self.core
        for part in job.parts:
            part.posting = False
        if self.world.refuse_post():
            core.read_failed(now, job, TransportError("sim: the read could not be posted"))
            return
        parts = [(self.world.tag(self.ident, q.rec.request_id, q.rec.generation), q.rec.request_id,
                  q.rec.generation, q.plan) for q in job.group]
        ticket = self.world.transport.post("read", self, job.agent, parts, at_once=at_once)
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

    def check_tokens(self, rec: Any, tag: int, req: Any, pages: np.ndarray) -> None:
        """(b) on a page-size seed: every byte of the leased kv pages that holds a token prefill sent (its
        pages' tokens; past them, the tail of decode's last page is the request's garbage on both sides)
        was last written by this request and is the source's byte of that token, head and place."""
        ts = self.world.page_sizes[0]
        sent = req.total["kv"] * ts
        first = req.prefix.get("kv", 0)
        for buf in self.memory.layout.pool("kv").buffers:
            want, tokens = token_rows(rec.request_id, first, len(pages), self.pages.layout_index[buf.name], buf)
            mask = tokens < sent
            got = self.pages.arrays[buf.name].take(pages, axis=0)
            tags = self.slice_prov.rows[buf.name].take(pages, axis=0)
            stale = mask & (tags != tag)
            if stale.any():
                i, byte = (int(x) for x in np.argwhere(stale)[0])
                self.sim.fail("b_done_bytes", f"{self.name}: {rec.request_id!r} gen {rec.generation} DONE but "
                              f"{buf.name} page {int(pages[i])} byte {byte} (token {int(tokens[i, byte])}) was last "
                              f"written by {self.world.tag_name(int(tags[i, byte]))}")
            wrong = mask & (got != want)
            if wrong.any():
                i, byte = (int(x) for x in np.argwhere(wrong)[0])
                self.sim.fail("b_done_bytes", f"{self.name}: {rec.request_id!r} gen {rec.generation} DONE but "
                              f"{buf.name} page {int(pages[i])} byte {byte} differs from the source's byte of "
                              f"token {int(tokens[i, byte])} ({self.world.page_sizes[0]} -> "
                              f"{self.world.page_sizes[1]} tokens per page)")

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
            if att.req.tokens and pool == "kv":   # a page-size seed: token by token (``check_tokens``)
                self.check_tokens(rec, tag, att.req, pages)
                continue
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
                want = page_rows(rec.request_id, first, len(pages), self.pages.layout_index[buf.name], buf, self.rank,
                                 layout.tp_size)
                if got.tobytes() != want.tobytes():   # cheaper than numpy's comparison on a few small rows
                    page = int(pages[np.flatnonzero((got != want).any(axis=1))[0]])
                    self.sim.fail("b_done_bytes", f"{self.name}: {rec.request_id!r} gen {rec.generation} DONE "
                                  f"but {buf.name} page {page} differs from its source (rank {self.rank}'s "
                                  "heads of the request's page)")
