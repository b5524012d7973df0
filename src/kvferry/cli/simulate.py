"""``kvferry simulate``: the deterministic simulator over many seeds, or one seed replayed with its trace.

A command module, above ``args`` and ``simulation``, below ``main``. ``--seeds N`` runs seeds ``S .. S+N-1``
(``--seed S``, default 0) and prints one line per violation and a summary with the throughput reached
(simulated requests per minute of CPU time); ``--seed S`` alone replays that seed and prints its trace.
``--json`` prints one JSON object instead (the totals, the figure, and each violation with its replay line).
Exit status: 0 when no invariant broke, 1 otherwise, 2 on usage errors.
"""

from __future__ import annotations

import argparse
import sys
import time
from collections import Counter
from collections.abc import Iterable
from dataclasses import dataclass, field, replace

from kvferry.cli.args import emit_json, positive_int, progress_bar
from kvferry.simulation import MUTATIONS, RunResult, SimConfig, run_seed, shrink
from kvferry.simulation.config import FAULT_KINDS, PAGE_PAIRS
from kvferry.simulation.tp import TP_PAIRS, TP_SIZES, WIDE_PAIRS

__all__ = ["add_parser", "run_simulate"]


def add_parser(subparsers: argparse._SubParsersAction) -> None:
    """Register ``kvferry simulate`` (handler ``run_simulate``)."""
    p = subparsers.add_parser(
        "simulate", help="explore the protocol under faults in a deterministic simulator, seed by seed",
        description="Run the real prefill and decode protocol cores in one thread over a simulated clock, "
                    "network, transport and processes, with faults drawn from each seed, checking the "
                    "invariants after every step (docs/simulation.md). A failure prints its seed, the invariant "
                    "and a trace; --seed S alone replays seed S exactly.")
    p.add_argument("--seeds", type=positive_int, default=None, metavar="N", help="run N seeds from --seed on")
    p.add_argument("--seed", type=int, default=0, metavar="S", help="the first seed, or the one to replay")
    p.add_argument("--steps", type=int, default=0, metavar="K",
                   help="at most K events per seed (default: until rest; a capped run skips the at-rest check)")
    p.add_argument("--requests", type=positive_int, default=SimConfig().requests, metavar="R",
                   help=f"requests per seed (default {SimConfig().requests})")
    p.add_argument("--no-faults", action="store_true", help="no faults: the protocol's happy paths only")
    p.add_argument("--tp", type=_tp_pair, default=None, metavar="P:D",
                   help=f"every group at prefill TP P and decode TP D, each one of {', '.join(map(str, TP_SIZES))} "
                        f"(default: drawn per seed among {_pairs(TP_PAIRS)}, or see --wide-tp)")
    p.add_argument("--wide-tp", type=_share, default=SimConfig().wide_tp, metavar="SHARE",
                   help=f"the share of seeds (0 to 1) drawing a pair with TP 4 or 8 instead, weighted to TP 4: "
                        f"{_pairs(WIDE_PAIRS)} (default 0: every seed draws as it always did, and at any share "
                        "the other seeds still do; a wide seed's replay line names its pair)")
    p.add_argument("--page-sizes", type=_page_pair, default=None, metavar="TS:TD",
                   help="every node at TP 1 with the kv pool at TS tokens per page on prefill and TD on decode "
                        f"(default: drawn for a share of the seeds among {_pairs(PAGE_PAIRS)}, see --page-share)")
    p.add_argument("--page-share", type=_share, default=SimConfig().page_share, metavar="SHARE",
                   help=f"the share of seeds (0 to 1, default {SimConfig().page_share}) whose kv pool differs in "
                        "page size between prefill and decode (TP 1:1; its replay line names the pair); seeds "
                        "given --tp draw none")
    p.add_argument("--state-share", type=_share, default=SimConfig().state_share, metavar="SHARE",
                   help=f"the share of seeds (0 to 1, default {SimConfig().state_share}) at a TP pair other than 1:1 "
                        "whose layouts also hold a state pool (Mamba2- and GDN-like channel sections sliced across "
                        "TP); 1:1 seeds, page-size seeds included, never do")
    p.add_argument("--mutate", choices=sorted(MUTATIONS), default=None,
                   help="switch on a known bug (docs/simulation.md): the run should find it")
    p.add_argument("--without", action="append", choices=FAULT_KINDS, default=[], metavar="KIND",
                   help=f"switch a fault kind off in each seed's draw (repeatable; what --shrink prints): "
                        f"{', '.join(FAULT_KINDS)}")
    p.add_argument("--shrink", action="store_true", help="shrink a failure: fewer requests and faults, same invariant")
    p.add_argument("--trace", type=int, default=30, metavar="L", help="trace lines printed for a failure")
    p.add_argument("--json", action="store_true",
                   help="print one JSON object (totals, the figure, each violation with its replay line)")
    p.set_defaults(handler=run_simulate)


def _pairs(pairs: Iterable[tuple[int, int]]) -> str:
    return ", ".join(f"{a}:{b}" for a, b in pairs)


