"""``KVFerryConnector``: kvferry as a vLLM v1 KV connector (prefill pushes, decode verifies).

The top of ``kvferry.integrations.vllm``, above ``scheduler`` and ``worker``, which hold the logic; this
module only adapts vLLM's types to theirs. vLLM loads it with::

    kv_transfer_config={"kv_connector": "KVFerryConnector",
                        "kv_connector_module_path": "kvferry.integrations.vllm",
                        "kv_role": "kv_producer" | "kv_consumer" | "kv_both",
                        "kv_connector_extra_config": {...}}   # WorkerConfig's fields

vLLM builds two instances per engine: a scheduler-side one (in the engine core) and a worker-side one (in
each worker); they talk only through the per-step ``KVFerryMetadata`` and the worker's transfer results.
Imported only when vLLM loads it (``import kvferry`` never imports vLLM or torch).
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorBase_V1,
    KVConnectorHandshakeMetadata,
    KVConnectorMetadata,
    KVConnectorRole,
    KVConnectorTransferResults,
    SupportsHMA,
)

from kvferry.errors import UsageError
from kvferry.integrations.vllm.layout import (
    GroupSpec,
    RankPlace,
    cpu_kernel_parts,
    mamba2_state_geometry,
    memory_from_kv_caches,
    rank_kv_heads,
)
from kvferry.integrations.vllm.scheduler import SchedulerSide, StepPlan
from kvferry.integrations.vllm.stats import KVFerryConnectorStats, KVFerryPromMetrics, StatsTaker
from kvferry.integrations.vllm.worker import WorkerConfig, WorkerSide
from kvferry.layout import StateGeometry

if TYPE_CHECKING:
    import torch
    from vllm.config import VllmConfig
    from vllm.forward_context import ForwardContext
    from vllm.v1.core.kv_cache_manager import KVCacheBlocks
    from vllm.v1.core.sched.output import SchedulerOutput
    from vllm.v1.kv_cache_interface import KVCacheConfig
    from vllm.v1.outputs import KVConnectorOutput
    from vllm.v1.request import Request

__all__ = ["KVFerryConnector", "KVFerryHandshake", "KVFerryMetadata"]

log = logging.getLogger("kvferry.vllm")

_ROLES = {"kv_producer": "producer", "kv_consumer": "consumer", "kv_both": "both"}


@dataclass(frozen=True)
class KVFerryMetadata(KVConnectorMetadata):
    """Scheduler -> worker, once per step: the step's sends, announces and aborts."""

    plan: StepPlan


@dataclass(frozen=True)
class KVFerryHandshake(KVConnectorHandshakeMetadata):
    """Worker -> scheduler, once at start-up: where the worker's prefill endpoint listens."""

    address: str | None


