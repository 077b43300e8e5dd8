"""The rollout server's journal in DuckDB: tasks, sessions, their state changes and rewards.

The server's batches are durable first in an append-only log (journal_log.py), and folded
into these tables every few seconds, a transaction per fold; on a restart it reads it all
back, the log's unfolded batches over the tables.
Why a task's unfinished sessions were stopped (a cancel request, an early stop) is the detail
of its "stopping" event, read back as the task's cancel_reason.
"""

from __future__ import annotations

import os
from typing import TypedDict

import orjson

from . import journal_log
from .journal_log import Batch, Event, SessionRow, TaskRow  # noqa: F401 - the journal's rows, re-exported
from .db import init_db, reading, writing
from .meta import meta_value, set_meta_value


STOPPING = "stopping"      # a task-level event: its unfinished sessions are being stopped (detail: why)


def _j(v) -> str | None:
    return None if v is None else orjson.dumps(v).decode()


# A session's outputs (the node's stats "harness_output" and "eval_output": bounded tails,
# credentials redacted) are columns of rollout_sessions, not part of its stats JSON.
OUTPUTS = ("harness_output", "eval_output")


def _split_outputs(stats: dict | None) -> tuple[str | None, str | None, str | None]:
    """(stats JSON without the outputs, harness_output, eval_output)."""
    if not stats:
        return _j(stats), None, None
    rest = {k: v for k, v in stats.items() if k not in OUTPUTS}
    harness, evaluator = (None if stats.get(k) is None else str(stats[k]) for k in OUTPUTS)
    return _j(rest), harness, evaluator


def _joined_outputs(stats: str | None, harness_output: str | None, eval_output: str | None) -> dict | None:
    """The stats as the server held them: the outputs back in."""
    out = orjson.loads(stats) if stats else None
    extra = {k: v for k, v in zip(OUTPUTS, (harness_output, eval_output)) if v is not None}
    return {**(out or {}), **extra} if extra else out


def ensure(path: str | os.PathLike, timeout: float = 60.0) -> None:
    init_db(path, timeout)


def save(path: str | os.PathLike, batch: Batch, timeout: float = 60.0) -> None:
    """One transaction: a crash leaves either all of a batch or none of it."""
    with writing(path, timeout) as con:
        con.execute("BEGIN")
        try:
            _apply(con, batch)
            con.execute("COMMIT")
        except BaseException:
            con.execute("ROLLBACK")
            raise


def folded_segment(con) -> int:
    """The number of the journal log's last segment folded into the tables (0: none)."""
    return int(meta_value(con, journal_log.FOLDED_KEY) or 0)


def folded_through(path: str | os.PathLike, timeout: float = 60.0) -> int:
    """The number of the journal log's last segment folded into the tables (0: none)."""
    if not os.path.exists(path):
        return 0
    with reading(path, timeout) as con:
        return folded_segment(con)


def save_segments(path: str | os.PathLike, segments: list[tuple[int, list[Batch]]], timeout: float = 60.0) -> int:
    """The journal log's segments (numbered, in order) in one transaction with the number of
    the last: those folded before are skipped, so each batch lands once. Returns the batches
    written."""
    with writing(path, timeout) as con:
        con.execute("BEGIN")
        try:
            done = folded_segment(con)
            todo = [(n, batches) for n, batches in segments if n > done]
            if not todo:
                con.execute("ROLLBACK")
                return 0
            _apply(con, journal_log.merge([b for _, batches in todo for b in batches]))
            set_meta_value(con, journal_log.FOLDED_KEY, str(todo[-1][0]))
            con.execute("COMMIT")
        except BaseException:
            con.execute("ROLLBACK")
            raise
    return sum(len(b) for _, b in todo)


def fold(path: str | os.PathLike, log: journal_log.JournalLog | None = None, timeout: float = 60.0) -> int:
    """The journal log's closed segments into the tables (a running server's log: its open
    segment is closed first, and later appends go to a new one); then they are deleted.
    Returns the batches written."""
    below = log.rotate() if log is not None else None
    paths = [p for p in journal_log.segments(journal_log.log_dir(path)) if below is None or journal_log.seq(p) < below]
    if not paths:
        return 0
    n = save_segments(path, [(journal_log.seq(p), journal_log.read_segment(p)) for p in paths], timeout)
    for p in paths:
        p.unlink(missing_ok=True)
    return n


