"""The closed loop over many iterations, and where one iteration spends its time.

    .venv/bin/python scripts/bench_loop.py --iterations 200 [--kill-at 150] [--report-to tensorboard,...]
    .venv/bin/python scripts/bench_loop.py --demo [--iterations 2] [--backend URL]
    .venv/bin/python scripts/bench_loop.py --read DIR      # a run that is already there

Long runs (the default): `polar-train loop` with a stand-in for vLLM (tests/support/fake_vllm.py, in
this process), a tiny random model and a `command` harness (curl through the node's proxy),
so that hundreds of iterations take minutes and only the loop's own costs show. It prints,
at iterations 1, 10, 50, 100 and 200: the time per iteration (wall, and the loop's own
rollout + train + sync: medians of the five iterations that end there), the rollout
journal's saves over those five iterations (their count, the median of their p50s and the
worst p99: the rollout server's own figures, in loop_iterations), the database's size, and
the RSS of the loop and the proxy; then the targets' PASS/FAIL lines: iteration time at the
end within 10% of iteration 10, RSS within 10%, the journal save p99 at most 50 ms in every
iteration. --kill-at N kills the loop with SIGKILL during iteration N and reruns the same
command (a resume): the figures after N are the resumed run's, and it adds the marks N - 1
and N + 10. With --report-to, each tracker is read back with its own library's reader: one
run, reward/mean at every iteration, equal to loop_iterations.

--demo runs `polar-mitm demo`'s loop on real vLLM and Pi and prints, per iteration, rollouts /
training / sync (drain, reload, reset) / the rest as seconds and shares of the iteration, and
checks that the sync takes at most 5% of it. --compare-staleness runs K=0 (synchronous) and
K=1 (the next iteration's rollouts during training) one after the other and compares
iterations per hour. --compare-sync-mode runs the demo's loop at --max-staleness 1 with
--sync-mode inflight, then drain (same settings), and prints per iteration, side by side: the
phases, vLLM's stall per sync (sync_stall_s), the drain, the calls in flight across the sync,
drained and held, the tokens trained, dropped as stale and of no known version, and from the
calls themselves those whose tokens carry two versions and the share of tokens older than
the trained version - 1 (it should equal the trainer's stale share).
"""

from __future__ import annotations

import argparse
import json
import os
import re
import signal
import statistics
import subprocess
import sys
import threading
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from polar_mitm.store import query  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
DEMO = ROOT / "polar_mitm" / "demo_tasks"
TRAIN = str(Path(sys.executable).parent / "polar-train")
MARKS = (1, 10, 50, 100, 200)


def run_demo(out: Path, iterations: int, backend: str | None, staleness: int = 0, sync_mode: str = "auto",
             samples: int | None = None, held_out: bool = True, echo=None,
             workers: int | None = None) -> float:
    """`polar-mitm demo`'s loop, with its settings (cli.DemoSettings); --compare-sync-mode
    may change the samples and workers and leave out the held-out tasks (the same for both arms)."""
    from polar_mitm.cli.main import DEMO as D
    from polar_mitm.grpo.config import TrainConfig
    from polar_mitm.loop.run import LoopOptions, run_loop

    t0 = time.monotonic()
    run_loop(LoopOptions(tasks_file=str(DEMO / "arithmetic.jsonl"), iterations=iterations, out=out,
                         harness="pi", samples=samples or D.samples, backend=backend,
                         workers=workers or D.workers,
                         eval_tasks_file=str(DEMO / "arithmetic_heldout.jsonl") if held_out else None,
                         max_tokens=D.max_tokens, eval_every=D.eval_every,
                         max_staleness=staleness, sync_mode=sync_mode),
             TrainConfig(lr=D.lr, groups_per_step=D.groups_per_step), **({"echo": echo} if echo else {}))
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


# ---- in-flight syncs against drains (issue 42) ------------------------------------------------

SYNCED = re.compile(r"synced policy v(\d+) \((\w+)\): drained (\d+) calls, held (\d+)")


