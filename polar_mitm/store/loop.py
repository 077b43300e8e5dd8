"""The closed loop's bookkeeping (polar-train loop): one row per iteration, per optimizer
step and per policy version. Plain dicts in; all SQL here."""

from __future__ import annotations

import os
from typing import Iterable

import orjson

from .db import reading, writing

ITERATION_COLUMNS = (
    "run_id", "iteration", "policy_version", "checkpoint", "reward_mean", "reward_std",
    "eval_reward_mean", "sessions_done", "sessions_failed", "sessions_timed_out", "calls", "tokens",
    "stale_dropped", "loss", "clip_frac", "logprob_abs_diff", "rollout_s", "train_s", "sync_s", "sync_drain_s",
    "sync_reload_s", "sync_reset_s", "sync_wake_s", "sleep_s", "per_task")


def record_iteration(db: str | os.PathLike, row: dict, steps: Iterable[dict], timeout: float = 120.0) -> None:
    """The iteration's row and its optimizer steps, replacing those of an earlier try of it."""
    values = [orjson.dumps(row[c]).decode() if c == "per_task" else row.get(c) for c in ITERATION_COLUMNS]
    with writing(db, timeout) as con:
        con.execute("BEGIN")
        con.execute("DELETE FROM loop_iterations WHERE run_id = ? AND iteration = ?",
                    [row["run_id"], row["iteration"]])
        con.execute("DELETE FROM loop_steps WHERE run_id = ? AND iteration = ?", [row["run_id"], row["iteration"]])
        con.execute(f"INSERT INTO loop_iterations ({', '.join(ITERATION_COLUMNS)}) "
                    f"VALUES ({', '.join('?' * len(ITERATION_COLUMNS))})", values)
        for m in steps:
            con.execute("INSERT INTO loop_steps VALUES (?, ?, ?, ?) ON CONFLICT DO UPDATE SET "
                        "iteration = excluded.iteration, metrics = excluded.metrics",
                        [row["run_id"], row["iteration"], m["global_step"], orjson.dumps(m).decode()])
        con.execute("COMMIT")


def record_version(db: str | os.PathLike, run_id: str, version: int, checkpoint: str | None,
                   timeout: float = 120.0) -> None:
    with writing(db, timeout) as con:
        con.execute("INSERT INTO policy_versions (run_id, version, checkpoint) VALUES (?, ?, ?) "
                    "ON CONFLICT DO UPDATE SET checkpoint = excluded.checkpoint, synced_at = now()",
                    [run_id, version, checkpoint])


def iterations(db: str | os.PathLike, run_id: str, timeout: float = 30.0) -> list[dict]:
    with reading(db, timeout) as con:
        cur = con.execute("SELECT * FROM loop_iterations WHERE run_id = ? ORDER BY iteration", [run_id])
        cols = [d[0] for d in cur.description]
        return [dict(zip(cols, r)) for r in cur.fetchall()]
