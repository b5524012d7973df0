"""Old code against new in one run: ``kvferry simulate`` on the same seeds, the two trees in turn.

For a speed change to the simulator or the protocol cores it runs (issue 30), the question is how many
more simulated requests a CPU minute the new tree gets on this machine now. CPU time of the same run moves
by a third from one run to the next here, so the trees run alternately (old, new, old, new...), each run a
fresh process, and the medians are compared. A pure speed change must also leave every run as it was: the
summary line's counts (requests, DONE, FAILED, events, simulated time) of the two trees are compared and
any difference is reported.

* ``--old REV``: the git revision of the old code (its ``src`` exported with ``git archive``, as
  ``control_ab.py`` does); the new code is this checkout.
* ``--seeds N --seed S [--tp P:D]``: what each run simulates (``kvferry simulate``'s options).

Usage: ``python bench/simulate_ab.py --old REV [--rounds 3] [--seeds 60] [--seed 7000] [--tp 1:1] [--json]``.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
from control_ab import ROOT, export  # a sibling script (bench is not a package)

RATE = re.compile(r"in ([0-9.]+) s CPU: ([0-9,]+) simulated requests per minute")
SUMMARY = re.compile(r"^(\d+ seeds .*?events)", re.MULTILINE)   # the counts, up to the event total


def run(tree: Path, args: argparse.Namespace) -> dict[str, Any]:
    """One ``kvferry simulate`` of ``tree`` (its kvferry first on the path): CPU seconds, requests per
    minute, and the summary's counts."""
    argv = ["simulate", "--seeds", str(args.seeds), "--seed", str(args.seed)] + (["--tp", args.tp] if args.tp else [])
    code = "import sys; from kvferry.cli import main; sys.argv = ['kvferry', *sys.argv[1:]]; sys.exit(main())"
    env = {**os.environ, "PYTHONPATH": str(tree / "src")}
    out = subprocess.run([sys.executable, "-c", code, *argv], cwd=tree, env=env, capture_output=True, text=True)
    if out.returncode != 0:
        raise SystemExit(f"{tree}: kvferry simulate exited {out.returncode}:\n{out.stdout}{out.stderr}")
    rate, summary = RATE.search(out.stdout), SUMMARY.search(out.stdout)
    assert rate is not None and summary is not None, out.stdout
    return {"cpu_s": float(rate.group(1)), "per_min": int(rate.group(2).replace(",", "")),
            "summary": summary.group(1)}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--old", required=True, help="git revision of the old code")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--seeds", type=int, default=60)
    p.add_argument("--seed", type=int, default=7000)
    p.add_argument("--tp", default=None, help="P:D for every seed (default: drawn per seed)")
    p.add_argument("--json", action="store_true")
    args = p.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        trees = {"old": export(args.old, Path(tmp)), "new": ROOT}
        runs: dict[str, list[dict[str, Any]]] = {"old": [], "new": []}
        for _ in range(args.rounds):
            for name, tree in trees.items():
                runs[name].append(run(tree, args))
    medians = {name: statistics.median(r["per_min"] for r in rs) for name, rs in runs.items()}
    same = {r["summary"] for rs in runs.values() for r in rs}
    report = {"old": args.old, "seeds": args.seeds, "seed": args.seed, "tp": args.tp or "drawn",
              "per_min": {name: [r["per_min"] for r in rs] for name, rs in runs.items()},
              "median_per_min": medians, "new_over_old": medians["new"] / medians["old"],
              "same_runs": len(same) == 1, "summaries": sorted(same)}
    if args.json:
        print(json.dumps(report, indent=2))
        return
    print(f"kvferry simulate --seeds {args.seeds} --seed {args.seed} --tp {report['tp']}, {args.rounds} rounds, "
          "trees alternated (simulated requests per CPU minute)")
    for name in ("old", "new"):
        print(f"  {name:>3} ({args.old if name == 'old' else 'this checkout'}): "
              f"{', '.join(f'{x:,}' for x in report['per_min'][name])}  median {medians[name]:,.0f}")
    print(f"  new / old: {report['new_over_old']:.2f}x; the runs themselves "
          f"{'are the same in both trees' if report['same_runs'] else 'DIFFER: ' + ' | '.join(sorted(same))}")


if __name__ == "__main__":
    main()
