"""kvferry as SGLang's disaggregation transfer backend (``--disaggregation-transfer-backend kvferry``).

Above ``control``, beside ``workload``. ``kvferry.integrations.sglang.layout`` turns SGLang's ``KVArgs`` into
a kvferry layout without importing SGLang; ``conn`` (the manager, sender, receiver and bootstrap server)
and ``plugin`` (the entry point SGLang's ``load_plugins()`` runs) import SGLang, so this package imports
neither eagerly: ``import kvferry`` never imports SGLang. See docs/sglang.md.
"""

from __future__ import annotations


def register() -> None:
    """SGLang plugin entry point (group ``sglang.srt.plugins``, name ``kvferry``)."""
    from kvferry.integrations.sglang.plugin import register as _register

    _register()


__all__ = ["register"]
