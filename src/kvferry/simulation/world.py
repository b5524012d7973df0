"""The simulated world: clock and event queue, network, transport, page memory with provenance.

Part of ``simulation``, below the nodes (``node``, ``prefill_node``, ``decode_node``) and ``runner``. One
thread, one heap of events ordered by (time, sequence): nothing here reads a wall clock or an unseeded random
source, so a seed replays exactly.

* Network (``Net``): a decode's link is one connection to a prefill. ZMQ over one TCP connection is FIFO, so
  a message never overtakes an earlier one on its connection (delivery time is at least the previous
  one's); messages on different connections reorder freely. A cut loses what is in flight and tells both
  sides as their shells would be told (decode: ``dropped``; prefill: ``connection_dropped``); a partition
  holds messages until it heals (TCP retransmits), which looks like silence to both sides, or to one side
  only when it holds one direction (``Net.held_to_p``, ``Net.held_to_d``).
* Transport (``Transport``): a write copies its plan's rows from prefill memory into decode memory when it
  lands, then delivers its notification, then tells the writer it completed; a read copies when it
  completes. Either may be late (landing after the writer was declared dead: a one-sided write needs no
  help from the stalled process that posted it) or fail. Each landed row is checked against decode's lease
  table and recorded in a provenance array per buffer and page: which (request, generation) wrote it.
"""

from __future__ import annotations

import bisect
import ctypes
import heapq
import math
import random
from collections import Counter, deque
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import numpy as np

from kvferry.layout.memory import KVMemory
from kvferry.simulation.config import DATA_TIMEOUT

if TYPE_CHECKING:
    from kvferry.simulation.decode_node import DecodeNode
    from kvferry.simulation.prefill_node import PrefillNode

__all__ = ["Conn", "Net", "PageMap", "Sim", "Transport", "Violation"]

TRACE_LEN = 400


@dataclass(frozen=True, slots=True)
class Violation:
    """An invariant broken: which (its name), when, and what."""

    invariant: str
    time: float
    detail: str


class ViolationFound(BaseException):  # control flow: the run stops at its first violation, whatever catches
    def __init__(self, violation: Violation) -> None:
        super().__init__(violation.detail)
        self.violation = violation


class Sim:
    """The clock, the event heap, the seeded random streams and the trace."""

    def __init__(self, seed: int) -> None:
        self.seed = seed
        self.now = 0.0
        self._heap: list[tuple[float, int, Callable[..., None], tuple[Any, ...]]] = []
        self._seq = 0
        # Separate streams: the workload, the faults and the latencies each draw from their own, so that
        # shrinking one (fewer requests, a fault switched off) disturbs the others less.
        self.rng_work = random.Random(seed * 4 + 1)
        self.rng_fault = random.Random(seed * 4 + 2)
        self.rng_lat = random.Random(seed * 4 + 3)
        self.rng_live = random.Random(seed * 4 + 4 + (1 << 40))   # liveness mode, starvation, ZMTP timing
        self.rng_data = random.Random(seed * 4 + 5 + (1 << 41))   # which partitions hold the data path too
        self.rng_fabric = random.Random(seed * 4 + 6 + (1 << 42))  # the data path cut alone; split transfers
        self.rng_oneway = random.Random(seed * 4 + 7 + (1 << 43))  # which partitions hold one direction only
        self.rng_dup = random.Random(seed * 4 + 8 + (1 << 44))     # which messages are copied, and when
        self.rng_read = random.Random(seed * 4 + 9 + (1 << 45))    # which reads' posts stop decode, how long
        self.rng_skip = random.Random(seed * 4 + 10 + (1 << 46))   # which requests' engines skip a chunk
        self.trace: deque[tuple[float, str, str]] = deque(maxlen=TRACE_LEN)
        self.events = 0
        # Faults injected, by kind (``config.FAULT_KINDS``' names): counted as they happen, no draw of their own
        self.faults: Counter[str] = Counter()

    def at(self, t: float, fn: Callable[..., None], *args: Any) -> None:
        now = self.now
        heapq.heappush(self._heap, (t if t > now else now, self._seq, fn, args))
        self._seq += 1

    def step(self) -> bool:
        if not self._heap:
            return False
        t, _, fn, args = heapq.heappop(self._heap)
        self.now = t
        self.events += 1
        fn(*args)
        return True

    def run_until(self, stop: float, max_events: int = 0) -> None:
        """Handle the events due before ``stop``, in order; at most until ``max_events`` were handled in all
        (0: no cap). ``step`` in a loop, without a call per event."""
        heap, pop = self._heap, heapq.heappop
        cap = max_events or math.inf
        while heap and heap[0][0] < stop and self.events < cap:
            t, _, fn, args = pop(heap)
            self.now = t
            self.events += 1
            fn(*args)

    def next_time(self) -> float:
        return self._heap[0][0] if self._heap else math.inf

    def log(self, who: str, what: str) -> None:
        self.trace.append((self.now, who, what))

    def fail(self, invariant: str, detail: str) -> None:
        self.log("INVARIANT", f"{invariant}: {detail}")
        raise ViolationFound(Violation(invariant, self.now, detail))


