"""Old code against new in one run: ``bench/control.py`` and the V3.2 plan + post, interleaved.

For a change to the control plane (issue 29: the protocol moved into pure cores with I/O shells), the
question is whether the new code is slower than the old one on this machine now. Machine load moves
``bench/control.py``'s p50 by more than the change could, so the two trees run in turn (old, new, old,
new...), each run a fresh pair of processes (``bench/control.py --json --repeats 1``, its prefill spawned
from the same tree), and the medians of each tree's runs are compared.

* ``--old REV``: the git revision of the old code (its ``src`` and ``bench`` are exported to a temporary
  directory with ``git archive``); the new code is this checkout.
* Rows: each of ``bench/control.py``'s (raw NIXL, kvferry push per digest mode), and ``plan+post v32``:
  ``bench/overhead.py``'s ``total_auto`` for the DeepSeek-V3.2 request (512 pages x 183 buffers: plan, the
  transport's checks, page indices; what a write of it costs kvferry before NIXL's ``transfer``).
* Columns: old and new medians, and new / old - 1.

Usage: ``python bench/control_ab.py --old REV [--repeats 5] [--requests 2000] [--digests off,sampled]
[--json]``.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tarfile
import tempfile
from pathlib import Path
from typing import Any

import numpy as np

ROOT = Path(__file__).resolve().parent.parent
ROWS = ("p50_us", "mean_us", "prefill_cpu_us", "decode_cpu_us")


def export(rev: str, into: Path) -> Path:
    """``rev``'s ``src`` and ``bench`` under ``into`` (nothing else of the tree is needed to run them)."""
    data = subprocess.run(["git", "-C", str(ROOT), "archive", "--format=tar", rev, "src", "bench"],
                          check=True, capture_output=True).stdout
    tar = into / "old.tar"
    tar.write_bytes(data)
    with tarfile.open(tar) as t:
        t.extractall(into / "old", filter="data")
    return into / "old"


def run(tree: Path, argv: list[str]) -> Any:
    """One bench command of ``tree``, with that tree's kvferry first on the path; its JSON output."""
    env = {**os.environ, "PYTHONPATH": str(tree / "src")}
    out = subprocess.run([sys.executable, *argv], cwd=tree, env=env, check=True, capture_output=True, text=True)
    return json.loads(out.stdout[out.stdout.index("["):] if argv[0].endswith("control.py") else out.stdout)


def control_rows(tree: Path, args: argparse.Namespace) -> dict[str, dict[str, float]]:
    results = run(tree, ["bench/control.py", "--json", "--repeats", "1", "--requests", str(args.requests),
                         "--digests", args.digests, "--peer-timeout", str(args.peer_timeout)])
    return {r["name"]: {k: r[k] for k in ROWS} for r in results}


def plan_post(tree: Path, args: argparse.Namespace) -> dict[str, dict[str, float]]:
    with tempfile.NamedTemporaryFile(suffix=".json") as f:
        run_json(tree, ["bench/overhead.py", "--repeat", str(args.plan_repeat), "--json", f.name])
        out = json.loads(Path(f.name).read_text())
    case = out["components_us"]["v32_512_pages"]
    return {"plan+post v32": {"p50_us": case["warm"]["total_auto"], "cold_us": case["cold"]["total_auto"]}}


def run_json(tree: Path, argv: list[str]) -> None:
    env = {**os.environ, "PYTHONPATH": str(tree / "src")}
    subprocess.run([sys.executable, *argv], cwd=tree, env=env, check=True, capture_output=True, text=True)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--old", required=True, help="git revision of the old code")
    ap.add_argument("--repeats", type=int, default=5, help="runs of each tree, interleaved")
    ap.add_argument("--requests", type=int, default=2000)
    ap.add_argument("--digests", default="off,sampled")
    ap.add_argument("--peer-timeout", type=float, default=30.0,
                    help="both sides' peer_timeout (high: a loaded machine must not fail a run)")
    ap.add_argument("--plan-repeat", type=int, default=200, help="calls per plan+post figure")
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args()
    runs: dict[str, dict[str, list[dict[str, float]]]] = {"old": {}, "new": {}}
    with tempfile.TemporaryDirectory(prefix="kvferry-ab-") as tmp:
        trees = {"old": export(args.old, Path(tmp)), "new": ROOT}
        for i in range(args.repeats):
            for side in ("old", "new") if i % 2 == 0 else ("new", "old"):
                rows = {**control_rows(trees[side], args), **plan_post(trees[side], args)}
                for name, figures in rows.items():
                    runs[side].setdefault(name, []).append(figures)
                print(f"run {i + 1}/{args.repeats} {side}: done", file=sys.stderr)
    table = []
    for name, old_runs in runs["old"].items():
        new_runs = runs["new"].get(name)
        if not new_runs:
            continue
        row: dict[str, Any] = {"name": name, "repeats": len(old_runs)}
        for key in old_runs[0]:
            old = float(np.median([r[key] for r in old_runs]))
            new = float(np.median([r[key] for r in new_runs]))
            row[key] = {"old": old, "new": new, "new_vs_old": new / old - 1.0}
        table.append(row)
    if args.json:
        print(json.dumps(table, indent=2))
        return 0
    print(f"old = {args.old}, new = this checkout; medians of {args.repeats} runs each, interleaved")
    print(f"{'row':<28}{'figure':<16}{'old':>10}{'new':>10}{'new/old':>10}")
    for row in table:
        for key, v in row.items():
            if isinstance(v, dict):
                print(f"{row['name']:<28}{key:<16}{v['old']:>10.0f}{v['new']:>10.0f}{v['new_vs_old'] * 100:>+9.1f}%")
    return 0


if __name__ == "__main__":
    sys.exit(main())
