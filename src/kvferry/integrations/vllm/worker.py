"""The worker-side half of kvferry's vLLM connector: the endpoints, driven by the scheduler's step plans.

Part of the integrations layer, above ``control`` and ``scheduler``, below ``connector`` (the class vLLM loads,
which forwards its worker hooks here). No vLLM import: the memory comes in as a ``KVMemory`` built by
``layout``, the work as ``StepPlan``s, so the whole flow runs in tests with numpy memory.

Push by default: decode announces (and leases) its blocks, prefill writes into them and reports digests,
decode verifies. With ``mode: "pull"`` decode reads prefill's blocks itself (docs/fencing.md). Prefill
reports a request finished (vLLM frees its blocks) only once its endpoint says ``done`` or ``failed`` and
nothing can still read them; decode reports a failed request only once its pages are no longer leased, so
vLLM neither decodes on KV that did not verify nor hands those blocks to another request while a late
write could still land in them.
"""

from __future__ import annotations

import importlib
import logging
from collections.abc import Mapping
from dataclasses import dataclass, fields, replace
from typing import Any

from kvferry.control import DecodeEndpoint, EndpointOptions, PrefillEndpoint, RequestState
from kvferry.control.pull import DECODE_MODES
from kvferry.errors import KVFerryError, LayoutError, UsageError
from kvferry.integrations.vllm.scheduler import RecvSpec, SendSpec, StepPlan
from kvferry.layout import KVMemory
from kvferry.transport import Transport, make_transport
from kvferry.transport.mooncake import check_address

__all__ = ["WorkerConfig", "WorkerSide"]

log = logging.getLogger("kvferry.vllm")

ROLES = ("producer", "consumer", "both")
# The first back-off from a prefill whose handshake failed (DecodeEndpoint.connect_needed doubles it per
# failure in a row; a refused layout is never retried).
RETRY_AFTER = 5.0
MAX_PREFILL_RANKS = 1024   # transfer parameters are untrusted input: far above any TP size