def run_sync_mode(out: Path, mode: str, iterations: int, backend: str | None, samples: int | None,
                  held_out: bool, workers: int | None) -> tuple[float, list[tuple[int, int]]]:
    """One arm: the demo's loop at --max-staleness 1 with this --sync-mode; its wall time and
    each sync's (drained, held) calls, from the loop's own line (not in loop_iterations)."""
    import click

    counts: list[tuple[int, int]] = []

    def echo(line: str) -> None:
        if m := SYNCED.search(line):
            counts.append((int(m.group(3)), int(m.group(4))))
        click.echo(line)

    wall = run_demo(out, iterations, backend, staleness=1, sync_mode=mode, samples=samples, held_out=held_out,
                    echo=echo, workers=workers)
    return wall, counts


def token_versions_by_iteration(db: Path, max_staleness: int = 1) -> dict[int, dict]:
    """From the calls themselves, per iteration that trained them: calls, calls whose tokens
    carry two distinct versions (a sync landed while they ran), tokens, and tokens of a version
    older than the trained one minus K (what the trainer masks as stale) or of no known version.
    A NULL token_versions means every token is the call's policy_version."""
    from polar_mitm.session_ids import parse_run_task, task_of

    _, its = query(db, "SELECT iteration, policy_version FROM loop_iterations ORDER BY iteration")
    trained_at = dict(its)
    _, rows = query(db, "SELECT session_id, policy_version, token_versions, len(token_ids) FROM calls")
    out: dict[int, dict] = {}
    for sid, version, versions, n in rows:
        rt = parse_run_task(task_of(sid) or "")
        if rt is None or rt.held_out or rt.iteration not in trained_at:
            continue
        f = out.setdefault(rt.iteration, {"calls": 0, "straddling": 0, "tokens": 0, "stale": 0, "unknown": 0})
        per_token = list(versions) if versions is not None else [version] * (n or 0)
        oldest = trained_at[rt.iteration] - max_staleness
        f["calls"] += 1
        f["straddling"] += len({v for v in per_token if v is not None}) >= 2
        f["tokens"] += len(per_token)
        f["stale"] += sum(1 for v in per_token if v is not None and v < oldest)
        f["unknown"] += sum(1 for v in per_token if v is None)
    return out


def in_flight_at_sync(db: Path) -> dict[int, int]:
    """Per iteration, the calls that ran across its sync: started before the sync ended and
    recorded after it began (the sync: the sync_s seconds before the row's finished_at, which
    is written right after it)."""
    _, rows = query(db, "SELECT i.iteration, count(c.call_id) FROM loop_iterations i LEFT JOIN calls c "
                        "ON c.started_at < i.finished_at "
                        "AND c.created_at > i.finished_at - to_microseconds(CAST(i.sync_s * 1e6 AS BIGINT)) "
                        "GROUP BY ALL")
    return dict(rows)


def _frac(a: float, b: float) -> str:
    return f"{a / b:.1%}" if b else "-"


