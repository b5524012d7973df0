"""kvferry as an SGLang disaggregation transfer backend: manager, sender, receiver, bootstrap server.

The classes subclass SGLang's ``Common*`` ones (its schedulers use members beyond the abstract interface)
and keep SGLang's bootstrap flow: prefill ranks register with the bootstrap server, decode looks them up
with ``try_ensure_parallel_info`` and ``init``. What travels differs: the rank port a prefill registers is
its kvferry ``PrefillEndpoint``, the decode manager's ``DecodeEndpoint`` connects to it (the handshake
compares the full layouts, buffer by buffer), and every request moves as a kvferry request named by its
bootstrap room, with leases, deadlines and page digests. Failures land in SGLang's ``failure_records`` so
``failure_exception`` raises ``KVTransferError`` with kvferry's reason, and the request fails instead of
decoding on bad KV.
"""

from __future__ import annotations

import contextlib
import logging
import os
import time
from typing import Any

from sglang.srt.disaggregation.base.conn import KVArgs, KVPoll, KVTransferDestination, KVTransferMetric
from sglang.srt.disaggregation.common.conn import (
    CommonKVBootstrapServer,
    CommonKVManager,
    CommonKVReceiver,
    CommonKVSender,
)
from sglang.srt.disaggregation.utils import DisaggregationMode
from sglang.srt.environ import envs
from sglang.srt.runtime_context import get_parallel

from kvferry.control import DecodeEndpoint, EndpointOptions, PrefillEndpoint, RequestState
from kvferry.control.pull import DECODE_MODES
from kvferry.errors import HandshakeError, IncompatiblePeer, KVFerryError, LayoutError, PeerLost, UsageError
from kvferry.integrations.sglang.layout import (
    Mamba2Dims,
    PoolNames,
    chunk_pages,
    kvargs_memory,
    rank_kv_heads,
    request_pages,
)
from kvferry.integrity.binding import Binding, token_binding
from kvferry.transport import Transport, make_transport

__all__ = ["KVFerryKVBootstrapServer", "KVFerryKVManager", "KVFerryKVReceiver", "KVFerryKVSender"]

logger = logging.getLogger(__name__)

_POLL = {RequestState.BOOTSTRAPPING: KVPoll.Bootstrapping, RequestState.WAITING_FOR_INPUT: KVPoll.WaitingForInput,
         RequestState.TRANSFERRING: KVPoll.Transferring, RequestState.DONE: KVPoll.Success,
         RequestState.FAILED: KVPoll.Failed}


# What an endpoint raises for a request id it has not heard of (the peer has not announced it yet).
_UNKNOWN = (KeyError, UsageError)
# Tokens per binding block (integrity.binding), the same on both sides whatever their page sizes. SGLang's
# pages are often one token; one digest per token would cost a hash call and 16 bytes each.
BIND_TOKENS = 64


def _room_id(room: int) -> str:
    return f"room-{room}"


# Which kvferry transport the backend moves pages with: "nixl" (the default) or "mooncake" (Mooncake's Transfer
# Engine, pip install 'kvferry[mooncake]'). An environment variable, as SGLang's own backends read theirs:
# its server args have no field a plugin backend may add. Both sides of a pair must name the same one (the
# handshake refuses otherwise).
TRANSPORT_ENV = "KVFERRY_SGLANG_TRANSPORT"
SGLANG_TRANSPORTS = ("nixl", "mooncake")


# Who moves the bytes: "push" (prefill writes into decode's pages), "pull" (decode reads prefill's; prefill holds
# its pages until decode's verdict, and decode never quarantines a page: nothing is held forever when a prefill
# on another host dies, docs/fencing.md) or "auto" (the default: push to a prefill on a loopback address, pull
# to any other). Read on decode, which chooses per connection; a prefill accepts either.
MODE_ENV = "KVFERRY_SGLANG_MODE"


def _decode_mode() -> str:
    mode = os.environ.get(MODE_ENV, "auto") or "auto"
    if mode not in DECODE_MODES:
        raise UsageError(f"kvferry backend: {MODE_ENV} must be one of {DECODE_MODES}, got {mode!r}")
    return mode


