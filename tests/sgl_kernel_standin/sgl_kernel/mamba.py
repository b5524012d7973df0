"""``sgl_kernel.mamba``: imported by SGLang's linear-attention backends on CPU (``gdn_backend``, ``kda_backend``,
``gdn_triton``); none is implemented here, each fails by name when called."""

from __future__ import annotations

from sgl_kernel import not_implemented

chunk_gated_delta_rule_cpu = not_implemented("sgl_kernel.mamba.chunk_gated_delta_rule_cpu")
causal_conv1d_fn_cpu = not_implemented("sgl_kernel.mamba.causal_conv1d_fn_cpu")
causal_conv1d_update_cpu = not_implemented("sgl_kernel.mamba.causal_conv1d_update_cpu")
