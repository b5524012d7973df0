"""Token bindings (issue 31): a hand-off serves only the prompt it was computed for.

Both sides state which tokens a request's KV is computed from; prefill refuses a difference before any byte
moves, on both sides, naming both requests and the first block that differs. In-process (local transport)
here; ``test_a_swap_between_two_processes_over_nixl`` runs the same over NIXL between two processes.
"""

from __future__ import annotations

import time

import numpy as np
import pytest

from kvferry import Binding, BindingMismatch, KVMemory, RequestFailed, UnknownRequest, UsageError, token_binding
from kvferry.control import DecodeEndpoint, EndpointOptions, PrefillEndpoint, RequestState, wire
from kvferry.integrity.binding import check_binding, mismatch

from .control_peer import fill, make_layout, snapshot

OPTS = EndpointOptions(heartbeat_interval=0.2, peer_timeout=5.0, lease_grace=0.4, request_timeout=20.0)
BLOCK = 64   # tokens per block: the "main" pool's tokens_per_page in control_peer's layout
PROMPT_A = list(range(100, 100 + 3 * BLOCK - 6))           # 186 tokens: 3 blocks, the last partial
PROMPT_B = [*PROMPT_A[:2 * BLOCK], 7, *PROMPT_A[2 * BLOCK + 1:]]   # same length, differs in block 2 only


# -- the pure part ------------------------------------------------------------------------------------
def test_token_binding_is_chained_per_block_and_names_the_first_difference() -> None:
    a, b = token_binding(PROMPT_A, BLOCK, "A"), token_binding(PROMPT_B, BLOCK, "B")
    assert len(a.blocks) == 3 and all(len(entry) == 16 for entry in a.blocks)
    assert a.blocks[:2] == b.blocks[:2] and a.blocks[2] != b.blocks[2]
    assert mismatch(a, b)[0] == 2 and mismatch(a, a) is None
    # Chained: a change in block 0 changes every later entry (the KV of a page depends on every token before).
    c = token_binding([0, *PROMPT_A[1:]], BLOCK)
    assert all(x != y for x, y in zip(a.blocks, c.blocks, strict=True))
    # A shorter prompt with the same first blocks: the extra block is named.
    assert mismatch(a, token_binding(PROMPT_A[:2 * BLOCK], BLOCK)) == (
        2, "block 2 is stated by one side only (decode states 3 blocks, prefill 2)")
    err = check_binding("t1", a, b)
    assert isinstance(err, BindingMismatch)
    assert "decode's request 'A'" in str(err) and "prefill's request 'B'" in str(err) and "block 2 differs" in str(err)
    assert check_binding("t1", a, None) is None and check_binding("t1", None, b) is None   # unbound: not checked
    with pytest.raises(UsageError, match="block 1"):
        Binding((b"x", b""))
    with pytest.raises(UsageError, match="block_tokens"):
        token_binding(PROMPT_A, 0)


def test_the_binding_travels_in_the_announce() -> None:
    bound = token_binding(PROMPT_A, BLOCK, "cmpl-A")
    msg = wire.decode(wire.encode(wire.Announce("t", 1, {}, {}, *wire.binding_fields(bound))))
    assert wire.announced_binding(msg) == bound
    assert wire.announced_binding(wire.decode(wire.encode(wire.Announce("t", 1, {})))) is None
    assert wire.PROTOCOL_VERSION >= 7   # the binding came with protocol 7


# -- the endpoints (local transport) -------------------------------------------------------------------
def _pair() -> tuple[KVMemory, KVMemory]:
    src, dst = KVMemory.allocate(make_layout("prefill")), KVMemory.allocate(make_layout("decode"))
    fill(src, 11)
    fill(dst, 999)
    return src, dst


def _idle(decode: DecodeEndpoint, prefill: PrefillEndpoint) -> None:
    """Nothing leaked: no live request, lease or handle on either side, nothing held (the leak check)."""
    deadline = time.monotonic() + 5
    while (decode.num_live_leases or prefill.counters()["live_requests"]) and time.monotonic() < deadline:
        time.sleep(0.005)   # prefill's requests end at decode's verdict, a message after decode's
    d, p = decode.counters(), prefill.counters()
    assert (d["live_requests"], d["live_leases"], d["live_handles"]) == (0, 0, 0), d
    assert (p["live_requests"], p["live_handles"], p["source_holds"]) == (0, 0, 0), p


