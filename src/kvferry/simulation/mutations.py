"""Bugs switched on by patching a core method: the simulator must find each and name the right invariant.

Part of ``simulation``, at its bottom. Each mutation is a bug class the protocol exists to rule out;
``mutation(name)`` patches it in for the duration of a ``with`` block (the test suite's mutation check, and
``kvferry simulate --mutate NAME``), and restores the real method after.

1. ``quarantine_timer``: decode frees a quarantined lease on a timer (``lease_grace`` after the link died)
   while the stalled writer may still write.
2. ``planner_buffer0``: the planner indexes every buffer's pages with buffer 0's slot count (the NIXL
   sender bug kvferry exists for, tests/test_buffer0_regression.py).
3. ``done_before_verdict``: prefill reports DONE once its writes completed, before decode's verdict.
4. ``abort_frees_lease``: decode's abort ends the lease at once, before the writer is fenced.
5. ``stale_generation``: decode accepts a completion of an earlier generation for a reused request id.
6. ``pull_release_early``: prefill never holds a pull-mode source: its pages go back to the engine while
   decode's read of them is in flight.

Three only a TP group of another size can show (``simulation.tp``):

7. ``tp_slice_offset``: the TP planner puts a prefill rank's head slice at its offset in the *source* page
   (its heads' place on prefill) instead of its place in decode's page: the slice lands on another rank's
   heads, or past the page. Digests do not help: decode checks the slices the same planner derived.
8. ``group_done_early``: a prefill rank reports a request DONE once its own decode rank verified it,
   without waiting for the other decode ranks of the request's group.
12. ``tp_state_slice``: the TP planner cuts a state buffer's channel sections for the next decode rank
    (``(d + 1) % D``) instead of decode rank ``d``: rank 0's channels land on rank 1, a replicated section
    comes from another prefill rank's election, and some channels are never written.

One only copied messages can show (``Swarm.duplicate``):

9. ``announce_copy_answered``: prefill takes every announce as new, a copy of one too: a copy of a live
   generation's announce is refused with a Fail that tells decode nothing will be written under it, and
   decode frees the pages prefill is writing; a late copy of an ended one starts a write into pages since
   leased again. (kvferry 0.4.0.dev0 had this bug until the simulator copied messages.)

Two only a pull decode stopped inside a read's post can show (``Swarm.stall_read``: back from the stop, the
shell carries on with the rest of its iteration and takes the read's completion before reading what came
meanwhile; docs/fencing.md, "The source hold, and decode's fence"):

10. ``pull_fence_off``: decode's pull fence removed (``fenced`` never objects): a read posted after prefill
    released its source pages (it declared decode dead during the stop, and its Bye or the dropped
    connection is not read yet) is accepted.
11. ``pull_fence_link_only``: the fence reduced to the link's state (established, prefill heard within
    ``peer_timeout``), decode's own stall not checked (F1): frames that arrived before prefill's connection
    dropped, read after the stop, make prefill look alive while the drop notice waits for the next poll.

One only different page sizes on the two sides can show (``SimConfig.page_share``):

13. ``page_index_paired``: the planner between page sizes pairs page indices instead of token ranges:
    prefill's page ``k`` of a chunk goes to decode's page ``k`` of the lease, from its first token, as many
    tokens as the smaller page holds (vLLM's NixlConnector at 32 -> 64, issue 50). The digests do not help:
    they describe the rows the same planner made.
14. ``page_gap_accepted``: prefill's coverage check between page sizes (``control.core.page_sizes``) no
    longer looks at the last chunk: a request whose engine skipped a chunk (``Swarm.skip_chunk``) reaches
    DONE with decode's leased pages short of tokens (or buffers) the skipped chunk held. The digests do not
    help: they describe the chunks that were sent.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import replace
from typing import Any

import numpy as np

from kvferry.control.core import decode as core_decode
from kvferry.control.core import decode_reader, page_sizes, prefill_writer
from kvferry.control.core import prefill as core_prefill
from kvferry.control.core.decode import DecodeCore
from kvferry.control.core.decode_liveness import Liveness
from kvferry.control.core.decode_messages import Messages
from kvferry.control.core.holds import SourceHolds
from kvferry.control.core.prefill_announces import Announces
from kvferry.control.core.prefill_writer import Writer
from kvferry.layout.memory import KVMemory
from kvferry.plan import ranks as plan_ranks
from kvferry.plan import tokens as plan_tokens
from kvferry.plan import tp as plan_tp

__all__ = ["EXPECTED", "MUTATIONS", "mutation"]


def _quarantine_timer(self: Liveness, now: float) -> None:
    for rec in list(self.core.by_gen.values()):
        for part in list(rec.parts.values()):
            if part.settled or part.link.established:
                continue
            part.grace.writer_gone(now)   # the bug: no one asked whether the writer can still write
            if part.grace.due(now):
                self.core.messages.settle(rec, part)


def _done_before_verdict(orig: Callable[..., None]) -> Callable[..., None]:
    def settle(self: Writer, rec: Any) -> None:
        if rec.is_live and rec.last_posted and not rec.handles and not rec.posting:
            rec.decode_ok = True   # the bug: our writes completed, so it must be fine
        orig(self, rec)
    return settle


def _abort_frees_lease(orig: Callable[..., None]) -> Callable[..., None]:
    def abort(self: DecodeCore, now: float, request_id: str, reason: str) -> None:
        orig(self, now, request_id, reason)
        rec = self.records.get(request_id)
        if rec is not None and getattr(rec, "generation", None) in self.by_gen:
            self.messages.end_lease(rec)   # the bug: the writer may still be writing these pages
    return abort


def _stale_generation(self: Messages, link: Any, request_id: str, generation: int) -> Any:
    rec = self.core.records.get(request_id)   # the bug: by id alone, whatever the generation
    if rec is None or not hasattr(rec, "parts") or link not in rec.parts:
        return None
    return rec


def _no_hold(self: SourceHolds, rec: Any) -> None:
    rec.source_held, rec.release_at = False, None   # the bug: decode's reads are not waited for


class Buffer0Plan:
    """A plan whose destination rows are where buffer 0's slot count puts them (``b * slots0 + page`` into
    the pool's flat per-page list), not where the buffers are."""

    def __init__(self, plan: Any) -> None:
        self._plan = plan
        self.dst_descs = _buffer0_rows(plan.dst_memory, plan.dst_descs)
        self.src_descs = plan.src_descs
        self.whole_pages = plan.whole_pages

    def __getattr__(self, name: str) -> Any:
        return getattr(self._plan, name)


