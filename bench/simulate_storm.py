"""Every fault at once: seeds whose swarm draws every fault kind at a high rate, over wide TP pairs too.

``kvferry simulate`` draws each seed's swarm so that most seeds stay plausible (a fault kind off in some,
rare in most) and TP 4 and 8 only where asked. This script is the other end, for an exploration between
rounds: each seed draws every rate of ``Swarm`` from a wide range at once (partitions several a second,
stalls of up to 2 s, copies of up to a tenth of the frames, pull, chunked and layer-by-layer sends), and its
TP pair from a list that includes 4:4, 2:4, 4:1, 8:4 and 1:8. A seed's run is the simulator's own
(``run_seed``), so a violation prints its invariant and the end of its trace, and the same seed here
replays it exactly.

Usage: ``python bench/simulate_storm.py START COUNT [--mutation NAME]`` (seeds START..START+COUNT-1;
``--mutation``: one of ``kvferry.simulation.mutations.MUTATIONS`` patched in, to see the storm find it).
Exit status 1 when a seed broke an invariant. Figures: docs/simulation.md ("Explorations").
"""

from __future__ import annotations

import argparse
import random
import time

from kvferry.simulation.config import SimConfig, Swarm
from kvferry.simulation.mutations import MUTATIONS
from kvferry.simulation.runner import run_seed

PAIRS = [(1, 1), (1, 2), (2, 1), (2, 2), (4, 4), (2, 4), (4, 1), (8, 4), (1, 8)]


def storm(r: random.Random) -> Swarm:
    """A swarm with every fault kind on, each at a rate drawn from a wide range."""
    u, pick = r.uniform, r.choice
    return Swarm(
        delay_max=pick([0.002, 0.01]), spike=u(0, 0.1), spike_max=pick([0.2, 0.6]),
        cut_rate=u(0, 2), partition_rate=u(0, 3), partition_max=pick([0.3, 1.5]),
        stall_rate=u(0, 1.5), stall_max=pick([0.3, 1.0, 2.0]), stall_post=u(0, 0.1),
        crash_rate=u(0, 0.5), transfer_fail=u(0, 0.1), slow_transfer=u(0, 0.3), slow_max=pick([0.3, 1.0]),
        prefill_abort=u(0, 0.3), decode_abort=u(0, 0.3), cancel=u(0, 0.1), retry=u(0, 0.8),
        pull=pick([0.0, 0.5, 1.0]), chunked=u(0, 1), layered=u(0, 0.5), prefix=u(0, 0.6),
        digest=pick(["off", "sampled", "full"]), zmtp=r.random() < 0.5,
        starve_rate=u(0, 1), starve_max=pick([0.3, 1.0]), data_partition=u(0, 1),
        fabric_rate=u(0, 2), fabric_max=pick([0.3, 1.5]), oneway=u(0, 0.6),
        duplicate=u(0, 0.1), duplicate_max=pick([0.0, 0.1, 0.5]))


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("start", type=int)
    ap.add_argument("count", type=int)
    ap.add_argument("--mutation", choices=sorted(MUTATIONS))
    args = ap.parse_args()
    bad = requests = 0
    t0 = time.process_time()
    for seed in range(args.start, args.start + args.count):
        r = random.Random(seed * 7919)   # the swarm's own stream, apart from the run's
        sw = storm(r)
        tp = r.choice(PAIRS)
        cfg = SimConfig(tp=tp, requests=96 if max(tp) >= 4 else 192)
        res = run_seed(seed, cfg, swarm=sw, mutate=args.mutation, trace=30)
        requests += res.requests
        if res.violation is not None:
            bad += 1
            v = res.violation
            print(f"seed {seed} tp {tp[0]}:{tp[1]}: {v.invariant} at {v.time:.6f} s: {v.detail}", flush=True)
            # Not ``res.replay_command()``: ``kvferry simulate`` would draw the seed's own swarm, not this one
            again = f" --mutation {args.mutation}" if args.mutation else ""
            print(f"  replay: python bench/simulate_storm.py {seed} 1{again}", flush=True)
            print("\n".join(res.trace), flush=True)
    print(f"storm {args.start}..{args.start + args.count - 1}: {bad} with a violation, {requests} requests, "
          f"{time.process_time() - t0:.0f} s CPU", flush=True)
    return 1 if bad else 0


if __name__ == "__main__":
    raise SystemExit(main())