@dataclass(frozen=True, slots=True)
class WorkerConfig:
    """The connector's settings, from vLLM's ``kv_connector_extra_config`` (see docs/vllm.md).

    ``transport``: ``"nixl"`` (between processes), ``"mooncake"`` (Mooncake's Transfer Engine;
    tests/test_vllm_mooncake.py), ``"local"`` (one process) or ``"module:factory"``, a
    callable taking the side (``"prefill"``/``"decode"``) and returning a ``Transport`` (tests inject
    faults this way). ``mooncake_host``: where this worker's Mooncake engine listens and its peers reach it
    (this host's IP when the two sides run on different hosts; a wildcard address is refused: peers cannot
    reach it); ``mooncake_protocol``: ``"tcp"`` or ``"rdma"``, on ``mooncake_device`` (the RDMA NIC).
    ``host``/``port``: where prefill listens. ``digest_mode``: ``off``, ``sampled``,
    ``full``. ``secret``: shared by both sides, or None. Times in seconds. ``mode``: the transfer mode a
    consumer asks its prefills for, ``"push"`` (prefill writes into decode's blocks) or ``"pull"`` (decode
    reads prefill's blocks, see docs/fencing.md); a producer accepts either, so the consumer chooses.
    ``batch_chunks``: ``EndpointOptions.batch_chunks`` (1: every request's blocks a transfer of their own).
    ``peer_timeout``, ``heartbeat_interval``, ``lease_grace``, ``transport_liveness``: ``EndpointOptions``'
    (how soon a dead or stalled peer fails its requests, and whether silence alone may decide it; docs/vllm.md,
    "Faults"). ``unbound_for_tests``: tests only (a
    request whose transfer params carry ``scheduler.UNBOUND_KEY`` is announced without its token binding).
    """

    role: str
    transport: str = "nixl"
    host: str = "127.0.0.1"
    port: int = 0
    digest_mode: str = "sampled"
    secret: str | None = None
    request_timeout: float = 60.0
    handshake_timeout: float = 10.0
    mode: str = "auto"   # a consumer's: push to a prefill on loopback, pull to any other host (control.pull)
    batch_chunks: int = EndpointOptions().batch_chunks
    peer_timeout: float = EndpointOptions().peer_timeout
    heartbeat_interval: float = EndpointOptions().heartbeat_interval
    lease_grace: float = EndpointOptions().lease_grace
    transport_liveness: bool = EndpointOptions().transport_liveness
    unbound_for_tests: bool = False   # tests only: honour scheduler.UNBOUND_KEY (an unbound announce)
    mooncake_host: str = "127.0.0.1"
    mooncake_protocol: str = "tcp"
    mooncake_device: str = ""

    def __post_init__(self) -> None:
        if self.role not in ROLES:
            raise UsageError(f"kvferry connector: role must be one of {ROLES}, got {self.role!r}")
        if self.mode not in DECODE_MODES:
            raise UsageError(f"kvferry connector: mode must be one of {DECODE_MODES}, got {self.mode!r}")
        # At parse time, naming the config keys (the transport checks the same when it is built).
        check_address(self.mooncake_host, self.mooncake_protocol, "kvferry connector: mooncake_")

    @classmethod
    def from_extra(cls, role: str, extra: Mapping[str, Any] | None) -> WorkerConfig:
        """Read ``kv_connector_extra_config``; unknown keys are refused (a typo would silently not apply)."""
        known = {f.name for f in fields(cls)} - {"role"}
        unknown = sorted(set(extra or {}) - known)
        if unknown:
            raise UsageError(f"kvferry connector: unknown kv_connector_extra_config keys {unknown} "
                             f"(known: {sorted(known)})")
        return cls(role, **dict(extra or {}))

    def for_rank(self, tp_rank: int) -> WorkerConfig:
        """The settings of TP rank ``tp_rank``'s worker: a fixed ``port`` is rank 0's, rank ``r`` listens on
        ``port + r`` (every rank has a prefill endpoint of its own)."""
        return self if not self.port or not tp_rank else replace(self, port=self.port + tp_rank)

    def options(self) -> EndpointOptions:
        return EndpointOptions(request_timeout=self.request_timeout, handshake_timeout=self.handshake_timeout,
                               batch_chunks=self.batch_chunks, peer_timeout=self.peer_timeout,
                               heartbeat_interval=self.heartbeat_interval, lease_grace=self.lease_grace,
                               transport_liveness=self.transport_liveness,
                               refuse_unissued=True)   # the scheduler issues every id first (after_alloc)

    def make_transport(self, side: str) -> Transport:
        if self.transport == "mooncake":
            return make_transport("mooncake", hostname=self.mooncake_host, protocol=self.mooncake_protocol,
                                  device=self.mooncake_device)
        if ":" not in self.transport:
            return make_transport(self.transport)
        module, _, name = self.transport.partition(":")
        transport = getattr(importlib.import_module(module), name)(side)
        if not isinstance(transport, Transport):
            raise UsageError(f"kvferry connector: {self.transport} returned {type(transport).__name__}, "
                             "not a kvferry Transport")
        return transport