def fold_orphaned(path: str | os.PathLike, timeout: float = 60.0) -> int:
    """A journal log no live server appends to (one killed -9), folded: SQL sees its last state."""
    if not journal_log.segments(journal_log.log_dir(path)) or journal_log.owner_alive(path):
        return 0
    return fold(path, timeout=timeout)


def _apply(con, batch: Batch) -> None:
    """A batch's rows and events (in the caller's transaction)."""
    if batch["tasks"]:
        con.executemany(
            "INSERT INTO rollout_tasks (task_id, spec, state, priority, callback_state, "
            "callback_tries, submit_order) VALUES (?, ?, ?, ?, ?, ?, ?) ON CONFLICT (task_id) DO UPDATE SET "
            "state = excluded.state, callback_state = excluded.callback_state, "
            "callback_tries = excluded.callback_tries, updated_at = now()",
            [[t["task_id"], _j(t["spec"]), t["state"], t["priority"], t["callback_state"],
              t["callback_tries"], t["order"]] for t in batch["tasks"]])
    if batch["sessions"]:
        con.executemany(
            "INSERT INTO rollout_sessions (session_id, task_id, sample, attempt, state, "
            "node_id, reward, reason, stats, harness_output, eval_output) "
            "VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?) "
            "ON CONFLICT (session_id) DO UPDATE SET state = excluded.state, "
            "node_id = excluded.node_id, reward = excluded.reward, reason = excluded.reason, "
            "stats = excluded.stats, harness_output = excluded.harness_output, "
            "eval_output = excluded.eval_output, updated_at = now()",
            [[s["session_id"], s["task_id"], s["sample"], s["attempt"], s["state"],
              s["node_id"], s["reward"], s["reason"], *_split_outputs(s["stats"])]
             for s in batch["sessions"]])
    if batch["events"]:
        con.executemany(
            "INSERT INTO rollout_events VALUES (to_timestamp(0) + to_microseconds(?), ?, ?, ?, ?, ?)",
            [[e["at_us"], e["task_id"], e["session_id"], e["state"], e["node_id"], e["detail"]]
             for e in batch["events"]])


def load(path: str | os.PathLike, timeout: float = 60.0) -> tuple[list[TaskRow], list[SessionRow]]:
    """Every task and session, for a restarted server: the tables, and over them what the
    journal log holds that is not folded yet (a server killed -9, or one running)."""
    for _ in range(20):
        tasks, sessions, folded = _load_tables(path, timeout)
        try:
            _, batches = journal_log.unfolded(path, folded)
        except FileNotFoundError:
            continue      # a running server folded a segment meanwhile: the tables have it now
        if batches:
            newer = journal_log.merge(batches)
            by_task = {t["task_id"]: t for t in tasks}
            by_task.update({t["task_id"]: t for t in newer["tasks"]})   # newer ones go last
            tasks = list(by_task.values())
            by_session = {s["session_id"]: s for s in sessions}
            by_session.update({s["session_id"]: s for s in newer["sessions"]})
            sessions = sorted(by_session.values(), key=lambda s: (s["task_id"], s["sample"], s["attempt"]))
        return tasks, sessions
    raise RuntimeError(f"{path}: the rollout journal kept changing while read")


def _load_tables(path: str | os.PathLike, timeout: float) -> tuple[list[TaskRow], list[SessionRow], int]:
    with reading(path, timeout) as con:
        tasks = [TaskRow(task_id=r[0], spec=orjson.loads(r[1]), state=r[2], priority=r[3],
                         callback_state=r[4], callback_tries=r[5], cancel_reason=r[6], order=r[7])
                 for r in con.execute(
                     "SELECT t.task_id, spec, t.state, priority, callback_state, callback_tries, e.detail, "
                     "submit_order "
                     "FROM rollout_tasks t LEFT JOIN (SELECT task_id, arg_max(detail, event_at) AS detail "
                     "FROM rollout_events WHERE session_id IS NULL AND state = ? GROUP BY task_id) e "
                     "USING (task_id) ORDER BY submitted_at, submit_order, t.task_id", [STOPPING]).fetchall()]
        sessions = [SessionRow(session_id=r[0], task_id=r[1], sample=r[2], attempt=r[3], state=r[4],
                               node_id=r[5], reward=r[6], reason=r[7], stats=_joined_outputs(r[8], r[9], r[10]))
                    for r in con.execute("SELECT session_id, task_id, sample, attempt, state, node_id, "
                                         "reward, reason, stats, harness_output, eval_output "
                                         "FROM rollout_sessions ORDER BY task_id, sample, attempt").fetchall()]
        folded = folded_segment(con)
    return tasks, sessions, folded


