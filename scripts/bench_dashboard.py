"""The dashboard on a 100,000-call database: page load times, and a rollout's calls/s beside it.

    .venv/bin/python scripts/bench_dashboard.py [--calls 100000] [--work DIR] [--keep]
    .venv/bin/python scripts/bench_dashboard.py --work DIR --reuse      # the database is there

1. The database, built as the proxy builds one: coding-agent sessions of 20 turns
   (scripts/workload.py: bodies ~43 KB growing to ~200 KB, half OpenAI Chat, half Anthropic,
   with tool calls and tool results) through a real polar-mitm proxy in front of the
   workload's fake vLLM, 64 clients at once, until --calls calls are recorded. The sessions
   are named as the loop names them (TASK@bench.I~k): groups of 8 samples of a task, a run of
   iterations; the rollout tables, the rewards and loop_iterations are then written through
   the store's own writers, so every page has what a real run gives it.
2. Page loads, in headless Chromium (the Debian package, through Playwright), each page 5 times
   on a fresh page: Runs (/), a group (/groups/TASK) and a session (/sessions/SID, 20 turns
   with their tokens): from navigation to the page's data drawn (its rows). Target: under 1 s.
   The first load of each is cold (the dashboard's cache is empty); the worst load counts.
3. A rollout beside it: the same proxy (on the 100,000-call database) serving new sessions,
   calls/s measured in alternating windows, A without the dashboard and B with the dashboard
   running and a browser holding the live Runs page and a live group page open (the pages
   refresh on every change the dashboard sees), after a warm-up window, in the order A B B A
   A B B A, averaged. Target: B within 5% of A.
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import sys
import tempfile
import threading
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import bench_gateway as bg  # noqa: E402
import workload  # noqa: E402

from polar_mitm.stack import launch  # noqa: E402
from polar_mitm.store import query  # noqa: E402
from polar_mitm.store.db import Reward, store_rewards  # noqa: E402
from polar_mitm.store.loop import IterationRow, record_iteration  # noqa: E402
from polar_mitm.store import rollout_journal  # noqa: E402
from polar_mitm.rollout.spec import parse_task  # noqa: E402

RUN = "bench"
SAMPLES = 8
TURNS = 20
POLAR = str(Path(sys.executable).parent / "polar-mitm")


def task_name(it: int, t: int) -> str:
    return f"task{t:03d}@{RUN}.{it}"


def build(work: Path, calls: int, tasks_per_iteration: int) -> Path:
    """The database, through a real proxy; returns its path."""
    fake = bg.Fake(work / "fake.log")
    service, _, rp, db = bg.start_polar(fake.url, work, None, [], name="build")
    sessions_needed = -(-calls // TURNS)
    groups = -(-sessions_needed // SAMPLES)
    iterations = -(-groups // tasks_per_iteration)
    made, t0 = 0, time.monotonic()
    try:
        for it in range(iterations):
            batch: list[workload.Session] = []
            for t in range(tasks_per_iteration):
                if made >= sessions_needed:
                    break
                for s in workload.make_sessions(SAMPLES, prefix=task_name(it, t), turns=TURNS,
                                                first_seed=it * 1000 + t * SAMPLES):
                    batch.append(s)
                    made += 1
            if not batch:
                break
            records = bg.run_load(rp, batch, 64)
            bad = [r for r in records if r.status != 200 or r.error]
            if bad:
                raise SystemExit(f"building the database: {len(bad)} calls failed, e.g. {bad[0].error}")
            done = made * TURNS
            print(f"  iteration {it}: {done} calls recorded ({done / (time.monotonic() - t0):.0f} calls/s)",
                  flush=True)
    finally:
        service.stop()
        fake.stop()
    return db


def _rollout_tables(db: Path, iterations: int, tasks_per_iteration: int) -> None:
    """What the rollout server and the loop write for such a run, through the store's writers:
    tasks, sessions (done, with rewards), their events, the rewards, loop_iterations."""
    _, rows = query(db, "SELECT session_id, count(*) FROM call_records GROUP BY session_id")
    calls_of = dict(rows)
    now_us = int(time.time() * 1e6)
    rewards: list[Reward] = []
    for it in range(iterations):
        tasks, sessions, events, per_task = [], [], [], {}
        for t in range(tasks_per_iteration):
            tid = task_name(it, t)
            sids = [f"{tid}~{k}" for k in range(SAMPLES) if f"{tid}~{k}" in calls_of]
            if not sids:
                continue
            spec = parse_task({"task_id": tid, "instruction": f"Fix the failing test of project {t}.",
                               "num_samples": SAMPLES}).to_json()
            tasks.append({"task_id": tid, "order": it * tasks_per_iteration + t, "spec": spec,
                          "state": "done", "priority": 0, "callback_state": None, "callback_tries": 0,
                          "cancel_reason": None})
            rs = []
            for k, sid in enumerate(sids):
                r = float((k + t + it) % 3 == 0)
                rs.append(r)
                rewards.append(Reward(sid, r, None, tid))
                sessions.append({"session_id": sid, "task_id": tid, "sample": k, "attempt": 1, "state": "done",
                                 "node_id": "node-1", "reward": r, "reason": None,
                                 "stats": {"calls": calls_of[sid], "harness_output": "ok\n",
                                           "eval_output": f"reward {r}\n"}})
                for state in ("assigned", "init", "ready", "run", "post_run", "done"):
                    now_us += 1
                    events.append({"at_us": now_us, "task_id": tid, "session_id": sid, "state": state,
                                   "node_id": "node-1", "detail": None})
            per_task[tid.split("@")[0]] = {"mean": statistics.fmean(rs), "std": statistics.pstdev(rs), "n": len(rs)}
        rollout_journal.save(db, {"tasks": tasks, "sessions": sessions, "events": events})
        all_r = [v["mean"] for v in per_task.values()]
        record_iteration(db, IterationRow(
            run_id=RUN, iteration=it, policy_version=it, checkpoint=None,
            reward_mean=statistics.fmean(all_r) if all_r else None,
            reward_std=statistics.pstdev(all_r) if all_r else None, reward_n=len(sessions),
            eval_reward_mean=None, sessions_done=len(sessions), sessions_failed=0, sessions_timed_out=0,
            calls=sum(calls_of[s["session_id"]] for s in sessions), tokens=0, stale_dropped=0,
            loss=0.0, clip_frac=0.0, logprob_abs_diff=0.0, rollout_s=60.0, train_s=20.0, sync_s=1.0,
            per_task=per_task), [])
    store_rewards(db, rewards)


# ---- the dashboard and the browser -------------------------------------------------------------


class Dashboard:
    def __init__(self, db: Path, work: Path):
        self.port = launch.free_port()
        self.service = launch.Service("dashboard", [POLAR, "dashboard", "--db", str(db), "--port", str(self.port)],
                                      None, work / "dashboard.log")
        launch.wait_port(self.port, self.service, timeout=60)
        self.url = f"http://127.0.0.1:{self.port}"

    def stop(self) -> None:
        self.service.stop()


def browser(pw):
    args = ["--no-sandbox"] if os.geteuid() == 0 else []   # Chromium refuses root without it
    return pw.chromium.launch(executable_path=shutil.which("chromium"), args=args)


# page -> the selector that shows its data is drawn
PAGES = {"runs": "table#iterations tr[data-iteration]", "group": "table#samples tr[data-session]",
         "session": "ol#turns li.turn"}


def page_loads(url: str, paths: dict[str, str], repeats: int = 5) -> dict[str, list[float]]:
    from playwright.sync_api import sync_playwright
    out: dict[str, list[float]] = {k: [] for k in paths}
    with sync_playwright() as pw:
        b = browser(pw)
        try:
            for _ in range(repeats):
                for name, path in paths.items():
                    page = b.new_page()
                    t0 = time.perf_counter()
                    page.goto(url + path, wait_until="commit")
                    page.wait_for_selector(PAGES[name], timeout=30_000)
                    out[name].append(time.perf_counter() - t0)
                    page.close()
        finally:
            b.close()
    return out


def _in_thread(fn, *args):
    """fn(*args) in a thread of its own: Playwright's sync API keeps an event loop running in
    this one, and the load's clients run one with asyncio.run."""
    out: list = []
    t = threading.Thread(target=lambda: out.append(fn(*args)))
    t.start()
    t.join()
    if not out:
        raise SystemExit("the rollout window's clients failed (see above)")
    return out[0]


