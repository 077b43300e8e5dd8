"""The closed loop's bookkeeping (polar-train loop): one row per iteration, per optimizer
step and per policy version. Typed rows in; all SQL here."""

from __future__ import annotations

import math
import os
from typing import Any, Iterable, Mapping, TypedDict

import orjson

from .db import reading, writing


class TaskRewards(TypedDict):
    mean: float | None
    std: float | None
    n: int


class IterationRow(TypedDict, total=False):
    """One loop_iterations row, filled in as the iteration goes (absent: NULL)."""
    run_id: str
    iteration: int
    policy_version: int              # the version that sampled the iteration
    checkpoint: str | None           # what it trained, served as policy_version + 1
    reward_mean: float | None
    reward_std: float | None
    eval_reward_mean: float | None
    sessions_done: int
    sessions_failed: int
    sessions_timed_out: int
    calls: int
    tokens: int
    stale_dropped: int
    loss: float | None
    clip_frac: float | None
    logprob_abs_diff: float | None
    rollout_s: float
    train_s: float
    sync_s: float
    sync_drain_s: float | None
    sync_reload_s: float | None
    sync_reset_s: float | None
    sync_wake_s: float | None
    sleep_s: float | None
    per_task: dict[str, TaskRewards]   # stored as JSON
    sessions_released: int           # attempts handed back and run again (never scored)
    released_why: dict[str, int]     # stored as JSON: {cause: n} (rewards.release_causes)
    reward_n: int                    # rewarded sessions (training tasks): reward_std / sqrt(n - 1) is the SE
    eval_reward_std: float | None    # held-out tasks' population std
    eval_reward_n: int | None
    journal_saves: int | None        # the rollout server's journal saves in the iteration
    journal_save_p50_ms: float | None
    journal_save_p99_ms: float | None
    stale_tokens: int                # sampled tokens context only: more than --max-staleness versions behind
    unknown_version_tokens: int      # sampled tokens context only: of a version not known
    sync_mode: str | None            # inflight | drain (None: no sync)
    sync_stall_s: float | None       # seconds vLLM generated nothing for the sync


def standard_error(std: float | None, n: int | None) -> float | None:
    """The standard error of a mean from its population std over n samples (as the loop
    computes it: std / sqrt(n - 1), the sample std / sqrt(n)); None when unknown."""
    if std is None or n is None or n < 2 or not math.isfinite(std):
        return None
    return std / math.sqrt(n - 1)


ITERATION_COLUMNS = tuple(IterationRow.__annotations__)
_JSON_COLUMNS = frozenset({"per_task", "released_why"})


def record_iteration(db: str | os.PathLike, row: IterationRow, steps: Iterable[Mapping[str, Any]],
                     timeout: float = 120.0) -> None:
    """The iteration's row and its optimizer steps (the trainer's metrics, global_step
    included), replacing those of an earlier try of it."""
    values = [orjson.dumps(row.get(c)).decode() if c == "per_task" or (c in _JSON_COLUMNS and c in row)
              else row.get(c) for c in ITERATION_COLUMNS]
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


def iterations(db: str | os.PathLike, run_id: str, timeout: float = 30.0) -> list[dict[str, Any]]:
    """The run's loop_iterations rows as stored (per_task as JSON text), in order."""
    with reading(db, timeout) as con:
        cur = con.execute("SELECT * FROM loop_iterations WHERE run_id = ? ORDER BY iteration", [run_id])
        cols = [d[0] for d in cur.description or []]
        return [dict(zip(cols, r)) for r in cur.fetchall()]


def steps(db: str | os.PathLike, run_id: str, timeout: float = 30.0) -> list[tuple[int, dict[str, Any]]]:
    """The run's optimizer steps as recorded: (0-based iteration, the trainer's metrics with
    global_step), in order."""
    with reading(db, timeout) as con:
        rows = con.execute("SELECT iteration, metrics FROM loop_steps WHERE run_id = ? ORDER BY global_step",
                           [run_id]).fetchall()
    return [(it, orjson.loads(m)) for it, m in rows]