def report_sync_modes(arms: dict[str, tuple[Path, float, list[tuple[int, int]]]]) -> None:
    """Per iteration and mean, the two arms side by side."""
    cols = ("iteration", "rollout_s", "train_s", "sync_s", "sync_stall_s", "sync_drain_s", "sync_reload_s",
            "tokens", "stale_tokens", "unknown_version_tokens", "sync_mode", "finished_at")
    figures: dict[str, list[dict]] = {}
    for mode, (out, _, counts) in arms.items():
        db = out / "rollouts.duckdb"
        _, stored = query(db, f"SELECT {', '.join(cols)} FROM loop_iterations ORDER BY iteration")
        from_calls = token_versions_by_iteration(db)
        across = in_flight_at_sync(db)
        last = None
        figures[mode] = []
        for i, r in enumerate(stored):
            d = dict(zip(cols, r))
            d["wall"] = (d["finished_at"] - last).total_seconds() if last is not None else None
            last = d["finished_at"]
            d["drained"], d["held"] = counts[i] if i < len(counts) else (None, None)
            d["calls"] = from_calls.get(d["iteration"], {})
            d["across"] = across.get(d["iteration"])
            figures[mode].append(d)
    head = (f"{'arm':>8} {'iter':>4} {'mode':>8} {'rollout s':>9} {'train s':>7} {'sync s':>6} {'iter s':>6} "
            f"{'stall s':>7} {'drain s':>7} {'reload s':>8} {'in flight':>9} {'drained':>7} {'held':>4} "
            f"{'tokens':>6} {'stale':>5} {'unknown':>7} {'stale %':>7} {'straddle':>8} {'calls stale %':>13}")
    print("\n" + head)
    print("-" * len(head))
    for mode, rows in figures.items():
        for d in rows:
            c = d["calls"]
            seen = d["tokens"] + d["stale_tokens"] + d["unknown_version_tokens"]
            print(f"{mode:>8} {d['iteration'] + 1:>4} {d['sync_mode'] or '-':>8} {d['rollout_s']:>9.1f} "
                  f"{d['train_s']:>7.1f} {d['sync_s']:>6.2f} {_num(d['wall'], 6, 1)} "
                  f"{_num(d['sync_stall_s'], 7, 2)} "
                  f"{_num(d['sync_drain_s'], 7, 2)} {_num(d['sync_reload_s'], 8, 2)} "
                  f"{_num(d['across'], 9, 0)} {_num(d['drained'], 7, 0)} {_num(d['held'], 4, 0)} "
                  f"{d['tokens']:>6} "
                  f"{d['stale_tokens']:>5} "
                  f"{d['unknown_version_tokens']:>7} {_frac(d['stale_tokens'], seen):>7} "
                  f"{'%d/%d' % (c.get('straddling', 0), c.get('calls', 0)):>8} "
                  f"{_frac(c.get('stale', 0), c.get('tokens', 0)):>13}")
    print("\nmeans (iteration s: from the 2nd iteration on; stall and drain: the iterations that synced)")
    for mode, rows in figures.items():
        synced = [d for d in rows if d["sync_stall_s"] is not None or d["sync_drain_s"] is not None]
        walls = [d["wall"] for d in rows if d["wall"] is not None]
        trained, stale = sum(d["tokens"] for d in rows), sum(d["stale_tokens"] for d in rows)
        unknown = sum(d["unknown_version_tokens"] for d in rows)
        seen = trained + stale + unknown

        def of_calls(key: str) -> int:
            return sum(d["calls"].get(key, 0) for d in rows)

        def mean(key: str, among: list[dict] = rows) -> float:
            return _mean_of([d[key] or 0 for d in among])

        print(f"{mode:>8}: iteration {_mean_of(walls):.1f} s (rollouts {mean('rollout_s'):.1f}, training "
              f"{mean('train_s'):.1f}, sync {mean('sync_s'):.2f}); vLLM idle per sync "
              f"{mean('sync_stall_s', synced):.2f} s, drain {mean('sync_drain_s', synced):.2f} s; stale "
              f"{stale}/{seen} tokens ({_frac(stale, seen)}), unknown version {unknown}; calls straddling a "
              f"sync {of_calls('straddling')}/{of_calls('calls')}; in the calls, tokens older than the "
              f"trained version - 1: {_frac(of_calls('stale'), of_calls('tokens'))}, of no known version "
              f"{of_calls('unknown')}; wall {arms[mode][1]:.0f} s with vLLM's start")


def _num(x, width: int, digits: int) -> str:
    return f"{x:>{width}.{digits}f}" if x is not None else f"{'-':>{width}}"


def _mean_of(xs: list[float]) -> float:
    return statistics.fmean(xs) if xs else float("nan")


# ---- long runs, on stand-ins ------------------------------------------------------------------

URL = "https://api.openai.com/v1/chat/completions"
BODY = json.dumps({"model": "gpt-4o", "messages": [{"role": "user", "content": "say ok"}], "max_tokens": 8})
CURL = (f"curl -sS --fail-with-body -X POST {URL} -H 'content-type: application/json' "
        f"-H 'authorization: Bearer x' -d '{BODY}' -o answer.json")


def standin_tasks(folder: Path, tasks: int) -> tuple[Path, Path]:
    """tasks training tasks and one held-out task; the sample index as reward (every group
    has a signal, so every iteration trains, saves and syncs)."""
    def rows(names):
        return "".join(json.dumps({"task_id": t, "instruction": "say ok", "harness": "command", "command": CURL,
                                   "timeout": 60, "evaluator": "grep -q chat.completion answer.json && "
                                   "echo $POLAR_SAMPLE"}) + "\n" for t in names)
    train, held_out = folder / "tasks.jsonl", folder / "heldout.jsonl"
    train.write_text(rows(f"t{i}" for i in range(tasks)))
    held_out.write_text(rows(["h0"]))
    return train, held_out


