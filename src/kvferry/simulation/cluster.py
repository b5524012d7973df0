"""One simulated deployment: prefills and decodes, the workload they serve, the faults, and the invariants.

Part of ``simulation``, above the nodes (``prefill_node``, ``decode_node``) and ``world``, below ``runner``.
``World`` builds the nodes and the workload from the seed, schedules the faults, runs the event loop, and
checks after every step:

* ``a_lease`` (a): no byte lands in a decode page that is not leased to the (request, generation) whose
  write or read carried it (checked row by row as it lands, from the row's own address); and
  ``a_source_released_under_write`` / ``a_source_released_under_read``: no prefill source page is handed back
  to the engine while a write of it is in flight, or while a read of it can still be accepted;
* ``b_done_bytes`` / ``b_prefill_done_before_verdict`` (b): a request DONE on decode has every leased page
  last written by it and equal to its source; prefill reports DONE only after decode's verdict;
* ``b_group_verdict`` (b, across TP): a prefill rank reports DONE only after every decode rank it writes the
  request to (its request group) verified it;
* ``c_done_and_failed`` (c): never DONE on prefill and FAILED on decode for the same request and generation
  (DONE on decode and FAILED on prefill is counted, not a violation: a verdict lost with its connection
  cannot be told apart from a late one; docs/simulation.md);
* ``d_deadline`` (d): every request ends on both sides by its deadline (plus the cores' check period, and
  plus any stall of the node holding it);
* ``e_at_rest`` (e): once faults stop and the work is done, no lease, hold, quarantine, record or transfer
  remains, and every page is back with its engine;
* ``internal``: a core caught a bug of its own (``InternalError``).
"""

from __future__ import annotations

import random
from collections.abc import Callable, Mapping
from dataclasses import dataclass, replace
from typing import Any

from kvferry.control.core.states import RequestState
from kvferry.simulation.config import LAYERS, STATE_LAYERS, SimConfig, Swarm, draw_page_sizes
from kvferry.simulation.decode_node import DecodeNode
from kvferry.simulation.node import DEADLINE_SLACK, Node
from kvferry.simulation.prefill_node import PrefillNode
from kvferry.simulation.tp import STATE_POOL, TP_PAIRS, DecodeGroup, draw_state, draw_tp, needed_ranks, rank_name
from kvferry.simulation.world import Net, Sim, Transport, copy_rows

__all__ = ["Chunk", "Request", "World"]

REST_CHECK_S = 0.5


@dataclass(frozen=True, slots=True)
class Chunk:
    """One ``send``: per pool, the request positions it carries (lo, hi); the buffers (None: all)."""

    ranges: Mapping[str, tuple[int, int]]
    buffers: tuple[str, ...] | None = None


@dataclass(frozen=True, slots=True)
class Request:
    """One request of the workload, as both engines will handle it."""

    rid: str
    decode: int                  # the decode group (every rank of it announces the request)
    prefill: int                 # the prefill group (every rank of it sends its heads)
    arrive: float
    total: Mapping[str, int]     # pages per pool of the whole request
    prefix: Mapping[str, int]    # leading pages decode already holds
    chunks: tuple[Chunk, ...]
    send_at: float
    prefill_abort: float | None  # seconds after its send, or None
    decode_abort: float | None   # seconds after its announce, or None
    cancel: bool                 # decode never announces it, and says so
    leased: Mapping[str, int]    # pages per pool decode leases: the total less the prefix
    # A page-size seed's kv tokens (0: pages are alike on both sides): ``total`` is then prefill's pages,
    # ``prefix`` and ``leased`` decode's.
    tokens: int = 0