class KVFerryConnector(KVConnectorBase_V1, SupportsHMA):
    """kvferry's vLLM connector. Each hook's contract is vLLM's (``KVConnectorBase_V1``); what it does here
    is one call into the scheduler-side or worker-side half. ``SupportsHMA``: vLLM keeps its hybrid KV cache
    manager on, so a model with full-attention and sliding-window layers has a KV cache group per kind
    (overlaid in memory: one kvferry pool, see ``layout``), and vLLM calls
    ``request_finished_all_groups`` with every group's blocks."""

    def __init__(self, vllm_config: VllmConfig, role: KVConnectorRole, kv_cache_config: KVCacheConfig) -> None:
        super().__init__(vllm_config, role, kv_cache_config)
        transfer = self._kv_transfer_config
        if transfer.kv_role not in _ROLES:
            raise UsageError(f"kvferry connector: kv_role must be one of {sorted(_ROLES)}, got {transfer.kv_role!r}")
        parallel = vllm_config.parallel_config
        if parallel.pipeline_parallel_size != 1 or parallel.data_parallel_size != 1:
            raise UsageError(f"kvferry connector: pipeline parallel size {parallel.pipeline_parallel_size}, data "
                             f"parallel size {parallel.data_parallel_size}: only tensor parallelism is supported")
        self._config = WorkerConfig.from_extra(_ROLES[transfer.kv_role], transfer.kv_connector_extra_config)
        self._groups = _groups(kv_cache_config, vllm_config)
        self._scheduler: SchedulerSide | None = None
        self._worker: WorkerSide | None = None
        self._stats = StatsTaker()
        if role == KVConnectorRole.SCHEDULER:
            self._scheduler = SchedulerSide(self._groups, unbound_for_tests=self._config.unbound_for_tests,
                                            tp_size=parallel.tensor_parallel_size)

    # -- worker side -----------------------------------------------------------------------------------
    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None:
        """Called once, after vLLM allocated its KV cache: bind it and start this worker's endpoints."""
        cache_dtype = str(self._vllm_config.cache_config.cache_dtype)
        place = _rank_place(self._vllm_config)
        kinds = _kinds(self._vllm_config, kv_caches, self._groups) | _state_kinds(self._kv_cache_config, self._groups)
        memory = memory_from_kv_caches(kv_caches, self._groups, self._kv_cache_config.num_blocks,
                                       cache_dtype=cache_dtype, kinds=kinds, place=place,
                                       head_parts=_head_parts(self._vllm_config, kv_caches, cache_dtype))
        self._worker = WorkerSide(self._config.for_rank(place.tp_rank), memory)
        log.info("kvferry: %s registered %d buffers in %d pools (%.1f MiB), prefill address %s",
                 self._config.role, len(memory.layout.buffers), len(memory.layout.pools),
                 memory.layout.nbytes / 2**20, self._worker.address)

    def get_handshake_metadata(self) -> KVFerryHandshake | None:
        return KVFerryHandshake(self._worker.address) if self._worker is not None else None

    def start_load_kv(self, forward_context: ForwardContext, **kwargs: Any) -> None:
        metadata = self._get_connector_metadata()
        if not (isinstance(metadata, KVFerryMetadata) and self._worker is not None):
            raise UsageError('kvferry connector: a worker-side hook needs KVFerryMetadata and the worker-side instance')
        self._worker.start(metadata.plan)

    def wait_for_layer_load(self, layer_name: str) -> None:
        return   # asynchronous loads only: a request runs once its whole KV arrived

    def save_kv_layer(self, layer_name: str, kv_layer: torch.Tensor, attn_metadata: Any, **kwargs: Any) -> None:
        return   # prefill sends whole requests from request_finished's blocks, not layer by layer

    def wait_for_save(self) -> None:
        return   # sends are asynchronous; their blocks stay held until get_transfer_results reports them

    def get_transfer_results(self, finished_req_ids: set[str]) -> KVConnectorTransferResults:
        if self._worker is None:
            raise UsageError('kvferry connector: a worker-side hook was called on the scheduler-side instance')
        sending, recving, failed = self._worker.results()
        return KVConnectorTransferResults(finished_sending=sending, finished_recving=recving,
                                          failed_recving=failed)

    def get_finished(self, finished_req_ids: set[str]) -> tuple[set[str] | None, set[str] | None]:
        results = self.get_transfer_results(finished_req_ids)
        return results.finished_sending, results.finished_recving

    # -- stats (integrations.vllm.stats) ---------------------------------------------------------------
    def get_kv_connector_stats(self) -> KVFerryConnectorStats | None:
        """Worker side, after each step: what this worker's endpoints did since the last call, or None."""
        if self._worker is None:
            return None
        return self._stats.take(e for e in (self._worker.prefill, self._worker.decode) if e is not None)

    @classmethod
    def build_kv_connector_stats(cls, data: dict[str, Any] | None = None) -> KVFerryConnectorStats:
        return KVFerryConnectorStats(data=dict(data or {}))

    @classmethod
    def build_prom_metrics(cls, vllm_config: VllmConfig, metric_types: dict[type, type], labelnames: list[str],
                           per_engine_labelvalues: dict[int, list[object]]) -> KVFerryPromMetrics:
        return KVFerryPromMetrics(vllm_config, metric_types, labelnames, per_engine_labelvalues)

    def shutdown(self) -> None:
        if self._worker is not None:
            self._worker.close()
            self._worker = None

    # -- scheduler side --------------------------------------------------------------------------------
    def set_xfer_handshake_metadata(self, metadata: dict[int, KVConnectorHandshakeMetadata]) -> None:
        """Every TP rank's prefill address (keyed by rank), once at start-up: the transfer parameters name
        them all, so each decode rank can reach the prefill ranks holding its heads."""
        ranks = [metadata.get(rank) for rank in range(len(metadata))]
        if self._scheduler is None or not all(isinstance(h, KVFerryHandshake) for h in ranks):
            return
        addresses = [h.address for h in ranks]   # type: ignore[union-attr]
        if None in addresses:
            return   # a consumer: no prefill endpoint
        self._scheduler.address = addresses[0]
        self._scheduler.addresses = tuple(addresses) if len(addresses) > 1 else ()

    def on_new_request(self, request: Request) -> None:
        """Prefill of a model with state groups: take the prompt's last token off a request that hands its KV
        to a decode, which computes that token over the state (``SchedulerSide.hold_back``). Decode-only: warn
        when requests come without a hand-off (``SchedulerSide.unhanded``)."""
        if self._scheduler is None:
            raise UsageError('kvferry connector: a scheduler-side hook was called on the worker-side instance')
        if self._config.role == "consumer":   # decode-only: say when the router handed nothing off
            warning = self._scheduler.unhanded(request.request_id, request.kv_transfer_params,
                                               request.num_prompt_tokens)
            if warning is not None:
                log.warning("%s", warning)
        tokens = request.prompt_token_ids
        has_ids = (tokens is not None and request.prompt_embeds is None and request.num_computed_tokens == 0
                   and getattr(request, "prompt_is_token_ids", None) is None)   # not embeddings, not mixed
        if self._scheduler.hold_back(request.kv_transfer_params, request.num_prompt_tokens, has_ids):
            _shorten_prompt(request, self._scheduler.backoff)

    def get_num_new_matched_tokens(self, request: Request, num_computed_tokens: int) -> tuple[int | None, bool]:
        if self._scheduler is None:
            raise UsageError('kvferry connector: a scheduler-side hook was called on the worker-side instance')
        return self._scheduler.matched_tokens(request.request_id, request.num_prompt_tokens,
                                              request.kv_transfer_params, num_computed_tokens)

    def get_loaded_kv_cache_group_ids(self, request: Request) -> tuple[int, ...]:
        return tuple(range(len(self._groups)))   # a transfer fills the request's blocks in every group

    def update_state_after_alloc(self, request: Request, blocks: KVCacheBlocks, num_external_tokens: int) -> None:
        if self._scheduler is None:
            raise UsageError('kvferry connector: a scheduler-side hook was called on the worker-side instance')
        self._scheduler.after_alloc(request.request_id, request.kv_transfer_params, blocks.get_block_ids(),
                                    num_external_tokens, request.prompt_token_ids)

    def build_connector_meta(self, scheduler_output: SchedulerOutput) -> KVConnectorMetadata:
        if self._scheduler is None:
            raise UsageError('kvferry connector: a scheduler-side hook was called on the worker-side instance')
        return KVFerryMetadata(self._scheduler.take_plan())

    def update_connector_output(self, connector_output: KVConnectorOutput) -> None:
        if self._scheduler is None:
            raise UsageError('kvferry connector: a scheduler-side hook was called on the worker-side instance')
        self._scheduler.on_worker_output(tuple(connector_output.finished_sending or ()),
                                         tuple(connector_output.finished_recving or ()))

    def request_finished(self, request: Request, block_ids: list[int]) -> tuple[bool, dict[str, Any] | None]:
        return self.request_finished_all_groups(request, (block_ids,))   # vLLM calls it only without HMA

    def request_finished_all_groups(self, request: Request,
                                    block_ids: tuple[list[int], ...]) -> tuple[bool, dict[str, Any] | None]:
        from vllm.v1.request import RequestStatus

        if self._scheduler is None:
            raise UsageError('kvferry connector: a scheduler-side hook was called on the worker-side instance')
        completed = request.status in (RequestStatus.FINISHED_LENGTH_CAPPED, RequestStatus.FINISHED_STOPPED)
        return self._scheduler.finished(request.request_id, request.kv_transfer_params, block_ids,
                                        request.num_computed_tokens, completed, request.prompt_token_ids)

    def has_pending_push_work(self) -> bool:
        return self._scheduler is not None and self._scheduler.has_pending_work()