def rollout_windows(db: Path, work: Path, dashboard_url_for, rounds: int, sessions: int) -> dict[str, list[float]]:
    """calls/s of new sessions through a proxy on the big database: A (no dashboard) and B
    (the dashboard, with the live Runs page and a live group page open in a browser)."""
    from playwright.sync_api import sync_playwright
    fake = bg.Fake(work / "fake-rollout.log")
    port, rp = launch.free_ports(2)
    try:   # the rollout's proxy records into the big database
        service = launch.start_proxy(db=db, backend=fake.url, port=port, confdir=work / "rollout-conf",
                                     log_path=work / "rollout-mitmdump.log", reverse_port=rp)
    except BaseException:
        fake.stop()
        raise
    rates: dict[str, list[float]] = {"A": [], "B": []}
    n, nonce = 0, f"{int(time.time()) % 100_000:05d}"    # new sessions in every run
    try:
        with sync_playwright() as pw:
            b = browser(pw)
            try:
                # a first window unmeasured: the proxy's first calls on a big file (its loader
                # opening it) are slower whatever runs beside it
                _in_thread(bg.run_load, rp, workload.make_sessions(
                    sessions // 2, prefix=f"warmup{nonce}@{RUN}.{9_999}", turns=TURNS, first_seed=800_000), 64)
                for r in range(rounds):
                    for arm in (("A", "B") if r % 2 == 0 else ("B", "A")):   # A B B A A B ...
                        dash = pages = None
                        if arm == "B":
                            dash, paths = dashboard_url_for()
                            pages = []
                            for path, sel in paths:
                                pg = b.new_page()
                                pg.goto(dash.url + path)
                                pg.wait_for_selector(sel, timeout=30_000)
                                pages.append(pg)
                        batch = workload.make_sessions(sessions, prefix=f"live{nonce}{r}{arm}@{RUN}.{10_000 + n}",
                                                       turns=TURNS, first_seed=900_000 + n * sessions)
                        n += 1
                        records = _in_thread(bg.run_load, rp, batch, 64)
                        summary = bg.summarize([records])
                        if summary["errors"]:
                            raise SystemExit(f"rollout window failed: {summary['first_errors']}")
                        rates[arm].append(summary["calls_per_s"])
                        print(f"  round {r + 1} {arm}: {summary['calls_per_s']:.1f} calls/s "
                              f"({summary['ok']} calls)", flush=True)
                        for pg in pages or []:
                            pg.close()
                        if dash is not None:
                            dash.stop()
            finally:
                b.close()
    finally:
        service.stop()
        fake.stop()
    return rates


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--calls", type=int, default=100_000)
    ap.add_argument("--tasks", type=int, default=25, help="tasks per iteration (groups of 8 samples)")
    ap.add_argument("--work", default=None)
    ap.add_argument("--reuse", action="store_true", help="the database in --work is there already")
    ap.add_argument("--build-only", action="store_true", help="build the database, measure nothing")
    ap.add_argument("--rounds", type=int, default=4)
    ap.add_argument("--window-sessions", type=int, default=64, help="20-turn sessions per rollout window")
    args = ap.parse_args()
    work = Path(args.work or tempfile.mkdtemp(prefix="polar-bench-dashboard-"))
    work.mkdir(parents=True, exist_ok=True)
    db = work / "build-store" / "calls.duckdb"
    if not args.reuse:
        t0 = time.monotonic()
        print(f"building a {args.calls}-call database in {work} ...", flush=True)
        db = build(work, args.calls, args.tasks)
        print(f"built in {time.monotonic() - t0:.0f} s", flush=True)
    _, rows = query(db, "SELECT count(*) FROM rollout_tasks")
    if not rows[0][0]:   # the rollout server's and the loop's tables, as a run leaves them
        _, rows = query(db, "SELECT count(DISTINCT split_part(session_id, '~', 1)) FROM call_records")
        _rollout_tables(db, -(-rows[0][0] // args.tasks), args.tasks)
    if args.build_only:
        return
    _, rows = query(db, "SELECT count(*), count(DISTINCT session_id) FROM call_records")
    n_calls, n_sessions = rows[0]
    _, rows = query(db, "SELECT session_id FROM call_records GROUP BY session_id ORDER BY count(*) DESC, "
                        "session_id LIMIT 1")
    sid = rows[0][0]
    task = sid.rsplit("~", 1)[0]
    size_mb = db.stat().st_size / 2**20
    print(f"database: {n_calls} calls, {n_sessions} sessions, {size_mb:.0f} MB")

    from urllib.parse import quote
    paths = {"runs": "/", "group": f"/groups/{quote(task, safe='')}", "session": f"/sessions/{quote(sid, safe='')}"}
    dash = Dashboard(db, work)
    try:
        loads = page_loads(dash.url, paths)
    finally:
        dash.stop()
    print(f"\n{'page':<9} {'cold s':>7} {'median s':>9} {'worst s':>8}")
    ok_pages = True
    for name, ts in loads.items():
        print(f"{name:<9} {ts[0]:>7.3f} {statistics.median(ts):>9.3f} {max(ts):>8.3f}")
        ok_pages &= max(ts) < 1.0

    def live_dashboard():
        d = Dashboard(db, work)
        return d, [("/", PAGES["runs"]), (paths["group"], PAGES["group"])]

    print("\na rollout beside it (A: no dashboard; B: the dashboard with two live pages open):")
    rates = rollout_windows(db, work, live_dashboard, args.rounds, args.window_sessions)
    a, b = statistics.fmean(rates["A"]), statistics.fmean(rates["B"])
    change = (b - a) / a * 100
    print(f"\ncalls/s: A {a:.1f}, B {b:.1f} ({change:+.1f}%)")
    for name, ts in loads.items():
        print(f"{'PASS' if max(ts) < 1.0 else 'FAIL'}: {name} page under 1 s on {n_calls} calls "
              f"(worst of {len(ts)} loads {max(ts):.3f} s)")
    ok_rollout = abs(change) <= 5.0
    print(f"{'PASS' if ok_rollout else 'FAIL'}: a rollout beside the dashboard within 5% "
          f"({b:.1f} vs {a:.1f} calls/s: {change:+.1f}%)")
    sys.exit(0 if ok_pages and ok_rollout else 1)


if __name__ == "__main__":
    main()
