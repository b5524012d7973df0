"""Run-time patches for SGLang servers in the tests (tests/sglang_servers.py puts this directory first on
PYTHONPATH of the servers that need one, with the switch below set). Nothing in site-packages is edited;
each patch applies when SGLang imports the module it changes.

``KVFERRY_TEST_NIXL_DRAM=1``: SGLang 0.5.23's NIXL backend registers KV as ``"VRAM"`` whatever the device;
on a machine without a GPU, UCX refuses that (``NIXL_ERR_BACKEND``). Every memory kind this process hands
NIXL's agent is mapped VRAM -> DRAM, so SGLang's own address arithmetic runs unchanged on host memory.

``KVFERRY_TEST_MLA_ABSORBED=1``: SGLang picks an MLA model's attention method per backend
(``AttentionBackendRegistry`` in ``models/deepseek_common/attention_backend_handler.py``). ``torch_native``
(the attention backend on a CPU without AMX) has no entry there, so it gets the Triton handler, which runs a
prompt without cached prefix through the MHA method; ``torch_native`` then attends over the latent cache
buffers (kv_lora_rank + rope dims) with MHA-sized queries and fails. Registering ``torch_native`` to the
absorbed MLA method, the one SGLang already uses for every decode step and every prompt with a cached
prefix, lets a DeepSeek-V2-style model run on CPU.

``KVFERRY_TEST_ROLL_DECODE_PAGES=1``: a forced bug, for showing tests/test_sglang_server_page_sizes.py can
fail. kvferry's ``PageSizePlanner.spans`` (prefill's chunks mapped by token into decode's pages at another
page size) hands back each span with decode's pages rolled by one: tokens land in the wrong decode pages.
"""

from __future__ import annotations

import importlib.abc
import importlib.machinery
import os
import sys
from collections.abc import Callable
from typing import Any


def _dram(value: Any) -> Any:
    return "DRAM" if value == "VRAM" else value


def _patch_nixl(package: Any) -> None:
    nixl_agent = sys.modules["nixl._api"].nixl_agent   # the package aliases its wheel's (nixl_cu13) _api
    for name in ("register_memory", "deregister_memory", "get_xfer_descs", "get_reg_descs", "prep_xfer_dlist"):
        original = getattr(nixl_agent, name)

        def wrapped(self: Any, *a: Any, _original: Any = original, **kw: Any) -> Any:
            return _original(self, *[_dram(x) if isinstance(x, str) else x for x in a],
                             **{k: _dram(v) if isinstance(v, str) else v for k, v in kw.items()})

        setattr(nixl_agent, name, wrapped)


def _patch_mla(module: Any) -> None:
    module.AttentionBackendRegistry.register("torch_native", module._dispatch_mla_subtype)


class _AfterImport(importlib.abc.MetaPathFinder):
    """Runs ``patch(module)`` right after ``name`` is first imported."""

    def __init__(self, name: str, patch: Callable[[Any], None]) -> None:
        self.name, self.patch = name, patch

    def find_spec(self, fullname: str, path: Any, target: Any = None) -> importlib.machinery.ModuleSpec | None:
        if fullname != self.name:
            return None
        sys.meta_path.remove(self)
        spec = importlib.machinery.PathFinder.find_spec(fullname, path)
        if spec is None or spec.loader is None:
            return spec
        exec_module, patch = spec.loader.exec_module, self.patch

        def exec_and_patch(module: Any) -> None:
            exec_module(module)
            patch(module)

        spec.loader.exec_module = exec_and_patch  # type: ignore[method-assign]
        return spec


def _patch_page_size_planner(module: Any) -> None:
    import numpy as np

    spans = module.PageSizePlanner.spans

    def rolled(self: Any, *a: Any, **kw: Any) -> Any:
        out = spans(self, *a, **kw)
        return {pool: module.TokenSpan(s.src_pages, np.roll(np.asarray(s.dst_pages), 1), s.src_first, s.dst_first,
                                       s.start, s.stop) for pool, s in out.items()}

    module.PageSizePlanner.spans = rolled


if os.environ.get("KVFERRY_TEST_NIXL_DRAM") == "1":
    sys.meta_path.insert(0, _AfterImport("nixl", _patch_nixl))
if os.environ.get("KVFERRY_TEST_MLA_ABSORBED") == "1":
    sys.meta_path.insert(0, _AfterImport("sglang.srt.models.deepseek_common.attention_backend_handler", _patch_mla))
if os.environ.get("KVFERRY_TEST_ROLL_DECODE_PAGES") == "1":
    sys.meta_path.insert(0, _AfterImport("kvferry.plan.tokens", _patch_page_size_planner))