def _tp_pair(text: str) -> tuple[int, int]:
    try:
        pair = tuple(int(x) for x in text.split(":"))
    except ValueError:
        pair = ()
    if len(pair) != 2 or not all(size in TP_SIZES for size in pair):
        raise argparse.ArgumentTypeError(f"expected P:D, each one of {', '.join(map(str, TP_SIZES))}, got {text!r}")
    return pair  # type: ignore[return-value]


def _page_pair(text: str) -> tuple[int, int]:
    try:
        pair = tuple(int(x) for x in text.split(":"))
    except ValueError:
        pair = ()
    if len(pair) != 2 or not all(size > 0 and size % 16 == 0 for size in pair):
        raise argparse.ArgumentTypeError(f"expected TS:TD, tokens per page each a multiple of 16, got {text!r}")
    return pair  # type: ignore[return-value]


def _share(text: str) -> float:
    try:
        share = float(text)
    except ValueError:
        share = -1.0
    if not 0.0 <= share <= 1.0:
        raise argparse.ArgumentTypeError(f"expected a share from 0 to 1, got {text!r}")
    return share


# What each of ``FAULT_KINDS`` counts, as the summary names it.
FAULT_LABELS = {
    "spike": "messages delayed by a spike", "cut_rate": "connections cut", "partition_rate": "partitions",
    "data_partition": "of them holding the data path too", "stall_rate": "stalls", "stall_post": "stalls in a post",
    "crash_rate": "crashes", "transfer_fail": "transfers failed or refused", "slow_transfer": "transfers late",
    "prefill_abort": "prefill aborts", "decode_abort": "decode aborts", "cancel": "cancels",
    "retry": "retries under the same id", "starve_rate": "starvations",
    "fabric_rate": "data paths cut alone (messages still flowing)",
    "oneway": "one way only", "duplicate": "messages copied",
    "stall_read": "stops inside a read's post (the rest of the iteration on resume)",
    "skip_chunk": "chunks a prefill engine skipped (page-size seeds)",
}


# Counted among the partitions, in brackets after them.
_OF_PARTITIONS = ("data_partition", "oneway")


def describe_faults(faults: Counter[str]) -> str:
    """``faults`` (by ``FAULT_KINDS``' names) in that order, each with its label; the kinds of partition (the
    data path held too, one way only) in brackets after the partitions."""
    parts = []
    for kind in FAULT_KINDS:
        if kind in _OF_PARTITIONS or not faults[kind]:
            continue
        part = f"{faults[kind]:,} {FAULT_LABELS[kind]}"
        if kind == "partition_rate":
            of = [f"{faults[k]:,} {FAULT_LABELS[k]}" for k in _OF_PARTITIONS if faults[k]]
            if of:
                part += f" ({', '.join(of)})"
        parts.append(part)
    return ", ".join(parts)


def _violation(result: RunResult, trace: int) -> dict[str, object]:
    v = result.violation
    assert v is not None
    return {"seed": result.seed, "invariant": v.invariant, "time": v.time, "detail": v.detail,
            "faults": result.swarm.describe(), "replay": result.replay_command(),
            "requests": result.config.requests, "without": list(result.without),
            "trace": list(result.trace[-trace:]) if trace > 0 else []}


def _report(result: RunResult, trace: int) -> None:
    v = result.violation
    assert v is not None
    print(f"seed {result.seed}: invariant {v.invariant} broken at t={v.time:.5f}: {v.detail}")
    print(f"  faults: {result.swarm.describe()}")
    print(f"  replay: {result.replay_command()}")
    for line in result.trace[-trace:]:
        print("  " + line)