def _transport(host: str, server_args: Any) -> Transport:
    """A fresh transport of the kind ``KVFERRY_SGLANG_TRANSPORT`` names. Mooncake's engine listens on
    ``host`` (the rank's IP, what peers reach it at) over TCP, or RDMA when ``KVFERRY_MOONCAKE_PROTOCOL=rdma``
    on ``--disaggregation-ib-device`` (SGLang's own server arg for its Mooncake backend's NIC)."""
    kind = os.environ.get(TRANSPORT_ENV, "nixl") or "nixl"
    if kind not in SGLANG_TRANSPORTS:
        raise UsageError(f"kvferry backend: {TRANSPORT_ENV} must be one of {SGLANG_TRANSPORTS}, got {kind!r}")
    logger.info("kvferry SGLang backend: pages move over %s", kind)
    if kind == "nixl":
        return make_transport("nixl")
    return make_transport("mooncake", hostname=host, protocol=os.environ.get("KVFERRY_MOONCAKE_PROTOCOL", "tcp"),
                          device=str(getattr(server_args, "disaggregation_ib_device", None) or ""))


def _memory_device(args: KVArgs, server_args: Any) -> tuple[str, int]:
    """Where SGLang's pools live: NIXL registers CUDA pointers as VRAM, host ones as DRAM."""
    kinds = getattr(args, "kv_data_mem_kinds", None)
    on_host = (kinds and all(str(k).upper() == "DRAM" for k in kinds)) or \
        str(getattr(server_args, "device", "cuda")) == "cpu"
    return ("cpu", 0) if on_host else ("cuda", int(getattr(args, "gpu_id", 0) or 0))


def _total_kv_heads(args: KVArgs, server_args: Any) -> tuple[int | None, str]:
    """An MHA rank's model-wide KV head count and where it came from. SGLang's prefill sets
    ``total_kv_head_num`` (with the per-rank ``kv_head_num``) always; its decode only with hetero-TP staging,
    after the manager exists, so a decode reads its own model config (what its scheduler read to size the
    pool). ``kv_head_num`` alone is not used: where heads are replicated it is ``max(1, total // tp)``, which
    does not give the total back. None when nothing says; the handshake checks what is declared."""
    total = int(getattr(args, "total_kv_head_num", 0) or 0)
    if total > 0:
        return total, "kv_args.total_kv_head_num"
    try:
        from sglang.srt.configs.model_config import ModelConfig

        return int(ModelConfig.from_server_args(server_args).get_total_num_kv_heads()), "the model config"
    except Exception as exc:  # any failure to read a config means "unknown", never a guess
        return None, f"unknown (the model config did not load: {type(exc).__name__}: {exc})"


def _mha_heads(args: KVArgs, server_args: Any, tp_size: int) -> tuple[int | None, str]:
    """This rank's KV heads for the layout (None: no head geometry, equal TP sizes only) and a note saying
    why, for refusals and logs."""
    total, source = _total_kv_heads(args, server_args)
    heads = rank_kv_heads(total, tp_size)
    pool_heads = int(getattr(args, "kv_head_num", 0) or 0)
    if heads is not None and pool_heads and pool_heads != heads:
        # The pool was sized with another count than the one this rank would declare: neither is safe to cut by.
        raise LayoutError(f"KVArgs kv_head_num {pool_heads} (the pool's KV heads on this rank) != {total} KV heads "
                          f"(from {source}) over attn TP {tp_size}")
    if total is not None and heads is None:
        return None, (f"{total} KV heads (from {source}) do not split evenly over attn TP {tp_size}: "
                      f"SGLang replicates heads there, which kvferry does not model")
    return heads, f"{heads} KV heads per rank (from {source})" if heads else f"KV heads {source}"


def _needs_mamba2_dims(args: KVArgs) -> bool:
    """Whether ``args`` has a mamba component whose conv comes with no sub-block sizes (a Mamba2 ``[x | B |
    C]``, or another conv kvferry does not cut): only then is the model config read for its sizes."""
    groups = getattr(args, "state_conv_shard_groups", None) or []
    return any(str(getattr(st, "value", st)) == "mamba" and not any(groups[i] if i < len(groups) else [])
               for i, st in enumerate(getattr(args, "state_types", None) or []))