def rss_mb(pid: int) -> float | None:
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    except OSError:
        pass
    return None


def _fds(pid: int) -> tuple[int, int] | None:
    """(open descriptors, the highest one's number): a leak shows in both."""
    try:
        fds = [int(f) for f in os.listdir(f"/proc/{pid}/fd")]
    except OSError:
        return None
    return len(fds), max(fds, default=0)


def children(pid: int) -> list[int]:
    out = []
    for p in filter(str.isdigit, os.listdir("/proc")):
        try:
            stat = Path(f"/proc/{p}/stat").read_text()
        except OSError:
            continue
        if int(stat.rsplit(")", 1)[1].split()[1]) == pid:
            out.append(int(p))
    return out


def proxy_pid(loop_pid: int) -> int | None:
    for c in children(loop_pid):
        try:
            if b"mitmdump" in Path(f"/proc/{c}/cmdline").read_bytes():
                return c
        except OSError:
            pass
    return None


ITERATION_LINE = re.compile(r"^iteration (\d+) \(policy v\d+\)")


def run_standin(out: Path, iterations: int, kill_at: int | None, tasks: int, samples: int, workers: int,
                report_to: str | None) -> dict[int, dict]:
    """The loop as a child process, watched: per iteration, when its line came, the database's
    size and the RSS of the loop and its proxy."""
    sys.path.insert(0, str(ROOT / "tests"))
    from support.fake_vllm import FakeVLLM
    from support.grpo_data import tiny_model_dir

    out.mkdir(parents=True, exist_ok=True)
    model = out / "model"
    if not model.exists():
        tiny_model_dir(model)
    train, held_out = standin_tasks(out, tasks)
    run = out / "run"
    seen: dict[int, dict] = {}
    with FakeVLLM() as fake:
        argv = [TRAIN, "loop", "--tasks", str(train), "--eval-tasks", str(held_out), "--iterations", str(iterations),
                "--out", str(run), "--samples", str(samples), "--backend", fake.url, "--model", str(model),
                "--lr", "1e-3", "--token-budget", "256", "--workers", str(workers), "--max-tokens", "8",
                "--keep", "1", *(["--report-to", report_to] if report_to else [])]
        for attempt in ("first", "resumed"):
            log = open(out / f"loop-{attempt}.log", "w")
            proc = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=log, text=True, start_new_session=True)
            killed = False
            assert proc.stdout is not None
            for line in proc.stdout:
                log.write(line)
                m = ITERATION_LINE.match(line)
                if not m:
                    continue
                it = int(m.group(1))
                db = run / "rollouts.duckdb"
                proxy = proxy_pid(proc.pid)
                seen[it] = {"at": time.monotonic(), "db_mb": sum(os.path.getsize(p) for p in (db, Path(f"{db}.wal"))
                                                                  if p.exists()) / 1e6,
                            "loop_rss": rss_mb(proc.pid), "proxy_rss": rss_mb(proxy) if proxy else None,
                            "loop_fds": _fds(proc.pid), "run": attempt}
                if it % 10 == 0 or it == 1:
                    print(f"  iteration {it}: {seen[it]['db_mb']:.1f} MB database, loop RSS "
                          f"{seen[it]['loop_rss'] or 0:.0f} MB, proxy RSS {seen[it]['proxy_rss'] or 0:.0f} MB",
                          flush=True)
                if kill_at is not None and attempt == "first" and it == kill_at - 1:
                    # during iteration kill_at: once its rollouts are under way
                    threading.Timer(2.0, lambda: os.killpg(proc.pid, signal.SIGKILL)).start()
                    killed = True
            code = proc.wait()
            log.close()
            if not killed:
                if code != 0:
                    raise SystemExit(f"the loop failed ({code}); see {out}/loop-{attempt}.log")
                break
            print(f"  killed -9 during iteration {kill_at}; rerunning the same command", flush=True)
    return seen