def make_workload(sim: Sim, cfg: SimConfig, swarm: Swarm, page_sizes: tuple[int, int] | None = None,
                  state: bool = False) -> list[Request]:
    """The requests; ``page_sizes`` (prefill's, decode's kv tokens per page): each request's kv pool is a
    token count, in prefill's pages (chunks, positions) on one side and decode's (prefix, lease) on the other.
    ``state``: the layouts have the state pool (``simulation.tp.STATE_POOL``): every request holds one slot
    of it, sent with its last chunk (each layer's with that layer's send). Drawn from no stream: a seed's
    other draws are what they were without it."""
    rng = sim.rng_work
    out = []
    layers = STATE_LAYERS if state else LAYERS
    for i in range(cfg.requests):
        tokens, dst_kv = 0, 0
        if page_sizes is None:
            total = {"kv": rng.randint(1, 4)}
            dst_kv = total["kv"]
        else:
            tokens = rng.randint(1, 2 * max(page_sizes))
            total = {"kv": -(-tokens // page_sizes[0])}
            dst_kv = -(-tokens // page_sizes[1])
        if rng.random() < 0.6:
            total["c"] = rng.randint(1, 2)
        if state:
            total[STATE_POOL] = 1
        prefix = {"kv": rng.randint(1, dst_kv - 1)} if dst_kv > 1 and rng.random() < swarm.prefix else {}
        if rng.random() < swarm.layered:
            chunks = tuple(Chunk({p: (0, n) for p, n in total.items()}, layer) for layer in layers)
        elif rng.random() < swarm.chunked and total["kv"] > 1:
            cut = rng.randint(1, total["kv"] - 1)
            first = {"kv": (0, cut)}
            rest = {"kv": (cut, total["kv"])}
            for pool in ("c", STATE_POOL):
                if pool in total:
                    rest[pool] = (0, total[pool])
            chunks = (Chunk(first), Chunk(rest))
        else:
            chunks = (Chunk({p: (0, n) for p, n in total.items()}),)
        if swarm.skip_chunk and len(chunks) > 1 and sim.rng_skip.random() < swarm.skip_chunk:
            gone = sim.rng_skip.randrange(len(chunks) - 1)   # never the last: the request still ends
            chunks = chunks[:gone] + chunks[gone + 1:]
            sim.faults["skip_chunk"] += 1
        arrive = rng.random() * cfg.arrival_span
        faults = cfg.faults
        dst_total = {**total, "kv": dst_kv}
        leased = {p: n - prefix.get(p, 0) for p, n in dst_total.items() if n > prefix.get(p, 0)}
        out.append(Request(
            f"r{i}", rng.randrange(cfg.decodes), rng.randrange(cfg.prefills), arrive, total, prefix, chunks,
            max(0.0, arrive + rng.uniform(-0.05, 0.3)),
            _abort_after(rng) if faults and rng.random() < swarm.prefill_abort else None,
            _abort_after(rng) if faults and rng.random() < swarm.decode_abort else None,
            faults and rng.random() < swarm.cancel, leased, tokens))
    return out


def _abort_after(rng: Any) -> float:
    """When an engine aborts: often right as the bytes move (the races), else any time later."""
    return rng.uniform(0.0, 0.03) if rng.random() < 0.5 else rng.uniform(0.0, 0.5)


def _cut_until(table: dict[tuple[str, str], float], key: tuple[str, str], heal: float) -> None:
    """``key``'s pair cut in ``table`` until ``heal`` at least (an earlier cut may last longer)."""
    table[key] = max(table.get(key, 0.0), heal)


class World:
    def __init__(self, seed: int, cfg: SimConfig, swarm: Swarm | None = None, without: tuple[str, ...] = ()) -> None:
        self.sim = Sim(seed)
        self.cfg = cfg
        # (prefill TP, decode TP): each group of ``cfg.prefills`` and ``cfg.decodes`` runs that many ranks, a
        # node each (``simulation.tp``); a request goes to one prefill group and one decode group. From a
        # stream of its own: drawing it first moves nothing else.
        # Page sizes (issue 50), from a stream of their own: a page-size seed runs TP 1:1, its kv pool at
        # another page size on each side; every other seed draws what it drew before.
        # A wide seed stays wide, and a seed given its TP pair draws none.
        drawn_tp = cfg.tp or draw_tp(seed, cfg.wide_tp)
        self.page_sizes = cfg.page_sizes or (draw_page_sizes(seed, cfg.page_share)
                                             if cfg.tp is None and drawn_tp in TP_PAIRS else None)
        self.tp = (1, 1) if self.page_sizes else drawn_tp
        self.state = draw_state(seed, self.tp, cfg.state_share)   # a state pool beside the paged ones (TP pairs)
        drawn = Swarm.draw(self.sim.rng_fault, cfg.faults)   # always drawn: the fault stream stays the same
        if cfg.faults:
            drawn = drawn.with_liveness(self.sim.rng_live).with_data_path(self.sim.rng_data).with_fabric(
                self.sim.rng_fabric).with_oneway(self.sim.rng_oneway).with_duplicates(self.sim.rng_dup).with_read_stalls(
                self.sim.rng_read).with_chunk_skips(self.sim.rng_skip, self.page_sizes)
        self.swarm = (swarm if swarm is not None else drawn).without(*without)
        self.options = replace(cfg.options, transport_liveness=self.swarm.zmtp)
        self.net = Net(self)
        self.transport = Transport(self)
        self.agents: dict[str, Node] = {}
        self.dead_processes: set[Any] = set()
        self.dead_agents: set[str] = set()
        self.graveyard: list[Any] = []
        self._tags: dict[tuple[str, str, int], int] = {}
        self._tag_names: list[tuple[str, str, int]] = []
        self._rids: dict[str, int] = {}
        self.decode_done: set[tuple[str, str, int]] = set()
        self.outcome_p: dict[tuple[str, str, int], RequestState] = {}
        self.outcome_d: dict[tuple[str, str, int], RequestState] = {}
        self.disagreements = 0
        self.done = self.failed = 0
        self.last_work = 0.0   # when the last engine command was scheduled for
        ptp, dtp = self.tp
        self.prefill_groups = [[self._prefill(i, r) for r in range(ptp)] for i in range(cfg.prefills)]
        self.prefills = [node for group in self.prefill_groups for node in group]
        # Any TP pair: across sizes a pulling decode rank reads its heads from the prefill ranks holding them
        modes = ["pull" if self.sim.rng_fault.random() < self.swarm.pull else "push" for _ in range(cfg.decodes)]
        self.decode_groups = [[DecodeNode(self, rank_name("decode", i, r, dtp), modes[i], r) for r in range(dtp)]
                              for i in range(cfg.decodes)]
        self.decodes = [node for group in self.decode_groups for node in group]
        self.engines = [DecodeGroup(group) for group in self.decode_groups if dtp > 1]
        for engine in self.engines:
            for node in engine.ranks:
                node.group = engine
        self.requests = make_workload(self.sim, cfg, self.swarm, self.page_sizes, self.state)
        for req in self.requests:
            for node in self.decode_groups[req.decode]:
                node.plan_announce(req, req.arrive)
            for prefill in self.prefill_groups[req.prefill]:
                prefill.plan_send(req, req.send_at)
                if req.prefill_abort is not None:
                    prefill.abort_at(req.send_at + req.prefill_abort, req.rid)
                    self.sim.faults["prefill_abort"] += 1
        if cfg.faults:
            self.schedule_faults()
        self.at_rest = False

    def _prefill(self, group: int, rank: int) -> PrefillNode:
        name = rank_name("prefill", group, rank, self.tp[0])
        return PrefillNode(self, name, f"sim://{name}", rank)

    def announce_peer(self, node: DecodeNode, req: Request) -> str | list[str]:
        """What decode rank ``node`` announces ``req`` to (``connect_needed``'s answer): the prefill's address
        at TP 1 on both sides, else the addresses of the prefill ranks holding its heads, in rank order."""
        group = self.prefill_groups[req.prefill]
        if self.tp == (1, 1):
            return group[0].address
        return [group[r].address for r in needed_ranks(node.rank, self.tp)]

    @property
    def split(self) -> int:
        """Decode group attempts DONE on one rank and FAILED on another (the engine failed them)."""
        return sum(engine.num_split() for engine in self.engines)

    # -- names -------------------------------------------------------------------------------------------
    def tag(self, decode: str, rid: str, gen: int) -> int:
        key = (decode, rid, gen)
        tag = self._tags.get(key)
        if tag is None:
            tag = self._tags[key] = len(self._tag_names)
            self._tag_names.append(key)
        return tag

    def tag_name(self, tag: int) -> str:
        if tag < 0:
            return "nobody"
        decode, rid, gen = self._tag_names[tag]
        return f"{rid!r} gen {gen} (for {decode})"

    def rid_id(self, rid: str) -> int:
        return self._rids.setdefault(rid, len(self._rids))

    def prefill_at(self, address: str) -> PrefillNode | None:
        for node in self.prefills:
            if node.address == address:
                return node
        return None

    @property
    def nodes(self) -> list[Node]:
        return [*self.prefills, *self.decodes]

    # -- faults --------------------------------------------------------------------------------------------
    def faults_on(self) -> bool:
        return self.cfg.faults and self.sim.now < self.cfg.fault_until

    def schedule_faults(self) -> None:
        s, rng = self.swarm, self.sim.rng_fault
        for rate, fn in ((s.cut_rate, self.net.cut_random), (s.partition_rate, self.partition),
                         (s.stall_rate, self.stall_one), (s.crash_rate, self.crash_one)):
            self._every(rate, rng, fn)
        # Each from its own stream: switching one off (shrinking) moves no other fault.
        self._every(s.starve_rate, self.sim.rng_live, self.starve_one)
        self._every(s.fabric_rate, self.sim.rng_fabric, self.fabric_cut)

    def _every(self, rate: float, rng: random.Random, fn: Callable[[], None]) -> None:
        """``fn`` at the times of a Poisson process of ``rate`` a second, until faults stop."""
        t = 0.0
        while rate > 0:
            t += rng.expovariate(rate)
            if t >= self.cfg.fault_until:
                break
            self.sim.at(t, fn)

    def _cut_pair(self, rng: random.Random, longest: float, *tables: dict[tuple[str, str], float]
                  ) -> tuple[DecodeNode, PrefillNode, float]:
        """A decode-prefill pair drawn and cut in each of ``tables`` (``Net``'s directions, or its data path)
        until a heal drawn up to ``longest`` seconds from now."""
        d, p = rng.choice(self.decodes), rng.choice(self.prefills)
        heal = self.sim.now + rng.uniform(0.05, longest)
        for table in tables:
            _cut_until(table, (d.name, p.name), heal)
        return d, p, heal

    def partition(self) -> None:
        """A pair's messages held until a heal: in both directions, or (``Swarm.oneway``) in one only, the
        other flowing (a route or firewall rule lost one way: one side hears the other, which hears nothing).
        The data path, when a partition holds it too, is held whole: RDMA's reliable connections need their
        acknowledgements back, so a path cut one way moves nothing either way."""
        net = self.net
        way = self.oneway_draw()
        tables = {"": (net.held_to_p, net.held_to_d), "to_p": (net.held_to_p,), "to_d": (net.held_to_d,)}[way]
        d, p, heal = self._cut_pair(self.sim.rng_fault, self.swarm.partition_max, *tables)
        data = bool(self.swarm.data_partition) and self.sim.rng_data.random() < self.swarm.data_partition
        self.sim.faults["partition_rate"] += 1
        if way:
            self.sim.faults["oneway"] += 1
        if data:
            _cut_until(net.data_partitions, (d.name, p.name), heal)
            self.sim.faults["data_partition"] += 1
        held = {"": "", "to_p": " (only what decode sends)", "to_d": " (only what prefill sends)"}[way]
        self.sim.log("net", f"partition {d.name}|{p.name}{held} until {heal:.4f}"
                            f"{' (the data path too)' if data else ''}")
        if self.swarm.zmtp:
            # The end that hears nothing (both, or the one the cut direction leads to) finds its heartbeats
            # unanswered and drops the connection; its close reaches the other end by the way still open.
            self.sim.at(self.zmtp_deadline(), self.zmtp_partition, d, p)

    def oneway_draw(self) -> str:
        """Which direction a new partition holds: "" both, else "to_p" or "to_d". Both values drawn from
        ``Sim.rng_oneway`` whatever is used, and only in seeds with one-way partitions: no other draw moves."""
        if not self.swarm.oneway:
            return ""
        rng = self.sim.rng_oneway
        oneway, to_p = rng.random() < self.swarm.oneway, rng.random() < 0.5
        return ("to_p" if to_p else "to_d") if oneway else ""

    def fabric_cut(self) -> None:
        """The data path between a decode and a prefill goes for a while; their messages still flow."""
        d, p, heal = self._cut_pair(self.sim.rng_fabric, self.swarm.fabric_max, self.net.data_partitions)
        self.sim.faults["fabric_rate"] += 1
        self.sim.log("net", f"data path {d.name}|{p.name} cut until {heal:.4f} (messages still flow)")

    def zmtp_deadline(self) -> float:
        """When libzmq drops a connection whose far end went quiet now: ``peer_timeout`` after the first
        heartbeat that goes unanswered, which leaves within ``heartbeat_interval``."""
        return self.sim.now + self.options.peer_timeout + self.sim.rng_live.random() * self.options.heartbeat_interval

    def zmtp_partition(self, d: DecodeNode, p: PrefillNode) -> None:
        if self.net.partitioned(d.name, p.name, self.sim.now):
            self.net.zmtp_drop(d, p, "partitioned past peer_timeout")

    def stopped(self, node: Node) -> None:
        """``node`` was stopped (SIGSTOP): with ZMTP heartbeats its peers' libzmq drop their connections to it
        if it is still stopped ``peer_timeout`` later (its own libzmq is stopped too: it answers none)."""
        if self.swarm.zmtp:
            self.sim.at(self.zmtp_deadline(), self.zmtp_stopped, node, node.inc)

    def zmtp_stopped(self, node: Node, inc: int) -> None:
        if node.inc == inc and not node.crashed and self.sim.now < node.stalled_until and not node.starving:
            if isinstance(node, DecodeNode):
                self.net.zmtp_drop(node, None, "stopped past peer_timeout")
            else:
                self.net.zmtp_drop(None, node, "stopped past peer_timeout")

    def starve_one(self) -> None:
        """CPU starvation: the node's Python does not run; its libzmq answers heartbeats, so no connection
        drops, however long (its peers find it slow, not dead)."""
        node = self.sim.rng_live.choice(self.nodes)
        self.sim.faults["starve_rate"] += not node.crashed
        node.stall(self.sim.rng_live.random() * self.swarm.starve_max, starving=True)

    def stall_one(self) -> None:
        node = self.sim.rng_fault.choice(self.nodes)
        self.sim.faults["stall_rate"] += not node.crashed
        node.stall(self.sim.rng_fault.random() * self.swarm.stall_max)

    def stall_in_post(self, node: Node) -> bool:
        s = self.swarm
        if s.stall_post and self.faults_on() and self.sim.rng_fault.random() < s.stall_post:
            node.stall(self.sim.rng_fault.random() * max(s.stall_max, self.options.peer_timeout * 3))
            self.sim.faults["stall_post"] += 1
            return True
        return False

    def stop_in_read(self, node: Node) -> bool:
        """Whether pull decode ``node`` stops (SIGSTOP) inside the post of the read it is about to post, after
        the core's last check (``Swarm.stall_read``); if so it is stopped now, for a quarter of
        ``stall_read_max`` up to all of it. Both from ``Sim.rng_read``: no other draw moves."""
        s = self.swarm
        if not s.stall_read or not self.faults_on():
            return False
        rng = self.sim.rng_read
        if rng.random() >= s.stall_read:
            return False
        node.stall(rng.uniform(0.25, 1.0) * s.stall_read_max)
        self.sim.faults["stall_read"] += 1
        return True

    def refuse_post(self) -> bool:
        s = self.swarm
        if s.transfer_fail and self.faults_on() and self.sim.rng_fault.random() < s.transfer_fail / 4:
            self.sim.faults["transfer_fail"] += 1
            return True
        return False

    def crash_one(self) -> None:
        node = self.sim.rng_fault.choice(self.nodes)
        if node.crashed:
            return
        self.sim.faults["crash_rate"] += 1
        node.crash()
        self.sim.at(self.sim.now + self.sim.rng_fault.uniform(0.1, 1.0), node.restart)

    def node_crashed(self, node: Node) -> None:
        for conn in list(self.net.by_link.values()):
            if conn.decode is node or conn.prefill is node:
                self.net.close(conn.link, tell_decode=conn.decode is not node)
        if isinstance(node, PrefillNode):
            for rec in node.core.active:
                if rec.is_live:
                    self.prefill_ended(rec, RequestState.FAILED)
        else:
            for rec in node.core.by_gen.values():
                if rec.is_live:
                    self.outcome_d[(node.ident, rec.request_id, rec.generation)] = RequestState.FAILED

    def internal(self, node: Node, exc: Exception) -> None:
        self.sim.fail("internal", f"{node.name}: {exc}")

    # -- the transport's bytes -----------------------------------------------------------------------------
    def apply(self, part: tuple[int, str, int, Any], src: PrefillNode, dst: DecodeNode, kind: str) -> bool:
        """Copy one chunk's rows from ``src``'s memory into ``dst``'s as they land, checking each row against
        decode's lease table (a). False when a source page was no longer the request's (released).

        The tables are read as lists (a page's owner a plain int); when a row fails, ``bad_row`` goes through
        the rows again and reports the first as it is."""
        tag, rid, gen, plan = part
        rid_id = self.rid_id(rid)
        sd, dd = plan.src_descs, plan.dst_descs
        s_addr, s_len, d_addr, d_len = sd[:, 0].tolist(), sd[:, 1].tolist(), dd[:, 0].tolist(), dd[:, 1].tolist()
        dpages, spages = dst.pages, src.pages
        wheres, origins = dpages.find_all(d_addr, d_len), spages.find_all(s_addr, s_len)
        if None in wheres or None in origins:
            self.bad_row(part, src, dst, kind)
        leases = dst.core.leases   # the lease table's own view (pool -> lease id per page)
        owners = [leases.owners(pool).tolist() for pool in dpages.pool_names]
        sowners = [src.src_owner[pool].tolist() for pool in spages.pool_names]
        dpool, spool = dpages.pool_of, spages.pool_of
        src_ok = True
        for (k, p0, p1), (j, q0, q1) in zip(wheres, origins):   # type: ignore[misc]
            owner = owners[dpool[k]]
            if p1 > len(owner) or owner[p0:p1].count(gen) != p1 - p0:
                self.bad_row(part, src, dst, kind)
            sown = sowners[spool[j]]
            if q1 > len(sown) or sown[q0:q1].count(rid_id) != q1 - q0:
                src_ok = False
        copy_rows(s_addr, s_len, d_addr)
        prov, tags, bases = dpages.prov_sorted, dst.slice_tags, dpages.base_list
        for (k, p0, p1), d, n in zip(wheres, d_addr, d_len):   # type: ignore[misc]
            prov[k][p0:p1] = tag
            lo = d - bases[k]
            tags[k][lo:lo + n] = tag
        if kind == "write" and not src_ok:
            self.sim.fail("a_source_released_under_write", f"write of {rid!r} gen {gen} by {src.name} read source "
                          "pages its engine had been given back")
        return src_ok

    def bad_row(self, part: tuple[int, str, int, Any], src: PrefillNode, dst: DecodeNode, kind: str) -> None:
        """Fail (a) at the first row of ``part`` outside every buffer or landing in pages not leased to it."""
        _, rid, gen, plan = part
        leases = dst.core.leases
        owners = {pool: leases.owners(pool) for pool in dst.pages.pool_names}
        for (s, n, _), (d, _, _) in zip(plan.src_descs.tolist(), plan.dst_descs.tolist()):
            where = dst.pages.locate(d, n)
            if where is None:
                self.sim.fail("a_lease", f"{kind} of {rid!r} gen {gen} to {dst.name}: a row at "
                              f"{dst.pages.describe(d)}, {n} bytes, lies outside every registered buffer")
            assert where is not None
            buf, p0, p1 = where
            owner = owners[dst.pages.pools[buf]]
            if p1 > len(owner) or (owner[p0:p1] != gen).any():
                held = [int(x) for x in owner[p0:min(p1, len(owner))]]
                self.sim.fail("a_lease", f"{kind} of {rid!r} gen {gen} landed in {dst.name} {buf} pages "
                              f"{p0}..{p1 - 1}, leased to generations {held} (-1: free; pages past {len(owner)} "
                              "are never leased)")
            if src.pages.locate(s, n) is None:
                self.sim.fail("a_lease", f"{kind} of {rid!r}: a source row lies outside {src.name}'s buffers")
        raise AssertionError("bad_row: every row of the part is fine")

    # -- invariants after each step --------------------------------------------------------------------------
    def after_step(self, node: Node, now: float) -> None:
        if node.core.num_internal_errors:
            self.sim.fail("internal", f"{node.name}: the core caught a bug of its own (InternalError)")
        if node.ended:
            ended, node.ended = node.ended, []
            for rec, state in ended:
                if isinstance(node, PrefillNode):
                    self.prefill_ended(rec, state)
                    if state is RequestState.DONE:
                        self.check_group_verdict(node, rec)
                elif hasattr(rec, "generation"):
                    self.decode_ended(node, rec, state)   # type: ignore[arg-type]
        if now < node.stalled_until or node.crashed:
            return
        heap = node.deadlines.heap
        if not heap or now <= heap[0][0] + DEADLINE_SLACK:
            return   # no record is late: the first deadline of the heap is the earliest of every record's
        rec = node.deadlines.earliest(node.holds_record)   # the live record the core holds due first
        if rec is not None and now > max(rec.deadline, node.resumed_at) + DEADLINE_SLACK:
            self.sim.fail("d_deadline", f"{node.name}: {rec.request_id!r} still {rec.state.value} at "
                          f"{now:.4f}, its deadline was {rec.deadline:.4f}")

    def prefill_ended(self, rec: Any, state: RequestState) -> None:
        if rec.session is None or rec.generation < 0:
            return
        key = (rec.session.identity.split(b"|")[0].decode(), rec.request_id, rec.generation)
        self.outcome_p[key] = state
        if state is RequestState.DONE:
            if key not in self.decode_done:
                self.sim.fail("b_prefill_done_before_verdict", f"prefill reports {rec.request_id!r} gen "
                              f"{rec.generation} DONE; decode {key[0]} has not verified it")
            if self.outcome_d.get(key) is RequestState.FAILED:
                self.sim.fail("c_done_and_failed", f"{rec.request_id!r} gen {rec.generation}: DONE on prefill, "
                              "FAILED on decode")
        elif self.outcome_d.get(key) is RequestState.DONE:
            self.disagreements += 1

    def check_group_verdict(self, node: PrefillNode, rec: Any) -> None:
        """(b) across TP: prefill rank ``node`` reports the request DONE (its group's leader) only after every
        rank of the decode group that needs ``node``'s heads verified it (``prefill_requests.group_done``)."""
        if rec.leader is not rec or rec.session is None:
            return
        ident = rec.session.identity.split(b"|")[0].decode()
        decode = self.agents.get(f"agent:{ident}")
        group = next((g for g in self.decode_groups if decode in g), None)
        if group is None:
            return
        verified = {m.session.identity.split(b"|")[0].decode().rsplit(".", 1)[0] for m in rec.group
                    if m.session is not None and (m.session.identity.split(b"|")[0].decode(), m.request_id,
                                                  m.generation) in self.decode_done}
        for d in group:
            if node.rank in needed_ranks(d.rank, self.tp) and d.name not in verified:
                self.sim.fail("b_group_verdict", f"{node.name} reports {rec.request_id!r} DONE; decode rank "
                              f"{d.name} (which needs its heads) has not verified it")

    def decode_ended(self, node: DecodeNode, rec: Any, state: RequestState) -> None:
        key = (node.ident, rec.request_id, rec.generation)
        self.outcome_d[key] = state
        if state is RequestState.DONE:
            self.done += 1
            node.check_done(rec)
            self.decode_done.add(key)
            if self.outcome_p.get(key) is RequestState.FAILED:
                self.disagreements += 1
        else:
            self.failed += 1
            if self.outcome_p.get(key) is RequestState.DONE:
                self.sim.fail("c_done_and_failed", f"{rec.request_id!r} gen {rec.generation}: DONE on prefill, "
                              "FAILED on decode")

    # -- at rest -------------------------------------------------------------------------------------------
    def leftovers(self) -> list[str]:
        """What remains although nothing should: (e)'s list, empty at rest."""
        out = []
        untracked = [node.name for node in self.nodes if not node.crashed and not node.tracks_records()]
        assert not untracked, f"{untracked}: the core replaced its record container; the simulator tracks the old one"
        if self.sim.now <= self.last_work:
            out.append(f"engine commands still due (until {self.last_work:.4f})")
        for node in self.decodes:
            core = node.core
            if node.crashed:
                out.append(f"{node.name} is down")
                continue
            if core.leases.num_leases:
                gens = sorted(core.by_gen)
                states = [f"{core.by_gen[g].request_id}#{g}:{core.by_gen[g].state.value}" for g in gens[:5]]
                out.append(f"{node.name}: {core.leases.num_leases} leases ({core.quarantine.num_leases} quarantined) "
                           f"{states}")
            if core.num_reads() or core.reading:
                out.append(f"{node.name}: reads in flight")
            if node.attempts:
                out.append(f"{node.name}: engine still holds {len(node.attempts)} requests' pages")
            if node.waiting:
                out.append(f"{node.name}: engine waits to announce {len(node.waiting)} requests")
            total = sum(p.min_pages for p in node.memory.layout.pools)
            if sum(len(v) for v in node.free.values()) != total:
                out.append(f"{node.name}: engine pages not all free")
        for node in self.prefills:
            core = node.core
            if node.crashed:
                out.append(f"{node.name} is down")
                continue
            if core.active:
                out.append(f"{node.name}: {len(core.active)} active records "
                           f"{[(r.request_id, r.state.value, len(r.handles)) for r in list(core.active)[:5]]}")
            if core.holds.held:
                out.append(f"{node.name}: {len(core.holds.held)} source holds")
            if core.writes:
                out.append(f"{node.name}: {len(core.writes)} writes in flight")
            if node.attempts:
                out.append(f"{node.name}: engine still waits on {len(node.attempts)} requests' source pages")
            if node.waiting:
                out.append(f"{node.name}: engine waits to send {len(node.waiting)} requests")
        if self.transport.pending:
            out.append(f"{len(self.transport.pending)} transfers in flight")
        return out

    def run(self) -> None:
        cfg, sim = self.cfg, self.sim
        end = cfg.fault_until + cfg.rest_after
        # Rest is looked for from the moment faults stop (every REST_CHECK_S): a run ends as soon as it is
        # reached, or fails (e) when it is not by ``end``.
        next_check = max(cfg.fault_until, cfg.arrival_span)
        while True:
            sim.run_until(next_check, cfg.max_events)
            if sim.next_time() < next_check:
                return   # capped
            if not self.leftovers():
                self.at_rest = True
                return
            next_check += REST_CHECK_S
            if next_check > end:
                sim.now = end
                sim.fail("e_at_rest", "; ".join(self.leftovers()))