def _mamba2_dims(args: KVArgs, server_args: Any) -> tuple[Mamba2Dims | None, str | None]:
    """The model's Mamba2 state sizes from its config, read as SGLang reads them to size the ``MambaPool``
    (``hybrid_arch.mamba2_config``, then its ``mamba2_cache_params``), and a note for logs. None (the conv
    state then moves between equal TP sizes only) when the model is not such a Mamba2 or its config does
    not load; the shape SGLang made must agree with the groups read, else nothing is declared. The note is
    None when there is no such conv state (nothing read)."""
    if not _needs_mamba2_dims(args):
        return None, None
    try:
        from sglang.srt.configs.hybrid_arch import mamba2_config
        from sglang.srt.configs.mamba_utils import Mamba2StateShape, extra_groups_for_head_shards
        from sglang.srt.configs.model_config import ModelConfig
        from sglang.srt.runtime_context import get_parallel

        config = mamba2_config(ModelConfig.from_server_args(server_args))
        shape = None if config is None else config.mamba2_cache_params.shape
        if not isinstance(shape, Mamba2StateShape) or shape.conv_shard_groups:
            return None, "the model config is not a Mamba2 hybrid (x | B | C conv)"
        # NemotronH and Mamba2 name the groups n_groups; Granite 4.0-H and Falcon-H1 mamba_n_groups.
        n_groups = getattr(config, "n_groups", None) or getattr(config, "mamba_n_groups", None)
        tp_size = int(get_parallel().attn_tp_size)
    except Exception as exc:  # any failure to read a config means "unknown", never a guess
        return None, f"unknown (the model config did not load: {type(exc).__name__}: {exc})"
    if not isinstance(n_groups, int) or n_groups <= 0:
        return None, f"the model config gives no Mamba2 group count ({n_groups!r})"
    groups = n_groups + extra_groups_for_head_shards(n_groups, tp_size)
    if shape.conv_dim != shape.intermediate_size + 2 * groups * shape.state_size:
        return None, (f"the model config's {n_groups} groups do not give SGLang's conv dim {shape.conv_dim} "
                      f"at attn TP {tp_size}")
    dims = Mamba2Dims(int(shape.intermediate_size), n_groups, int(shape.state_size), int(shape.num_heads),
                      int(shape.head_dim), int(shape.conv_kernel))
    note = f"Mamba2 {dims} (from the model config)"
    if n_groups % tp_size and n_groups != 1:
        # Its pool still builds (Mamba2StateShape.create extends the groups), but each group then sits on some
        # ranks only, which no section can say: the handshake refuses a cross-TP peer, and this says why.
        note += (f"; its {n_groups} groups neither divide over attn TP {tp_size} nor are one group (SGLang's "
                 f"MambaMixer2 refuses that TP size): the conv state moves between equal TP sizes only")
    return dims, note