def _rank_place(vllm_config: VllmConfig) -> RankPlace:
    """This worker's TP rank and how its blocks split into KV heads (``layout.RankPlace``). MLA's latent
    cache is the same on every rank; MHA/GQA heads are sharded when they split evenly over the ranks, and
    replicated by vLLM otherwise (then blocks move rank to rank only, and the handshake refuses other TP
    sizes by name)."""
    from vllm.distributed.parallel_state import get_tensor_model_parallel_rank

    model = vllm_config.model_config
    tp_size = vllm_config.parallel_config.tensor_parallel_size
    tp_rank = get_tensor_model_parallel_rank() if tp_size > 1 else 0
    if model.use_mla:
        return RankPlace(tp_size, tp_rank, None, replicated=True)
    return RankPlace(tp_size, tp_rank, rank_kv_heads(model.get_total_num_kv_heads(), tp_size))


def _shorten_prompt(request: Request, count: int) -> None:
    """Take the last ``count`` prompt tokens off a request vLLM has not scheduled yet, and let it sample one
    token (which nobody reads: decode computes from the prompt). A new list, never the caller's: in one
    process vLLM's request may hold the very list the client passed."""
    request.prompt_token_ids = list(request.prompt_token_ids or ())[:-count]
    del request._all_token_ids[-count:]   # in place: ``all_token_ids`` is a read-only view of this list
    request.num_prompt_tokens -= count
    request.max_tokens = 1


