"""Decode's view of its prefill peers: one ``Link`` per prefill rank, and which links a request goes to.

Part of the protocol core, above ``wire``, below ``core.decode``. A link (its ZMQ DEALER socket is the
shell's) goes connecting -> established -> dead (or failed). What a prefill must show to be established is
``admission``'s; ``pick_links`` chooses, per announced request, exactly the prefill ranks this decode
rank needs (``tp.source_ranks``). Mutated only under the endpoint's lock.
"""

from __future__ import annotations

from collections.abc import Sequence

from kvferry.control.core.process import ProcessIdentity
from kvferry.control.core.states import LINK_TRANSITIONS, LinkState, check_transition
from kvferry.control.core.timers import PeerClock
from kvferry.errors import KVFerryError, PeerLost, UsageError
from kvferry.integrity import DigestMode
from kvferry.layout.memory import KVMemory
from kvferry.layout.spec import Layout
from kvferry.plan.tokens import PageSizePlanner
from kvferry.plan.tp import PageSlice, TPPlanner, source_ranks

__all__ = ["Link", "pick_links"]


class Link:
    """One prefill this decode talks to. ``state``: connecting -> established -> dead (or failed)
    (``LinkState``; ``move`` checks each step against its table)."""

    def __init__(self, address: str, deadline: float, clock: PeerClock, session: str, nonce: bytes) -> None:
        self.address = address
        self.state = LinkState.CONNECTING
        self.error: KVFerryError | None = None
        self.deadline = deadline
        self.session = session   # random, chosen by the caller (the core has no random source)
        self.nonce = nonce
        self.hello = b""
        self.server_nonce: bytes | None = None
        self.agent = ""
        self.process: ProcessIdentity | None = None   # prefill's process, from its Welcome
        self.digest_mode = DigestMode.OFF
        self.clock = clock   # when we last heard from this prefill, and it from us (core.timers)
        # The prefill's place in its TP group (from its manifest); ``expect``: what connect_all asked for.
        self.rank, self.tp_size = 0, 1
        self.expect: tuple[int, int] | None = None
        self.retry_at = 0.0   # once dead with quarantined pages: when decode may next try to reconnect
        # Across TP sizes: the planner of this prefill rank's slices of our pages (its memory -> ours): what
        # pull mode reads, and, as ``slices``, what its digests cover.
        self.planner: TPPlanner | None = None
        # Between page sizes (equal TP): the planner of that prefill's chunks into our pages, by token (what
        # pull mode reads).
        self.translator: PageSizePlanner | None = None
        # Transfer mode asked for ("push": prefill writes; "pull": decode reads, see ``pull``). In pull
        # mode: prefill's memory as its Welcome describes it (what reads come from), the fence (the
        # longest gap between our own messages after which no read is accepted) and whether it tripped.
        self.mode = "push"
        self.remote: KVMemory | None = None
        self.fence_s = 0.0
        self.expired = False

    @property
    def slices(self) -> dict[str, PageSlice] | None:
        """Across TP sizes: buffer -> the slice of each page this prefill rank writes here (digest checks)."""
        return self.planner.slices if self.planner is not None else None

    def move(self, new: LinkState) -> None:
        """Move to ``new``; ``InternalError`` when the table does not allow it (a kvferry bug)."""
        self.state = check_transition(LINK_TRANSITIONS, self.state, new, f"link to prefill {self.address}")

    @property
    def established(self) -> bool:
        return self.state is LinkState.ESTABLISHED

    @property
    def connecting(self) -> bool:
        return self.state is LinkState.CONNECTING


def pick_links(links: dict[str, Link], peer: str | Sequence[str] | None, local: Layout) -> list[Link]:
    """The prefill ranks a request goes to: ``peer``'s, or all live ones when they are one TP group's
    needed ranks (one prefill at equal TP). Exactly ``source_ranks`` of that group, or an error:
    ``PeerLost`` when not connected to them, ``ValueError`` when the choice is ambiguous or wrong."""
    live = [link for link in links.values() if link.established]
    if peer is None:
        if not live:
            raise PeerLost("decode is not connected to any prefill")
        one_group = len({x.tp_size for x in live}) == 1 and len({x.rank for x in live}) == len(live)
        if not one_group:  # e.g. two prefill instances: which one is the caller's choice
            raise UsageError(f"connected to {len(live)} prefills: pass peer= (one of "
                             f"{[x.address for x in live]}, or a list of one TP group's ranks)")
        chosen = live
    else:
        chosen = [_live_link(links, name) for name in ([peer] if isinstance(peer, str) else peer)]
    _check_sources(chosen, local)
    return chosen


def _live_link(links: dict[str, Link], address: str) -> Link:
    link = links.get(address)
    if link is None or not link.established:
        raise PeerLost(f"not connected to prefill {address!r}")
    return link


def _check_sources(links: list[Link], local: Layout) -> None:
    """``links`` must be exactly the prefill ranks this decode rank needs: one missing would leave its
    heads unwritten, yet every other rank's part would complete."""
    sizes = {x.tp_size for x in links}
    if len(sizes) != 1:
        raise UsageError(f"peers {[x.address for x in links]} belong to prefill TP groups of sizes {sorted(sizes)}")
    ptp = sizes.pop()
    need = list(source_ranks(local.tp_rank, ptp, local.tp_size))
    ranks = sorted(x.rank for x in links)
    if ranks == need:
        return
    missing = sorted(set(need) - set(ranks))
    if missing and len(set(ranks)) == len(ranks):
        raise PeerLost(f"decode rank {local.tp_rank} of TP {local.tp_size} needs prefill ranks {need} of TP "
                       f"{ptp}; not connected to rank(s) {missing}")
    raise UsageError(f"peers {[x.address for x in links]} are prefill ranks {ranks} of TP {ptp}; decode rank "
                     f"{local.tp_rank} of TP {local.tp_size} needs exactly ranks {need}")