class KVFerryKVManager(CommonKVManager):
    """One per scheduler rank. Prefill: a ``PrefillEndpoint`` whose port is the rank port registered with
    the bootstrap server. Decode: one ``DecodeEndpoint`` connected to every prefill rank it pairs with."""

    supports_role_switch = False
    reports_transfer_latency = True

    def __init__(self, args: KVArgs, disaggregation_mode: DisaggregationMode, server_args: Any,
                 is_mla_backend: bool | None = False) -> None:
        device, device_id = _memory_device(args, server_args)
        parallel = get_parallel()   # what CommonKVManager reads too, and registers with the bootstrap server
        # Built first: a KVArgs kvferry cannot describe fails the manager, before any bootstrap side effect.
        # The layout sits at this rank's attention TP place; an MLA backend's buffers are the same on every
        # rank (replicated), which is what lets kvferry's TP planner pair it with another TP size. An MHA
        # backend's KV entries are cut by head when this rank knows its KV heads (the rule: declared
        # whenever known; docs/sglang.md), so both sides of a pair must know them, and the handshake
        # compares total heads and head bytes.
        tp_size = int(parallel.attn_tp_size)
        self.kv_heads, self.kv_heads_note = (None, "MLA") if is_mla_backend else _mha_heads(args, server_args, tp_size)
        if not is_mla_backend:
            logger.info("kvferry SGLang backend, attn TP rank %s of %s: %s", parallel.attn_tp_rank, tp_size,
                        self.kv_heads_note)
        # A Mamba2 conv state's sub-blocks (x | B | C) are not in KVArgs: read from the model config.
        self.mamba2, self.mamba2_note = _mamba2_dims(args, server_args)
        if self.mamba2_note is not None:
            logger.info("kvferry SGLang backend, attn TP rank %s of %s: %s", parallel.attn_tp_rank, tp_size,
                        self.mamba2_note)
        self.kvferry_memory, self.pool_names = kvargs_memory(
            args, device=device, device_id=device_id, tp_size=tp_size, tp_rank=int(parallel.attn_tp_rank),
            replicated=bool(is_mla_backend), kv_heads=self.kv_heads, mamba2=self.mamba2)
        self.kvferry_mode = _decode_mode()   # checked on both sides: a typo is refused wherever it is set
        self.kvferry_options = EndpointOptions(
            request_timeout=float(envs.SGLANG_DISAGGREGATION_WAITING_TIMEOUT.get()),
            handshake_timeout=10.0)
        self.prefill_endpoint: PrefillEndpoint | None = None
        self.decode_endpoint: DecodeEndpoint | None = None
        super().__init__(args, disaggregation_mode, server_args, is_mla_backend)
        # SGLang's PULL socket carries its own backends' messages; kvferry's endpoint replaces it.
        self.server_socket.close(linger=0)
        if disaggregation_mode == DisaggregationMode.DECODE:
            self.decode_endpoint = DecodeEndpoint(self.kvferry_memory, _transport(self.local_ip, server_args),
                                                  options=self.kvferry_options, mode=self.kvferry_mode)
            # SGLang's decode caches each prefill's bootstrap info (and so its kvferry address) per bootstrap
            # address, and only its heartbeat thread (``_handle_node_failure``) drops it: without it, a
            # restarted prefill (a new endpoint port) is never looked up again, and every later request
            # goes to the dead address. It also fails the rooms of a dead prefill that kvferry never heard
            # of (not announced yet), which would otherwise wait in Bootstrapping with no deadline.
            self._start_heartbeat_checker_thread()

    def register_to_bootstrap(self) -> None:
        """Bind the prefill endpoint on this rank's IP and register its port as the rank port."""
        if self.prefill_endpoint is None:
            self.prefill_endpoint = PrefillEndpoint(self.kvferry_memory, _transport(self.local_ip, self.server_args),
                                                    host=self.local_ip, options=self.kvferry_options)
        self.rank_port = int(self.prefill_endpoint.address.rsplit(":", 1)[1])
        super().register_to_bootstrap()

    def connect_prefill(self, address: str) -> None:
        """Decode: handshake with a prefill rank once (layouts compared buffer by buffer). A prefill that is
        down is not asked again for a while (``DecodeEndpoint.connect_needed``'s back-off): each request
        then fails at once rather than after a handshake timeout; a refusal is final."""
        if self.decode_endpoint is None:
            raise UsageError('kvferry backend: this manager has no decode endpoint (not a decode instance)')
        self.decode_endpoint.connect_needed([address], exact=True)

    def prefill_lost(self, bootstrap_addr: str, reason: str) -> None:
        """Decode: kvferry found the prefill behind ``bootstrap_addr`` gone (no handshake, or its link
        lost): forget what SGLang cached of it, as its heartbeat does, so the next request looks it up
        again (a restarted prefill has a new endpoint port), and fail its rooms still waiting."""
        logger.warning("kvferry: prefill at bootstrap address %s lost (%s): its bootstrap info is dropped",
                       bootstrap_addr, reason)
        self._handle_node_failure(bootstrap_addr)

    @property
    def tokens_per_page(self) -> int:
        return int(self.kvferry_memory.layout.pool(self.pool_names.kv).tokens_per_page or 1)

    def endpoint_prefix(self, room: int) -> dict[str, int]:
        """Prefill: the tokens per pool decode announced it holds for ``room`` (its pages at its own page
        size, which may differ from this side's; none before the announce)."""
        if self.prefill_endpoint is None:
            raise UsageError("kvferry backend: this manager has no prefill endpoint (not a prefill instance)")
        return self.prefill_endpoint.decode_prefix_tokens(_room_id(room)) or {}

    def bind(self, token_ids: Any, label: str) -> Binding:
        """The binding of a request's input ids (``integrity.binding``), in blocks of ``BIND_TOKENS``
        tokens whatever this side's page size: prefill and decode may page differently and must still
        state the same binding."""
        return token_binding(token_ids, BIND_TOKENS, label=label)

    def fail(self, room: int, reason: str) -> None:
        self.record_failure(room, reason)
        self.update_status(room, KVPoll.Failed)

    def teardown(self) -> None:
        shutdown = getattr(self, "_heartbeat_shutdown", None)   # decode only: stop the heartbeat thread
        if shutdown is not None:
            shutdown.set()
        for endpoint in (self.prefill_endpoint, self.decode_endpoint):
            if endpoint is not None:
                endpoint.close()

    @property
    def endpoint(self) -> PrefillEndpoint | DecodeEndpoint:
        endpoint = self.prefill_endpoint or self.decode_endpoint
        if endpoint is None:
            raise UsageError('kvferry backend: this manager has no endpoint for its disaggregation mode')
        return endpoint


