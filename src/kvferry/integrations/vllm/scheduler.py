"""The scheduler-side half of kvferry's vLLM connector: which requests move, which blocks, when.

Part of the integrations layer, above ``layout``, below ``connector`` (the class vLLM loads, which
forwards its scheduler hooks here). Plain Python over vLLM's values (request ids, prompt lengths, block
tables as lists), so it runs without vLLM. It never touches memory or sockets: it stages, per engine step,
a ``StepPlan`` that vLLM carries to the worker-side half (``worker``), and learns from the worker's
reports which requests' blocks vLLM may free.

The hand-off, as vLLM's own disaggregated flow does it:

1. Prefill gets the request with ``kv_transfer_params={"do_remote_decode": True}`` and ``max_tokens=1``.
   When it finishes, ``finished`` keeps its blocks (``delay_free``), stages a send of them, and returns
   the transfer parameters (prefill's address, the transfer id, the prompt length) that vLLM puts on the
   request output.
2. Decode gets the same prompt with those parameters. ``matched_tokens`` says every prompt token past
   decode's local prefix-cache hit arrives from outside, asynchronously; ``after_alloc`` stages an announce
   of the blocks vLLM allocated for them, with the hit as the announce's ``prefix``: prefill sent the whole
   prompt's blocks (it cannot know decode's cache), and kvferry moves only those past the prefix. vLLM
   recomputes only the last prompt token itself, to sample from it.

A model with state groups (Mamba) cannot recompute a token: the state would take it in twice. So prefill
holds the prompt's last token back (``hold_back``: it computes ``N - 1`` tokens, its state is the state
after them, final when the request stops), moves those ``N - 1`` tokens' blocks and the state, and decode
computes token ``N`` itself from them, as vLLM's own NixlConnector does for these models.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from kvferry.errors import LayoutError, UsageError
from kvferry.integrations.vllm.layout import (
    GroupSpec,
    by_group,
    decode_pages,
    first_held_tokens,
    group_transfer_id,
    recv_parts,
    request_pages,
    send_parts,
)
from kvferry.integrity.binding import Binding, token_binding

__all__ = ["BINDING_TOKENS", "HELD_BACK_KEY", "RecvSpec", "SchedulerSide", "SendSpec", "StepPlan", "missing_handoff",
           "transfer_params"]

# The keys kvferry adds to a request's kv_transfer_params (the rest are vLLM's own PD conventions).
ADDRESS_KEY = "kvferry_address"
ADDRESSES_KEY = "kvferry_addresses"   # prefill's TP ranks' addresses, in rank order (only when TP > 1)
TRANSFER_ID_KEY = "kvferry_request_id"
NUM_TOKENS_KEY = "remote_num_tokens"
SKIPPED_KEY = "kvferry_not_sent"   # why prefill sent nothing (decode then prefills the request itself)
# Per KV cache group, the first prompt token prefill still holds (a request moved per group: layout.by_group)
FIRST_TOKENS_KEY = "kvferry_first_tokens"
# Prefill's own mark on a request whose last prompt token it held back (a model with state groups).
HELD_BACK_KEY = "kvferry_held_back"
# Tokens per binding entry (integrity.binding), whatever either side's block size.
BINDING_TOKENS = 16
# Tests only: a request whose params carry this key is announced unbound, on a decode whose extra config sets
# ``unbound_for_tests`` (the negative control of tests/test_vllm.py: the swap it refuses, served).
UNBOUND_KEY = "kvferry_unbound_for_tests"


@dataclass(frozen=True, slots=True)
class SendSpec:
    """Prefill: write ``pages`` (pool -> block ids, in token order) of ``request_id`` once decode announces.
    A request moved per KV cache group (``layout.by_group``) has a send per group: ``transfer_id`` names
    the group's transfer, ``offset`` (pool -> block index) where its pages begin in the request."""

    request_id: str
    pages: Mapping[str, Sequence[int]]
    binding: Binding | None = None   # the prompt's tokens (integrity.binding): decode must announce the same
    transfer_id: str = ""            # the kvferry request id; "" for ``request_id``
    offset: Mapping[str, int] = field(default_factory=dict)

    @property
    def kvferry_id(self) -> str:
        return self.transfer_id or self.request_id


