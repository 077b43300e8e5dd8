"""GRPO groups under faults: `polar-mitm rollout` killed -9 at random moments (the window
between a session's reward and its report included), and interrupted with SIGINT three
times in a row, then rerun to the end each time. After every trial:
  - no group holds more rewarded sessions than samples (in `sessions`, what polar-train
    reads, and in the server's `rollout_sessions`);
  - no sample is lost for good: every sample's final attempt is done, with its reward.

    .venv/bin/python scripts/soak_groups.py [--kills 20] [--interrupts 20] [--seed 0]

Stand-ins: the scripted model backend (tests/support/fake_vllm.py, "scripted") and the `command` harness
running tests/support/fake_harness.py (model calls through the proxy, then a random sleep), with an
evaluator that scores the sample index. Exit status 0 when every trial held.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT), str(ROOT / "tests")]

from polar_mitm import session_ids  # noqa: E402
from polar_mitm.store import query  # noqa: E402

POLAR = str(Path(sys.executable).parent / "polar-mitm")
FAKE = f"{sys.executable} {ROOT / 'tests' / 'support' / 'fake_harness.py'}"
TASKS, SAMPLES = 3, 4


def write_tasks(path: Path, trial: str) -> None:
    # each session: 2 model calls, then 0.5-3 s of "work"; the evaluator takes a moment too,
    # so kills land before, during and after scoring and reporting
    cmd = f'{FAKE} slow:$(python3 -c "import random; print(random.uniform(0.5, 3))") 2'
    path.write_text("".join(json.dumps({
        "task_id": f"{trial}-t{t}", "instruction": "x", "harness": "command", "command": cmd,
        "num_samples": SAMPLES, "timeout": 60,
        "evaluator": {"command": "sleep 0.2; echo ${POLAR_SAMPLE}.5", "timeout": 30}}) + "\n" for t in range(TASKS)))


def start(tasks: Path, db: Path, backend: str) -> subprocess.Popen:
    return subprocess.Popen([POLAR, "rollout", str(tasks), "--db", str(db), "--backend", backend, "--workers", "4"],
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True)


def finish(tasks: Path, db: Path, backend: str) -> tuple[int, str]:
    """The final rerun's exit code, and the tail of what it printed (a failure says why)."""
    done = subprocess.run([POLAR, "rollout", str(tasks), "--db", str(db), "--backend", backend, "--workers", "4"],
                          stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, timeout=600)
    return done.returncode, done.stdout[-600:]


def check(db: Path, trial: str) -> list[str]:
    """The invariants, as problems found (none: the trial held)."""
    problems = []
    _, rows = query(db, "SELECT task_id, count(*) FROM sessions WHERE reward IS NOT NULL AND task_id LIKE ? "
                        "GROUP BY 1", [f"{trial}-%"])
    problems += [f"{t}: {n} rewarded sessions in `sessions` for {SAMPLES} samples" for t, n in rows if n > SAMPLES]
    _, rows = query(db, "SELECT task_id, count(*) FROM rollout_sessions WHERE reward IS NOT NULL AND task_id LIKE ? "
                        "GROUP BY 1", [f"{trial}-%"])
    problems += [f"{t}: {n} rewarded sessions in rollout_sessions" for t, n in rows if n > SAMPLES]
    _, rows = query(db, "SELECT task_id, sample, arg_max(state, attempt), arg_max(reward, attempt), "
                        "arg_max(session_id, attempt), arg_max(stats->>'eval_output', attempt) FROM rollout_sessions WHERE task_id LIKE ? GROUP BY 1, 2",
                    [f"{trial}-%"])
    if len(rows) != TASKS * SAMPLES:
        problems.append(f"{len(rows)} samples in rollout_sessions, not {TASKS * SAMPLES}")
    for task, sample, state, reward, sid, said in rows:
        if state != "done" or reward != sample + 0.5:
            problems.append(f"{session_ids.make(task, sample)}: lost for good ({sid} {state}, reward {reward}, "
                            f"the evaluator said {said!r})")
    _, rows = query(db, "SELECT session_id, reward FROM sessions WHERE reward IS NOT NULL AND task_id LIKE ?",
                    [f"{trial}-%"])
    _, final = query(db, "SELECT arg_max(session_id, attempt) FROM rollout_sessions WHERE task_id LIKE ? "
                         "GROUP BY task_id, sample", [f"{trial}-%"])
    finals = {r[0] for r in final}
    problems += [f"{sid}: rewarded in `sessions` but not its sample's final attempt" for sid, _ in rows
                 if sid not in finals]
    return problems


def soak(kills: int, interrupts: int, seed: int = 0, work: Path | None = None, log=print) -> dict:
    from support.fake_vllm import FakeVLLM

    # the fake harness lives in tests/, which a session's sandbox does not see otherwise
    os.environ["POLAR_SANDBOX_EXPOSE"] = str(ROOT / "tests")
    rng = random.Random(seed)
    work = Path(work or tempfile.mkdtemp(prefix="polar-soak-"))
    db = work / "soak.duckdb"
    report = {"kills": 0, "interrupts": 0, "trials": 0, "problems": [], "released": 0, "lost": 0}
    with FakeVLLM("scripted") as backend:
        trials = [("kill", i) for i in range(kills)] + [("sigint", i) for i in range(interrupts)]
        for kind, i in trials:
            trial = f"{kind}{i}"
            tasks = work / f"{trial}.jsonl"
            write_tasks(tasks, trial)
            t0 = time.monotonic()
            if kind == "kill":
                p = start(tasks, db, backend.url)
                time.sleep(rng.uniform(2.0, 9.0))     # the proxy's start, then sessions at every stage
                os.killpg(p.pid, signal.SIGKILL) if rng.random() < 0.5 else p.kill()
                p.wait(30)
                report["kills"] += 1
            else:
                for _ in range(3):
                    p = start(tasks, db, backend.url)
                    time.sleep(rng.uniform(2.0, 7.0))
                    p.send_signal(signal.SIGINT)
                    code = p.wait(120)
                    if code not in (130, 0, 3):
                        report["problems"].append(f"{trial}: SIGINT exit code {code}")
                    report["interrupts"] += 1
            code, said = finish(tasks, db, backend.url)
            problems = check(db, trial)
            if code != 0:
                problems.append(f"{trial}: the final rerun exited {code}: {said}")
            report["problems"] += problems
            report["trials"] += 1
            log(f"{trial}: {'held' if not problems else '; '.join(problems)} ({time.monotonic() - t0:.0f}s)")
    _, rows = query(db, "SELECT state, count(*) FROM rollout_sessions GROUP BY 1")
    states = dict(rows)
    report["released"], report["lost"] = states.get("released", 0), states.get("lost", 0)
    report["sessions"] = states
    return report


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--kills", type=int, default=20)
    ap.add_argument("--interrupts", type=int, default=20)
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()
    r = soak(args.kills, args.interrupts, args.seed)
    print(f"\n{r['trials']} trials: {r['kills']} kill -9, {r['interrupts']} SIGINTs (3 per trial); "
          f"attempts by final state {r['sessions']}")
    print(f"groups never over their samples, no sample lost for good: {'PASS' if not r['problems'] else 'FAIL'}")
    for p in r["problems"]:
        print("  " + p)
    return 0 if not r["problems"] else 1


if __name__ == "__main__":
    sys.exit(main())
