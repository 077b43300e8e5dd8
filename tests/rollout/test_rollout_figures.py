"""The figures an RL user watches (issue 22, section 6): per task the reward's mean, std, min and
max with zero-variance groups flagged; calls and tokens per session; sessions per minute; the
model backend's busy share (from the recorded calls' timing); an ETA; why sessions were
cancelled. On `polar-mitm rollout` over the scripted backend with the `command` harness, the
busy share is checked against the backend's own record of when it was generating."""

from __future__ import annotations

import json
import re
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from polar_mitm.cli.rollout import RunFigures, reward_figures
from polar_mitm.store import connect, init_db
from polar_mitm.store.figures import backend_busy, run_figures, session_calls
from support.fake_vllm import FakeVLLM
from support.rollouts import Rollouts
from support import SUPPORT

HERE = SUPPORT   # the helper scripts the sessions run
FAKE = f"{sys.executable} {HERE / 'fake_harness.py'}"
POLAR = str(Path(sys.executable).parent / "polar-mitm")


class TimedVLLM(FakeVLLM):
    """The scripted backend, noting when each completion was being generated (unix seconds):
    on /v1/chat/completions, where answer() runs once the delay is over."""

    def __init__(self, delay: float):
        super().__init__("scripted", token_route=False)
        self.delay = delay
        self.intervals: list[tuple[float, float]] = []
        self._lock = threading.Lock()

    def answer(self, body: dict) -> dict:
        end = time.time()
        with self._lock:
            self.intervals.append((end - self.delay, end))
        return super().answer(body)

    def busy_s(self) -> float:
        total, cur = 0.0, None
        for s, e in sorted(self.intervals):
            if cur is None or s > cur[1]:
                total += (cur[1] - cur[0]) if cur else 0.0
                cur = [s, e]
            else:
                cur[1] = max(cur[1], e)
        return total + ((cur[1] - cur[0]) if cur else 0.0)


def _calls(db: Path, rows: list[tuple]) -> None:
    """Recorded calls: (session_id, started_at, queue_ms, backend_ms, prompt, completion, error)."""
    init_db(db)
    con = connect(db)
    try:
        for i, (sid, t, q, b, p, c, err) in enumerate(rows):
            con.execute("INSERT INTO call_records_tail (call_id, session_id, seq, started_at, queue_ms, backend_ms, "
                        "prompt_tokens, completion_tokens, error) VALUES (?, ?, ?, to_timestamp(?), ?, ?, ?, ?, ?)",
                        [f"c{i}", sid, i, t, q, b, p, c, err])
    finally:
        con.close()


def test_busy_share_is_the_union_of_the_calls_backend_intervals_over_the_window(tmp_path):
    db = tmp_path / "r.duckdb"
    t = 1_700_000_000.0
    _calls(db, [("a~0", t, 0, 1000, 100, 10, None),         # [0, 1]
                ("a~0", t + 0.5, 0, 1000, 150, 10, None),   # [0.5, 1.5]: overlaps, union [0, 1.5]
                ("a~1", t + 3, 500, 1000, 50, 5, None),     # queued 0.5 s: at the backend [3.5, 4.5]
                ("a~1", t + 6, 0, 0, 0, 0, "refused"),      # never reached the backend
                ("other~0", t + 2, 0, 1000, 9, 9, None)])   # not one of the run's sessions
    ids = ["a~0", "a~1"]
    b = backend_busy(db, ids, t - 1, t + 9)
    assert b["busy_s"] == pytest.approx(2.5) and b["window_s"] == pytest.approx(10)
    assert b["share"] == pytest.approx(0.25) and b["calls"] == 3 and b["call_s"] == pytest.approx(3.0)
    # clipped to the window: [0.2, 1.5] and [3.5, 3.7]
    b = backend_busy(db, ids, t + 0.2, t + 3.7)
    assert b["busy_s"] == pytest.approx(1.5) and b["share"] == pytest.approx(1.5 / 3.5)
    assert backend_busy(db, ["a~0", "a~1", "other~0"], t - 1, t + 9)["busy_s"] == pytest.approx(3.5)
    assert backend_busy(db, [], t, t + 1)["share"] == 0.0
    assert session_calls(db, ids + ["none~0"]) == {
        "a~0": {"calls": 2, "failed_calls": 0, "prompt_tokens": 250, "completion_tokens": 20},
        "a~1": {"calls": 2, "failed_calls": 1, "prompt_tokens": 50, "completion_tokens": 5}}
    calls, busy = run_figures(db, ids, t - 1, t + 9)
    assert set(calls) == {"a~0", "a~1"} and busy["busy_s"] == pytest.approx(2.5)


