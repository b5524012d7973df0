"""Engine adapters (SGLang, vLLM): an engine's buffers and page tables in kvferry's terms; above ``control``."""