# The error kinds (call_records.error_kind) of calls that failed because of the model backend,
# not because of the request: a refused or dropped connection and vLLM's 503 ("overloaded"),
# no answer in time ("timeout"), vLLM's other 5xx and answers that are no completion
# ("backend_error"), and vLLM's 429 ("rate_limit"). The request's own errors (invalid_request,
# context_too_long, not_found, too_large), an error a healthy backend answered while it served
# other calls ("request_failed": addons/request_failures.py), a session that kept its own calls
# at the backend past the wait ("session_busy") and a harness that gave up ("abandoned") are not.
BACKEND_ERROR_KINDS = ("overloaded", "timeout", "backend_error", "rate_limit")


class CallStats(TypedDict):
    calls: int
    failed_calls: int
    prompt_tokens: int
    completion_tokens: int
    backend_failed_calls: int     # failed because of the backend (BACKEND_ERROR_KINDS)
    backend_error_kinds: list[str]
    unknown_version_calls: int    # answered, with no policy version (the weights were not verified)


def call_stats(path: str | os.PathLike, session_id: str, timeout: float = 60.0) -> CallStats:
    """What the proxy recorded for one session (read after its harness has exited: every call
    it got an answer to is there, failed ones included)."""
    return call_stats_many(path, [session_id], timeout)[session_id]


def call_stats_many(path: str | os.PathLike, session_ids: list[str], timeout: float = 60.0) -> dict[str, CallStats]:
    """call_stats of several sessions in one read (a session with no call: all zero)."""
    kinds = ", ".join(f"'{k}'" for k in BACKEND_ERROR_KINDS)
    with reading(path, timeout) as con:
        rows = con.execute(
            "SELECT session_id, count(*), count(error), coalesce(sum(prompt_tokens), 0), "
            f"coalesce(sum(completion_tokens), 0), count(*) FILTER (WHERE error_kind IN ({kinds})), "
            f"list_sort(list_distinct(list(error_kind) FILTER (WHERE error_kind IN ({kinds})))), "
            "count(*) FILTER (WHERE error IS NULL AND policy_version IS NULL) "
            "FROM call_records WHERE session_id IN (SELECT unnest(?::VARCHAR[])) GROUP BY session_id",
            [list(session_ids)]).fetchall()
    out = {sid: CallStats(calls=0, failed_calls=0, prompt_tokens=0, completion_tokens=0, backend_failed_calls=0,
                          backend_error_kinds=[], unknown_version_calls=0) for sid in session_ids}
    for sid, n, failed, p, c, backend_failed, backend_kinds, unknown in rows:
        out[sid] = CallStats(calls=n, failed_calls=failed, prompt_tokens=int(p), completion_tokens=int(c),
                             backend_failed_calls=backend_failed, backend_error_kinds=list(backend_kinds or []),
                             unknown_version_calls=unknown)
    return out


class SessionOutput(TypedDict):
    session_id: str
    task_id: str
    state: str
    node_id: str | None
    reward: float | None
    reason: str | None
    exit_code: int | None
    harness_output: str | None   # the tail of the harness's stdout and stderr
    eval_output: str | None      # the tail of the evaluator's


def session_output(path: str | os.PathLike, session_id: str, timeout: float = 60.0) -> SessionOutput | None:
    """One session's outcome and kept output (None: no such session in the journal)."""
    with reading(path, timeout) as con:
        row = con.execute(
            "SELECT session_id, task_id, state, node_id, reward, reason, TRY_CAST(stats->>'exit_code' AS INTEGER), "
            "harness_output, eval_output FROM rollout_sessions WHERE session_id = ?", [session_id]).fetchone()
    if row is None:
        return None
    return SessionOutput(session_id=row[0], task_id=row[1], state=row[2], node_id=row[3], reward=row[4],
                         reason=row[5], exit_code=row[6], harness_output=row[7], eval_output=row[8])
