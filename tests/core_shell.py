"""What a shell does between two events, for the fake-clock tests that drive a protocol core by hand.

The same order as ``control.endpoints.EndpointBase._step``: the deferred decisions, the batched transfers,
then effects and transfers in the order queued, each transfer checked again by the core (``start``) and
"posted" at ``t`` (no transport: the test settles it when it likes).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Any


def between_events(core: Any, t: float, apply: Callable[[Any], None], start: Callable[[float, Any], Any],
                   posted: Callable[[Any], None], holders: Callable[[Any], Iterable[Any]], *,
                   post: bool = True) -> list[Any]:
    """Carry out what the core queued; return the transfers posted (``post=False``: none, as if the shell
    stalled before posting them)."""
    done: list[Any] = []
    for fn in core.run_calls(t):
        fn()
    core.post_queued()
    while core.effects or (post and core.transfers):
        while core.effects:
            apply(core.effects.popleft())
        if post and core.transfers:
            job = start(t, core.transfers.popleft())
            if job is not None:
                for holder in holders(job):
                    holder.posting = False
                posted(job)
                done.append(job)
    return done
