"""A deterministic simulator of kvferry's protocol under faults (issue 30).

Part of the library at the ``workload | integrations`` layer: it drives the real protocol cores
(``control.core``'s ``PrefillCore`` and ``DecodeCore``) of several prefills and decodes in one thread, over a
simulated clock, network (ZMQ-like connections: FIFO per connection, cuts, partitions both ways or one way),
transport (writes and reads into real ``KVMemory`` page memory, late, failed, or landing after the writer was
declared dead, with the provenance of every destination page kept) and processes (stalls of any length,
crashes, restarts under a new identity). Every random choice comes from the seed, so any run replays exactly
from it; the invariants (``cluster``) are checked after every step. docs/simulation.md says what and how.
"""

from kvferry.simulation.config import SimConfig, Swarm
from kvferry.simulation.mutations import MUTATIONS, mutation
from kvferry.simulation.runner import RunResult, run_many, run_seed, shrink
from kvferry.simulation.world import Violation

__all__ = ["MUTATIONS", "RunResult", "SimConfig", "Swarm", "Violation", "mutation", "run_many", "run_seed", "shrink"]
