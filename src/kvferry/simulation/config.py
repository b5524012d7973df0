"""What one simulated run is made of: its size (``SimConfig``) and its faults (``Swarm``, drawn per seed).

Swarm testing: rather than every fault at a fixed rate in every run, each seed switches each kind of fault
on or off and picks its rate, so that some runs are dominated by one fault (many cuts, or long stalls),
which finds bugs a uniform mix dilutes. ``Swarm.draw`` is the only place the fault mix comes from.
"""

from __future__ import annotations

import random
from dataclasses import dataclass, fields, replace

from kvferry.control.core.options import EndpointOptions
from kvferry.layout.spec import Buffer, HeadGeometry, Layout, Pool

__all__ = ["DATA_STORM", "DATA_TIMEOUT", "OPTIONS", "PAGE_PAIRS", "READ_STORM", "STATE_LAYERS", "SimConfig", "Swarm",
           "draw_page_sizes", "page_layout", "sim_layout"]

# Short timers: a run covers many peer timeouts, deadlines and grace periods in a few simulated seconds.
# ``transport_liveness`` is each seed's (``Swarm.zmtp``): the world copies these with it set.
OPTIONS = EndpointOptions(heartbeat_interval=0.1, peer_timeout=0.5, request_timeout=3.0, lease_grace=0.3,
                          handshake_timeout=1.0, batch_chunks=8, transport_liveness=False)


def sim_layout(side: str, pages: int = 128) -> Layout:
    """Small pages, and buffers of one pool that differ in page size and capacity (the heterogeneity the
    planner and the lease table must respect: buffer 0's slot count is wrong for the others). ``pages``:
    decode's main pool size (prefill's is a quarter larger; the other pool half of it)."""
    kv = pages * 5 // 4 if side == "prefill" else pages
    c = kv // 2
    return Layout([
        Pool("kv", [
            Buffer("kv.L0", 64, kv, "fp8_e4m3", "kv", 0),
            Buffer("idx.L0", 16, kv + 8, "bf16", "index_k", 0),
            Buffer("kv.L1", 64, kv, "fp8_e4m3", "kv", 1),
        ], tokens_per_page=16),
        Pool("c", [
            Buffer("c.L0", 32, c, "fp8_e4m3", "kv", 0),
            Buffer("c.L1", 32, c + 4, "fp8_e4m3", "kv", 1),
        ], tokens_per_page=64),
    ])


LAYERS = (("kv.L0", "idx.L0", "c.L0"), ("kv.L1", "c.L1"))
# With the state pool (TP seeds, ``simulation.tp.STATE_POOL``): each layer's send carries its state buffer.
STATE_LAYERS = (("kv.L0", "idx.L0", "c.L0", "s.L0"), ("kv.L1", "c.L1", "s.L1"))

# (prefill's, decode's) tokens per page of the kv pool a page-size seed draws among (``SimConfig.page_share``):
# both directions, ratios of 2 and 4, and one that does not divide (a page straddles the other side's pages).
PAGE_PAIRS: tuple[tuple[int, int], ...] = ((16, 64), (64, 16), (16, 32), (32, 16), (48, 32), (32, 48))
_KV_TOKENS = 4096   # decode's kv pool in tokens on a page-size seed (prefill's a quarter more), whatever its pages


def draw_page_sizes(seed: int, share: float) -> tuple[int, int] | None:
    """Seed ``seed``'s page sizes when it is one of the ``share`` of seeds that runs different page sizes on
    the two sides (None: equal, as before). From a stream of its own, so that every other draw of the seed
    is what it was, and a seed that draws a pair at one share draws the same at every larger share."""
    rng = random.Random(seed * 4 + (4 << 40))
    pick, pair = rng.random(), rng.choice(PAGE_PAIRS)
    return pair if pick < share else None