def _endpoint_poll(mgr: KVFerryKVManager, room: int) -> tuple[KVPoll | None, str | None]:
    """The kvferry request's state as a ``KVPoll`` (None while the endpoint has not heard of it), and the
    failure reason when it failed."""
    try:
        state = mgr.endpoint.poll(_room_id(room))
    except _UNKNOWN:
        return None, None
    if state is RequestState.FAILED:
        return KVPoll.Failed, str(mgr.endpoint.failure(_room_id(room)) or "kvferry request failed")
    return _POLL[state], None


def _abort(mgr: KVFerryKVManager, room: int, reason: str) -> None:
    """Abort the kvferry request; one the endpoint never heard of has nothing in flight to stop."""
    with contextlib.suppress(*_UNKNOWN):
        mgr.endpoint.abort(_room_id(room), reason)


class KVFerryKVSender(CommonKVSender):
    """Prefill side of one request: each ``send`` (one per chunk) is a kvferry ``send`` of that chunk.

    With a decode prefix (decode's radix cache holds the request's first pages), SGLang's prefill asks
    ``pop_decode_prefix_len`` once decode announced, then calls ``init`` and ``send`` for the suffix pages
    only: their kvferry positions start at the prefix, since kvferry counts positions in the whole
    request."""

    kv_mgr: KVFerryKVManager
    # KV pages of the request decode already holds (as popped): the first sent KV page's position.
    prefix_pages = 0
    # Bytes of the pages handed to kvferry for this request, every pool (get_transfer_metric).
    moved_bytes = 0
    # The request's input ids (bind_tokens; the plugin calls it when SGLang creates the sender): every send
    # states them, and kvferry refuses a decode announcing other tokens. None: unbound.
    binding: Binding | None = None

    def bind_tokens(self, token_ids: Any, label: str = "") -> None:
        """Bind this request's transfer to its input ids (``req.origin_input_ids``); ``label``: SGLang's rid."""
        self.binding = self.kv_mgr.bind(token_ids, label or f"room {self.bootstrap_room}")

    def pop_decode_prefix_len(self) -> int:
        """Where SGLang's prefill starts sending (``start_send_idx``): decode's prefix in tokens (whole
        pages of decode's size: kvferry refused any other at the announce), from kvferry's announce, cut
        down to whole pages of this side's size. SGLang lists a request's pages from there
        (``kv_to_page_indices`` takes the page of every ``page_size``-th token), which misses a page when
        the start falls inside one; kvferry maps the pages sent by token and skips what decode holds of
        the first. 0 before the announce arrived, and then kvferry skips the whole prefix."""
        held = self.kv_mgr.endpoint_prefix(self.bootstrap_room).get(self.kv_mgr.pool_names.kv, 0)
        self.prefix_pages = held // self.kv_mgr.tokens_per_page
        return self.prefix_pages * self.kv_mgr.tokens_per_page

    def init(self, num_kv_indices: int, aux_index: int | None = None) -> None:
        super().init(num_kv_indices, aux_index)
        if num_kv_indices < 0:
            # SGLang computes ceil((input tokens - prefix) / page): negative only when decode's prefix runs
            # past the request, and its prefill would then never send (start_send_idx > end).
            self._fail(f"decode_prefix_len {self.prefix_pages * self.kv_mgr.tokens_per_page} tokens is past the "
                       f"request: pool {self.kv_mgr.pool_names.kv!r}, expected a prefix of at most the request's "
                       f"{self.prefix_pages + num_kv_indices} pages, decode claims {self.prefix_pages}")

    def send(self, kv_indices: Any, state_indices: list | None = None, num_kv_tokens: int | None = None,
             **_: Any) -> None:
        if self.conclude_state in (KVPoll.Success, KVPoll.Failed):
            return
        start = self.curr_idx
        self.curr_idx += len(kv_indices)
        last = self.curr_idx == self.num_kv_indices
        if self._transfer_start_time is None:
            self._transfer_start_time = time.perf_counter()
        names: PoolNames = self.kv_mgr.pool_names
        try:
            pages, offsets = chunk_pages(names, kv_indices, self.prefix_pages + start, last, self.aux_index,
                                         state_indices)
            if pages or last:
                self.kv_mgr.endpoint.send(_room_id(self.bootstrap_room), pages, offset=offsets, last=last,
                                          binding=self.binding)
                self.moved_bytes += _page_bytes(self.kv_mgr, pages)
        except KVFerryError as exc:
            self._fail(f"kvferry send failed: {exc}")
            return
        self._record_transfer_indices(kv_indices, state_indices if last else None)

    def get_transfer_metric(self) -> KVTransferMetric:
        """What SGLang's metrics collector records per request (``sglang:kv_transfer_*``, on Success), from
        kvferry: the bytes of the pages kvferry moved for it, every pool (what the endpoint's stats count as
        ``page_bytes``), and its time from the first send to DONE on the prefill endpoint."""
        try:
            started, ended = self.kv_mgr.endpoint.timing(_room_id(self.bootstrap_room))
        except UsageError:   # never sent (aborted or failed first): nothing moved, no time to report
            return KVTransferMetric(transfer_total_bytes=self.moved_bytes)
        return KVTransferMetric(transfer_latency_s=None if ended is None else ended - started,
                                transfer_total_bytes=self.moved_bytes)

    def poll(self) -> KVPoll:
        if self.conclude_state is not None:
            return self.conclude_state
        status, reason = _endpoint_poll(self.kv_mgr, self.bootstrap_room)
        if status is None:   # decode has not announced the request yet: SGLang's bootstrap timeout applies
            polled = self._poll_with_status(self.kv_mgr.check_status)
            if polled == KVPoll.Failed:   # SGLang failed it (its timeout): decode must not wait on
                _abort(self.kv_mgr, self.bootstrap_room, self.kv_mgr.failure_records.get(
                    self.bootstrap_room, "failed on prefill"))
            return polled
        if reason is not None:
            self.kv_mgr.record_failure(self.bootstrap_room, reason)
        self.kv_mgr.update_status(self.bootstrap_room, status)
        return self._poll_with_status(self.kv_mgr.check_status)

    def abort(self) -> None:
        # Before decode announced, kvferry keeps the room FAILED and tells every decode peer at once.
        _abort(self.kv_mgr, self.bootstrap_room, "aborted by SGLang (AbortReq)")
        super().abort()

    def _fail(self, reason: str) -> None:
        self.kv_mgr.fail(self.bootstrap_room, reason)
        _abort(self.kv_mgr, self.bootstrap_room, reason)
        self.conclude_state = KVPoll.Failed