@pytest.mark.parametrize("order", ["announce_first", "send_first"])
def test_a_swapped_hand_off_is_refused_on_both_sides_before_any_byte_moves(order: str) -> None:
    """Decode announces transfer ``a`` for its request B (other tokens): both sides fail it with a
    ``BindingMismatch`` naming both requests and block 2, decode's pages keep their bytes, nothing stays
    leased or held; the matching request beside it moves and verifies."""
    src, dst = _pair()
    before = snapshot(dst)
    with PrefillEndpoint(src, "local", options=OPTS) as prefill, DecodeEndpoint(dst, "local", options=OPTS) as decode:
        decode.connect(prefill.address)
        prefill.ended()
        pairs = {"a": ([1, 2, 3], [10, 11, 12], token_binding(PROMPT_B, BLOCK, "decode-B"),
                       token_binding(PROMPT_A, BLOCK, "prefill-A")),
                 "ok": ([4, 5, 6], [20, 21, 22], token_binding(PROMPT_A, BLOCK, "decode-A"),
                        token_binding(PROMPT_A, BLOCK, "prefill-A2"))}
        for rid, (s, d, dbind, pbind) in pairs.items():
            if order == "announce_first":
                decode.announce(rid, {"main": d}, binding=dbind)
                time.sleep(0.05)   # the announce reaches prefill before its send
                prefill.send(rid, {"main": s}, binding=pbind)
            else:
                prefill.send(rid, {"main": s}, binding=pbind)
                time.sleep(0.05)
                decode.announce(rid, {"main": d}, binding=dbind)
        decode.wait("ok", timeout=5)
        prefill.wait("ok", timeout=5)
        for side in (decode, prefill):
            with pytest.raises(RequestFailed) as info:
                side.wait("a", timeout=5)
            cause = info.value.__cause__
            assert isinstance(cause, BindingMismatch), cause
            text = str(cause)
            assert "transfer 'a'" in text and "'decode-B'" in text and "'prefill-A'" in text, text
            assert "block 2 differs" in text, text
            assert side.poll("a") is RequestState.FAILED
        for buf in dst.layout.pool("main").buffers:
            assert np.array_equal(dst.array(buf.name)[[20, 21, 22]], src.array(buf.name)[[4, 5, 6]])
            assert np.array_equal(dst.array(buf.name)[[10, 11, 12]], before[buf.name][[10, 11, 12]])
        _idle(decode, prefill)
        assert not prefill.holds_source("a")


def test_unbound_sides_still_work_and_prefix_and_chunks_compare_whole_requests() -> None:
    """A side that states no binding is not checked (the documented loss); with both bound, a decode prefix
    hit and a chunked send move and verify as before."""
    src, dst = _pair()
    with PrefillEndpoint(src, "local", options=OPTS) as prefill, DecodeEndpoint(dst, "local", options=OPTS) as decode:
        decode.connect(prefill.address)
        decode.announce("unbound-decode", {"main": [30, 31]})
        prefill.send("unbound-decode", {"main": [1, 2]}, binding=token_binding(PROMPT_A[:100], BLOCK))
        decode.announce("unbound-prefill", {"main": [32, 33]}, binding=token_binding(PROMPT_B[:100], BLOCK))
        prefill.send("unbound-prefill", {"main": [3, 4]})
        whole = token_binding(PROMPT_A, BLOCK)
        decode.announce("prefix", {"main": [40]}, prefix=2 * BLOCK, binding=whole)      # holds blocks 0-1
        prefill.send("prefix", {"main": [5, 6, 7]}, binding=whole)
        decode.announce("chunked", {"main": [50, 51, 52]}, binding=whole)
        prefill.send("chunked", {"main": [8]}, last=False, binding=whole)
        prefill.send("chunked", {"main": [9, 10]}, offset=1)                 # later chunks need not repeat it
        for rid in ("unbound-decode", "unbound-prefill", "prefix", "chunked"):
            decode.wait(rid, timeout=5)
        for buf in dst.layout.pool("main").buffers:
            assert np.array_equal(dst.array(buf.name)[[40]], src.array(buf.name)[[7]])
            assert np.array_equal(dst.array(buf.name)[[50, 51, 52]], src.array(buf.name)[[8, 9, 10]])
        with pytest.raises(UsageError, match="a binding differing"):
            prefill.send("late", {"main": [1]}, last=False, binding=whole)
            prefill.send("late", {"main": [2]}, offset=1, binding=token_binding(PROMPT_B, BLOCK))
        prefill.abort("late")
        _idle(decode, prefill)