@dataclass(frozen=True, slots=True)
class RecvSpec:
    """Decode: lease ``pages`` of vLLM request ``request_id`` to transfer ``transfer_id`` from ``address``;
    ``prefix``: per pool, the leading pages of prefill's list decode's prefix cache already holds."""

    request_id: str
    transfer_id: str
    address: str
    pages: Mapping[str, Sequence[int]]
    prefix: Mapping[str, int] = field(default_factory=dict)
    addresses: tuple[str, ...] = ()   # prefill's TP group (rank order) when it runs more than one rank
    binding: Binding | None = None    # the prompt's tokens, compared by prefill with its own before any write

    @property
    def prefill_ranks(self) -> tuple[str, ...]:
        """Every prefill rank's address, in rank order (one: prefill runs TP 1)."""
        return self.addresses or (self.address,)


@dataclass(frozen=True, slots=True)
class StepPlan:
    """What the worker-side half does at the next engine step."""

    sends: tuple[SendSpec, ...] = ()
    recvs: tuple[RecvSpec, ...] = ()
    aborts: tuple[str, ...] = ()   # decode request ids whose transfer must stop (vLLM aborted them)
    failures: tuple[tuple[str, str], ...] = ()   # decode (request id, why): KV promised to vLLM, cannot come
    issues: tuple[str, ...] = ()   # prefill request ids whose transfer params this step's output may hand out
    # decode: (transfer id, prefill's ranks, why) of hand-offs it declined: prefill frees their blocks now
    cancels: tuple[tuple[str, tuple[str, ...], str], ...] = ()


def transfer_params(address: str, transfer_id: str, num_tokens: int,
                    addresses: Sequence[str] = ()) -> dict[str, Any]:
    """The ``kv_transfer_params`` prefill returns, which the client passes on to decode unchanged. With
    prefill at TP > 1, ``addresses`` lists every rank's endpoint (rank 0's is ``address``): each decode rank
    connects to the ranks holding its heads (``DecodeEndpoint.connect_all``)."""
    params = {"do_remote_prefill": True, "do_remote_decode": False, ADDRESS_KEY: address,
              TRANSFER_ID_KEY: transfer_id, NUM_TOKENS_KEY: num_tokens}
    if len(addresses) > 1:
        params[ADDRESSES_KEY] = list(addresses)
    return params