def _page_bytes(mgr: KVFerryKVManager, pages: dict[str, Any]) -> int:
    """The bytes of ``pages`` (pool -> page list) over every buffer of their pools, on this side."""
    layout = mgr.kvferry_memory.layout
    return sum(len(p) * sum(b.page_bytes for b in layout.pool(pool).buffers) for pool, p in pages.items())


def _parallel_refusal(info: Any, mgr: KVFerryKVManager) -> str | None:
    """Why kvferry cannot pair this decode rank with the prefill ``info`` describes, or None."""
    ptp, dtp = info.attn_tp_size, mgr.attn_tp_size
    if info.pp_size != 1 or info.attn_cp_size != 1:
        return (f"kvferry's SGLang backend does not move KV from prefill PP {info.pp_size} / attn CP "
                f"{info.attn_cp_size} (PP 1 and CP 1 only)")
    if getattr(info, "enable_kv_cache_sharding", False):
        return "kvferry's SGLang backend does not support prefill MLA KV cache sharding"
    if ptp != dtp and not mgr.is_mla_backend and mgr.kv_heads is None:
        # An MHA pool shards its KV heads over the ranks: with no head count for this decode rank there is
        # nothing to cut pages by, so only rank to rank (docs/sglang.md). With one, the handshake checks
        # prefill's against it.
        return (f"kvferry's SGLang backend moves non-MLA KV across attention TP sizes only when decode knows "
                f"its KV heads: prefill attn TP {ptp}, decode attn TP {dtp}, decode "
                f"{mgr.kv_heads_note}")
    if max(ptp, dtp) % min(ptp, dtp):
        return f"attention TP sizes must divide one another: prefill {ptp}, decode {dtp}"
    return None


