"""The same benchmark on an older commit and on this tree, side by side in one run, with ratios.

    .venv/bin/python scripts/bench_compare.py --before REV [--rounds 1] [--which utilization,gateway]
        [--utilization-args "--clis pi --cli-sessions 8"] [--gateway-args "--concurrency 8,64 --rounds 1"]

REV is checked out as a git worktree in a temporary directory; both trees run on this
checkout's .venv (PYTHONPATH puts each tree's package first, so every process a bench starts,
mitmdump and the node included, imports that tree's code). The arms alternate A B B A
(before, after, after, before: a machine that slows down or speeds up during the run weighs
on both arms alike), and the figures are pooled per arm:

- bench_utilization: sessions per minute of each arm of its table, and the INIT per session
  medians (workspace copy, image cached);
- bench_gateway: polar's calls/s at each concurrency (from its --out JSON), and plain
  mitmdump's for reference.

The targets of issue 41: sessions/min and calls/s within 5%, INIT per session within +50 ms.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shlex
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PY = str(ROOT / ".venv" / "bin" / "python")


def run(tree: Path, script: str, args: list[str]) -> str:
    env = {**os.environ, "PYTHONPATH": str(tree)}
    done = subprocess.run([PY, str(tree / "scripts" / script), *args], cwd=tree, env=env, capture_output=True,
                          text=True, timeout=3600)
    if done.returncode not in (0, 1):
        raise SystemExit(f"{script} in {tree} failed (exit {done.returncode}):\n{done.stdout[-3000:]}"
                         f"\n{done.stderr[-3000:]}")
    return done.stdout


def utilization_figures(out: str) -> dict[str, float]:
    """{figure: value} from bench_utilization's printed tables."""
    figs: dict[str, float] = {}
    for line in out.splitlines():
        m = re.match(r"^(.{28}) +([\d.]+)s +[\d.]+s +[\d.]+s +[\d.]+s$", line)
        if m:
            figs[f"INIT median: {m.group(1).strip()} (s)"] = float(m.group(2))
            continue
        m = re.match(r"^(.{58}) (\S+)\s+(\d+)/(\d+)\s+([\d.]+)s\s+([\d.]+)", line)
        if m:
            figs[f"sessions/min: {m.group(1).strip()} [{m.group(2)}]"] = float(m.group(6))
    return figs


def gateway_figures(tree: Path, args: list[str]) -> dict[str, float]:
    with tempfile.NamedTemporaryFile(suffix=".json", delete=False) as f:
        out = f.name
    run(tree, "bench_gateway.py", [*args, "--out", out])
    raw = json.loads(Path(out).read_text())
    os.unlink(out)
    figs: dict[str, list[float]] = {}
    for r in raw.get("results", raw if isinstance(raw, list) else []):
        if r.get("config") in ("polar", "plain") and "calls_per_s" in r:
            figs.setdefault(f"calls/s: {r['config']} at {r['concurrency']} clients", []).append(r["calls_per_s"])
    return {k: statistics.mean(v) for k, v in figs.items()}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--before", required=True, help="the commit to compare against")
    ap.add_argument("--rounds", type=int, default=1, help="A B B A rounds")
    ap.add_argument("--which", default="utilization,gateway")
    ap.add_argument("--utilization-args", default="--clis pi --cli-sessions 8")
    ap.add_argument("--gateway-args", default="--concurrency 8,64 --rounds 1")
    args = ap.parse_args()
    which = [w for w in args.which.split(",") if w]
    with tempfile.TemporaryDirectory(prefix="polar-bench-before-") as d:
        before = Path(d) / "tree"
        subprocess.run(["git", "-C", str(ROOT), "worktree", "add", "--detach", "-q", str(before), args.before],
                       check=True)
        try:
            pooled: dict[str, dict[str, list[float]]] = {"before": {}, "after": {}}
            for _ in range(args.rounds):
                for arm in ("before", "after", "after", "before"):
                    tree = before if arm == "before" else ROOT
                    figs: dict[str, float] = {}
                    if "utilization" in which:
                        figs.update(utilization_figures(run(tree, "bench_utilization.py",
                                                            shlex.split(args.utilization_args))))
                    if "gateway" in which:
                        figs.update(gateway_figures(tree, shlex.split(args.gateway_args)))
                    for k, v in figs.items():
                        pooled[arm].setdefault(k, []).append(v)
                    print(f"{arm}: {len(figs)} figures", file=sys.stderr, flush=True)
        finally:
            subprocess.run(["git", "-C", str(ROOT), "worktree", "remove", "--force", str(before)], check=False)
    keys = sorted(set(pooled["before"]) & set(pooled["after"]))
    print(f"before: {args.before}; after: this tree; {args.rounds} round(s) of A B B A, means per arm")
    print(f"{'figure':72} {'before':>9} {'after':>9} {'after/before':>12}")
    for k in keys:
        b, a = statistics.mean(pooled["before"][k]), statistics.mean(pooled["after"][k])
        ratio = f"{a / b:.3f}" if b else "-"
        if k.startswith("INIT"):
            ratio = f"{(a - b) * 1000:+.0f} ms"
        print(f"{k:72} {b:9.3f} {a:9.3f} {ratio:>12}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