def page_layout(side: str, tokens: int, pages: int = 128) -> Layout:
    """``sim_layout`` with its kv pool at ``tokens`` per page, its buffers' head geometry saying where each
    token lies (so that the two sides' page sizes translate): K of 8 heads head-major, an indexer of one
    2-byte head, V of 8 heads token-major, a byte per head and token; as many tokens as 128 pages of 32."""
    kv = -(-_KV_TOKENS * pages // 128 // tokens) * (5 if side == "prefill" else 4) // 4
    k, idx, v = HeadGeometry(8, 1, tokens, "head"), HeadGeometry(1, 2, tokens), HeadGeometry(8, 1, tokens, "token")
    return Layout([
        Pool("kv", [
            Buffer("kv.L0", k.page_bytes, kv, "fp8_e4m3", "kv", 0, k),
            Buffer("idx.L0", idx.page_bytes, kv + 8, "bf16", "index_k", 0, idx),
            Buffer("kv.L1", v.page_bytes, kv, "fp8_e4m3", "kv", 1, v),
        ], tokens_per_page=tokens),
        sim_layout(side, pages).pool("c"),
    ])


@dataclass(frozen=True, slots=True)
class SimConfig:
    """A run's size. ``prefills``/``decodes``: engines, each a TP group of ``tp`` ranks (``simulation.tp``).
    ``fault_until``: faults stop then (partitions heal, stalled and crashed nodes come back), and the run goes
    on until everything is at rest (``rest_after`` more seconds at most)."""

    requests: int = 192
    pages: int = 128              # decode's main pool, as many per request as 32 were for 48 (sim_layout)
    prefills: int = 2
    decodes: int = 2
    arrival_span: float = 4.0
    fault_until: float = 5.0
    rest_after: float = 12.0
    max_events: int = 0           # 0: no cap (a capped run skips the at-rest check)
    options: EndpointOptions = OPTIONS
    faults: bool = True
    tp: tuple[int, int] | None = None   # (prefill TP, decode TP) of every group; None: drawn per seed
    # The share of seeds (when ``tp`` is None) that draw a pair with TP 4 or 8 (``tp.WIDE_PAIRS``) instead; 0:
    # every seed runs the pair it always drew (``tp.TP_PAIRS``), and at any share the other seeds still do.
    wide_tp: float = 0.0
    # Page sizes (issue 50): the kv pool's (prefill, decode) tokens per page of every node (TP 1:1); None:
    # drawn per seed, ``page_share`` of the seeds (when ``tp`` is not set) drawing one of ``PAGE_PAIRS``.
    page_sizes: tuple[int, int] | None = None
    page_share: float = 0.25
    # The share of seeds at a TP pair other than 1:1 whose layouts also hold a state pool (``tp.STATE_POOL``:
    # Mamba/GDN-like channel sections sliced across TP), decided by a stream of its own: every other seed runs
    # as it did before state pools.
    state_share: float = 0.5


@dataclass(frozen=True, slots=True)
class Swarm:
    """One seed's fault mix: each a rate per simulated second, a probability per occurrence, or a bound."""

    delay_max: float = 0.002       # per message (network) and per transfer (transport), uniform
    spike: float = 0.0             # a message delayed much longer (TCP retransmits), up to spike_max
    spike_max: float = 0.0
    cut_rate: float = 0.0          # connection cuts, across all connections
    partition_rate: float = 0.0    # a decode-prefill pair partitioned for a while (messages held, TCP-like)
    partition_max: float = 0.0
    stall_rate: float = 0.0        # a node stops handling events (SIGSTOP) for up to stall_max
    stall_max: float = 0.0
    stall_post: float = 0.0        # a stall between a transfer's decision and its posting
    crash_rate: float = 0.0        # a node crashes, restarting later under a new identity
    transfer_fail: float = 0.0     # a write or read fails (nothing, or part of it, landed)
    slow_transfer: float = 0.0     # a write or read completes late: up to slow_max
    slow_max: float = 0.0
    prefill_abort: float = 0.0     # per request
    decode_abort: float = 0.0
    cancel: float = 0.0            # decode never announces, and says so
    retry: float = 0.0             # decode announces a failed request again, same id
    pull: float = 0.0              # share of decodes that pull
    chunked: float = 0.5
    layered: float = 0.2
    prefix: float = 0.3
    digest: str = "off"
    # Liveness (issue 29): with ``zmtp`` the cores run with ``transport_liveness`` and the network keeps
    # libzmq's ZMTP heartbeats: a connection whose far end is stopped (SIGSTOP) or partitioned away for
    # ``peer_timeout`` drops, as libzmq drops it. ``starve``: a node's Python does not run for up to
    # ``starve_max`` while its libzmq goes on answering (CPU starvation): its connections stand.
    zmtp: bool = False
    starve_rate: float = 0.0
    starve_max: float = 0.0
    # The data path (issue 30's transport, partitioned): the share of partitions that hold the transport
    # between the two nodes as well as their messages (one fabric, or a switch both paths cross). A write
    # or read due to land meanwhile waits for the heal, or fails after ``DATA_TIMEOUT`` of waiting (RC
    # retries exhausted: the queue pair errors, and nothing more of it lands).
    data_partition: float = 0.0
    # The data path cut alone (``fabric_rate``, cuts a second across all decode-prefill pairs, each for up to
    # ``fabric_max``): the transport between two nodes fails while their messages flow (RDMA over its own
    # fabric, control over the host's network; or a NIC port down). Both sides stay alive to each other, so
    # nothing but the transfers' own outcomes (late, or timed out) tells them; held transfers as above.
    fabric_rate: float = 0.0
    fabric_max: float = 0.0
    # Partitions one way only (``oneway``: the share of partitions that hold one direction, drawn at each):
    # one side goes on hearing the other, which hears nothing. Decode may give up on a prefill that still
    # reads its Results and aborts, or a prefill on a decode that still reads its Readys.
    oneway: float = 0.0
    # Messages copied (``duplicate``: the share of frames sent twice, the copy sent again up to
    # ``duplicate_max`` later on the same connection, behind what was sent before it). ZMQ over one TCP
    # connection neither duplicates nor replays; the copies stand for a peer or a proxy that does, a peer's
    # messages being untrusted input: no core may act twice on one message.
    duplicate: float = 0.0
    duplicate_max: float = 0.0
    # A pull decode stopped inside a read's post (``stall_read``: the share of its reads, each stop up to
    # ``stall_read_max``), after the core's last check, and back to *the rest of that iteration* (the shell's
    # ``_step``): the read goes out and completes at once (``LocalTransport`` copies inside ``read``; a small
    # read over cma is done by the pump right after), and the iteration's pump takes its completion before
    # the messages that came meanwhile are read, or after those of the sockets it was draining (a drop
    # notice, on the monitor's socket, waits for the next poll). The late reader, past prefill's source hold.
    stall_read: float = 0.0
    stall_read_max: float = 0.0
    # A prefill engine that skips one chunk of a request (``skip_chunk``: the share of requests sent in more
    # than one chunk), the last still sent: a chunk of a prefix or a layer's send forgotten by the engine.
    # Decode's leased pages are then left short, and kvferry must fail the request at its last chunk rather
    # than report it DONE (``control.core.coverage``, and between page sizes ``page_sizes``). Page-size
    # seeds only (``with_chunk_skips``), where a chunk's tokens split decode's pages.
    skip_chunk: float = 0.0

    @classmethod
    def draw(cls, rng: random.Random, faults: bool = True) -> Swarm:
        def on(p: float = 0.5) -> bool:
            return rng.random() < p

        base = cls(delay_max=rng.choice([0.0005, 0.002, 0.01]), pull=rng.choice([0.0, 0.5, 1.0, 1.0]),
                   chunked=rng.random(), layered=rng.random() * 0.5, prefix=rng.random() * 0.5,
                   digest=rng.choice(["off", "off", "sampled", "full"]))
        if not faults:
            return base
        drawn = replace(
            base,
            spike=rng.uniform(0.01, 0.1) if on() else 0.0,
            spike_max=rng.choice([0.05, 0.2, 0.4]),
            cut_rate=rng.uniform(0.2, 2.0) if on() else 0.0,
            partition_rate=rng.uniform(0.1, 1.0) if on() else 0.0,
            partition_max=rng.uniform(0.2, 1.5),
            stall_rate=rng.uniform(0.1, 1.0) if on() else 0.0,
            stall_max=rng.choice([0.2, 0.7, 2.0]),
            stall_post=rng.uniform(0.0, 0.2) if on() else 0.0,
            crash_rate=rng.uniform(0.05, 0.3) if on(0.3) else 0.0,
            transfer_fail=rng.uniform(0.0, 0.2) if on() else 0.0,
            slow_transfer=rng.uniform(0.0, 0.3) if on() else 0.0,
            slow_max=rng.choice([0.3, 1.0, 2.0]),
            prefill_abort=rng.uniform(0.0, 0.3) if on() else 0.0,
            decode_abort=rng.uniform(0.0, 0.3) if on() else 0.0,
            cancel=rng.uniform(0.0, 0.15) if on(0.3) else 0.0,
            retry=rng.uniform(0.2, 0.8) if on() else 0.0,
        )
        profile = rng.choice([None, None, None, *PROFILES])
        return drawn if profile is None else replace(drawn, **PROFILES[profile])

    def with_liveness(self, rng: random.Random) -> Swarm:
        """Half the seeds judge liveness by ZMTP heartbeats (the default since protocol 8), and half of those
        starve nodes. From a stream of its own (``Sim.rng_live``), so that adding it moved no other draw."""
        if rng.random() >= 0.5:
            return self
        starve = rng.uniform(0.1, 1.0) if rng.random() < 0.5 else 0.0
        return replace(self, zmtp=True, starve_rate=starve, starve_max=rng.choice([0.7, 2.0, 5.0]))

    def with_data_path(self, rng: random.Random) -> Swarm:
        """Half the seeds with partitions partition the transport too, in a share of their partitions; and one
        seed in eight is a *storm* (``DATA_STORM``): partitions often and long, every one holding the data
        path, transfers often late (so that some are in flight when the path goes). From a stream of its own
        (``Sim.rng_data``), so that adding it moved no other draw."""
        # Every value drawn whatever is used: the stream stays aligned.
        on, share = rng.random() < 0.5, rng.choice([0.5, 1.0])
        storm, rate, longest = rng.random() < 0.125, rng.uniform(1.0, 3.0), rng.choice([1.0, 1.5, 2.5])
        if storm:
            return replace(self, partition_rate=rate, partition_max=longest, data_partition=1.0,
                           slow_transfer=max(self.slow_transfer, 0.2), slow_max=max(self.slow_max, 1.0))
        if not on or not self.partition_rate:
            return self
        return replace(self, data_partition=share)

    def with_fabric(self, rng: random.Random) -> Swarm:
        """A quarter of the seeds with faults cut the data path alone now and then (``fabric_rate``). From a
        stream of its own (``Sim.rng_fabric``), so that adding it moved no other draw."""
        on, rate, longest = rng.random() < 0.25, rng.uniform(0.3, 1.5), rng.choice([0.3, 1.0, 2.0])
        return replace(self, fabric_rate=rate, fabric_max=longest) if on else self

    def with_oneway(self, rng: random.Random) -> Swarm:
        """Half the seeds with partitions make a share of them one-way. From a stream of its own
        (``Sim.rng_oneway``), so that adding it moved no other draw."""
        on, share = rng.random() < 0.5, rng.choice([0.5, 1.0])
        return replace(self, oneway=share) if on and self.partition_rate else self

    def with_duplicates(self, rng: random.Random) -> Swarm:
        """A quarter of the seeds with faults copy messages. From a stream of its own (``Sim.rng_dup``, which
        also draws each copy and its delay), so that adding it moved no other draw."""
        on, share, longest = rng.random() < 0.25, rng.uniform(0.01, 0.1), rng.choice([0.0, 0.1, 1.0])
        return replace(self, duplicate=share, duplicate_max=longest) if on else self

    def with_read_stalls(self, rng: random.Random) -> Swarm:
        """Half the seeds with faults stop pull decodes inside reads' posts now and then (``stall_read``: a
        share of the posts, each stop a quarter of ``stall_read_max`` up to all of it). Half of those whose
        decodes pull with digests off (where only the fence stands), at any TP pair, are *late-reader storms*
        (``READ_STORM``):
        a fifth of the posts stop, for 1 to 4 s, and ZMTP heartbeats are on (a decode stopped past
        ``peer_timeout`` loses its connections: prefill ends the session without a Bye reaching decode). From
        a stream of its own (``Sim.rng_read``, which also draws each stop and its length), so that adding it
        moved no other draw; it changes only the runs of seeds with pull decodes."""
        # Every value drawn whatever is used: the stream stays aligned.
        on, share, longest, storm = rng.random() < 0.5, rng.uniform(0.02, 0.1), rng.choice([2.5, 4.0]), rng.random()
        if not on:
            return self
        if storm < 0.5 and self.pull and self.digest == "off":
            return replace(self, stall_read=0.2, stall_read_max=4.0, zmtp=True)
        return replace(self, stall_read=share, stall_read_max=longest)

    def with_chunk_skips(self, rng: random.Random, page_sizes: tuple[int, int] | None) -> Swarm:
        """Page-size seeds with faults have their prefill engines skip a chunk of a share of their requests
        (``skip_chunk``, 5% to 25% of those sent in more than one chunk: most still move whole). From a stream
        of its own (``Sim.rng_skip``, which also draws each request's skip), so that adding it moved no other
        draw; it changes only the runs of page-size seeds."""
        share = rng.uniform(0.05, 0.25)
        return replace(self, skip_chunk=share) if page_sizes is not None else self

    def describe(self) -> str:
        return " ".join(f"{f.name}={getattr(self, f.name):.3g}" if isinstance(getattr(self, f.name), float)
                        else f"{f.name}={getattr(self, f.name)}" for f in fields(self)
                        if getattr(self, f.name) not in (0.0, "off"))

    def without(self, *names: str) -> Swarm:
        """This mix with the named faults switched off (shrinking)."""
        return replace(self, **{n: 0.0 for n in names})


# Swarm profiles: a quarter of the seeds push one family of races hard, where a uniform mix rarely lines
# up the several faults a bug needs at once (a pull read in flight as prefill fails the request and its Fail
# is delayed; a writer stalled past peer_timeout with its write posted; a request id reused while the old
# generation still settles).
PROFILES: dict[str, dict[str, float | str]] = {
    "pull_races": {"pull": 1.0, "digest": "off", "prefill_abort": 0.6, "spike": 0.1, "spike_max": 0.4,
                   "delay_max": 0.01},
    "stalled_writers": {"pull": 0.0, "stall_post": 0.2, "stall_max": 2.0, "slow_transfer": 0.2, "slow_max": 1.0},
    "reuse": {"decode_abort": 0.5, "retry": 0.8, "slow_transfer": 0.2, "slow_max": 1.0, "digest": "off"},
}

FAULT_KINDS = ("spike", "cut_rate", "partition_rate", "stall_rate", "stall_post", "crash_rate", "transfer_fail",
               "slow_transfer", "prefill_abort", "decode_abort", "cancel", "retry", "starve_rate", "data_partition",
               "fabric_rate", "oneway", "duplicate", "stall_read", "skip_chunk")

# How long a transfer waits on a partitioned data path before it fails: the transport's own timeout (UCX's
# RC retries; a few seconds by default, shorter here with the other timers: ``OPTIONS``).
DATA_TIMEOUT = 1.0

# What a data-path storm (``Swarm.with_data_path``) may change in a seed's fault mix.
DATA_STORM = ("partition_rate", "partition_max", "data_partition", "slow_transfer", "slow_max")

# What a late-reader storm (``Swarm.with_read_stalls``) may change in a seed's fault mix.
READ_STORM = ("stall_read", "stall_read_max", "zmtp")