class KVFerryKVReceiver(CommonKVReceiver):
    """Decode side of one request: ``init`` resolves and handshakes with the prefill rank(s),
    ``send_metadata`` announces (leases) the destination pages to kvferry."""

    kv_mgr: KVFerryKVManager
    binding: Binding | None = None   # the request's input ids (bind_tokens), stated in the announce

    def bind_tokens(self, token_ids: Any, label: str = "") -> None:
        """Bind this request's transfer to its input ids (``req.origin_input_ids``); ``label``: SGLang's rid.
        Prefill refuses the announce when the room's KV was computed from other tokens."""
        self.binding = self.kv_mgr.bind(token_ids, label or f"room {self.bootstrap_room}")

    def init(self, prefill_dp_rank: int) -> None:
        if self.conclude_state == KVPoll.Failed:
            return
        info = self.kv_mgr.prefill_info_table.get(self.bootstrap_addr)
        if info is None:
            self._fail(f"prefill at bootstrap address {self.bootstrap_addr} is unknown or down "
                       f"(try_ensure_parallel_info found no parallel info)")
            return
        refusal = _parallel_refusal(info, self.kv_mgr)
        if refusal is not None:
            self._fail(refusal)
            return
        self.prefill_info = info
        self.target_tp_rank = info.target_tp_rank
        self.target_tp_ranks = info.target_tp_ranks
        self.target_cp_ranks = info.target_cp_ranks
        self.target_pp_ranks = info.target_pp_ranks
        self.required_dst_info_num = info.required_dst_info_num
        self.required_prefill_response_num = info.required_prefill_response_num
        self.prefill_dp_rank = prefill_dp_rank
        self._setup_bootstrap_infos()   # calls _register_kv_args: the kvferry handshake
        if self.conclude_state == KVPoll.Failed or self.bootstrap_infos is None:
            return
        # Every prefill rank SGLang pairs this decode rank with, "dummy" ones included: kvferry's TP
        # protocol has each source rank report on each request, a rank with nothing of this decode rank's
        # to write (MLA: all but replica_source) with an empty write that only notifies.
        self.peer_addresses = [self._address(i) for i in self.bootstrap_infos]
        self.kv_mgr.update_status(self.bootstrap_room, KVPoll.WaitingForInput)

    @staticmethod
    def _address(info: dict) -> str:
        return f"tcp://{info['rank_ip']}:{info['rank_port']}"

    def _register_kv_args(self) -> bool:
        """SGLang's registration step, done as kvferry's handshake: it refuses a prefill whose layout
        differs in any buffer (name, dtype, page size), with the first difference as the reason."""
        if self.bootstrap_infos is None:
            return False
        try:
            for info in self.bootstrap_infos:
                self.kv_mgr.connect_prefill(self._address(info))
        except KVFerryError as exc:
            if isinstance(exc, (HandshakeError, PeerLost)) and not isinstance(exc, IncompatiblePeer):
                self.kv_mgr.prefill_lost(self.bootstrap_addr, f"handshake: {exc}")
            # An MHA decode's head geometry (and a Mamba2 conv's sub-blocks) is what it derived itself: say
            # from where, so an operator can tell a wrong model config from a wrong prefill.
            notes = [] if self.kv_mgr.is_mla_backend else [self.kv_mgr.kv_heads_note]
            notes += [self.kv_mgr.mamba2_note] if self.kv_mgr.mamba2_note is not None else []
            heads = f" (decode: {'; '.join(notes)})" if notes else ""
            self._fail(f"kvferry handshake with prefill failed: {exc}{heads}")
            return False
        return True

    def send_metadata(self, kv_indices: Any, aux_index: int | None = None, state_indices: list | None = None,
                      decode_prefix_len: int | None = None,
                      destination: KVTransferDestination = KVTransferDestination.DEVICE, **_: Any) -> None:
        if self.conclude_state == KVPoll.Failed:
            return
        status, reason = _endpoint_poll(self.kv_mgr, self.bootstrap_room)
        if status == KVPoll.Failed:   # prefill failed the room first (kvferry's Cancel): lease nothing
            self._fail(reason or "failed on prefill before the announce")
            return
        if destination != KVTransferDestination.DEVICE:
            raise NotImplementedError("kvferry: host KV destinations are not supported")
        try:
            # SGLang's lists are of what decode lacks: KV pages past the prefix, DSA suffix pages, the SWA
            # window past it, whole request state. The prefix (tokens) tells kvferry where the KV pages
            # start in the request; state pools have no token pages and move whole.
            pages = request_pages(self.kv_mgr.pool_names, kv_indices, aux_index, state_indices)
            peer = self.peer_addresses[0] if len(self.peer_addresses) == 1 else self.peer_addresses
            self.kv_mgr.endpoint.announce(_room_id(self.bootstrap_room), pages, peer=peer,
                                          prefix=int(decode_prefix_len or 0), binding=self.binding)
        except KVFerryError as exc:
            if isinstance(exc, PeerLost):   # SGLang's cached address of a prefill that is gone (restarted)
                self.kv_mgr.prefill_lost(self.bootstrap_addr, f"announce: {exc}")
            self._fail(f"kvferry announce failed: {exc}")
            return
        self.init_time = time.time()

    def poll(self) -> KVPoll:
        if self.conclude_state is not None:
            return self.conclude_state
        status, reason = _endpoint_poll(self.kv_mgr, self.bootstrap_room)
        if status is None:
            return super().poll()
        if status is KVPoll.Bootstrapping:
            status = KVPoll.WaitingForInput   # announced, prefill not yet confirmed: still waiting
        if reason is not None:
            self.kv_mgr.record_failure(self.bootstrap_room, reason)
        if status in (KVPoll.Success, KVPoll.Failed):
            self.kv_mgr.update_status(self.bootstrap_room, status)
            self.conclude_state = status
        return status

    def abort(self) -> None:
        self._tell_prefill("aborted by SGLang (AbortReq)")
        super().abort()

    def ensure_abort_notified(self, *, force_arm: bool = False) -> None:
        # SGLang's own notification would go to a ZMQ PULL socket kvferry does not run.
        self._send_abort_notification(force_arm=force_arm)

    def _send_abort_notification(self, *, force_arm: bool = False) -> None:
        """SGLang's paths that end a room on decode (its waiting timeout, a cleared unfinished room) call
        this: kvferry tells prefill instead."""
        self._tell_prefill(self.kv_mgr.failure_records.get(self.bootstrap_room, "failed on decode"))

    def _tell_prefill(self, reason: str) -> None:
        """Tell every prefill rank of the room, once, that decode ended it, so each fails it now and frees
        what it holds (issue 26). Announced: kvferry's abort (the lease ends once no write can land). Not
        announced but connected: kvferry's cancel (nothing leased; prefill would otherwise hold the room in
        Bootstrapping until SGLang's bootstrap timeout). Before a handshake there is no one to tell."""
        if self.abort_notified:
            return
        self.abort_notified = True
        endpoint, room = self.kv_mgr.decode_endpoint, _room_id(self.bootstrap_room)
        if endpoint is None:
            return
        try:
            endpoint.poll(room)
        except _UNKNOWN:
            peers = getattr(self, "peer_addresses", None)
            if peers:
                with contextlib.suppress(KVFerryError):   # prefill gone or closing: it fails the room itself
                    endpoint.cancel(room, reason, peer=peers[0] if len(peers) == 1 else peers)
            return
        endpoint.abort(room, reason)   # a no-op for a room that ended

    def is_abort_release_safe(self) -> bool:
        """True once no write of this request can still land in its pages (kvferry's lease ended)."""
        if self.kv_mgr.decode_endpoint is None:
            raise UsageError('kvferry backend: this manager has no decode endpoint (not a decode instance)')
        return not self.kv_mgr.decode_endpoint.holds_lease(_room_id(self.bootstrap_room))

    def _fail(self, reason: str) -> None:
        self.kv_mgr.fail(self.bootstrap_room, reason)
        self.conclude_state = KVPoll.Failed
        self._tell_prefill(reason)


class KVFerryKVBootstrapServer(CommonKVBootstrapServer):
    """SGLang's bootstrap server: it maps (dp, cp, tp, pp) ranks to the kvferry endpoint ports.

    It does not state prefill's page size to decode: SGLang's decode (``CommonKVManager.
    try_ensure_parallel_info``) raises ``RuntimeError("Page size mismatch ...")`` in its scheduler for any
    other page size than its own, and skips the check when none is stated. kvferry's handshake compares
    the page sizes pool by pool instead: it translates them where every token's bytes lie alike (MHA and
    MLA pools) and refuses any other difference by name (docs/sglang.md)."""

    @property
    def page_size(self) -> int | None:
        return None

    @page_size.setter
    def page_size(self, value: int | None) -> None:
        self.registered_page_size = value   # what a prefill rank registered (kept, never routed)