@dataclass
class _Totals:
    """What the summary lines add up over the seeds run."""

    requests: int = 0
    events: int = 0
    done: int = 0
    failed: int = 0
    disagree: int = 0
    sim_time: float = 0.0
    split: int = 0
    held: int = 0
    timed_out: int = 0
    partial: int = 0
    on_wire: int = 0
    failures: int = 0
    state: int = 0   # seeds whose layouts held the state pool
    pairs: Counter[tuple[int, int]] = field(default_factory=Counter)
    # Per pair, the requests run and their seeds' CPU time: a request at TP P:D runs on P + D rank cores
    pair_requests: Counter[tuple[int, int]] = field(default_factory=Counter)
    pair_cpu: Counter[tuple[int, int]] = field(default_factory=Counter)
    faults: Counter[str] = field(default_factory=Counter)

    def add(self, r: RunResult) -> None:
        self.requests += r.requests
        self.events += r.events
        self.sim_time += r.sim_time
        self.done += r.done
        self.failed += r.failed
        self.disagree += r.disagreements
        self.split += r.split
        self.held += r.held
        self.timed_out += r.timed_out
        self.partial += r.partial
        self.on_wire += r.on_wire
        self.failures += not r.ok
        self.state += r.state
        self.pairs[r.tp] += 1
        self.pair_requests[r.tp] += r.requests
        self.pair_cpu[r.tp] += r.cpu_s
        self.faults.update(dict(r.faults))

    def to_dict(self, seeds: range, cpu: float) -> dict[str, object]:
        """What ``print`` says, as one JSON-ready object (pairs as ``"P:D"`` keys)."""
        def by_pair(counter: Counter[tuple[int, int]]) -> dict[str, float]:
            return {f"{a}:{b}": counter[(a, b)] for a, b in sorted(counter)}

        return {
            "seeds": {"first": seeds.start, "count": len(seeds)}, "seeds_with_violation": self.failures,
            "requests": self.requests, "done": self.done, "failed": self.failed,
            "done_on_decode_failed_on_prefill": self.disagree, "events": self.events,
            "simulated_seconds": self.sim_time, "cpu_seconds": cpu, "seeds_with_state_pool": self.state,
            "requests_per_minute": self.requests / cpu * 60, "seeds_by_pair": by_pair(self.pairs),
            "requests_per_minute_by_pair": {f"{a}:{b}": self.pair_requests[(a, b)] / max(self.pair_cpu[(a, b)], 1e-9)
                                            * 60 for a, b in sorted(self.pairs)},
            "group_attempts_split": self.split, "faults": dict(self.faults),
            "messages_held_on_wire": self.on_wire,
            "transfers_held": {"held": self.held, "timed_out": self.timed_out, "partial": self.partial},
        }

    def print(self, seeds: range, cpu: float) -> None:
        n = len(seeds)
        print(f"{n} seed{'s' * (n != 1)} ({seeds.start}..{seeds.stop - 1}), {self.failures} with a violation; "
              f"{self.requests} requests (on decode {self.done} generations DONE, {self.failed} FAILED, retries "
              f"counted apart; {self.disagree} DONE on decode but FAILED on prefill), {self.events} events, "
              f"{self.sim_time:.1f} s simulated in {cpu:.2f} s CPU: "
              f"{self.requests / cpu * 60:,.0f} simulated requests per minute")
        # The four pairs always (the line as it was), then any other pair that ran, in the order of TP_SIZES
        pairs = self.pairs
        shown = [*TP_PAIRS, *sorted(pair for pair in pairs if pair not in TP_PAIRS)]
        print("seeds per (prefill TP, decode TP): " + ", ".join(f"{a}:{b} {pairs[(a, b)]}" for a, b in shown)
              + f"; {self.split} decode group attempts DONE on one rank and FAILED on another (counted, not a "
              "violation)")
        if self.state:
            print(f"seeds with a state pool (channel sections sliced across TP): {self.state} of {n}")
        ran = [pair for pair in shown if pairs[pair]]
        if len(ran) > 1:
            print("simulated requests per minute by pair (a request runs on P + D rank cores): " + ", ".join(
                f"{a}:{b} {self.pair_requests[(a, b)] / max(self.pair_cpu[(a, b)], 1e-9) * 60:,.0f}" for a, b in ran))
        if self.faults:
            print("faults injected: " + describe_faults(self.faults))
        if self.on_wire:
            print(f"messages on the wire when a partition began, held until its heal: {self.on_wire}")
        if self.held:
            print(f"transfers held by a partitioned data path: {self.held}, {self.timed_out} of them timed out (the "
                  f"rest went on after the heal); in {self.partial} part had crossed before the path went")


def run_simulate(args: argparse.Namespace) -> int:
    cfg = replace(SimConfig(), requests=args.requests, max_events=max(0, args.steps), faults=not args.no_faults,
                  tp=args.tp, wide_tp=args.wide_tp, page_sizes=args.page_sizes, page_share=args.page_share,
                  state_share=args.state_share)
    seeds = range(args.seed, args.seed + (args.seeds or 1))
    start = time.process_time()
    totals = _Totals()
    violations: list[dict[str, object]] = []
    # Drawn only at each seed's end: no refresh thread, whose CPU time would enter the figure printed
    with progress_bar(enabled=len(seeds) > 1 and sys.stderr.isatty() and not args.json, total=len(seeds),
                      label="seeds", auto_refresh=False) as tick:
        for i, seed in enumerate(seeds):
            result = run_seed(seed, cfg, mutate=args.mutate, trace=max(args.trace, 200), without=tuple(args.without))
            totals.add(result)
            if not result.ok:
                if args.shrink:
                    result = shrink(result, args.mutate)
                    if not args.json:
                        print(f"seed {result.seed}: shrunk to {result.config.requests} requests, without "
                              f"{', '.join(result.without) or 'no fault kind'}")
                if args.json:
                    violations.append(_violation(result, args.trace))
                else:
                    _report(result, args.trace)
            if tick is not None:
                tick(i + 1, len(seeds))
    cpu = max(time.process_time() - start, 1e-9)
    if args.json:
        emit_json({**totals.to_dict(seeds, cpu), "mutation": args.mutate, "violations": violations})
    else:
        totals.print(seeds, cpu)
    return 1 if totals.failures else 0