@dataclass
class SchedulerSide:
    """Per-engine scheduler state. ``address`` is this instance's prefill endpoint (None on a decode-only
    instance, or until the workers report it through vLLM's handshake metadata)."""

    groups: tuple[GroupSpec, ...]
    address: str | None = None
    addresses: tuple[str, ...] = ()   # every TP rank's prefill endpoint, in rank order (TP > 1)
    unbound_for_tests: bool = False   # honour UNBOUND_KEY (WorkerConfig.unbound_for_tests)
    tp_size: int = 1                  # this instance's TP size (state moves across TP sizes too)
    _issues: list[str] = field(default_factory=list)
    _sends: list[SendSpec] = field(default_factory=list)
    _recvs: list[RecvSpec] = field(default_factory=list)
    _aborts: list[str] = field(default_factory=list)
    _failures: list[tuple[str, str]] = field(default_factory=list)
    _cancels: list[tuple[str, tuple[str, ...], str]] = field(default_factory=list)
    _loading: set[str] = field(default_factory=set)     # decode: announce staged, not yet reported back
    _holding: set[str] = field(default_factory=set)     # blocks vLLM keeps until the worker reports them
    _taken: set[str] = field(default_factory=set)       # decode: KV already asked for, never twice
    unhanded_requests: int = 0   # decode-only: requests that came without a kvferry hand-off (``unhanded``)

    @property
    def backoff(self) -> int:
        """Prompt tokens prefill holds back and decode computes: 1 with state groups (see the module's
        docstring), else 0 (decode recomputes the last token over KV that holds it already)."""
        return 1 if any(group.state for group in self.groups) else 0

    def remote_tokens(self, num_prompt_tokens: int) -> int:
        """The prompt tokens whose KV (and state) prefill moves: all but the held-back ones; 0 when the
        prompt is no longer than those (prefill then sends nothing)."""
        return max(0, num_prompt_tokens - self.backoff)

    # -- prefill ---------------------------------------------------------------------------------------
    def hold_back(self, params: dict[str, Any] | None, num_prompt_tokens: int, has_token_ids: bool) -> bool:
        """vLLM's ``on_new_request``, prefill: whether to take the prompt's last ``backoff`` tokens off a
        request that hands its KV to a decode (the caller shortens the request); marks ``params`` so a
        preempted request, seen again, is not shortened twice, and so ``finished`` knows it was."""
        if not (self.backoff and params and params.get("do_remote_decode")) or params.get(HELD_BACK_KEY):
            return False
        if self.address is None:
            return False   # no prefill endpoint here: the request is served whole, as ``finished`` does
        if not has_token_ids or self.remote_tokens(num_prompt_tokens) < 1:
            return False   # nothing to hold back from (or embeddings): ``finished`` sends nothing
        params[HELD_BACK_KEY] = True
        return True

    # -- decode ----------------------------------------------------------------------------------------
    def unhanded(self, request_id: str, params: Mapping[str, Any] | None, num_prompt_tokens: int) -> str | None:
        """A decode-only instance (``kv_consumer``) got a request that carries no hand-off from a kvferry
        prefill: vLLM computes its whole prompt here, and nothing else says so (the client's answer is the
        same, only slower). The warning to log, on the 1st, 10th, 100th, ... such request, else None."""
        why = missing_handoff(params)
        if why is None:
            return None
        self.unhanded_requests += 1
        count = self.unhanded_requests
        if str(count).rstrip("0") != "1":   # 1, 10, 100, ...: the first says it, the rest say it goes on
            return None
        return (f"kvferry decode: request {request_id} came with {why}: this instance computes its "
                f"{num_prompt_tokens} prompt tokens itself, none arrive from a prefill ({count} so far on this "
                "instance). The router in front did not hand it off from a kvferry prefill; behind smg, register "
                'the vLLM workers with "kv_connector": "NixlConnector" (docs/deploy.md). Expected only where '
                "this instance serves some requests whole on purpose.")

    def matched_tokens(self, request_id: str, num_prompt_tokens: int, params: Mapping[str, Any] | None,
                       num_computed_tokens: int) -> tuple[int, bool]:
        """vLLM's ``get_num_new_matched_tokens``: every prompt token of a remote-prefilled request past
        ``num_computed_tokens`` (decode's local prefix-cache hit, whole blocks) comes from prefill, loaded
        asynchronously."""
        if not _wants_remote_prefill(params) or request_id in self._taken:
            return 0, False   # asked once: a preempted request recomputes here, prefill's copy is gone
        if params is None:
            raise UsageError('kvferry connector: the request carries no kvferry transfer parameters')
        remote = self.remote_tokens(num_prompt_tokens)
        if int(params.get(NUM_TOKENS_KEY, -1)) != remote or remote < 1:
            return 0, False
        if num_computed_tokens >= remote:
            return 0, False   # vLLM's hit stops short of the last prompt token: not reached
        why = self._declined(params, remote, num_computed_tokens)
        if why is not None:   # decode computes the prompt itself, and prefill frees its blocks now
            self._taken.add(request_id)
            self._cancels.extend((tid, _prefill_ranks(params), why) for tid in self.transfer_ids(params))
            return 0, False
        return remote - num_computed_tokens, True

    def _declined(self, params: Mapping[str, Any], remote: int, held: int) -> str | None:
        """Why decode cannot take prefill's KV of ``remote`` tokens past its hit of ``held``, or None.
        Decode's recompute of the last token reads a block its own vLLM freed (``GroupSpec.transferable``:
        one prompt length in a block size); or, per group, decode's first non-null block begins before the
        first token prefill still holds (a prefill of smaller blocks than decode's frees some of what
        decode's first window block holds: ``first_held_tokens``)."""
        if not all(group.transferable(remote) for group in self.groups):
            return f"decode's sliding window needs a block its vLLM frees at {remote} tokens"
        if not by_group(self.groups):
            return None
        theirs = params.get(FIRST_TOKENS_KEY)
        if not (isinstance(theirs, list) and len(theirs) == len(self.groups)
                and all(isinstance(t, int) and not isinstance(t, bool) for t in theirs)):
            return f"prefill's {FIRST_TOKENS_KEY} {theirs!r} does not name {len(self.groups)} KV cache groups"
        for index, (mine, first) in enumerate(zip(first_held_tokens(self.groups, remote), theirs)):
            if first > max(mine, held):
                return (f"KV cache group {index}: decode's blocks hold tokens from {max(mine, held)} on, prefill "
                        f"freed those before token {first} ({remote} prompt tokens)")
        return None

    def transfer_ids(self, params: Mapping[str, Any]) -> list[str]:
        """The kvferry transfers of a hand-off: one, or one per group (``layout.by_group``)."""
        tid = str(params[TRANSFER_ID_KEY])
        if not by_group(self.groups):
            return [tid]
        return [group_transfer_id(tid, index, len(self.groups)) for index in range(len(self.groups))]

    def after_alloc(self, request_id: str, params: Mapping[str, Any] | None, block_ids: Sequence[Sequence[int]],
                    num_external_tokens: int, prompt_token_ids: Sequence[int] | None = None) -> None:
        """vLLM's ``update_state_after_alloc``: stage the announce of the blocks decode lacks for the worker.
        ``block_ids`` are the request's whole block tables; those under decode's local hit (the prompt
        less ``num_external_tokens``) hold KV already, and may be shared with running requests: they are
        the announce's prefix, never written. The announce is bound to ``prompt_token_ids``.

        Prefill: a request that will hand its KV to a decode is issued now, in the step that computes it,
        so the worker's endpoint knows the id before vLLM can return its transfer params; an announce for
        any other id is refused at once (``EndpointOptions.refuse_unissued``)."""
        if params and params.get("do_remote_decode") and self.address is not None:
            self._issues.extend(self.transfer_ids({TRANSFER_ID_KEY: request_id}))
        if num_external_tokens <= 0 or not _wants_remote_prefill(params) or request_id in self._taken:
            return
        if params is None:
            raise UsageError('kvferry connector: the request carries no kvferry transfer parameters')
        self._loading.add(request_id)
        self._taken.add(request_id)
        num_tokens = int(params.get(NUM_TOKENS_KEY, num_external_tokens))
        ranks = params.get(ADDRESSES_KEY) or ()
        try:
            announces = self._announces(params, block_ids, num_tokens, num_tokens - num_external_tokens)
        except LayoutError as exc:   # vLLM waits for this KV now: the worker reports it failed
            self._failures.append((request_id, str(exc)))
            return
        unbound = self.unbound_for_tests and bool(params.get(UNBOUND_KEY))
        tokens = None if prompt_token_ids is None else prompt_token_ids[:num_tokens]   # prefill's, held back
        binding = None if unbound else self._binding(request_id, tokens)
        self._recvs.extend(RecvSpec(request_id, tid, str(params[ADDRESS_KEY]), pages, prefix,
                                    tuple(str(a) for a in ranks), binding) for tid, pages, prefix in announces)

    def _announces(self, params: Mapping[str, Any], block_ids: Sequence[Sequence[int]], num_tokens: int,
                   held: int) -> list[tuple[str, dict[str, list[int]], dict[str, int]]]:
        """(transfer id, pages, prefix) of each announce of a request: one, or one per group (``by_group``:
        a group's prefix is the block its part begins at, past the hit and past its freed blocks)."""
        if not by_group(self.groups):
            pages, prefix = decode_pages(block_ids, self.groups, num_tokens, held)
            return [(str(params[TRANSFER_ID_KEY]), pages, prefix)]
        parts = recv_parts(block_ids, self.groups, num_tokens, held)
        return [(tid, {part.pool: list(part.pages)}, {part.pool: part.first})
                for tid, part in zip(self.transfer_ids(params), parts)]

    def _binding(self, request_id: str, prompt_token_ids: Sequence[int] | None) -> Binding | None:
        """The prompt's binding, in ``BINDING_TOKENS`` (not vLLM's blocks: prefill and decode may run
        different block sizes, and both must state the same entries), named by this side's request id; None
        without the tokens (an unbound hand-off)."""
        if prompt_token_ids is None:
            return None
        return token_binding(prompt_token_ids, BINDING_TOKENS, label=request_id)

    # -- both ------------------------------------------------------------------------------------------
    def finished(self, request_id: str, params: Mapping[str, Any] | None, block_ids: Sequence[Sequence[int]],
                 num_computed_tokens: int, completed: bool,
                 prompt_token_ids: Sequence[int] | None = None) -> tuple[bool, dict[str, Any] | None]:
        """vLLM's ``request_finished``: whether vLLM must keep the blocks, and the params to return.

        Decode, aborted while its KV was still arriving: stop the transfer and keep the blocks until the
        worker reports that no write can land in them any more. Prefill, ``completed`` (stopped or at its
        length, not aborted): keep the blocks until decode has them, and hand out the transfer params; the
        send is bound to ``prompt_token_ids``.
        """
        self._taken.discard(request_id)
        if request_id in self._loading:
            self._aborts.append(request_id)
            self._holding.add(request_id)
            return True, None
        if not params or not params.get("do_remote_decode") or not completed or self.address is None:
            return False, None
        try:
            if self.backoff and not params.get(HELD_BACK_KEY):
                raise LayoutError("a prompt of state groups whose last token prefill did not hold back (one token, "
                                  "or embeddings): decode could not compute it over the state")
            if not all(group.transferable(num_computed_tokens) for group in self.groups):
                raise LayoutError(f"a sliding window's first block is freed at {num_computed_tokens} tokens")
            sends = self._send_specs(request_id, block_ids, num_computed_tokens, prompt_token_ids)
        except LayoutError as exc:   # nothing to send: decode, finding no address, prefills the request
            return False, {"do_remote_prefill": False, "do_remote_decode": False, SKIPPED_KEY: str(exc)}
        self._sends.extend(sends)
        self._holding.add(request_id)
        out = transfer_params(self.address, request_id, num_computed_tokens, self.addresses)
        if by_group(self.groups):
            out[FIRST_TOKENS_KEY] = first_held_tokens(self.groups, num_computed_tokens)
        return True, out

    def _send_specs(self, request_id: str, block_ids: Sequence[Sequence[int]], num_tokens: int,
                    prompt_token_ids: Sequence[int] | None) -> list[SendSpec]:
        """The request's sends: its whole page list, or one per group from its first kept block (``by_group``)."""
        binding = self._binding(request_id, prompt_token_ids)
        if not by_group(self.groups):
            return [SendSpec(request_id, request_pages(block_ids, self.groups, num_tokens), binding)]
        parts = send_parts(block_ids, self.groups, num_tokens)
        return [SendSpec(request_id, {part.pool: list(part.pages)}, binding, part.transfer_id(request_id, len(parts)),
                         {part.pool: part.first}) for part in parts]

    def take_plan(self) -> StepPlan:
        """vLLM's ``build_connector_meta``: what was staged since the last step, handed over once."""
        plan = StepPlan(tuple(self._sends), tuple(self._recvs), tuple(self._aborts), tuple(self._failures),
                        tuple(self._issues), tuple(self._cancels))
        self._sends, self._recvs, self._aborts, self._failures, self._issues = [], [], [], [], []
        self._cancels = []
        return plan

    def on_worker_output(self, finished_sending: Sequence[str], finished_recving: Sequence[str]) -> None:
        """vLLM's ``update_connector_output``: requests the worker is done with (vLLM frees their blocks)."""
        for request_id in (*finished_sending, *finished_recving):
            self._holding.discard(request_id)
            self._loading.discard(request_id)

    def has_pending_work(self) -> bool:
        """Whether vLLM must keep stepping: staged work, or blocks held for a transfer still in flight."""
        return bool(self._sends or self._recvs or self._aborts or self._failures or self._issues or self._cancels
                    or self._holding)


def missing_handoff(params: Mapping[str, Any] | None) -> str | None:
    """What a decode's request lacks to receive its KV from a kvferry prefill, or None: it has kvferry's
    hand-off, or its prefill said why it sent none (``SKIPPED_KEY``: decode prefills it, as planned)."""
    if not params:
        return "no kv_transfer_params"
    if _wants_remote_prefill(params) or SKIPPED_KEY in params:
        return None
    if params.get("do_remote_prefill"):
        return f"another connector's kv_transfer_params (keys {sorted(params)}, no {ADDRESS_KEY})"
    return f"kv_transfer_params that ask for no remote prefill (keys {sorted(params)})"


def _prefill_ranks(params: Mapping[str, Any]) -> tuple[str, ...]:
    """Prefill's TP group's addresses, in rank order, from a hand-off's params."""
    return tuple(str(a) for a in params.get(ADDRESSES_KEY) or (params[ADDRESS_KEY],))


def _wants_remote_prefill(params: Mapping[str, Any] | None) -> bool:
    return bool(params) and bool(params.get("do_remote_prefill")) and ADDRESS_KEY in params  # type: ignore[operator]
