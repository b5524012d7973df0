"""A stand-in for ``sgl_kernel`` (SGLang's compiled kernel package), for SGLang on a CPU-only test machine.

SGLang 0.5.23 imports ``sgl_kernel`` at module import on its CPU path (``mem_cache/allocation.py`` takes
``assign_req_to_token_pool_cpu`` and ``kernels/ops/kvcache/cache_move.py`` ``copy_all_layer_kv_cache_cpu``
when ``is_cpu()``), so no SGLang server starts without a module of that
name. PyPI has no CPU wheel and no sdist of it. This package is the project's own, written from SGLang's
call sites: the helpers SGLang's CPU path calls for the models the tests run, in plain torch, and, for
the other names SGLang's CPU path imports from it (here and in ``sgl_kernel.mamba``), a function that
raises ``NotImplementedError`` naming the op when called. A test whose server reaches a real kernel fails
loudly instead of running something else. Names SGLang imports only behind a probe
(``try: from sgl_kernel... except ImportError``) are absent, so SGLang takes the fallback it takes
without sgl_kernel. ``torch.ops.sgl_kernel.*`` (the AMX path) is not registered:
SGLang takes it only on CPUs with AMX, and a call there fails in torch, naming the op.

Installed into .venv-sglang by scripts/setup-sglang.sh (a ``.pth`` line); see docs/sglang.md.
"""

from __future__ import annotations

import ctypes
from typing import Any

import torch

__version__ = "0.0.0+kvferry.standin"
STANDIN = True


def assign_req_to_token_pool_cpu(req_pool_indices: torch.Tensor, req_to_token: torch.Tensor,
                                 start_offset: torch.Tensor, end_offset: torch.Tensor,
                                 out_cache_loc: torch.Tensor, pool_len: int) -> None:
    """``req_to_token[req_pool_indices[i], start_offset[i]:end_offset[i]]`` takes request ``i``'s run of
    ``out_cache_loc`` (the runs back to back, in batch order): what SGLang's Triton kernel
    ``assign_req_to_token_pool`` does on GPUs (``mem_cache/allocation.py``)."""
    del pool_len   # the row length; indexing the tensor bounds the writes already
    pos = 0
    for req, start, end in zip(req_pool_indices.tolist(), start_offset.tolist(), end_offset.tolist()):
        n = int(end) - int(start)
        req_to_token[int(req), int(start):int(end)] = out_cache_loc[pos:pos + n].to(req_to_token.dtype)
        pos += n


def copy_all_layer_kv_cache_cpu(data_ptrs: torch.Tensor, strides: torch.Tensor, tgt_loc: torch.Tensor,
                                src_loc: torch.Tensor) -> None:
    """In every KV buffer (``data_ptrs[b]``, rows of ``strides[b]`` bytes), copy row ``src_loc[i]`` to row
    ``tgt_loc[i]``: what SGLang's Triton kernel ``copy_all_layer_kv_cache_tiled`` does on GPUs
    (``sglang/kernels/ops/kvcache/cache_move.py``; SGLang moves KV slots with it)."""
    pairs = list(zip(tgt_loc.tolist(), src_loc.tolist()))
    for ptr, stride in zip(data_ptrs.tolist(), strides.tolist()):
        base, row = int(ptr), int(stride)
        for tgt, src in pairs:
            ctypes.memmove(base + int(tgt) * row, base + int(src) * row, row)


def not_implemented(qualname: str) -> Any:
    """A function that raises ``NotImplementedError`` naming the op ``qualname`` when called."""
    def op(*args: Any, **kwargs: Any) -> Any:
        raise NotImplementedError(
            f"{qualname}: an sgl_kernel op the project's CPU stand-in does not implement (SGLang called it; "
            "this CPU-only test environment has no real sgl_kernel, see docs/sglang.md)")
    op.__name__ = op.__qualname__ = qualname.rsplit(".", 1)[1]
    op.__module__ = qualname.rsplit(".", 1)[0]
    return op


# Names SGLang 0.5.23 imports from sgl_kernel on its CPU path (gated on is_cpu()) that the tested models do
# not call: they import, and fail by name if called. Any other name is absent (AttributeError, ImportError
# for ``from sgl_kernel import x``), so SGLang's own probes (``try: from sgl_kernel... except ImportError``)
# take the fallback they take on a machine without sgl_kernel.
# layers/attention/intel_amx_backend.py (the AMX attention backend, not taken without AMX)
build_draft_decode_metadata_cpu = not_implemented("sgl_kernel.build_draft_decode_metadata_cpu")
# kernels/ops/speculative/*.py (speculative decoding: EAGLE, multi-layer EAGLE, tree verification), imported
# at start-up by the model runner; the tests run no draft model.
rotate_input_ids_cpu = not_implemented("sgl_kernel.rotate_input_ids_cpu")
fill_accept_out_cache_loc_cpu = not_implemented("sgl_kernel.fill_accept_out_cache_loc_cpu")
fill_bonus_tokens_cpu = not_implemented("sgl_kernel.fill_bonus_tokens_cpu")
assign_draft_cache_locs_contiguous_cpu = not_implemented("sgl_kernel.assign_draft_cache_locs_contiguous_cpu")
assign_extend_cache_locs_cpu = not_implemented("sgl_kernel.assign_extend_cache_locs_cpu")
build_tree_kernel_efficient_cpu = not_implemented("sgl_kernel.build_tree_kernel_efficient_cpu")
verify_tree_greedy_cpu = not_implemented("sgl_kernel.verify_tree_greedy_cpu")
