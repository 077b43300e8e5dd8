"""Sessions per minute of `polar-train loop --ray` on 1, 2 and 3 Ray nodes (x 4 slots each),
against today's one-machine loop, measured side by side in one run.

Each session waits on a stand-in vLLM with a fixed latency (2 s a call, one call), so the
slots, not this machine's cores, bound the rate. The Ray nodes are a local cluster
(ray.cluster_utils, loopback), each with its own folders; the tasks' files are shipped to
them and their calls shipped back. Also printed: what moved per iteration (the calls to the
driver, the weights to each replica) and each transfer's time.

    .venv/bin/python scripts/bench_fleet.py [--nodes 1,2,3] [--tasks 4] [--samples 9] [--latency 2]

Goals (issue 43): >= 2.7x at 3 nodes against 1, and 1 Ray node within 10% of the local loop."""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path[:0] = [str(ROOT), str(ROOT / "tests")]

from support.ray_cluster import LocalCluster  # noqa: E402  (first: it keeps Ray, imported later, on loopback)
from polar_mitm.grpo.config import TrainConfig  # noqa: E402
from polar_mitm.loop.options import LoopOptions  # noqa: E402
from polar_mitm.loop.run import run_loop  # noqa: E402
from support import SUPPORT  # noqa: E402
from support.fake_vllm import FakeVLLM  # noqa: E402
from support.grpo_data import tiny_model_dir  # noqa: E402

SLOTS = 4


def tasks_file(where: Path, tasks: int, samples: int) -> Path:
    ws = where / "workspace"
    ws.mkdir(parents=True, exist_ok=True)
    shutil.copy(SUPPORT / "fake_harness.py", ws / "fake_harness.py")
    path = where / "tasks.jsonl"
    path.write_text("\n".join(json.dumps({
        "task_id": f"t{i}", "instruction": "wait", "timeout": 300, "num_samples": samples, "workspace": str(ws),
        "command": f"{sys.executable} fake_harness.py ok 1", "evaluator": "echo $POLAR_SAMPLE"})
        for i in range(tasks)) + "\n")
    return path


def run(where: Path, backend: str, model: str, tasks: Path, iterations: int, ray: str | None) -> dict:
    said: list[str] = []
    opts = LoopOptions(tasks_file=str(tasks), iterations=iterations, out=where / "run", harness="command",
                       backend=backend, model=model, workers=SLOTS, max_tokens=4, ray=ray)
    t0 = time.monotonic()
    rows = run_loop(opts, TrainConfig(lr=1e-3, token_budget=256), echo=said.append)
    wall = time.monotonic() - t0
    sessions = sum(r["sessions_done"] + r["sessions_failed"] + r["sessions_timed_out"] for r in rows)
    rollout_s = sum(r["rollout_s"] for r in rows)
    transfers = [line for line in said if line.startswith(("calls shipped", "weights v", "published v"))]
    return {"sessions": sessions, "rollout_s": rollout_s, "per_min": 60 * sessions / rollout_s, "wall_s": wall,
            "transfers": transfers}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--nodes", default="1,2,3")
    ap.add_argument("--tasks", type=int, default=4)
    ap.add_argument("--samples", type=int, default=9)
    ap.add_argument("--latency", type=float, default=2.0)
    ap.add_argument("--iterations", type=int, default=2)
    args = ap.parse_args()
    counts = [int(n) for n in args.nodes.split(",")]
    base = Path(tempfile.mkdtemp(prefix="bfleet", dir="/tmp"))
    results: dict[str, dict] = {}
    try:
        model = str(tiny_model_dir(base / "model"))
        tasks = tasks_file(base / "driver", args.tasks, args.samples)
        with FakeVLLM(delay=args.latency) as fake:
            fake.fetch_pulls = True
            print(f"local loop: 1 node x {SLOTS} slots ...", file=sys.stderr)
            results["local"] = run(base / "local", fake.url, model, tasks, args.iterations, None)
            import ray

            for n in counts:
                print(f"ray: {n} node(s) x {SLOTS} slots ...", file=sys.stderr)
                cluster = LocalCluster(nodes=n, cpus=2)
                try:
                    results[f"ray x{n}"] = run(base / f"ray{n}", fake.url, model, tasks, args.iterations,
                                               cluster.address)
                finally:
                    ray.shutdown()
                    cluster.shutdown()
    finally:
        shutil.rmtree(base, ignore_errors=True)
    one = results.get("ray x1")
    print(f"\nsessions/min, {args.tasks} tasks x {args.samples} samples x {args.iterations} iterations, "
          f"one {args.latency:g}s call each, {SLOTS} slots a node (this machine: {os.cpu_count()} cores)")
    print(f"{'setup':10}{'sessions':>10}{'rollout s':>11}{'per min':>9}{'vs ray x1':>11}{'vs local':>10}")
    for name, r in results.items():
        vs1 = f"{r['per_min'] / one['per_min']:.2f}x" if one else "-"
        vsl = f"{r['per_min'] / results['local']['per_min']:.2f}x"
        print(f"{name:10}{r['sessions']:>10}{r['rollout_s']:>11.1f}{r['per_min']:>9.1f}{vs1:>11}{vsl:>10}")
    for name, r in results.items():
        if r["transfers"]:
            print(f"\n{name}: what moved")
            for line in r["transfers"]:
                print(f"  {line}")


if __name__ == "__main__":
    main()