def _buffer0_rows(memory: KVMemory, rows: np.ndarray) -> np.ndarray:
    out = np.array(rows, dtype=np.uint64, copy=True)
    for pool in memory.layout.pools:
        bufs = pool.buffers
        bases = [memory.address(b.name) for b in bufs]
        starts = np.cumsum([0] + [b.num_pages for b in bufs])
        slots0 = bufs[0].num_pages
        for i, (addr, _, _) in enumerate(rows.tolist()):
            for pos, b in enumerate(bufs):
                if bases[pos] <= addr < bases[pos] + b.page_bytes * b.num_pages:
                    page = (addr - bases[pos]) // b.page_bytes
                    flat = min(pos * slots0 + page, int(starts[-1]) - 1)
                    k = int(np.searchsorted(starts, flat, side="right")) - 1
                    out[i, 0] = bases[k] + (flat - int(starts[k])) * bufs[k].page_bytes
    return out


def _buffer0_planner(orig: Callable[..., Any]) -> Callable[..., Any]:
    def plan_pages(src: KVMemory, dst: KVMemory, pairs: Any, selected: Any = None) -> Any:
        return Buffer0Plan(orig(src, dst, pairs, selected))
    return plan_pages


def _slice_offset(orig: Callable[..., Any]) -> Callable[..., Any]:
    def slice_of(*args: Any) -> Any:
        found = orig(*args)
        if found is None or found.whole:
            return found
        return replace(found, dst_offset=found.src_offset)   # the bug: the source page's offset for both
    return slice_of


def _page_index_paired(orig: Callable[..., Any]) -> Callable[..., Any]:
    def segments(span: Any, vec: Any, pool: str, src_pages: np.ndarray, dst_pages: np.ndarray) -> Any:
        if vec.src_tokens == vec.dst_tokens:
            return orig(span, vec, pool, src_pages, dst_pages)
        # the bug: source page k of the span to destination page k, from its start, the smaller page's worth
        n = min(len(src_pages), len(dst_pages))
        per = min(vec.src_tokens, vec.dst_tokens) // vec.tokens_per_entry
        zero = np.zeros(n, dtype=np.int64)
        return src_pages[:n], zero, dst_pages[:n], zero, np.full(n, per, dtype=np.int64)
    return segments


def _gap_accepted(layout: Any, planner: Any, rec: Any) -> None:
    return None   # the bug: the last chunk ends the request whatever decode's pages received