def _groups(kv_cache_config: KVCacheConfig, vllm_config: VllmConfig) -> tuple[GroupSpec, ...]:
    """One GroupSpec per vLLM KV cache group: full attention (every prompt block moves), sliding window (the
    window's blocks move) and Mamba state (the request's state block moves, ``layout``; a Mamba2 state with
    its channel sections, ``_state_geometry``). Other kinds (chunked local or middle-gap windows, ...) keep
    KV of another shape or lifetime, which kvferry does not map yet."""
    from vllm.v1.kv_cache_interface import MambaSpec

    groups = []
    for index, group in enumerate(kv_cache_config.kv_cache_groups):
        spec = group.kv_cache_spec
        if isinstance(spec, MambaSpec):
            _check_state(index, group.layer_names, spec)
            groups.append(GroupSpec(tuple(group.layer_names), int(spec.block_size), state=True,
                                    geometry=_state_geometry(spec, vllm_config)))
            continue
        window = _window(spec)
        if window == -1:
            raise UsageError(f"kvferry connector: KV cache group {index} is {type(spec).__name__} "
                             f"(layers {list(group.layer_names)}); only full and sliding-window attention and "
                             "Mamba state are supported")
        groups.append(GroupSpec(tuple(group.layer_names), int(spec.block_size), window))
    return tuple(groups)


def _check_state(index: int, layers: Sequence[str], spec: Any) -> None:
    """A Mamba group kvferry maps: one state block per request (cache mode ``none``), no speculative blocks.
    vLLM's prefix caching of state (modes ``align``, ``all``) keeps a state per block position instead."""
    where = f"kvferry connector: KV cache group {index} ({type(spec).__name__}, layers {list(layers)})"
    if spec.mamba_cache_mode != "none":
        raise UsageError(f"{where} has mamba_cache_mode {spec.mamba_cache_mode!r} (vLLM's prefix caching of "
                         "Mamba state); kvferry moves one state per request: serve with --no-enable-prefix-caching")
    if spec.num_speculative_blocks:
        raise UsageError(f"{where} has {spec.num_speculative_blocks} speculative state blocks per request "
                         "(speculative decoding); kvferry does not move those")


def _state_geometry(spec: Any, vllm_config: VllmConfig) -> StateGeometry | None:
    """A Mamba2 group's state page as channel sections on this rank (``layout.mamba2_state_geometry``), from
    its spec, the model's groups (``mamba_n_groups``, or ``n_groups`` as Mamba2 and Nemotron-H name it: the
    spec does not carry them) and the TP size; None for other Mamba kinds, whose page then moves whole
    between equal TP sizes only."""
    from vllm.model_executor.layers.mamba.mamba_utils import get_conv_state_layout

    hf_config = vllm_config.model_config.hf_config
    n_groups = getattr(hf_config, "mamba_n_groups", None) or getattr(hf_config, "n_groups", None)
    if spec.mamba_type.name.lower() != "mamba2" or not isinstance(n_groups, int):
        return None
    return mamba2_state_geometry(spec.shapes, [dtype.itemsize for dtype in spec.dtypes], get_conv_state_layout(),
                                 n_groups, vllm_config.parallel_config.tensor_parallel_size)


