"""How fast the simulator finds each of its mutations: seeds and CPU seconds to the first find.

Each mutation of ``kvferry.simulation.mutations`` (a bug class patched into the real cores) is switched on and
seeds are run in order from ``--start`` (each seed's own draw, as ``kvferry simulate`` runs it) until one breaks
an invariant. A row gives the seed that found it, how many seeds that took (counting it), the CPU seconds they
took (``time.process_time``, this process), and the invariant broken; a mutation not found within
``--max-seeds``, or found by an invariant it is not expected to break (``mutations.EXPECTED``), fails the run.

Usage: ``python bench/mutation_finds.py [--start S] [--max-seeds N] [--mutation NAME ...]``. Prints a Markdown
table, then a line per failure. Exit status 0 when every mutation asked for was found by an expected
invariant, 1 otherwise. Figures: docs/simulation.md ("Mutations: time to the first find").
"""

from __future__ import annotations

import argparse
import time
from dataclasses import dataclass

from kvferry.simulation.mutations import EXPECTED, MUTATIONS
from kvferry.simulation.runner import run_seed


@dataclass(frozen=True, slots=True)
class Find:
    """One mutation's search: the seed that found it (None: none did), seeds run, CPU seconds, invariant."""

    name: str
    seed: int | None
    seeds: int
    cpu_s: float
    invariant: str | None

    @property
    def ok(self) -> bool:
        return self.invariant is not None and self.invariant in EXPECTED[self.name]


def first_find(name: str, start: int, max_seeds: int) -> Find:
    """Seeds from ``start`` with ``name`` switched on, until the first violation or ``max_seeds`` seeds."""
    t0 = time.process_time()
    for n, seed in enumerate(range(start, start + max_seeds), 1):
        result = run_seed(seed, mutate=name)
        if result.violation is not None:
            return Find(name, seed, n, time.process_time() - t0, result.violation.invariant)
    return Find(name, None, max_seeds, time.process_time() - t0, None)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--start", type=int, default=0, help="first seed (default 0, where make test's search starts)")
    ap.add_argument("--max-seeds", type=int, default=200, help="give up on a mutation after this many seeds")
    ap.add_argument("--mutation", action="append", choices=sorted(MUTATIONS), default=[],
                    help="only these (repeatable; default: every mutation)")
    args = ap.parse_args()
    finds = [first_find(name, args.start, args.max_seeds) for name in (args.mutation or sorted(MUTATIONS))]
    print("| mutation | found at seed | seeds run | CPU s | invariant |")
    print("|---|---|---|---|---|")
    for f in finds:
        print(f"| `{f.name}` | {'-' if f.seed is None else f.seed} | {f.seeds} | {f.cpu_s:.2f} | "
              f"{f.invariant or 'not found'} |")
    bad = [f for f in finds if not f.ok]
    for f in bad:
        why = (f"not found in {f.seeds} seeds from {args.start}" if f.seed is None
               else f"found by {f.invariant}, expected one of {list(EXPECTED[f.name])}")
        print(f"FAILED {f.name}: {why}")
    print(f"{len(finds) - len(bad)} of {len(finds)} mutations found, "
          f"{sum(f.cpu_s for f in finds):.2f} s of CPU in all")
    return 1 if bad else 0


if __name__ == "__main__":
    raise SystemExit(main())