def _state_slice(orig: Callable[..., Any]) -> Callable[..., Any]:
    def state_slice_of(sb: Any, db: Any, gid: int, r: int, d: int, ptp: int, dtp: int) -> Any:
        return orig(sb, db, gid, r, (d + 1) % dtp, ptp, dtp)   # the bug: the next decode rank's channels
    return state_slice_of


def _group_done_early(rec: Any) -> bool:
    return True   # the bug: this decode rank's verdict stands for the group's


def _fence_off(link: Any, now: float) -> str | None:
    return None   # the bug: every read is accepted, whenever it completes


def _fence_link_only(link: Any, now: float) -> str | None:
    if not link.established:
        return f"prefill {link.address} is {link.state.value}"
    if link.clock.peer_silent(now):   # the bug: only prefill's silence, not our own pause, is judged
        return f"prefill {link.address} silent for {link.clock.silent_for(now):.2f} s"
    return None


def _announce_copy_answered(orig: Callable[..., None]) -> Callable[..., None]:
    def on_announce(self: Announces, session: Any, msg: Any) -> None:
        session.last_generation = 0   # the bug: every announce taken as a new one, a copy answered like any
        orig(self, session, msg)
    return on_announce


# name -> (object, attribute, the replacement given the original)
MUTATIONS: dict[str, tuple[Any, str, Callable[[Any], Any]]] = {
    "quarantine_timer": (Liveness, "check_quarantine", lambda orig: _quarantine_timer),
    "planner_buffer0": (core_prefill, "plan_pages", _buffer0_planner),
    "done_before_verdict": (Writer, "settle", _done_before_verdict),
    "abort_frees_lease": (DecodeCore, "abort", _abort_frees_lease),
    "stale_generation": (Messages, "lookup", lambda orig: _stale_generation),
    "pull_release_early": (SourceHolds, "hold", lambda orig: _no_hold),
    "tp_slice_offset": (plan_tp, "slice_of", _slice_offset),
    "group_done_early": (prefill_writer, "group_done", lambda orig: _group_done_early),
    "tp_state_slice": (plan_ranks, "state_slice_of", _state_slice),
    "announce_copy_answered": (Announces, "on_announce", _announce_copy_answered),
    "pull_fence_off": (decode_reader, "fenced", lambda orig: _fence_off),
    "pull_fence_link_only": (decode_reader, "fenced", lambda orig: _fence_link_only),
    "page_index_paired": (plan_tokens, "_segments", _page_index_paired),
    "page_gap_accepted": (page_sizes, "_check_covered", lambda orig: _gap_accepted),
}

# The invariants each mutation must be caught by (any one of them).
EXPECTED: dict[str, tuple[str, ...]] = {
    "quarantine_timer": ("a_lease",),
    "planner_buffer0": ("a_lease",),
    "done_before_verdict": ("b_prefill_done_before_verdict",),
    "abort_frees_lease": ("a_lease",),
    # A stale completion counted for the new generation makes it DONE without its bytes; a stale settled
    # Fail ends the new generation's lease under its writes, or the old one is never settled; in pull mode
    # the old generation's read offer is taken for the new one, and decode reads (and accepts) source pages
    # prefill had already given back.
    "stale_generation": ("b_done_bytes", "a_lease", "e_at_rest", "a_source_released_under_read"),
    "pull_release_early": ("a_source_released_under_read",),
    # Another rank's heads overwritten (or never written: a_lease when the slice runs past the page).
    "tp_slice_offset": ("b_done_bytes", "a_lease"),
    "group_done_early": ("b_group_verdict",),
    # Another decode rank's channels where this rank's belong (or none written there).
    "tp_state_slice": ("b_done_bytes",),
    # Writes into pages decode freed (at the copy's Fail) or leased again (a late copy), or a request the
    # copy opened that nothing will end.
    "announce_copy_answered": ("a_lease", "e_at_rest"),
    # A read of source pages prefill had given back, accepted.
    "pull_fence_off": ("a_source_released_under_read",),
    "pull_fence_link_only": ("a_source_released_under_read",),
    # Tokens at the wrong place in decode's pages (or never written), or rows past the lease.
    "page_index_paired": ("b_done_bytes", "a_lease"),
    # Tokens of decode's leased pages never written by the request, which is DONE.
    "page_gap_accepted": ("b_done_bytes",),
}

assert core_decode is not None


@contextmanager
def mutation(name: str | None) -> Iterator[None]:
    """Patch in the named bug (None: none) for the duration of the block."""
    if name is None:
        yield
        return
    owner, attr, make = MUTATIONS[name]
    orig = getattr(owner, attr)
    setattr(owner, attr, make(orig))
    try:
        yield
    finally:
        setattr(owner, attr, orig)