def _state_kinds(kv_cache_config: KVCacheConfig, groups: Sequence[GroupSpec]) -> dict[str, str]:
    """Each state layer's buffer kind: ``state/<mamba type>/<dtypes>/VLLM_SSM_CONV_STATE_LAYOUT=<SD|DS>``,
    with ``/<shapes>`` after the type when its group has no channel sections (the sections say the shapes,
    per rank: the kind must not differ between TP sizes). The conv state's layout (vLLM's
    ``VLLM_SSM_CONV_STATE_LAYOUT``: ``SD`` unless set, ``DS`` where vLLM configures NixlConnector) decides
    what a state page holds, so two instances that differ in it must not exchange state: the handshake
    compares kinds, and its refusal names the variable."""
    from vllm.model_executor.layers.mamba.mamba_utils import get_conv_state_layout
    from vllm.v1.kv_cache_interface import MambaSpec

    kinds: dict[str, str] = {}
    for group, ours in zip(kv_cache_config.kv_cache_groups, groups):
        spec = group.kv_cache_spec
        if isinstance(spec, MambaSpec):
            shapes = "" if ours.geometry is not None else "/" + ",".join(
                "x".join(str(n) for n in shape) for shape in spec.shapes)
            dtypes = ",".join(str(dtype).removeprefix("torch.") for dtype in spec.dtypes)
            kind = (f"state/{spec.mamba_type.name.lower()}{shapes}/{dtypes}/"
                    f"VLLM_SSM_CONV_STATE_LAYOUT={get_conv_state_layout()}")
            kinds.update((layer, kind) for layer in group.layer_names)
    return kinds


def _window(spec: Any) -> int | None:
    """A group spec's sliding window; None for full attention; -1 for a kind kvferry does not map."""
    from vllm.v1.kv_cache_interface import (
        FullAttentionSpec,
        MLAAttentionSpec,
        SlidingWindowMLASpec,
        SlidingWindowSpec,
        UniformTypeKVCacheSpecs,
    )

    if type(spec) in (SlidingWindowSpec, SlidingWindowMLASpec):
        return int(spec.sliding_window)
    if type(spec) in (FullAttentionSpec, MLAAttentionSpec):   # exact: subclasses change which blocks live
        return None
    if isinstance(spec, UniformTypeKVCacheSpecs):   # full-attention layers of different sizes, one table
        windows = {_window(inner) for inner in spec.kv_cache_specs.values()}
        return windows.pop() if len(windows) == 1 else -1
    return -1


def _kinds(vllm_config: VllmConfig, kv_caches: dict[str, Any], groups: tuple[GroupSpec, ...]) -> dict[str, str]:
    """Each layer's buffer kind: ``kv/<attention backend>[/<CPU ISA>][/window<W>]``. What a block holds
    depends on the kernel, and which blocks move on the window, so two instances that differ in either must
    not exchange blocks: the handshake compares kinds."""
    import torch

    isa = ""
    if any(t.device.type == "cpu" for t in kv_caches.values()):
        isa = "/" + str(torch.backends.cpu.get_cpu_capability())
    context = vllm_config.compilation_config.static_forward_context
    windows = {layer: group.sliding_window for group in groups for layer in group.layer_names}
    kinds: dict[str, str] = {}
    for layer in kv_caches:
        backend = getattr(getattr(context.get(layer), "attn_backend", None), "get_name", lambda: "unknown")()
        window = f"/window{windows[layer]}" if windows.get(layer) is not None else ""   # compared too
        kinds[layer] = f"kv/{backend}{isa}{window}"
    return kinds


def _head_parts(vllm_config: VllmConfig, kv_caches: dict[str, Any], cache_dtype: str,
                ) -> dict[str, tuple[tuple[int, int], ...] | None]:
    """Each CPU attention layer's order inside a head's block (``layout.cpu_kernel_parts``), from the ISA
    vLLM's CPU backend chose for it (``layer.isa``, set before the KV cache is registered). Other devices'
    kernels were not read: their layers declare none, and move between equal block sizes only."""
    context = vllm_config.compilation_config.static_forward_context
    parts: dict[str, tuple[tuple[int, int], ...] | None] = {}
    for layer, tensor in kv_caches.items():
        shape = tuple(tensor.shape)
        if tensor.device.type != "cpu" or cache_dtype != "auto" or len(shape) != 4:
            parts[layer] = None
            continue
        isa = getattr(context.get(layer), "isa", None)
        parts[layer] = cpu_kernel_parts(isa, shape[3] // 2, str(tensor.dtype).removeprefix("torch."))
    return parts
