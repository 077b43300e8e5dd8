"""Where one iteration of the closed loop spends its time, on the demo (Pi on the arithmetic
tasks, the embedded SmolLM2, vLLM on this machine's CPUs):

    .venv/bin/python scripts/bench_loop.py [--iterations 2] [--out DIR] [--backend URL]
    .venv/bin/python scripts/bench_loop.py --read DIR      # a run that is already there

It runs `polar-mitm demo`'s loop (or reads a finished run's database) and prints, per
iteration, rollouts / training / sync (drain, reload, reset) / the rest (bookkeeping: saving the
checkpoint is counted in training) as seconds and shares of the iteration, and checks that
the sync takes at most 5% of it. --compare-staleness runs K=0 (synchronous) and K=1 (the next
iteration's rollouts during training) one after the other and compares iterations per hour.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from polar_mitm.store import query  # noqa: E402

DEMO = Path(__file__).resolve().parents[1] / "polar_mitm" / "demo_tasks"


def run_demo(out: Path, iterations: int, backend: str | None, staleness: int = 0) -> float:
    from polar_mitm.grpo.config import TrainConfig
    from polar_mitm.loop import LoopOptions, run_loop

    t0 = time.monotonic()
    run_loop(LoopOptions(tasks_file=str(DEMO / "arithmetic.jsonl"), iterations=iterations, out=out,
                         harness="pi", samples=4, backend=backend,
                         eval_tasks_file=str(DEMO / "arithmetic_heldout.jsonl"), max_tokens=48,
                         max_staleness=staleness),
             TrainConfig(lr=1e-5))
    return time.monotonic() - t0


def per_hour(out: Path) -> float:
    """Iterations per hour from the first iteration's end to the last's (vLLM's start and
    the first rollouts, the same for any K, left out)."""
    _, rows = query(out / "rollouts.duckdb", "SELECT finished_at FROM loop_iterations ORDER BY iteration")
    if len(rows) < 2:
        return float("nan")
    return (len(rows) - 1) * 3600 / (rows[-1][0] - rows[0][0]).total_seconds()


def report(out: Path, wall: float | None) -> bool:
    cols, rows = query(out / "rollouts.duckdb", "SELECT iteration, rollout_s, train_s, sync_s, sync_drain_s, "
                       "sync_reload_s, sync_reset_s, finished_at FROM loop_iterations ORDER BY iteration")
    if not rows:
        print(f"no iterations in {out}")
        return False
    print(f"{'iter':>4} {'rollouts s':>10} {'training s':>10} {'sync s':>8} {'drain s':>8} {'reload s':>8} "
          f"{'reset s':>8} {'idle s':>7} {'iteration s':>11} {'sync share':>10}")
    ok = True
    last = None
    for it, roll, train, sync, drain, reload, reset, at in rows:
        total = (at - last).total_seconds() if last is not None else roll + train + sync
        idle = max(0.0, total - roll - train - sync)
        share = sync / total if total else 0.0
        ok &= share <= 0.05
        print(f"{it + 1:>4} {roll:>10.1f} {train:>10.1f} {sync:>8.2f} {drain or 0:>8.2f} {reload or 0:>8.2f} "
              f"{reset or 0:>8.3f} {idle:>7.1f} {total:>11.1f} {share:>9.1%}")
        last = at
    print(f"sync <= 5% of every iteration: {'PASS' if ok else 'FAIL'}")
    if wall is not None:
        print(f"wall time, vLLM's start included: {wall:.0f} s")
    return ok


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--iterations", type=int, default=2)
    ap.add_argument("--out", default="/tmp/polar-bench-loop")
    ap.add_argument("--backend", default=None, help="a running dev-mode vLLM (default: start one)")
    ap.add_argument("--read", help="only report on this finished run directory")
    ap.add_argument("--compare-staleness", action="store_true",
                    help="run K=0 and K=1 (--max-staleness) side by side and compare iterations per hour")
    args = ap.parse_args()
    if args.read:
        return 0 if report(Path(args.read), None) else 1
    if not args.compare_staleness:
        wall = run_demo(Path(args.out), args.iterations, args.backend)
        return 0 if report(Path(args.out), wall) else 1
    ok, rates = True, {}
    for k in (0, 1):   # one after the other on the same machine; vLLM restarts for each
        out = Path(f"{args.out}-k{k}")
        wall = run_demo(out, args.iterations, args.backend, staleness=k)
        print(f"\n--max-staleness {k}:")
        ok &= report(out, wall)
        rates[k] = per_hour(out)
    print(f"\niterations per hour (after the first): K=0 {rates[0]:.1f}, K=1 {rates[1]:.1f} "
          f"(x{rates[1] / rates[0]:.2f})")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
