"""Engine integrations: adapters that drive kvferry's endpoints from an inference engine's hooks.

Above ``control`` (the endpoints) and everything below it; beside ``workload``; below the benchmark suite
and ``cli``. An adapter turns what the engine registers into a ``Layout`` and ``KVMemory``, maps the engine's
block ids to pages, and reports failures the way the engine expects. Engine packages (``vllm``, ``sglang``, ``torch``)
are imported only inside the adapter modules that need them, and nothing here is imported by
``import kvferry``.

* ``vllm``: vLLM's KV connector, ``KVFerryConnector`` (``kv_connector_module_path="kvferry.integrations.vllm"``):
  ``layout`` (vLLM's KV tensors and block tables as kvferry layouts and page lists), ``scheduler`` / ``worker``
  (the connector's two halves, plain Python over kvferry's endpoints), ``proxy`` (``kvferry vllm-proxy``) and
  ``connector`` (the class vLLM loads, the only module importing vLLM).
* ``sglang``: a transfer backend for SGLang's disaggregation, loaded as an SGLang plugin
  (``SGLANG_PLUGINS=kvferry``, ``--disaggregation-transfer-backend kvferry``).
"""