def journal_figures(db: Path) -> dict[int, tuple]:
    """Per iteration (1-based): the journal's saves, p50 and p99 ms, and the iteration's seconds
    from the previous one's end (the rollout server's figures, in loop_iterations)."""
    _, rows = query(db, "SELECT iteration, journal_saves, journal_save_p50_ms, journal_save_p99_ms, "
                        "rollout_s + train_s + sync_s FROM loop_iterations ORDER BY iteration")
    return {r[0] + 1: r[1:] for r in rows}


def window(xs: list[float]) -> float:
    return statistics.median(xs) if xs else float("nan")


def report_standin(out: Path, seen: dict[int, dict], iterations: int, kill_at: int | None = None) -> bool:
    figures = journal_figures(out / "run" / "rollouts.duckdb")
    at = {it: v["at"] for it, v in seen.items()}
    per_it = {it: at[it] - at[it - 1] for it in at if it - 1 in at and seen[it]["run"] == seen[it - 1]["run"]}
    # with a kill: the last iteration before it, and ten after the resume
    extra = {kill_at - 1, kill_at + 10} if kill_at else set()
    marks = sorted(m for m in {*MARKS, *extra} if 1 <= m <= iterations)
    print(f"\n{'iter':>5} {'run':>7} {'s/iteration':>11} {'loop s':>7} {'saves':>6} {'save p50':>9} {'save p99':>9} "
          f"{'db MB':>7} {'loop RSS':>9} {'proxy RSS':>9} {'loop fds':>9}")
    rows = {}
    for m in marks:
        lo = max(2, m - 4)
        wall = window([per_it[i] for i in range(lo, m + 1) if i in per_it])
        inner = window([figures[i][3] for i in range(max(1, m - 4), m + 1) if i in figures and figures[i][3]])
        # the journal over the same five iterations: saves in all, the median p50, the worst p99
        win = [figures[i] for i in range(max(1, m - 4), m + 1) if i in figures and figures[i][0]]
        saves = sum(f[0] for f in win) if win else None
        p50 = statistics.median(f[1] for f in win) if win else None
        p99 = max(f[2] for f in win) if win else None
        s = seen.get(m, {})
        rows[m] = {"wall": wall, "p99": p99, "loop_rss": s.get("loop_rss"), "proxy_rss": s.get("proxy_rss")}
        print(f"{m:>5} {s.get('run', '-'):>7} {wall:>11.2f} {inner:>7.2f} {saves if saves is not None else '-':>6} "
              f"{_ms(p50):>9} {_ms(p99):>9} {s.get('db_mb', float('nan')):>7.1f} "
              f"{s.get('loop_rss') or float('nan'):>9.0f} {s.get('proxy_rss') or float('nan'):>9.0f} "
              f"{'%d/%d' % s['loop_fds'] if s.get('loop_fds') else '-':>9}")
    p99s = [f[2] for f in figures.values() if f[2] is not None]
    worst = max(p99s) if p99s else float("nan")
    last = marks[-1]
    ok = True

    def check(name: str, passed: bool, detail: str) -> None:
        nonlocal ok
        ok &= passed
        print(f"{'PASS' if passed else 'FAIL'}: {name} ({detail})")

    print()
    if 10 in rows and last > 10:
        a, b = rows[10]["wall"], rows[last]["wall"]
        check(f"iteration time at {last} within 10% of iteration 10", b <= 1.10 * a,
              f"{b:.2f} s vs {a:.2f} s: {b / a - 1:+.1%}")
        for proc in ("loop", "proxy"):
            ra, rb = rows[10][f"{proc}_rss"], rows[last][f"{proc}_rss"]
            if ra and rb:
                check(f"{proc} RSS at {last} within 10% of iteration 10", rb <= 1.10 * ra,
                      f"{rb:.0f} MB vs {ra:.0f} MB: {rb / ra - 1:+.1%}")
    check("journal save p99 <= 50 ms in every iteration", worst <= 50.0,
          f"worst iteration's p99 {worst:.1f} ms over {len(p99s)} iterations")
    return ok