def test_reward_figures_use_the_population_std_and_flag_a_group_with_zero_variance():
    s = [{"reward": r} for r in (0.25, 0.5, 0.75)] + [{"reward": None}]   # on_failure drop: no reward
    f = reward_figures(s)
    assert (f["n"], f["mean"], f["min"], f["max"], f["flat"]) == (3, 0.5, 0.25, 0.75, False)
    assert f["std"] == pytest.approx((0.125 / 3) ** 0.5)
    assert reward_figures([{"reward": 1.0}, {"reward": 1.0}])["flat"]
    assert reward_figures([{"reward": 0.1 + 0.2}, {"reward": 0.3}])["flat"]   # as the trainer sees it
    assert reward_figures([{"reward": 1.0}])["flat"]                         # one sample: no baseline
    assert reward_figures([{"reward": None}]) is None


def _tasks(path: Path) -> None:
    tasks = [
        # rewards 0.25, 0.5, 0.75
        {"task_id": "spread", "num_samples": 3, "command": f"{FAKE} ok 2",
         "evaluator": "echo 0.$(( (${POLAR_SESSION#spread~} + 1) * 25 ))"},
        {"task_id": "flat", "num_samples": 2, "command": f"{FAKE} ok 2", "evaluator": "echo 1.0"},
        # sample 0 finishes, the other two are stopped by the early stop
        {"task_id": "early", "num_samples": 3, "early_stop": 1, "evaluator": "echo 0",
         "command": f"if [ \"$POLAR_SESSION\" = early~0 ]; then {FAKE} ok 2; else {FAKE} slow:120 1; fi"},
    ]
    path.write_text("".join(json.dumps({"instruction": "x", "harness": "command", **t}) + "\n" for t in tasks))