class PageMap:
    """Addresses back to (buffer, pages) for one memory: what a plan's rows touch, computed from the rows
    themselves (so a planner that computes a wrong address is seen writing the wrong page)."""

    def __init__(self, memory: KVMemory) -> None:
        self.memory = memory
        bufs = memory.layout.buffers
        order = sorted(range(len(bufs)), key=lambda i: memory.address(bufs[i].name))
        self.index = order
        self.bases = np.array([memory.address(bufs[i].name) for i in order], dtype=np.int64)
        self.ends = np.array([memory.address(bufs[i].name) + bufs[i].page_bytes * bufs[i].num_pages
                              for i in order], dtype=np.int64)
        self.page_bytes = [bufs[i].page_bytes for i in order]
        self.base_list, self.end_list = self.bases.tolist(), self.ends.tolist()   # plain ints: one row is cheaper
        self.names = [bufs[i].name for i in order]
        self.pools = {b.name: p.name for p in memory.layout.pools for b in p.buffers}
        self.pool_names = [p.name for p in memory.layout.pools]
        self.pool_of = [self.pool_names.index(self.pools[name]) for name in self.names]   # by ``find_all``'s number
        self.layout_index = {b.name: i for i, b in enumerate(bufs)}
        # Provenance: per buffer and page, the tag (``World.tags``) of the (request, generation) that last
        # wrote it; -1 never written.
        self.prov = {b.name: np.full(b.num_pages, -1, dtype=np.int64) for b in bufs}
        self.prov_sorted = [self.prov[name] for name in self.names]   # by ``find_all``'s number
        self.arrays = {b.name: memory.array(b.name) for b in bufs}

    def describe(self, addr: int) -> str:
        """Where ``addr`` is, relative to the buffers (not the address itself: a replay allocates elsewhere)."""
        k = bisect.bisect_right(self.base_list, addr) - 1
        if k < 0:
            return f"{self.base_list[0] - addr} bytes before {self.names[0]}"
        return f"{self.names[k]} byte {addr - self.base_list[k]} (it has {self.end_list[k] - self.base_list[k]})"

    def locate(self, addr: int, nbytes: int) -> tuple[str, int, int] | None:
        """(buffer, first page, last page + 1) of the row, or None when it is not inside one buffer."""
        found = self.find_all([addr], [nbytes])[0]
        return None if found is None else (self.names[found[0]], found[1], found[2])

    def find_all(self, addrs: list[int], nbytes: list[int]) -> list[tuple[int, int, int] | None]:
        """``locate`` for each row of a plan (one call for all: a plan has tens of rows), with the buffer's
        number in ``names`` (what the per-buffer lists are indexed by)."""
        bases, ends, page_bytes, bisect_right = self.base_list, self.end_list, self.page_bytes, bisect.bisect_right
        out: list[tuple[int, int, int] | None] = []
        for addr, n in zip(addrs, nbytes):
            k = bisect_right(bases, addr) - 1
            if k < 0 or addr + n > ends[k] or n <= 0:
                out.append(None)
            else:
                base, pb = bases[k], page_bytes[k]
                out.append((k, (addr - base) // pb, (addr + n - 1 - base) // pb + 1))
        return out


# -- network ----------------------------------------------------------------------------------------------
class Conn:
    """One ZMQ connection: a decode link's DEALER to a prefill's ROUTER (``identity``: its routing id)."""

    __slots__ = ("decode", "identity", "last_to_d", "last_to_p", "link", "open", "prefill", "reached_p")

    def __init__(self, decode: DecodeNode, link: Any, prefill: PrefillNode | None, identity: bytes) -> None:
        self.decode, self.link, self.prefill, self.identity = decode, link, prefill, identity
        self.open = True
        self.last_to_p = self.last_to_d = 0.0
        # A frame of it reached prefill: prefill's shell then names whose connection dropped (its ZMQ_SRCFD per
        # frame read, the monitor's descriptor); one that carried none drops unnamed (control.router)
        self.reached_p = False


class Net:
    def __init__(self, world: Any) -> None:
        self.world = world
        self.sim: Sim = world.sim
        self.by_identity: dict[bytes, Conn] = {}
        self.by_link: dict[Any, Conn] = {}
        # (decode, prefill) -> when their messages flow again, one table per direction: a partition in both
        # holds the pair in each, a one-way partition (``Swarm.oneway``) in one of them.
        self.held_to_p: dict[tuple[str, str], float] = {}
        self.held_to_d: dict[tuple[str, str], float] = {}
        self.data_partitions: dict[tuple[str, str], float] = {}   # the same, for the transport between them
        self.on_wire = 0   # messages on the wire when a partition began, held until its heal
        # (connection, towards prefill) -> what came due while that way was held, in the order sent (``_hold``)
        self.queued: dict[tuple[Conn, bool], list[bytes]] = {}

    def delay(self) -> float:
        swarm = self.world.swarm
        extra = 0.0
        if swarm.spike and self.sim.rng_fault.random() < swarm.spike and self.world.faults_on():
            extra = self.sim.rng_fault.random() * swarm.spike_max   # FIFO: later messages wait behind it
            self.sim.faults["spike"] += 1
        return 1e-5 + self.sim.rng_lat.random() * swarm.delay_max + extra

    @staticmethod
    def _held(conn: Conn, table: dict[tuple[str, str], float]) -> float:
        """Until when a message on ``conn`` in ``table``'s direction is held (0: it is not)."""
        if not table or conn.prefill is None:
            return 0.0
        return table.get((conn.decode.name, conn.prefill.name), 0.0)

    def partitioned(self, decode: str, prefill: str, now: float) -> bool:
        """Whether the messages between two nodes are held in either direction at ``now``."""
        return max(self.held_to_p.get((decode, prefill), 0.0), self.held_to_d.get((decode, prefill), 0.0)) > now

    def open(self, decode: DecodeNode, link: Any) -> Conn:
        prefill = self.world.prefill_at(link.address)
        identity = f"{decode.ident}|{link.session}".encode()
        conn = Conn(decode, link, prefill, identity)
        self.by_identity[identity] = conn
        self.by_link[link] = conn
        return conn

    def to_prefill(self, link: Any, frame: bytes, copy: bool = True) -> None:
        conn = self.by_link.get(link)
        if conn is None or not conn.open or conn.prefill is None or conn.prefill.crashed:
            return   # lost: ZMQ has nobody to hand it to (a crashed peer's queue dies with it)
        now = self.sim.now
        t = max(now + self.delay(), conn.last_to_p)
        conn.last_to_p = t
        self.sim.at(t, self._deliver_p, conn, frame, self._held(conn, self.held_to_p) <= now)
        if copy and self.world.swarm.duplicate:
            self._copy(self.to_prefill, link, frame)

    def _deliver_p(self, conn: Conn, frame: bytes, sent_open: bool) -> None:
        if conn.open and conn.prefill is not None and not conn.prefill.crashed:
            if self._held(conn, self.held_to_p) > self.sim.now or (self.queued and (conn, True) in self.queued):
                self._hold(conn, True, frame, sent_open)
                return
            conn.prefill.frames.append(("frame", conn.identity, frame))
            conn.reached_p = True
            conn.prefill.kick()

    def to_decode(self, identity: bytes, frame: bytes, copy: bool = True) -> None:
        conn = self.by_identity.get(identity)
        if conn is None or not conn.open or conn.decode.crashed:
            return   # ROUTER drops what it cannot route
        now = self.sim.now
        t = max(now + self.delay(), conn.last_to_d)
        conn.last_to_d = t
        self.sim.at(t, self._deliver_d, conn, frame, self._held(conn, self.held_to_d) <= now)
        if copy and self.world.swarm.duplicate:
            self._copy(self.to_decode, identity, frame)

    def _copy(self, send: Callable[[Any, bytes, bool], None], key: Any, frame: bytes) -> None:
        """With ``Swarm.duplicate``'s odds, ``frame`` sent once more on its connection (``key``), up to
        ``duplicate_max`` later, by ``send`` (``to_prefill``, ``to_decode``): it arrives behind whatever was
        sent before the copy left, and is lost if the connection is gone by then."""
        swarm, rng = self.world.swarm, self.sim.rng_dup
        if rng.random() < swarm.duplicate and self.world.faults_on():
            self.sim.faults["duplicate"] += 1
            self.sim.at(self.sim.now + rng.random() * swarm.duplicate_max, send, key, frame, False)

    def _deliver_d(self, conn: Conn, frame: bytes, sent_open: bool) -> None:
        if conn.open and not conn.decode.crashed:
            if self._held(conn, self.held_to_d) > self.sim.now or (self.queued and (conn, False) in self.queued):
                self._hold(conn, False, frame, sent_open)
                return
            conn.decode.frames.append(("frame", conn.link, frame))
            conn.decode.kick()

    def _hold(self, conn: Conn, to_p: bool, frame: bytes, sent_open: bool) -> None:
        """A message that came due while its direction (``to_p``: decode to prefill) is held waits for the
        heal, however it got there: sent during the partition, or (``sent_open``) already on the wire when
        it began, which TCP sends again once the route is back. It joins the connection's queue for that
        direction: messages come due in the order sent, and the queue hands them over in that order at the
        heal (a partition extended meanwhile, the later heal), so the connection stays FIFO."""
        if sent_open:
            self.on_wire += 1
        queue = self.queued.get((conn, to_p))
        if queue is None:
            queue = self.queued[(conn, to_p)] = []
            self.sim.at(self._held(conn, self.held_to_p if to_p else self.held_to_d), self._release, conn, to_p)
        queue.append(frame)

    def _release(self, conn: Conn, to_p: bool) -> None:
        heal = self._held(conn, self.held_to_p if to_p else self.held_to_d)
        if heal > self.sim.now:   # held again meanwhile
            self.sim.at(heal, self._release, conn, to_p)
            return
        queue = self.queued.pop((conn, to_p))
        node = conn.prefill if to_p else conn.decode
        if conn.open and node is not None and not node.crashed:
            node.frames.extend(("frame", conn.identity if to_p else conn.link, frame) for frame in queue)
            conn.reached_p = conn.reached_p or (to_p and bool(queue))
            node.kick()

    def close(self, link: Any, *, tell_decode: bool) -> None:
        """The connection ends (decode closed it, a cut, a crash): what is in flight is lost; both sides'
        monitors see the drop (decode's only when it did not close it itself). When decode's end closed
        (``tell_decode`` false) while what it sends is held, its FIN is held too: prefill hears of the drop
        at the heal, or sooner from its own ZMTP heartbeats going unanswered."""
        conn = self.by_link.pop(link, None)
        if conn is None or not conn.open:
            return
        conn.open = False
        self.by_identity.pop(conn.identity, None)
        if tell_decode and not conn.decode.crashed:
            conn.decode.frames.append(("dropped", link, b""))
            conn.decode.kick()
        prefill = conn.prefill
        if prefill is None or prefill.crashed:
            return
        heal = 0.0 if tell_decode else self._held(conn, self.held_to_p)
        if heal > self.sim.now:
            if self.world.swarm.zmtp:
                heal = min(heal, self.world.zmtp_deadline())
            self.sim.log("net", f"{prefill.name} hears {conn.decode.name} closed at {heal:.4f} (its FIN held)")
            self.sim.at(heal, self._dropped_p, prefill, prefill.inc, conn)
        else:
            self._dropped_p(prefill, prefill.inc, conn)

    @staticmethod
    def _dropped_p(prefill: PrefillNode, inc: int, conn: Conn | None = None) -> None:
        if not prefill.crashed and prefill.inc == inc:
            named = conn is not None and conn.reached_p
            prefill.frames.append(("dropped", conn.identity if named else b"", b""))
            prefill.kick()

    def zmtp_drop(self, decode: Any, prefill: Any, why: str) -> None:
        """The open connections between ``decode`` and ``prefill`` (None: any) drop, as libzmq drops one whose
        heartbeats went unanswered: both ends see it."""
        for conn in [c for c in self.by_link.values() if c.open and (decode is None or c.decode is decode)
                     and (prefill is None or c.prefill is prefill)]:
            self.sim.log("net", f"zmtp drop {conn.decode.name}->{conn.prefill.name if conn.prefill else '?'}: {why}")
            self.close(conn.link, tell_decode=True)

    def cut_random(self) -> None:
        conns = [c for c in self.by_link.values() if c.open]
        if conns:
            conn = self.sim.rng_fault.choice(conns)
            self.sim.faults["cut_rate"] += 1
            self.sim.log("net", f"cut {conn.decode.name}->{conn.prefill.name if conn.prefill else '?'}")
            self.close(conn.link, tell_decode=True)


# -- transport --------------------------------------------------------------------------------------------
class Pending:
    """A write or read in flight: who posted it, to or from whom, and its parts (one per chunk carried:
    the decode-side tag of its (request, generation), its plan, and the prefill record or decode entry)."""

    __slots__ = ("at_once", "dropped", "held_since", "kind", "notif", "parts", "peer_agent", "poster", "tainted",
                 "ticket")

    def __init__(self, ticket: int, kind: str, poster: Any, peer_agent: str, parts: list[Any], notif: bytes) -> None:
        self.ticket, self.kind, self.poster, self.peer_agent = ticket, kind, poster, peer_agent
        self.parts, self.notif = parts, notif
        self.at_once = False   # landing inside its post (``Transport.post``)
        self.dropped = False
        self.held_since: float | None = None   # when it first found its data path partitioned
        self.tainted: list[Any] = []   # a read's parts that crossed before its path went, from released pages


class Transport:
    def __init__(self, world: Any) -> None:
        self.world = world
        self.sim: Sim = world.sim
        self.pending: dict[int, Pending] = {}
        self.next_ticket = 1
        self.held = self.timed_out = 0   # transfers held by a partitioned data path; of those, timed out
        self.partial = 0                 # held transfers part of which crossed before the path went

    def latency(self) -> float:
        swarm = self.world.swarm
        lat = 1e-5 + self.sim.rng_lat.random() * swarm.delay_max
        if swarm.slow_transfer and self.sim.rng_fault.random() < swarm.slow_transfer:
            lat += self.sim.rng_fault.random() * swarm.slow_max
            self.sim.faults["slow_transfer"] += 1
        return lat

    def post(self, kind: str, poster: Any, peer_agent: str, parts: list[Any], notif: bytes = b"",
             at_once: bool = False) -> int:
        """Post a transfer; it lands after a drawn latency, or (``at_once``: a read copied inside its post, as
        ``LocalTransport`` copies) now, its completion handed to the reader before this returns, unless its
        data path is partitioned (then it waits as any transfer does)."""
        ticket = self.next_ticket
        self.next_ticket += 1
        pend = Pending(ticket, kind, poster, peer_agent, parts, notif)
        self.pending[ticket] = pend
        if at_once:
            pend.at_once = True
            self._land(pend)
            pend.at_once = False   # held by a partitioned data path: it completes as any other does
        else:
            self.sim.at(self.sim.now + self.latency(), self._land, pend)
        return ticket

    def _land(self, pend: Pending) -> None:
        if pend.dropped:
            self.pending.pop(pend.ticket, None)
            return
        if self.world.net.data_partitions and self._held(pend):
            return
        self.pending.pop(pend.ticket, None)
        world = self.world
        if pend.kind == "write":
            self._land_write(pend, world)
        else:
            self._land_read(pend, world)

    def _pair(self, pend: Pending) -> tuple[str, str] | None:
        """(decode, prefill) names of the two ends, as partitions are keyed; None when the far end is gone."""
        peer = self.world.agents.get(pend.peer_agent)
        if peer is None:
            return None
        return (peer.name, pend.poster.name) if pend.kind == "write" else (pend.poster.name, peer.name)

    def _cut_off(self, pend: Pending) -> float:
        """When the data path of ``pend`` heals (0: it is not partitioned now)."""
        pair = self._pair(pend)
        heal = self.world.net.data_partitions.get(pair, 0.0) if pair is not None else 0.0
        return heal if heal > self.sim.now else 0.0

    def _held(self, pend: Pending) -> bool:
        """A transfer due to land while its data path is partitioned waits for the heal (it lands late, the
        writer perhaps declared dead meanwhile: the stalled writer's case, with a live writer), or fails once
        it waited ``DATA_TIMEOUT`` (nothing more of it lands). True: it is still in flight."""
        heal = self._cut_off(pend)
        if not heal:
            return False
        now = self.sim.now
        if pend.held_since is None:
            pend.held_since = now
            self.held += 1
            self.sim.log(pend.poster.name, f"{pend.kind} {pend.ticket} held: data path partitioned until {heal:.4f}")
            self._split(pend)
        give_up = pend.held_since + DATA_TIMEOUT
        if heal <= give_up:
            self.sim.at(heal, self._land, pend)   # a later partition of the same pair holds it again then
        else:
            self.sim.at(give_up, self._time_out, pend)
        return True

    def _split(self, pend: Pending) -> None:
        """A transfer is posted as one and moves row by row, in no set order (spread over a NIC's queue pairs
        or rails): in one held transfer in two, some of its rows (any of them; perhaps all: then only its
        completion waits) crossed before the path went and land now; the rest waits with it, to land after
        the heal or never. Drawn from ``Sim.rng_fabric``: no other draw moves."""
        rng = self.sim.rng_fabric
        total = sum(len(part[3].src_descs) for part in pend.parts)
        crossed = rng.randrange(1, total + 1) if total and rng.random() < 0.5 else 0
        if not crossed:
            return
        head, tail = some_rows(pend.parts, crossed, rng.getrandbits(64))
        peer = self._live_peer(pend)
        if peer is None or pend.poster.crashed:
            return   # an end is gone: nothing crosses (its landing says so)
        src, dst = (pend.poster, peer) if pend.kind == "write" else (peer, pend.poster)
        self.partial += 1
        self.sim.log(pend.poster.name, f"{pend.kind} {pend.ticket}: {crossed} of {total} rows crossed before "
                     "the data path went")
        for part in head:
            if not self.world.apply(part, src=src, dst=dst, kind=pend.kind) and pend.kind == "read":
                pend.tainted.append(part)
        pend.parts = tail

    def _live_peer(self, pend: Pending) -> Any:
        """The far end of ``pend`` when it is the process it was posted to and up; else None."""
        peer = self.world.agents.get(pend.peer_agent)
        return None if peer is None or peer.crashed or peer.agent != pend.peer_agent else peer

    def _time_out(self, pend: Pending) -> None:
        self.pending.pop(pend.ticket, None)
        if pend.dropped:
            return
        self.timed_out += 1
        error = "timed out: data path partitioned"
        poster = pend.poster
        self.sim.log(poster.name, f"{pend.kind} {pend.ticket} {error}")
        if pend.kind == "write":
            self.sim.at(self.sim.now + 1e-5, poster.completed, pend.ticket, error)
        elif not poster.crashed:
            self.sim.at(self.sim.now + 1e-5, poster.read_completed, poster.inc, pend.ticket, error, [])

    def _fails(self) -> bool:
        rate = self.world.swarm.transfer_fail
        if rate and self.sim.rng_fault.random() < rate:
            self.sim.faults["transfer_fail"] += 1
            return True
        return False

    def _land_write(self, pend: Pending, world: Any) -> None:
        writer: PrefillNode = pend.poster
        target: DecodeNode | None = self._live_peer(pend)
        error = None
        parts = pend.parts
        if target is None:
            error = "peer gone"
            parts = []
        elif self._fails():
            error = "write failed"
            rng = self.sim.rng_fault   # any of its rows may have landed, or none
            parts = some_rows(parts, rng.randrange(sum(len(p[3].src_descs) for p in parts) + 1),
                              rng.getrandbits(64))[0]
        for part in parts:
            world.apply(part, src=writer, dst=target, kind="write")
        if error is None:
            assert target is not None
            self.sim.at(self.sim.now + 1e-5 + self.sim.rng_lat.random() * world.swarm.delay_max,
                        target.notified, pend.peer_agent, writer.agent, pend.notif)
        self.sim.log(writer.name, f"write {pend.ticket} landed{' ' + error if error else ''}")
        self.sim.at(self.sim.now + 1e-5, writer.completed, pend.ticket, error)

    def _land_read(self, pend: Pending, world: Any) -> None:
        reader: DecodeNode = pend.poster
        source: PrefillNode | None = self._live_peer(pend)
        error = None
        tainted: list[Any] = pend.tainted
        if reader.crashed:
            return
        if source is None:
            error = "peer gone"
        elif self._fails():
            error = "read failed"
        else:
            for part in pend.parts:
                if not world.apply(part, src=source, dst=reader, kind="read"):
                    tainted.append(part)
        self.sim.log(reader.name, f"read {pend.ticket} done{' ' + error if error else ''}")
        if pend.at_once:   # inside its post: the pump right after it takes the completion
            reader.read_completed(reader.inc, pend.ticket, error, tainted)
        else:
            self.sim.at(self.sim.now + 1e-5, reader.read_completed, reader.inc, pend.ticket, error, tainted)

    def crashed(self, node: Any) -> None:
        """``node`` crashed: its posted writes either land now (the NIC finishes what it had) or never."""
        for pend in list(self.pending.values()):
            if pend.poster is node:
                # (the draw first, whatever the data path: a partition leaves the fault stream as it was)
                if pend.kind == "write" and self.sim.rng_fault.random() < 0.5 and not self._cut_off(pend):
                    pend.dropped = True
                    self.pending.pop(pend.ticket, None)
                    self._land_write(pend, self.world)
                else:
                    pend.dropped = True
                    self.pending.pop(pend.ticket, None)


@dataclass(frozen=True, slots=True)
class Rows:
    """Some rows of a plan: what ``World.apply`` reads of one (a transfer split across a partition, or the
    part of a failed write that landed)."""

    src_descs: np.ndarray
    dst_descs: np.ndarray


def some_rows(parts: list[Any], n: int, bits: int) -> tuple[list[Any], list[Any]]:
    """``parts`` (each a (tag, rid, gen, plan)) as two lists: ``n`` of their rows, any of them (drawn from
    ``bits``), and the rest. A part wholly on one side stays as it is; a part cut in two is one ``Rows``
    on each side."""
    if not parts:
        return [], []
    sizes = [len(part[3].src_descs) for part in parts]
    chosen = np.zeros(sum(sizes), dtype=bool)
    chosen[np.random.default_rng(bits).permutation(len(chosen))[:n]] = True
    head, tail = [], []
    for part, mask in zip(parts, np.split(chosen, np.cumsum(sizes)[:-1]), strict=True):
        if mask.all():
            head.append(part)
        elif not mask.any():
            tail.append(part)
        else:
            head.append(_rows(part, mask))
            tail.append(_rows(part, ~mask))
    return head, tail


def _rows(part: tuple[int, str, int, Any], mask: np.ndarray) -> tuple[int, str, int, Rows]:
    tag, rid, gen, plan = part
    return tag, rid, gen, Rows(plan.src_descs[mask], plan.dst_descs[mask])


def copy_rows(src: list[int], nbytes: list[int], dst: list[int]) -> None:
    """memmove each (src, dst) row pair; the caller checked every row lies inside registered memory."""
    memmove = ctypes.memmove
    for s, n, d in zip(src, nbytes, dst):
        memmove(d, s, n)