# -- "never issued" against "not yet" (EndpointOptions.refuse_unissued) --------------------------------
STRICT = EndpointOptions(heartbeat_interval=0.2, peer_timeout=5.0, lease_grace=0.4, request_timeout=20.0,
                         refuse_unissued=True)


def test_an_announce_for_an_id_prefill_never_issued_fails_at_once() -> None:
    """With ``refuse_unissued`` prefill tells "never issued" from "not yet": an announce for an id it never
    issued nor sent, or one it already served (a replay), fails on both sides within a message, named
    (``UnknownRequest``), not at request_timeout (20 s here); an issued id still waits for its send, and
    one sent before its announce is served as ever. Without the option the unknown id waits."""
    src, dst = _pair()
    with (PrefillEndpoint(src, "local", options=STRICT) as prefill,
          DecodeEndpoint(dst, "local", options=OPTS) as decode):
        decode.connect(prefill.address)
        started = time.monotonic()
        decode.announce("forged", {"main": [1, 2]})
        with pytest.raises(RequestFailed) as info:
            decode.wait("forged", timeout=5)
        assert time.monotonic() - started < 1.0
        assert isinstance(info.value.__cause__, UnknownRequest), info.value.__cause__
        assert "request 'forged'" in str(info.value.__cause__) and "never issued it" in str(info.value.__cause__)
        prefill.issue("issued")
        decode.announce("issued", {"main": [3, 4]})
        time.sleep(0.1)
        assert decode.poll("issued") is not RequestState.FAILED        # not yet: it waits for the send
        prefill.send("issued", {"main": [5, 6]})
        prefill.send("sent-first", {"main": [7]})
        decode.announce("sent-first", {"main": [8]})
        decode.wait("issued", timeout=5)
        decode.wait("sent-first", timeout=5)
        for buf in dst.layout.pool("main").buffers:
            assert np.array_equal(dst.array(buf.name)[[3, 4, 8]], src.array(buf.name)[[5, 6, 7]])
        prefill.wait("issued", timeout=5)
        decode.announce("issued", {"main": [9, 10]})                  # a replay of a served request
        with pytest.raises(RequestFailed, match="served it already"):
            decode.wait("issued", timeout=5)
        _idle(decode, prefill)
    src, dst = _pair()
    with PrefillEndpoint(src, "local", options=OPTS) as prefill, DecodeEndpoint(dst, "local", options=OPTS) as decode:
        decode.connect(prefill.address)
        decode.announce("forged", {"main": [1, 2]})
        time.sleep(0.2)
        assert decode.poll("forged") is not RequestState.FAILED       # off: it waits for a send
        decode.abort("forged")
        _idle(decode, prefill)


def test_the_sglang_plugin_binds_the_sender_and_receiver_sglang_creates() -> None:
    """SGLang hands its transfer classes a room, never the request: the plugin's hooks around the two places
    it creates them bind kvferry's sender and receiver to ``req.origin_input_ids`` (other backends' objects,
    which have no ``bind_tokens``, are left alone). Stand-ins here; test_sglang checks the hooks install."""
    from types import SimpleNamespace

    from kvferry.integrations.sglang.plugin import create_receiver_around, create_sender_around

    bound: list[tuple[list[int], str]] = []
    transfer = SimpleNamespace(bind_tokens=lambda ids, label: bound.append((ids, label)))
    req = SimpleNamespace(origin_input_ids=[5, 6, 7], rid="rid-1", disagg_kv_sender=transfer)
    assert create_sender_around(lambda queue, r, heads: True, "queue", req, 2) is True
    decode_req = SimpleNamespace(kv_receiver=transfer)
    assert create_receiver_around(lambda queue, r, is_rebootstrap=False: decode_req, "queue", req) is decode_req
    assert bound == [([5, 6, 7], "rid-1"), ([5, 6, 7], "rid-1")]
    other = SimpleNamespace(origin_input_ids=[1], rid="x", disagg_kv_sender=object())
    assert create_sender_around(lambda queue, r, heads: False, "queue", other, 2) is False