def check_trackers(out: Path, report_to: str) -> bool:
    """Each tracker, read back with its own library's reader (tests/loop/test_trackers.py): one run
    (the kill -9 and the resume included), reward/mean at every iteration, equal to
    loop_iterations."""
    from support.tracker_readers import READERS

    run = out / "run"
    run_id = json.loads((run / "loop.json").read_text())["run_id"]
    _, rows = query(run / "rollouts.duckdb", "SELECT iteration + 1, reward_mean FROM loop_iterations "
                                             "WHERE run_id = ? ORDER BY 1", [run_id])
    want = {it: r for it, r in rows}
    ok = True
    for name in [t.strip() for t in report_to.split(",") if t.strip()]:
        try:
            got = READERS[name](run, run_id)["iteration"]["reward/mean"]
            same = set(got) == set(want) and all(abs(got[i] - want[i]) < 1e-6 for i in want)
            detail = (f"one run, reward/mean at {len(got)} iterations" +
                      ("" if same else f"; differs from loop_iterations ({len(want)} rows)"))
        except AssertionError as e:
            same, detail = False, f"not one run: {str(e)[:200]}"
        ok &= same
        print(f"{'PASS' if same else 'FAIL'}: {name} shows the run ({detail})")
    return ok


def _ms(x) -> str:
    return "-" if x is None else f"{x:.1f} ms"


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--iterations", type=int, default=None, help="default: 200 (stand-ins), 2 (--demo)")
    ap.add_argument("--out", default="/tmp/polar-bench-loop")
    ap.add_argument("--demo", action="store_true", help="the demo's loop on real vLLM and Pi (phases per iteration)")
    ap.add_argument("--kill-at", type=int, default=None, help="kill -9 during this iteration, then resume")
    ap.add_argument("--tasks", type=int, default=2, help="stand-in run: training tasks")
    ap.add_argument("--samples", type=int, default=4, help="stand-in run: samples per task")
    ap.add_argument("--workers", type=int, default=4, help="stand-in run: the node's RUN slots")
    ap.add_argument("--report-to", default=None, help="stand-in run: polar-train loop's --report-to")
    ap.add_argument("--backend", default=None, help="a running dev-mode vLLM (default: start one)")
    ap.add_argument("--read", help="only report on this finished run directory")
    ap.add_argument("--compare-staleness", action="store_true",
                    help="run K=0 and K=1 (--max-staleness) side by side and compare iterations per hour")
    ap.add_argument("--compare-sync-mode", action="store_true",
                    help="the demo's loop at --max-staleness 1, --sync-mode inflight then drain, side by side")
    ap.add_argument("--demo-samples", type=int, default=None,
                    help="--compare-sync-mode: samples per task (default: the demo's)")
    ap.add_argument("--demo-workers", type=int, default=None,
                    help="--compare-sync-mode: the node's RUN slots (default: the demo's; fewer: longer "
                         "rollouts, so that the sync lands in calls in flight)")
    ap.add_argument("--no-held-out", action="store_true", help="--compare-sync-mode: no held-out tasks")
    args = ap.parse_args()
    if args.iterations is None:
        args.iterations = 2 if (args.demo or args.compare_staleness) else 3 if args.compare_sync_mode else 200
    if args.read:
        return 0 if report(Path(args.read), None) else 1
    if args.compare_sync_mode:
        arms = {}
        for mode in ("inflight", "drain"):   # one after the other on the same machine; vLLM restarts for each
            out = Path(f"{args.out}-{mode}")
            wall, counts = run_sync_mode(out, mode, args.iterations, args.backend, args.demo_samples,
                                         not args.no_held_out, args.demo_workers)
            arms[mode] = (out, wall, counts)
        report_sync_modes(arms)
        return 0
    if not (args.demo or args.compare_staleness):
        out = Path(args.out)
        if (out / "run").exists():
            raise SystemExit(f"{out}/run exists: give another --out (a run starts fresh)")
        t0 = time.monotonic()
        seen = run_standin(out, args.iterations, args.kill_at, args.tasks, args.samples, args.workers,
                           args.report_to)
        print(f"{args.iterations} iterations in {time.monotonic() - t0:.0f} s")
        ok = report_standin(out, seen, args.iterations, args.kill_at)
        if args.report_to:
            ok &= check_trackers(out, args.report_to)
        return 0 if ok else 1
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
