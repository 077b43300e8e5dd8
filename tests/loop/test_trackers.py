"""--report-to: what each tracker logged, read back with that library's own reader
(TensorBoard's EventAccumulator, MLflow's client, wandb's offline run files through its
protobuf Record, trackio's SQLite storage), equals what was given: driven directly, and
through the real loop (stand-ins) against its loop_iterations and loop_steps tables. A
resume continues one run in each tracker. Nothing reaches the network: wandb runs offline
(its default here), MLflow on a local SQLite file, trackio locally."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from polar_mitm.loop.trackers import (PROJECT, iteration_metrics, open_trackers,
                                 parse_report_to, step_metrics, wandb_last_step, wandb_records)
from support.tracker_readers import QUIET, READERS, put_figure, read_wandb

TRAIN = str(Path(sys.executable).parent / "polar-train")
ALL = ("tensorboard", "wandb", "mlflow", "trackio")
# the trackers' own settings: none from the developer's environment, nothing leaves the machine
TRACKER_ENV = ("WANDB_MODE", "WANDB_DIR", "WANDB_PROJECT", "WANDB_RUN_ID", "WANDB_RESUME", "MLFLOW_TRACKING_URI",
               "MLFLOW_EXPERIMENT_NAME", "MLFLOW_EXPERIMENT_ID", "TRACKIO_DIR", "TRACKIO_PROJECT", "TRACKIO_SPACE_ID",
               "TRACKIO_SERVER_URL", "TRACKIO_BUCKET_ID", "TRACKIO_DATASET_ID")


@pytest.fixture
def tracker_env(monkeypatch):
    for name in TRACKER_ENV:
        monkeypatch.delenv(name, raising=False)
    for name, value in QUIET.items():
        monkeypatch.setenv(name, value)


def _close(got: dict, want: dict, what: str, rel: float) -> None:
    """Every metric of want, at every step, as got (TensorBoard stores float32)."""
    for axis in ("iteration", "global_step"):
        assert set(got.get(axis, {})) == set(want.get(axis, {})), (what, axis, set(got.get(axis, {})) ^ set(want.get(axis, {})))
        for name, steps in want.get(axis, {}).items():
            assert got[axis][name] == pytest.approx(steps, rel=rel), (what, name)


# ---- driven directly ------------------------------------------------------------------------

def _row(it: int, reward: float, **extra) -> dict:
    return {"run_id": "r0", "iteration": it, "policy_version": it, "checkpoint": f"/ckpt/v{it + 1}",
            "reward_mean": reward, "reward_std": 0.25, "eval_reward_mean": None if it == 0 else reward / 2,
            "sessions_done": 3, "sessions_failed": 1, "sessions_timed_out": 0, "sessions_released": 1,
            "released_why": {"backend unavailable": 1}, "calls": 7, "tokens": 123, "stale_dropped": it,
            "loss": -0.125, "clip_frac": 0.0625, "logprob_abs_diff": 0.001, "rollout_s": 1.5 + it,
            "train_s": 2.25, "sync_s": 0.125, "sync_drain_s": None,
            "per_task": {"add-3+5": {"mean": reward, "std": 0.5, "n": 2}, "b": {"mean": 0.75, "std": 0.0, "n": 2}},
            **extra}


def _step(g: int, loss: float) -> dict:
    return {"step": 1, "global_step": g, "epoch": 0, "loss": loss, "clip_frac": 0.125, "kl": 0.01 * g,
            "grad_norm": 1.5 + g, "logprob_abs_diff": 0.002, "lr": 1e-3 * g, "reward_mean": 0.5}


def _expect(logged: list[tuple[str, dict]]) -> dict:
    want: dict = {}
    for kind, x in logged:
        if kind == "steps":
            for name, v in step_metrics(x).items():
                put_figure(want, name, x["global_step"], v)
        else:
            for name, v in iteration_metrics(x).items():
                put_figure(want, name, x["iteration"] + 1, v)
    return want


def test_each_tracker_reads_back_what_was_logged_and_a_resume_continues_its_run(tmp_path, tracker_env):
    out = tmp_path / "run"
    logged: list[tuple[str, dict]] = []

    def iteration(trackers, it, steps, reward, global_step):
        history = [_step(g, loss) for g, loss in steps]
        trackers.log_steps(history, iteration=it)
        trackers.log_iteration(_row(it, reward), global_step=global_step)
        logged.extend([("steps", m) for m in history] + [("row", _row(it, reward))])

    lines: list[str] = []
    trackers = open_trackers(ALL, out, "r0", config={"train": {"lr": 1e-3}, "out": out}, echo=lines.append)
    assert [t.name for t in trackers.trackers] == list(ALL) and "wandb" in lines[0] and "offline" in lines[0]
    iteration(trackers, 0, [(1, 0.5), (2, 0.25)], 0.5, 2)
    iteration(trackers, 1, [(3, 0.125)], 0.625, 3)
    trackers.close()
    # a kill -9 after iteration 2 was logged but before it counted: the rerun logs it again
    # (other values), then goes on; the next iteration has no learning signal (no steps)
    trackers = open_trackers(ALL, out, "r0", config={"train": {"lr": 1e-3}, "out": out}, echo=lines.append)
    iteration(trackers, 1, [(3, -0.5)], 0.875, 3)
    iteration(trackers, 2, [], 1.0, 3)
    trackers.close()

    want = _expect(logged)
    assert want["iteration"]["reward/mean"] == {1: 0.5, 2: 0.875, 3: 1.0}   # the redone iteration's last value
    assert want["iteration"]["reward/task/add-3_5"] == {1: 0.5, 2: 0.875, 3: 1.0}
    assert want["iteration"]["sessions/done"] == {1: 3, 2: 3, 3: 3}
    assert want["iteration"]["iteration/stale_dropped"] == {1: 0, 2: 1, 3: 2}
    assert want["global_step"]["train/loss"] == {1: 0.5, 2: 0.25, 3: -0.5}
    assert "reward/held_out" in want["iteration"] and "time/sync_drain_s" not in want["iteration"]
    for name in ALL:
        got = READERS[name](out, "r0")
        _close(got, want, name, rel=1e-6 if name == "tensorboard" else 1e-12)
    assert read_wandb(out, "r0")["segments"] == 2
    assert not (tmp_path / "wandb").exists() and (out / "wandb").is_dir()   # under --out, not the cwd


RESUME_ROWS = [_row(0, 0.5), _row(1, 0.625), _row(2, 0.75)]
RESUME_STEPS = [(0, _step(1, 0.5)), (0, _step(2, 0.25)), (1, _step(3, 0.125)), (2, _step(4, -0.25))]


def _log_lose_tails_and_resume(out: Path) -> list[str]:
    """Three iterations logged to every tracker; wandb's file and trackio's database cut back
    as a kill -9 leaves them; the resume's catch-up. In a process of its own (trackio fixes
    its directory when first imported)."""
    import sqlite3

    trackers = open_trackers(ALL, out, "r0", echo=lambda m: None)
    for row in RESUME_ROWS:
        trackers.log_steps([m for it, m in RESUME_STEPS if it == row["iteration"]], iteration=row["iteration"])
        trackers.log_iteration(row)
    trackers.close()
    (folder,) = (out / "wandb").glob("offline-run-*-r0")
    wandb_file = folder / "run-r0.wandb"
    assert wandb_last_step(wandb_file) == 4 + 3          # wandb's step: global_step + iteration
    data = wandb_file.read_bytes()
    cut = len(data)
    while wandb_last_step(wandb_file) > 4:      # a tail lost mid-record, as a kill leaves it: up to
        cut -= 37                               # iteration 2's optimizer step, not its row
        wandb_file.write_bytes(data[:cut])
    with sqlite3.connect(out / "trackio" / f"{PROJECT}.db") as con:
        logged = con.execute("SELECT id, step, CAST(metrics AS TEXT) FROM metrics ORDER BY id").fetchall()
        first = next(i for i, step, m in logged if step == 1 and '"reward/mean"' in m)   # iteration 1's row
        con.execute("DELETE FROM metrics WHERE id > ?", [first])
    lines: list[str] = []
    trackers = open_trackers(ALL, out, "r0", echo=lines.append)
    trackers.catch_up(RESUME_ROWS, RESUME_STEPS)
    trackers.close()
    return lines


def test_a_resume_logs_again_what_a_tracker_writing_behind_the_loop_lost_to_a_kill(tmp_path, tracker_env):
    """wandb's service and trackio's sender thread write after log() returns: a kill -9 loses
    what they still held (2 of 200 iterations in wandb's files in the long-run bench). Emulated
    by cutting each one's store back; the resume reads what each holds and logs the rest from
    the database's rows and steps, to those two only."""
    out = tmp_path / "run"
    code = f"import json, test_trackers as t; print(json.dumps(t._log_lose_tails_and_resume(t.Path({str(out)!r}))))"
    here = Path(__file__).resolve().parent    # this module, and support/ beside it
    done = subprocess.run([sys.executable, "-c", code], cwd=here, capture_output=True, text=True, timeout=300,
                          env={**os.environ, "PYTHONPATH": os.pathsep.join([str(here), str(here.parent)])})
    assert done.returncode == 0, done.stderr[-3000:]
    lines = json.loads(done.stdout.strip().splitlines()[-1])
    assert [x for x in lines if "holds" in x] == [
        "--report-to wandb: it holds iterations 1-1 of this run; logging 2 more from the database",
        "--report-to trackio: it holds iterations 1-1 of this run; logging 2 more from the database"], lines
    want = _expect([("steps", m) if kind == "s" else ("row", m) for kind, m in
                    [("s", RESUME_STEPS[0][1]), ("s", RESUME_STEPS[1][1]), ("r", RESUME_ROWS[0]),
                     ("s", RESUME_STEPS[2][1]), ("r", RESUME_ROWS[1]), ("s", RESUME_STEPS[3][1]), ("r", RESUME_ROWS[2])]])
    for name in ALL:   # every tracker has every iteration and step
        _close(READERS[name](out, "r0"), want, name, rel=1e-6 if name == "tensorboard" else 1e-12)
    # wandb's own step goes on where the lost tail stopped, each step once
    orders = [r.history.step.num for p in sorted((out / "wandb").glob("offline-run-*-r0"))
              for r in wandb_records(p / "run-r0.wandb") if r.WhichOneof("record_type") == "history"]
    assert orders == [1, 2, 3, 4, 5, 6, 7], orders


def test_report_to_parses_repeats_commas_and_none():
    assert parse_report_to(["wandb,tensorboard", "wandb", " MLflow "]) == ("wandb", "tensorboard", "mlflow")
    assert parse_report_to(["none"]) == () and parse_report_to([]) == ()
    with pytest.raises(ValueError, match="'comet' is not a tracker"):
        parse_report_to(["tensorboard,comet"])


# ---- a missing one --------------------------------------------------------------------------

HIDDEN = """
import sys
sys.modules["wandb"] = None   # as if not installed
from polar_mitm.cli.train import main
main(["loop", "--tasks", sys.argv[1], "--iterations", "1", "--out", sys.argv[2],
      "--report-to", "tensorboard,wandb"], prog_name="polar-train")
"""


def test_a_missing_tracker_is_one_line_naming_its_extra(tmp_path):
    tasks = tmp_path / "tasks.jsonl"
    tasks.write_text('{"task_id": "a", "instruction": "hi"}\n')
    out = tmp_path / "run"
    done = subprocess.run([sys.executable, "-c", HIDDEN, str(tasks), str(out)], capture_output=True, text=True,
                          timeout=120)
    assert done.returncode == 1, (done.stdout, done.stderr)
    assert done.stderr.strip().splitlines() == [
        "Error: --report-to wandb: the wandb package is not installed: pip install 'polar-mitm[wandb]'"], done.stderr
    assert not out.exists()       # said before anything started
    bad = subprocess.run([TRAIN, "loop", "--tasks", str(tasks), "--iterations", "1", "--out", str(out),
                          "--report-to", "comet"], capture_output=True, text=True, timeout=120)
    assert bad.returncode == 2 and "'comet' is not a tracker" in bad.stderr, bad.stderr


# ---- through the loop -----------------------------------------------------------------------

def test_the_loop_reports_its_tables_to_every_tracker_and_a_resume_continues_the_run(tmp_path):
    from support.fake_vllm import FakeVLLM
    from support.grpo_data import tiny_model_dir
    from polar_mitm.store import query
    from support.loop_run import fake_tasks

    model = str(tiny_model_dir(tmp_path / "model"))
    tasks = fake_tasks(tmp_path, "ok 1")
    held_out = tmp_path / "heldout.jsonl"
    held_out.write_text(json.dumps({**json.loads(tasks.read_text().splitlines()[0]), "task_id": "h"}) + "\n")
    out = tmp_path / "run"
    env = {k: v for k, v in os.environ.items() if k not in TRACKER_ENV} | QUIET | {"WANDB_MODE": "offline"}
    with FakeVLLM(delay=0.02) as fake:
        argv = [TRAIN, "loop", "--tasks", str(tasks), "--eval-tasks", str(held_out), "--out", str(out),
                "--harness", "command", "--samples", "2", "--backend", fake.url, "--model", model,
                "--lr", "1e-3", "--token-budget", "256", "--workers", "4", "--max-tokens", "8", "--keep", "1",
                "--report-to", "tensorboard,wandb", "--report-to", "mlflow,trackio"]
        for iterations in ("2", "3"):     # then a rerun with more: a resume
            run = subprocess.run(argv + ["--iterations", iterations], env=env, stdout=subprocess.PIPE,
                                 stderr=subprocess.STDOUT, text=True, timeout=600)
            assert run.returncode == 0, run.stdout[-3000:]
            assert "reporting run" in run.stdout, run.stdout[-3000:]

    run_id = json.loads((out / "loop.json").read_text())["run_id"]
    db = out / "rollouts.duckdb"
    cols, rows = query(db, "SELECT iteration, reward_mean, reward_std, eval_reward_mean, rollout_s, train_s, sync_s, "
                           "stale_dropped, sessions_done, sessions_failed, calls, loss FROM loop_iterations "
                           "WHERE run_id = ? ORDER BY iteration", [run_id])
    assert [r[0] for r in rows] == [0, 1, 2]
    names = {"reward_mean": "reward/mean", "reward_std": "reward/std", "eval_reward_mean": "reward/held_out",
             "rollout_s": "time/rollout_s", "train_s": "time/train_s", "sync_s": "time/sync_s",
             "stale_dropped": "iteration/stale_dropped", "sessions_done": "sessions/done",
             "sessions_failed": "sessions/failed", "calls": "iteration/calls", "loss": "iteration/loss"}
    want: dict = {}
    for r in rows:
        for col, v in zip(cols[1:], r[1:]):
            if v is not None:
                want.setdefault("iteration", {}).setdefault(names[col], {})[r[0] + 1] = float(v)
    assert set(want["iteration"]["reward/held_out"]) == {1, 2, 3}
    _, steps = query(db, "SELECT global_step, metrics FROM loop_steps WHERE run_id = ? ORDER BY 1", [run_id])
    assert len(steps) >= 3
    for g, metrics in steps:
        m = json.loads(metrics)
        for key in ("loss", "grad_norm", "lr", "kl", "clip_frac", "logprob_abs_diff"):
            want.setdefault("global_step", {}).setdefault(f"train/{key}", {})[g] = float(m[key])
    for name in ALL:
        got = READERS[name](out, run_id)
        for axis, metrics in want.items():
            for metric, values in metrics.items():
                assert got[axis][metric] == pytest.approx(values, rel=1e-6 if name == "tensorboard" else 1e-12), \
                    (name, metric)
    assert read_wandb(out, run_id)["segments"] == 2



# ---- polar-train train ----------------------------------------------------------------------

def test_train_reports_its_steps_and_a_rerun_continues_the_same_run(tmp_path, tracker_env):
    from click.testing import CliRunner

    from support.grpo_data import synthetic_calls, tiny_model_dir, write_calls
    from polar_mitm.store.training import set_rewards
    from polar_mitm.cli.train import main

    calls = synthetic_calls()
    db = tmp_path / "a.duckdb"
    write_calls(db, calls)
    set_rewards(db, [{"session_id": c.session_id, "reward": c.reward} for c in calls])
    model = tiny_model_dir(tmp_path / "model")
    out = tmp_path / "run"
    for _ in range(2):     # the same command twice: one tracker run
        r = CliRunner().invoke(main, ["train", "--db", str(db), "--model", str(model), "--out", str(out), "--lr", "1e-3",
                                      "--groups-per-step", "1", "--token-budget", "64",
                                      "--report-to", "tensorboard,mlflow"], catch_exceptions=False)
        assert r.exit_code == 0, r.output
    run_id = json.loads((out / "tracker_run.json").read_text())["run_id"]
    steps = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]   # the rerun's
    assert [m["global_step"] for m in steps] == [1, 2]
    want: dict = {}
    for m in steps:
        for name, v in step_metrics(m).items():
            put_figure(want, name, m["global_step"], v)
    for name in ("tensorboard", "mlflow"):
        got = READERS[name](out, run_id)
        _close(got, want, name, rel=1e-6 if name == "tensorboard" else 1e-12)