class WorkerSide:
    """One vLLM worker's endpoints. ``start`` at each step, ``results`` after it; not thread-safe (vLLM
    calls both from the worker's step)."""

    def __init__(self, config: WorkerConfig, memory: KVMemory) -> None:
        self.config = config
        options = config.options()
        self.prefill: PrefillEndpoint | None = None
        self.decode: DecodeEndpoint | None = None
        if config.role in ("producer", "both"):
            self.prefill = PrefillEndpoint(memory, config.make_transport("prefill"), host=config.host,
                                           port=config.port, secret=config.secret,
                                           digest_mode=config.digest_mode, options=options)
        if config.role in ("consumer", "both"):
            self.decode = DecodeEndpoint(memory, config.make_transport("decode"), secret=config.secret,
                                         digest_mode=config.digest_mode, options=options, mode=config.mode)
        # Prefill: kvferry request id -> vLLM request id (a request moved per KV cache group has one per group;
        # vLLM hears it finished once every one is)
        self._sending: dict[str, str] = {}
        self._unsent: set[str] = set()   # sends the endpoint refused: nothing posted, reported finished at once
        self._recving: dict[str, list[RecvSpec]] = {}   # by vLLM request id: its announces (one per group)
        self._failed_now: dict[str, KVFerryError] = {}  # never announced: nothing leased, report at once
        self.num_failed = 0

    @property
    def address(self) -> str | None:
        """Where this worker's prefill endpoint listens (None on a consumer)."""
        return self.prefill.address if self.prefill is not None else None

    # -- per step --------------------------------------------------------------------------------------
    def start(self, plan: StepPlan) -> None:
        """Start this step's work: hand over prefill's KV, announce decode's blocks, stop aborted transfers.
        Non-blocking, except the first handshake with a prefill address (bounded by ``handshake_timeout``)."""
        if self.prefill is not None:
            for request_id in plan.issues:   # before this step's output can hand out their transfer params
                self.prefill.issue(request_id)
        for send in plan.sends:
            self._send(send)
        for recv in plan.recvs:
            self._announce(recv)
        for request_id in plan.aborts:   # after the announces: a request may be staged and aborted in one step
            self._abort(request_id)
        for request_id, why in plan.failures:   # nothing announced, nothing leased: report at the next results
            self._failed_now[request_id] = LayoutError(why)
        for transfer_id, ranks, why in plan.cancels:
            self._cancel(transfer_id, ranks, why)

    def results(self) -> tuple[set[str], set[str], set[str]]:
        """``(finished_sending, finished_recving, failed_recving)`` since the last call, as vLLM's
        ``get_transfer_results`` wants them: a failed receive is also a finished one."""
        done = [tid for tid in self._sending if self._sent(tid)]
        ended = {self._sending.pop(tid) for tid in done} | self._unsent
        self._unsent.clear()
        sending = ended - set(self._sending.values())   # every part of the request done
        recving: set[str] = set()
        failed: set[str] = set()
        for request_id, error in list(self._failed_now.items()):
            if request_id in self._recving:
                continue   # a part of it was announced: reported once that part settled (``_received``)
            del self._failed_now[request_id]
            self._report_failure(request_id, error)
            recving.add(request_id)
            failed.add(request_id)
        for request_id, parts in list(self._recving.items()):
            outcome = self._received(parts)
            if outcome is not None:
                del self._recving[request_id]
                recving.add(request_id)
                if not outcome:
                    failed.add(request_id)
        return sending, recving, failed

    def close(self) -> None:
        for endpoint in (self.decode, self.prefill):
            if endpoint is not None:
                endpoint.close()

    # -- prefill ---------------------------------------------------------------------------------------
    def _send(self, send: SendSpec) -> None:
        if self.prefill is None:
            raise UsageError('a send staged on an instance without a prefill endpoint')
        if send.request_id in self._unsent:   # an earlier part of it was refused: decode cannot use this one
            self.prefill.abort(send.kvferry_id, "another part of the request was not sent")
            return
        try:
            self.prefill.send(send.kvferry_id, send.pages, offset=send.offset, binding=send.binding)
        except KVFerryError as exc:
            # Nothing posted: vLLM may free the blocks once no other part of the request can be read, so it is
            # reported finished with them (left out, vLLM would hold them for ever: it frees a delayed request's
            # blocks only then). Every part stops (decode could not use one alone), this one too: its announce
            # is then refused at once, not at prefill's request timeout
            log.warning("kvferry: prefill request %s not sent: %s", send.kvferry_id, exc)
            self._unsent.add(send.request_id)
            why = f"part {send.kvferry_id} of the request was not sent: {exc}"
            for tid in [send.kvferry_id, *(t for t, r in self._sending.items() if r == send.request_id)]:
                self.prefill.abort(tid, why)
            return
        self._sending[send.kvferry_id] = send.request_id

    def _sent(self, request_id: str) -> bool:
        """Whether vLLM may free the request's blocks: the request ended and nothing can still read them
        (``PrefillEndpoint.may_free``: per request, its own writes in flight in push mode, decode's reads
        until its verdict in pull mode: docs/fencing.md)."""
        if self.prefill is None:
            raise UsageError('kvferry connector: this instance has no prefill endpoint (see kv_role)')
        if not self.prefill.may_free(request_id):
            return False
        if self.prefill.poll(request_id) is RequestState.DONE:
            return True
        log.warning("kvferry: prefill request %s failed: %s", request_id, self.prefill.failure(request_id))
        return True

    # -- decode ----------------------------------------------------------------------------------------
    def _announce(self, recv: RecvSpec) -> None:
        if self.decode is None:
            raise UsageError('a receive staged on an instance without a decode endpoint')
        try:
            peer = self._connect(recv.prefill_ranks)
            self.decode.announce(recv.transfer_id, recv.pages, peer=peer, prefix=recv.prefix, binding=recv.binding)
        except KVFerryError as exc:
            # A part not announced: the request fails, its announced parts stop (``_received`` reports it)
            self._failed_now[recv.request_id] = exc
            return
        self._recving.setdefault(recv.request_id, []).append(recv)

    def _cancel(self, transfer_id: str, ranks: tuple[str, ...], why: str) -> None:
        """Tell prefill this decode declined ``transfer_id`` (it computes the prompt itself), so prefill frees
        its blocks now rather than at its ``request_timeout``; best effort: a failure only logs."""
        if self.decode is None:
            return
        try:
            self.decode.cancel(transfer_id, f"decode declined it: {why}", peer=self._connect(ranks))
        except KVFerryError as exc:
            log.warning("kvferry: could not tell prefill that decode declined %s: %s", transfer_id, exc)

    def _connect(self, ranks: tuple[str, ...]) -> str | list[str]:
        """Connect to the prefill ranks this decode rank needs, out of prefill's TP group ``ranks`` (rank
        order); the announce's ``peer``. One rank on each side: that address, as ever. Otherwise the
        ranks holding this rank's heads (``connect_all``; the handshake refuses, by name, head counts or
        TP sizes that cannot pair)."""
        if self.decode is None:
            raise UsageError('kvferry connector: this instance has no decode endpoint (see kv_role)')
        if len(ranks) > MAX_PREFILL_RANKS:
            raise UsageError(f"kvferry connector: the transfer parameters name {len(ranks)} prefill ranks, more "
                             f"than {MAX_PREFILL_RANKS}")
        # The library's policy: which ranks, and a back-off from a prefill that is down (a refusal is final).
        return self.decode.connect_needed(list(ranks), retry_after=RETRY_AFTER)

    def _received(self, parts: list[RecvSpec]) -> bool | None:
        """True: every part arrived and verified. False: a part failed (the others are aborted) and no write
        can land any more (their blocks are zeroed). None: not yet."""
        if self.decode is None:
            raise UsageError('kvferry connector: this instance has no decode endpoint (see kv_role)')
        decode = self.decode
        states = [decode.poll(recv.transfer_id) for recv in parts]
        early = self._failed_now.get(parts[0].request_id)   # a sibling part was not announced
        if early is None and all(state is RequestState.DONE for state in states):
            return True
        failed = [recv for recv, state in zip(parts, states) if state is RequestState.FAILED]
        if early is None and not failed:
            return None
        for recv, state in zip(parts, states):
            if state is not RequestState.FAILED:
                decode.abort(recv.transfer_id, "another part of the request failed")
        ended = (RequestState.DONE, RequestState.FAILED)
        if any(decode.poll(r.transfer_id) not in ended or decode.holds_lease(r.transfer_id) for r in parts):
            return None
        self._failed_now.pop(parts[0].request_id, None)
        for recv in parts:
            self._clear(recv)
        error = early if early is not None else decode.failure(failed[0].transfer_id)
        self._report_failure(parts[0].request_id, error)
        return False

    def _clear(self, recv: RecvSpec) -> None:
        """Zero a failed receive's blocks. vLLM may recompute the request into them, and its attention
        reads whole blocks, masking slots past the prompt: a NaN left there by bad bytes survives the mask
        (NaN x 0 is NaN) and turns the recomputed request's tokens to garbage. Safe now: no write can land.
        Only the announced blocks: those under decode's prefix hold cached KV other requests may share."""
        if self.decode is None:
            raise UsageError('kvferry connector: this instance has no decode endpoint (see kv_role)')
        memory = self.decode.memory
        for pool, pages in recv.pages.items():
            for buffer in memory.layout.pool(pool).buffers:
                target = memory.owner(buffer.name)
                (memory.array(buffer.name) if target is None else target)[list(pages)] = 0

    def _abort(self, request_id: str) -> None:
        for recv in self._recving.get(request_id, ()):
            if self.decode is not None:
                self.decode.abort(recv.transfer_id, "vLLM finished the request before its KV arrived")

    def _report_failure(self, request_id: str, error: KVFerryError | None) -> None:
        self.num_failed += 1
        # The quarantine's figures go with it: a fault soak reads them from the log (its fencing cost).
        quarantined = (self.decode.num_quarantined_pages, self.decode.peak_quarantined_pages) if self.decode else (0, 0)
        log.warning("kvferry: KV of request %s did not arrive or did not verify (%s); vLLM recomputes or fails "
                    "it (kv_load_failure_policy); quarantined pages: %d now, %d at the peak", request_id, error,
                    *quarantined)