def test_rollout_prints_the_figures_while_it_runs_and_in_its_summary(tmp_path):
    tasks, db = tmp_path / "tasks.jsonl", tmp_path / "r.duckdb"
    _tasks(tasks)
    with TimedVLLM(delay=0.4) as backend:
        t0 = time.monotonic()
        # two RUN slots: the eight sessions run in turns, so progress lines come between them
        out = subprocess.run([POLAR, "rollout", str(tasks), "--db", str(db), "--backend", backend.url, "--workers", "2"],
                             capture_output=True, text=True, timeout=180)
        took = time.monotonic() - t0
        truth, intervals = backend.busy_s(), list(backend.intervals)
    text = out.stdout
    assert out.returncode == 0, text + out.stderr
    # each group's figures as it settles, and in the summary table
    assert "group spread done: reward mean 0.500 std 0.204 min 0.250 max 0.750 (n=3)" in text, text
    assert re.search(r"group flat done: reward mean 1\.000 std 0\.000 min 1\.000 max 1\.000 \(n=2\)"
                     r"  ! zero variance: no signal", text), text
    row = next(line for line in text.splitlines() if line.startswith("spread "))
    assert row.split()[-5:] == ["3", "0.500", "0.204", "0.250", "0.750"], row
    row = next(line for line in text.splitlines() if line.startswith("flat "))
    assert row.endswith("! zero variance: no signal"), row
    # the progress line: states, rewards, sessions per minute and an ETA
    progress = [line for line in text.splitlines() if line.startswith("[") and "sessions:" in line]
    assert any(re.search(r"\| [\d.]+ sessions/min, ETA \d+", line) for line in progress), progress
    assert "sessions: done 3 cancelled 2 | mean reward" in progress[-1] or \
        re.search(r"sessions: done \d cancelled 2", progress[-1]), progress[-1]
    # sessions per minute over this run: 6 finished (spread 3, flat 2, early~0)
    m = re.search(r"\n6 session\(s\) finished in (\d+)s: ([\d.]+) sessions/min", text)
    assert m and 0 < int(m[1]) <= took, text
    rate = float(m[2])
    # calls and tokens per finished session: two calls each, none failed
    m = re.search(r"per session \(6\): 2\.0 calls \(0\.0 failed\), (\d+) prompt \+ (\d+) completion tokens", text)
    assert m and int(m[1]) > 0 and int(m[2]) > 0, text
    # busy share: the recorded backend time agrees with the backend's own (a straggler that
    # started before the early stop made its one call too; 0.4 s each, up to 2 at once)
    m = re.search(r"model backend busy ([\d.]+)% of the wall time \(([\d.]+)s of ([\d.]+)s with at least one "
                  r"call at the backend; (\d+) calls, ([\d.]+) at once while busy\)", text)
    assert m, text
    busy, window, n = float(m[2]), float(m[3]), int(m[4])
    # every call the backend answered, but a straggler's that may still be at the backend when
    # the early stop has settled every group and the run prints its figures
    assert len(intervals) - 1 <= n <= len(intervals) and 12 <= n <= 14, (n, len(intervals))
    assert busy == pytest.approx(truth, abs=0.1 + 0.1 * truth), (busy, truth)
    assert float(m[1]) == pytest.approx(100 * busy / window, abs=0.1 * 100 / window) and window <= took   # shown to 0.1 s
    # calls at once while busy: the recorded backend seconds (each call's 0.4 s and what a
    # loaded machine adds to it) over the busy time
    with connect(db, read_only=True) as con:
        call_s = con.execute("SELECT sum(backend_ms) / 1e3 FROM call_records WHERE backend_ms > 0").fetchone()[0]
    assert call_s >= n * 0.4 and float(m[5]) == pytest.approx(call_s / busy, rel=0.1)
    assert rate == pytest.approx(6 / window * 60, rel=0.05)      # over the same wall time
    # why the two stragglers were cancelled
    assert "cancelled: early stop: 1 of 3 sessions finished x2" in text, text


def test_the_progress_line_shows_the_backend_busy_share_and_calls_per_session(start_proxy, tmp_path):
    """In-process, the figures read from the database at every tick."""
    with TimedVLLM(delay=0.3) as backend:
        proxy = start_proxy(backend.url)
        with Rollouts(proxy, tmp_path / "sessions") as rollouts:
            server = rollouts.server
            server.submit({"task_id": "p", "instruction": "x", "harness": "command", "num_samples": 4,
                           "command": f"{FAKE} ok 3", "evaluator": "echo 1"})
            run = RunFigures(server, str(proxy.db), ["p"], db_every=0.0, print_every=0.0)
            lines = []
            etas = []
            while not server.wait(["p"], timeout=0.5):
                lines += run.tick()
                etas.append(run.eta())
            run.stop_clock()
            lines += run.tick(final=True)
    last = lines[-1]
    assert "sessions: done 4 | mean reward 1.000 (n=4)" in last, lines
    assert re.search(r"per session 3\.0 calls, \d+ prompt \+ \d+ completion tokens", last), last
    m = re.search(r"backend busy (\d+)%", last)
    assert m and 0 < int(m[1]) <= 100, last
    assert "group p done: reward mean 1.000 std 0.000 min 1.000 max 1.000 (n=4)  ! zero variance" in "\n".join(lines)
    assert "zero-variance groups 1 of 1" in last
    assert run.eta() == 0.0 and run.rate() > 0
    # once a session finished and while some were left, an ETA: left / rate
    assert any(e for e in etas) and any(re.search(r", ETA \d+s \|", line) for line in lines), lines
