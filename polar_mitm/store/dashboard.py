"""The dashboard's reads (`polar-mitm dashboard`, polar_mitm/dashboard/): typed rows, all SQL here.

Cheap on a file of 100,000 calls and more, and read-only: every aggregate reads call_records'
own columns (counts, usage tokens, policy versions, error), never the calls view, which
rebuilds every call's request before a filter applies. One session's calls are rebuilt from
their deltas in Python, as the trainer's reader does (delta.apply_prompt for the prompt ids,
the calls view's text rule along one call's chain of bases for its request text). The rollout
server's journal log (what is not folded into its tables yet) is read over the tables, as
rollout_journal.load does, but only the columns a page shows: the outputs of the sessions
asked for, never of every session.

Every function opens one read-only connection (db.reading) and closes it before it returns:
the proxy's loader hands the file over for it, so callers read only when something changed
(the dashboard's live.py watches files, not the database)."""

from __future__ import annotations

import contextlib
import datetime as _dt
import functools
import math
import os
from collections import Counter
from typing import Any, Iterable, Iterator, TypedDict

import duckdb
import orjson

from ..adapters import AdapterError, adapter
from ..session_ids import RUN_SEPARATOR, attempt_of, parse, parse_run_task, task_of, task_of_run
from . import journal_log
from .db import reading
from .delta import apply_prompt, apply_text
from .loop import standard_error   # the loop's rule: the dashboard shows the figures it prints
from .rollout_journal import folded_segment
from .transcripts import body_with_answer, last_main_call


# -- names -----------------------------------------------------------------------------------
class RunTask(TypedDict):
    """What a task id says about the loop: TASK@RUN.I (held out: TASK@RUN.I.eval)."""
    base_task: str
    run_id: str | None
    iteration: int | None
    held_out: bool


@functools.lru_cache(maxsize=1 << 16)
def run_task(task_id: str) -> RunTask:
    """TASK@RUN.I[.eval] split (session_ids.parse_run_task); any other task id is its own
    base task, of no run. (Cached: callers must not change the answer.)"""
    rt = parse_run_task(task_id)
    if rt is None:
        return RunTask(base_task=task_id, run_id=None, iteration=None, held_out=False)
    return RunTask(base_task=rt.task, run_id=rt.run_id, iteration=rt.iteration, held_out=rt.held_out)


def _iso(v: Any) -> str | None:
    if v is None:
        return None
    if isinstance(v, _dt.datetime):
        return v.isoformat()
    return str(v)


def _iso_us(at_us: int | None) -> str | None:
    if at_us is None:
        return None
    return _dt.datetime.fromtimestamp(at_us / 1e6, tz=_dt.timezone.utc).isoformat()


def _json(v: Any) -> Any:
    if v is None or not isinstance(v, (str, bytes)):
        return v
    try:
        return orjson.loads(v)
    except orjson.JSONDecodeError:
        return v


def _finite(v: Any) -> Any:
    """JSON has no NaN: an unknown mean is null."""
    return None if isinstance(v, float) and not math.isfinite(v) else v


@contextlib.contextmanager
def _reading(db: str | os.PathLike, timeout: float) -> Iterator[duckdb.DuckDBPyConnection]:
    """db.reading, on one DuckDB thread: a page's read shares the machine with a rollout."""
    with reading(db, timeout) as con:
        con.execute("SET threads = 1")
        yield con


def _tables(con: duckdb.DuckDBPyConnection) -> set[str]:
    return {r[0] for r in con.execute("SELECT table_name FROM information_schema.tables").fetchall()}


def _columns(con: duckdb.DuckDBPyConnection, table: str) -> set[str]:
    return {r[0] for r in con.execute("SELECT column_name FROM information_schema.columns WHERE table_name = ?",
                                      [table]).fetchall()}


# -- the rollout server's state: its tables, the journal log over them -------------------------
class TaskLite(TypedDict):
    task_id: str
    state: str
    samples: int | None          # num_samples
    instruction: str | None
    order: int | None            # submitted as the server's n-th task


class SessionLite(journal_log.SessionStanding):
    session_id: str


def _read_sessions(con: duckdb.DuckDBPyConnection, where: str, params: list) -> dict[str, SessionLite]:
    """rollout_sessions' rows (`where`: the SQL after FROM), light: no stats, no outputs."""
    return {r[0]: SessionLite(session_id=r[0], task_id=r[1], sample=r[2], attempt=r[3], state=r[4], node_id=r[5],
                              reward=r[6], reason=r[7])
            for r in con.execute("SELECT session_id, task_id, sample, attempt, state, node_id, reward, reason "
                                 f"FROM rollout_sessions {where}", params).fetchall()}


def _task_lite(task_id: str, state: str, spec: dict | None, order: int | None) -> TaskLite:
    spec = spec or {}
    samples = spec.get("num_samples")
    instruction = spec.get("instruction")
    return TaskLite(task_id=task_id, state=state, samples=samples if isinstance(samples, int) else None,
                    instruction=instruction if isinstance(instruction, str) else None, order=order)


def _session_lite(r: Any) -> SessionLite:
    return SessionLite(session_id=r["session_id"], task_id=r["task_id"], sample=r["sample"], attempt=r["attempt"],
                       state=r["state"], node_id=r.get("node_id"), reward=r.get("reward"), reason=r.get("reason"))


def _read_rollout(con: duckdb.DuckDBPyConnection, tables: set[str], task_ids: list[str] | None
                  ) -> tuple[dict[str, TaskLite], dict[str, SessionLite], int]:
    """The rollout tables (of some tasks, or all), light: no spec but its figures, no outputs."""
    if "rollout_tasks" not in tables:
        return {}, {}, 0
    where, params = ("WHERE task_id IN (SELECT unnest(?::VARCHAR[]))", [task_ids]) if task_ids is not None else ("", [])
    order = "submit_order" if "submit_order" in _columns(con, "rollout_tasks") else "NULL"
    tasks = {r[0]: TaskLite(task_id=r[0], state=r[1], samples=r[2], instruction=r[3], order=r[4])
             for r in con.execute(
                 f"SELECT task_id, state, TRY_CAST(spec->>'num_samples' AS INTEGER), spec->>'instruction', {order} "
                 f"FROM rollout_tasks {where} ORDER BY submitted_at, {order}, task_id", params).fetchall()}
    sessions = _read_sessions(con, f"{where} ORDER BY task_id, sample, attempt", params)
    return tasks, sessions, folded_segment(con)


Segments = list[tuple[int, list[journal_log.Batch]]]


def _segments(db: str | os.PathLike) -> Segments:
    """The journal log's segments as they are now, read before the tables: the tables then
    say which of them are folded (a fold commits before it deletes its segments). Raises
    FileNotFoundError when one was deleted while read: read again."""
    return [(journal_log.seq(p), journal_log.read_segment(p)) for p in journal_log.segments(journal_log.log_dir(db))]


def _newer(segments: Segments, folded: int) -> journal_log.Batch | None:
    """The batches of the segments after the last folded one, merged (None: none)."""
    batches = [b for n, bs in segments if n > folded for b in bs]
    return journal_log.merge(batches) if batches else None


def _overlay(tasks: dict[str, TaskLite], sessions: dict[str, SessionLite], newer: journal_log.Batch | None,
             task_ids: list[str] | None) -> None:
    if newer is None:
        return
    for t in newer["tasks"]:
        if task_ids is None or t["task_id"] in task_ids:
            tasks.pop(t["task_id"], None)
            tasks[t["task_id"]] = _task_lite(t["task_id"], t["state"], t["spec"], t.get("order"))
    for s in newer["sessions"]:
        if task_ids is None or s["task_id"] in task_ids:
            sessions[s["session_id"]] = _session_lite(s)


def _retrying(read):
    """A read of the tables and the journal log over them, again while a fold deletes the
    segments it reads (as rollout_journal.load does)."""
    for _ in range(20):
        try:
            return read()
        except FileNotFoundError as e:
            if "no database" in str(e):
                raise
            continue
    raise RuntimeError("the rollout journal kept changing while read")


def latest_attempts(sessions: Iterable[SessionLite]) -> dict[tuple[str, int], SessionLite]:
    """Each sample's current attempt (the latest wins, as the server's group says)."""
    out: dict[tuple[str, int], SessionLite] = {}
    for s in sessions:
        key = (s["task_id"], s["sample"])
        if key not in out or s["attempt"] >= out[key]["attempt"]:
            out[key] = s
    return out


# -- call aggregates ----------------------------------------------------------------------------
class CallAgg(TypedDict):
    calls: int
    failed_calls: int
    prompt_tokens: int
    completion_tokens: int
    versions: list[int]           # the policy versions that served its calls (NULL left out)
    unknown_version_calls: int    # answered, with no known policy version


def _empty_agg() -> CallAgg:
    return CallAgg(calls=0, failed_calls=0, prompt_tokens=0, completion_tokens=0, versions=[],
                   unknown_version_calls=0)


_AGG = ("count(*), count(error), coalesce(sum(prompt_tokens), 0), coalesce(sum(completion_tokens), 0), "
        "list_sort(list(DISTINCT policy_version) FILTER (WHERE policy_version IS NOT NULL)), "
        "count(*) FILTER (WHERE error IS NULL AND policy_version IS NULL)")


def _agg(row: tuple) -> CallAgg:
    n, failed, p, c, versions, unknown = row
    return CallAgg(calls=n, failed_calls=failed, prompt_tokens=int(p), completion_tokens=int(c),
                   versions=[int(v) for v in versions or []], unknown_version_calls=unknown)


def merge_agg(a: CallAgg, b: CallAgg) -> CallAgg:
    return CallAgg(calls=a["calls"] + b["calls"], failed_calls=a["failed_calls"] + b["failed_calls"],
                   prompt_tokens=a["prompt_tokens"] + b["prompt_tokens"],
                   completion_tokens=a["completion_tokens"] + b["completion_tokens"],
                   versions=sorted(set(a["versions"]) | set(b["versions"])),
                   unknown_version_calls=a["unknown_version_calls"] + b["unknown_version_calls"])


def _session_aggs(con: duckdb.DuckDBPyConnection, session_ids: list[str]) -> dict[str, CallAgg]:
    rows = con.execute(f"SELECT session_id, {_AGG} FROM call_records "
                       "WHERE session_id IN (SELECT unnest(?::VARCHAR[])) GROUP BY session_id",
                       [session_ids]).fetchall()
    return {r[0]: _agg(r[1:]) for r in rows}


# -- the runs page --------------------------------------------------------------------------------
class LiveIteration(TypedDict):
    """A loop iteration's (or a plain rollout's) tasks as the rollout server has them now."""
    run_id: str | None
    iteration: int | None
    held_out: bool
    tasks: int
    tasks_by_state: dict[str, int]
    sessions_by_state: dict[str, int]    # each sample's current attempt
    rewarded: int
    reward_mean: float | None


class LiveState(TypedDict):
    tasks_by_state: dict[str, int]
    sessions_by_state: dict[str, int]    # each sample's current attempt
    attempts: int                        # every session, retries and their predecessors included
    iterations: list[LiveIteration]


class RunRows(TypedDict):
    run_id: str
    iterations: list[dict[str, Any]]     # loop_iterations rows, JSON columns parsed, + *_se
    versions: list[dict[str, Any]]       # policy_versions rows


class RunsData(TypedDict):
    runs: list[RunRows]
    live: LiveState
    calls: int
    sessions: int


def runs(db: str | os.PathLike, timeout: float = 30.0) -> RunsData:
    """The loop's iterations (every run of the file), its policy versions, and the rollout
    server's live state (tasks and sessions by state, per iteration too)."""
    def read() -> RunsData:
        segments = _segments(db)
        with _reading(db, timeout) as con:
            tables = _tables(con)
            its: list[dict[str, Any]] = []
            versions: list[dict[str, Any]] = []
            if "loop_iterations" in tables:
                cur = con.execute("SELECT * FROM loop_iterations ORDER BY run_id, iteration")
                cols = [d[0] for d in cur.description or []]
                its = [dict(zip(cols, r)) for r in cur.fetchall()]
                cur = con.execute("SELECT * FROM policy_versions ORDER BY run_id, version")
                cols = [d[0] for d in cur.description or []]
                versions = [dict(zip(cols, r)) for r in cur.fetchall()]
            tasks, sessions, folded = _read_rollout(con, tables, None)
            calls = (con.execute("SELECT count(*) FROM call_records").fetchone() or (0,))[0] \
                if "call_records" in tables else 0
            n_sessions = (con.execute("SELECT count(*) FROM sessions").fetchone() or (0,))[0] \
                if "sessions" in tables else 0
        _overlay(tasks, sessions, _newer(segments, folded), None)
        by_run: dict[str, RunRows] = {}
        held_out = _held_out_rewards(sessions)
        for r in its:
            run = by_run.setdefault(r["run_id"], RunRows(run_id=r["run_id"], iterations=[], versions=[]))
            run["iterations"].append(_iteration(r, held_out.get((r["run_id"], r["iteration"]))))
        for v in versions:
            run = by_run.setdefault(v["run_id"], RunRows(run_id=v["run_id"], iterations=[], versions=[]))
            run["versions"].append({k: _iso(x) if isinstance(x, _dt.datetime) else x for k, x in v.items()})
        return RunsData(runs=list(by_run.values()), live=_live(tasks, sessions), calls=int(calls),
                        sessions=int(n_sessions))
    return _retrying(read)


def _held_out_rewards(sessions: dict[str, SessionLite]) -> dict[tuple[str, int], list[float]]:
    """The rewards of each loop iteration's held-out tasks (TASK@RUN.I.eval), each sample's
    current attempt: what the loop's eval_reward_mean is the mean of."""
    out: dict[tuple[str, int], list[float]] = {}
    for s in latest_attempts(sessions.values()).values():
        rt = run_task(s["task_id"])
        if rt["held_out"] and rt["run_id"] is not None and rt["iteration"] is not None and s["reward"] is not None:
            out.setdefault((rt["run_id"], rt["iteration"]), []).append(s["reward"])
    return out


def _iteration(r: dict[str, Any], held_out: list[float] | None = None) -> dict[str, Any]:
    """A loop_iterations row for the page, with the standard errors of its rewards. Rows of an
    older loop have no reward_n, eval_reward_std or eval_reward_n (NULL): n is then the sum of
    per_task's n (what the loop counts), else sessions_done; the held-out std and n come from
    the rollout server's sessions of the iteration's held-out tasks when their mean is the
    row's (else the standard error stays unknown). "reward_n_from" and "eval_reward_n_from"
    say where a filled-in n came from ("per_task", "sessions_done", "sessions")."""
    out: dict[str, Any] = {k: _iso(v) if isinstance(v, _dt.datetime) else _finite(v) for k, v in r.items()}
    for k in ("per_task", "released_why"):
        out[k] = _json(out.get(k))
    if out.get("reward_n") is None and out.get("reward_mean") is not None:
        per_task = out["per_task"] if isinstance(out.get("per_task"), dict) else {}
        ns = [t.get("n") for t in per_task.values() if isinstance(t, dict)]
        if ns and all(isinstance(n, int) for n in ns):
            out["reward_n"], out["reward_n_from"] = sum(ns), "per_task"
        elif isinstance(out.get("sessions_done"), int):
            out["reward_n"], out["reward_n_from"] = out["sessions_done"], "sessions_done"
    if out.get("eval_reward_std") is None and out.get("eval_reward_mean") is not None and held_out:
        mean = sum(held_out) / len(held_out)
        if abs(mean - out["eval_reward_mean"]) < 1e-9:
            out["eval_reward_std"] = math.sqrt(sum((x - mean) ** 2 for x in held_out) / len(held_out))
            out["eval_reward_n"], out["eval_reward_n_from"] = len(held_out), "sessions"
    out["reward_se"] = standard_error(out.get("reward_std"), out.get("reward_n"))
    out["eval_reward_se"] = standard_error(out.get("eval_reward_std"), out.get("eval_reward_n"))
    return out


def _live(tasks: dict[str, TaskLite], sessions: dict[str, SessionLite]) -> LiveState:
    current = latest_attempts(sessions.values())
    per: dict[tuple[str | None, int | None, bool], LiveIteration] = {}
    rewards: dict[tuple[str | None, int | None, bool], list[float]] = {}

    def bucket(task_id: str) -> LiveIteration:
        rt = run_task(task_id)
        key = (rt["run_id"], rt["iteration"], rt["held_out"])
        if key not in per:
            per[key] = LiveIteration(run_id=key[0], iteration=key[1], held_out=key[2], tasks=0, tasks_by_state={},
                                     sessions_by_state={}, rewarded=0, reward_mean=None)
            rewards[key] = []
        return per[key]

    for t in tasks.values():
        b = bucket(t["task_id"])
        b["tasks"] += 1
        b["tasks_by_state"][t["state"]] = b["tasks_by_state"].get(t["state"], 0) + 1
    for s in current.values():
        b = bucket(s["task_id"])
        b["sessions_by_state"][s["state"]] = b["sessions_by_state"].get(s["state"], 0) + 1
        if s["reward"] is not None:
            rt = run_task(s["task_id"])
            rewards[(rt["run_id"], rt["iteration"], rt["held_out"])].append(s["reward"])
    for key, b in per.items():
        got = rewards[key]
        b["rewarded"] = len(got)
        b["reward_mean"] = sum(got) / len(got) if got else None
    order = sorted(per, key=lambda k: (k[0] or "", -1 if k[1] is None else k[1], k[2]))
    return LiveState(tasks_by_state=dict(Counter(t["state"] for t in tasks.values())),
                     sessions_by_state=dict(Counter(s["state"] for s in current.values())),
                     attempts=len(sessions), iterations=[per[k] for k in order])


# -- the groups list ------------------------------------------------------------------------------
class GroupRow(TypedDict):
    task_id: str
    base_task: str
    run_id: str | None
    iteration: int | None
    held_out: bool
    state: str | None            # the rollout server's task state (None: sessions named by hand)
    samples: int | None          # num_samples (else the samples seen)
    sessions: int                # attempts
    by_state: dict[str, int]     # each sample's current attempt
    rewards: list[float]         # each sample's current attempt's reward
    instruction: str | None
    order: int | None
    calls: CallAgg               # of every attempt, in this file


class GroupsData(TypedDict):
    groups: list[GroupRow]


def groups(db: str | os.PathLike, timeout: float = 30.0) -> GroupsData:
    """Every task of the file: the rollout server's, and groups of sessions named TASK~i by
    hand; with their calls as recorded in this file (a node's file may hold calls of tasks
    whose rollout rows are in another: the caller adds them up by task)."""
    def read() -> GroupsData:
        segments = _segments(db)
        with _reading(db, timeout) as con:
            tables = _tables(con)
            tasks, sessions, folded = _read_rollout(con, tables, None)
            named: list[tuple[str, str, float | None]] = []
            aggs: dict[str, CallAgg] = {}
            if "sessions" in tables:
                named = con.execute("SELECT session_id, task_id, reward FROM sessions "
                                    "WHERE task_id IS NOT NULL").fetchall()
                aggs = {r[0]: _agg(r[1:]) for r in con.execute(
                    f"SELECT s.task_id, {_AGG} FROM call_records c JOIN sessions s USING (session_id) "
                    "WHERE s.task_id IS NOT NULL GROUP BY s.task_id").fetchall()}
        _overlay(tasks, sessions, _newer(segments, folded), None)
        return GroupsData(groups=_group_rows(tasks, sessions, named, aggs))
    return _retrying(read)


def _group_rows(tasks: dict[str, TaskLite], sessions: dict[str, SessionLite],
                named: list[tuple[str, str, float | None]], aggs: dict[str, CallAgg]) -> list[GroupRow]:
    current = latest_attempts(sessions.values())
    rows: dict[str, GroupRow] = {}

    def row(task_id: str) -> GroupRow:
        if task_id not in rows:
            rt = run_task(task_id)
            t = tasks.get(task_id)
            rows[task_id] = GroupRow(task_id=task_id, base_task=rt["base_task"], run_id=rt["run_id"],
                                     iteration=rt["iteration"], held_out=rt["held_out"],
                                     state=t["state"] if t else None, samples=t["samples"] if t else None,
                                     sessions=0, by_state={}, rewards=[],
                                     instruction=(t["instruction"] or "")[:300] if t else None,
                                     order=t["order"] if t else None, calls=aggs.get(task_id, _empty_agg()))
        return rows[task_id]

    for t in tasks.values():
        row(t["task_id"])
    for s in sessions.values():
        row(s["task_id"])["sessions"] += 1
    for s in current.values():
        g = row(s["task_id"])
        g["by_state"][s["state"]] = g["by_state"].get(s["state"], 0) + 1
        if s["reward"] is not None:
            g["rewards"].append(s["reward"])
    # sessions named TASK~i by hand (no rollout row): their rewards from the sessions table,
    # the latest attempt of each sample
    by_sample: dict[str, tuple[int, str, float | None]] = {}
    for sid, task_id, reward in named:
        if sid in sessions or task_id in tasks:
            continue
        sample, attempt = attempt_of(sid)
        if sample not in by_sample or attempt > by_sample[sample][0]:
            by_sample[sample] = (attempt, task_id, reward)
        row(task_id)["sessions"] += 1
    for _, task_id, reward in by_sample.values():
        g = row(task_id)
        if reward is not None:
            g["rewards"].append(reward)
    for task_id in aggs:
        row(task_id)
    for g in rows.values():
        if g["samples"] is None:
            g["samples"] = sum(g["by_state"].values()) or len(
                [1 for _, t, _ in by_sample.values() if t == g["task_id"]]) or None
    return sorted(rows.values(), key=lambda g: (g["run_id"] or "", -1 if g["iteration"] is None else g["iteration"],
                                                g["held_out"], g["order"] if g["order"] is not None else 1 << 62,
                                                g["task_id"]))


# -- one group --------------------------------------------------------------------------------------
class EventRow(TypedDict):
    at: str | None
    session_id: str | None
    state: str
    node_id: str | None
    detail: str | None


class SampleRow(TypedDict):
    session_id: str
    sample: int | None
    attempt: int
    current: bool                # its sample's current attempt (the one trained on)
    state: str | None            # None: not a rollout session (named by hand)
    reward: float | None
    reason: str | None
    node_id: str | None
    exit_code: int | None
    stats: dict[str, Any] | None    # the node's stats, without the outputs
    harness_output: str | None
    eval_output: str | None
    reward_info: Any
    calls: CallAgg
    events: list[EventRow]


class GroupData(TypedDict):
    task_id: str
    base_task: str
    run_id: str | None
    iteration: int | None
    held_out: bool
    state: str | None
    spec: dict[str, Any] | None
    samples: list[SampleRow]
    events: list[EventRow]       # the task's own (no session)


def group(db: str | os.PathLike, task_id: str, timeout: float = 30.0) -> GroupData | None:
    """One task's sessions side by side (None: the file knows no such task)."""
    def read() -> GroupData | None:
        segments = _segments(db)
        with _reading(db, timeout) as con:
            tables = _tables(con)
            spec = None
            state = None
            outputs: dict[str, tuple[Any, str | None, str | None]] = {}
            events: list[EventRow] = []
            tasks, sessions, folded = _read_rollout(con, tables, [task_id])
            if "rollout_tasks" in tables:
                row = con.execute("SELECT spec FROM rollout_tasks WHERE task_id = ?", [task_id]).fetchone()
                spec = _json(row[0]) if row else None
                has_outputs = "harness_output" in _columns(con, "rollout_sessions")
                cols = "stats, harness_output, eval_output" if has_outputs else "stats, NULL, NULL"
                outputs = {r[0]: (_json(r[1]), r[2], r[3]) for r in con.execute(
                    f"SELECT session_id, {cols} FROM rollout_sessions WHERE task_id = ?", [task_id]).fetchall()}
                events = [EventRow(at=_iso(r[0]), session_id=r[1], state=r[2], node_id=r[3], detail=r[4])
                          for r in con.execute("SELECT event_at, session_id, state, node_id, detail FROM rollout_events "
                                               "WHERE task_id = ? ORDER BY event_at", [task_id]).fetchall()]
            named: dict[str, tuple[float | None, Any]] = {}
            if "sessions" in tables:
                named = {r[0]: (r[1], _json(r[2])) for r in con.execute(
                    "SELECT session_id, reward, reward_info FROM sessions WHERE task_id = ?", [task_id]).fetchall()}
            newer = _newer(segments, folded)
            _overlay(tasks, sessions, newer, [task_id])
            sids = sorted(set(sessions) | set(named))
            aggs = _session_aggs(con, sids) if sids else {}
        if newer is not None:
            for srow in newer["sessions"]:
                if srow["task_id"] == task_id:
                    kept = dict(srow["stats"] or {})
                    h, e = kept.pop("harness_output", None), kept.pop("eval_output", None)
                    outputs[srow["session_id"]] = (kept, h, e)
            events += [EventRow(at=_iso_us(e["at_us"]), session_id=e["session_id"], state=e["state"],
                                node_id=e["node_id"], detail=e["detail"])
                       for e in newer["events"] if e["task_id"] == task_id]
            for t in newer["tasks"]:
                if t["task_id"] == task_id:
                    spec = t["spec"]
        if task_id in tasks:
            state = tasks[task_id]["state"]
        sids = sorted(set(sessions) | set(named))
        if not sids and spec is None:
            return None
        current = {s["session_id"] for s in latest_attempts(sessions.values()).values()}
        finals: dict[str, int] = {}
        for sid in sids:
            sample, attempt = attempt_of(sid)
            finals[sample] = max(finals.get(sample, 0), attempt)
        samples: list[SampleRow] = []
        for sid in sids:
            s = sessions.get(sid)
            stats, h, e = outputs.get(sid, (None, None, None))
            reward, info = named.get(sid, (None, None))
            name = parse(sid)
            exit_code = (stats or {}).get("exit_code") if isinstance(stats, dict) else None
            samples.append(SampleRow(
                session_id=sid, sample=s["sample"] if s else (name.sample if name else None),
                attempt=s["attempt"] if s else attempt_of(sid)[1],
                current=sid in current if s else attempt_of(sid)[1] == finals[attempt_of(sid)[0]],
                state=s["state"] if s else None, reward=s["reward"] if s and s["reward"] is not None else reward,
                reason=s["reason"] if s else None, node_id=s["node_id"] if s else None,
                exit_code=exit_code if isinstance(exit_code, int) else None,
                stats=stats if isinstance(stats, dict) else None, harness_output=h, eval_output=e, reward_info=info,
                calls=aggs.get(sid, _empty_agg()),
                events=[ev for ev in events if ev["session_id"] == sid]))
        samples.sort(key=lambda r: (r["sample"] if r["sample"] is not None else 1 << 30, r["attempt"], r["session_id"]))
        rt = run_task(task_id)
        return GroupData(task_id=task_id, base_task=rt["base_task"], run_id=rt["run_id"], iteration=rt["iteration"],
                         held_out=rt["held_out"], state=state, spec=spec if isinstance(spec, dict) else None,
                         samples=samples, events=[ev for ev in events if ev["session_id"] is None])
    return _retrying(read)


def session_aggs(db: str | os.PathLike, session_ids: list[str], timeout: float = 30.0) -> dict[str, CallAgg]:
    """The calls this file holds of these sessions (a node's file, for a group read from the
    server's)."""
    if not session_ids:
        return {}
    with _reading(db, timeout) as con:
        return _session_aggs(con, list(session_ids))


# -- one session --------------------------------------------------------------------------------------
class CallData(TypedDict):
    call_id: str
    seq: int
    style: str | None
    path: str | None
    requested_model: str | None
    served_model: str | None
    stream: bool | None
    status_code: int | None
    policy_version: int | None
    finish_reason: str | None
    prompt_len: int | None
    prompt_tokens: int | None
    completion_tokens: int | None
    queue_ms: float | None
    backend_ms: float | None
    total_ms: float | None
    error: str | None
    error_kind: str | None
    started_at: str | None
    prompt: list[int] | None      # the prompt's token ids, rebuilt whole (None: none recorded)
    tokens: list[int]             # sampled token ids
    logprobs: list[float] | None  # aligned with tokens


class Turn(TypedDict, total=False):
    role: str                     # system | user | assistant | tool
    text: str
    reasoning: str
    tool_calls: list[dict[str, str]]   # {id, name, arguments}
    tool_call_id: str
    name: str | None              # a tool turn's tool, when known
    is_error: bool


class Conversation(TypedDict):
    call_id: str                  # the call whose request (and answer) it is
    seq: int
    answered: bool                # its answer is the last assistant turn
    style: str | None
    turns: list[Turn]
    tools: list[dict[str, Any]]   # {name, description, parameters}
    main_calls: list[int]         # the main chain's answered calls' seqs, in order


class RolloutSession(journal_log.SessionStanding):
    stats: dict[str, Any] | None
    harness_output: str | None
    eval_output: str | None


class SessionData(TypedDict):
    session_id: str
    task_id: str | None
    reward: float | None          # sessions.reward
    reward_info: Any
    instruction: str | None
    calls: list[CallData]
    conversation: Conversation | None
    rollout: RolloutSession | None
    siblings: list[str]           # the other sessions of its task (rollout rows and named)


_SESSION_CALLS = """
SELECT call_id, seq, base_call, prompt_shared, prompt_suffix, token_ids, logprobs, style, path, requested_model,
       served_model, stream, status_code, policy_version, finish_reason, prompt_len, prompt_tokens, completion_tokens,
       queue_ms, backend_ms, total_ms, error, error_kind, started_at, request_prefix, request_suffix, request_middle,
       error IS NULL AND coalesce(status_code, 200) < 400 AS ok
FROM call_records WHERE session_id = ? ORDER BY seq"""


def session(db: str | os.PathLike, session_id: str, timeout: float = 30.0) -> SessionData | None:
    """One session: its calls (prompt ids rebuilt whole, sampled tokens and logprobs), the
    conversation of its main chain's last call with its answer (system prompt and tools
    included), its rollout row and outputs; None when the file knows nothing of it."""
    def read() -> SessionData | None:
        segments = _segments(db)
        with _reading(db, timeout) as con:
            tables = _tables(con)
            rows = con.execute(_SESSION_CALLS, [session_id]).fetchall() if "call_records" in tables else []
            srow = con.execute("SELECT task_id, reward, reward_info FROM sessions WHERE session_id = ?",
                               [session_id]).fetchone() if "sessions" in tables else None
            rrow = None
            instruction = None
            response = None
            folded = folded_segment(con)
            if "rollout_sessions" in tables:
                cols = _columns(con, "rollout_sessions")
                out = "harness_output, eval_output" if "harness_output" in cols else "NULL, NULL"
                rrow = con.execute("SELECT task_id, sample, attempt, state, node_id, reward, reason, stats, "
                                   f"{out} FROM rollout_sessions WHERE session_id = ?", [session_id]).fetchone()
            task_id = (rrow[0] if rrow else None) or (srow[0] if srow else None) or task_of(session_id)
            siblings: list[str] = []
            if task_id is not None:
                if "rollout_tasks" in tables:
                    row = con.execute("SELECT spec->>'instruction' FROM rollout_tasks WHERE task_id = ?",
                                      [task_id]).fetchone()
                    instruction = row[0] if row else None
                    siblings += [r[0] for r in con.execute(
                        "SELECT session_id FROM rollout_sessions WHERE task_id = ?", [task_id]).fetchall()]
                if "sessions" in tables:
                    siblings += [r[0] for r in con.execute("SELECT session_id FROM sessions WHERE task_id = ?",
                                                           [task_id]).fetchall()]
            main = None
            if rows:
                main_id, answered = last_main_call([(r[0], r[9], r[-1]) for r in rows])
                main = (main_id, answered)
                if answered:
                    got = con.execute("SELECT response_json FROM call_records WHERE session_id = ? AND call_id = ?",
                                      [session_id, main_id]).fetchone()
                    response = _json(got[0]) if got else None
        newer = _newer(segments, folded)
        rollout = _rollout_session(rrow)
        if newer is not None:
            for s in newer["sessions"]:
                if s["session_id"] == session_id:
                    stats = dict(s["stats"] or {})
                    h, e = stats.pop("harness_output", None), stats.pop("eval_output", None)
                    rollout = RolloutSession(task_id=s["task_id"], sample=s["sample"], attempt=s["attempt"],
                                             state=s["state"], node_id=s["node_id"], reward=s["reward"],
                                             reason=s["reason"], stats=stats,
                                             harness_output=None if h is None else str(h),
                                             eval_output=None if e is None else str(e))
                if task_id is not None and s["task_id"] == task_id:
                    siblings.append(s["session_id"])
            if instruction is None and task_id is not None:
                for t in newer["tasks"]:
                    if t["task_id"] == task_id:
                        instruction = (t["spec"] or {}).get("instruction")
        if not rows and srow is None and rollout is None:
            return None
        calls, texts = _calls(rows)
        conversation = None
        if main is not None:
            main_id, answered = main
            by_id = {c["call_id"]: c for c in calls}
            target = by_id[main_id]
            text = texts(main_id)
            conversation = _conversation(target, text, response if answered else None, answered,
                                         _main_chain(rows))
        return SessionData(session_id=session_id, task_id=task_id, reward=srow[1] if srow else None,
                           reward_info=_json(srow[2]) if srow else None,
                           instruction=instruction if isinstance(instruction, str) else None,
                           calls=calls, conversation=conversation, rollout=rollout,
                           siblings=sorted(set(siblings) - {session_id}))
    return _retrying(read)


def _rollout_session(r: tuple | None) -> RolloutSession | None:
    if r is None:
        return None
    stats = _json(r[7])
    return RolloutSession(task_id=r[0], sample=r[1], attempt=r[2], state=r[3], node_id=r[4], reward=r[5],
                          reason=r[6], stats=stats if isinstance(stats, dict) else None, harness_output=r[8],
                          eval_output=r[9])


def _main_chain(rows: list[tuple]) -> list[int]:
    """The seqs of the main chain's answered calls (the model it called most), in order."""
    main = Counter(r[9] for r in rows).most_common(1)[0][0]
    return [r[1] for r in rows if r[9] == main and r[-1]]


def _calls(rows: list[tuple]):
    """The session's calls, prompt ids rebuilt from their deltas (bases are earlier calls of
    the session), and a function that rebuilds one call's request text along its chain."""
    ids: dict[str, tuple[list[int] | None, list[int]]] = {}
    text_rows: dict[str, tuple[str | None, int | None, int | None, str | None]] = {}
    out: list[CallData] = []
    for (call_id, seq, base, shared, suffix, tokens, logprobs, style, path, requested, served, stream, status,
         version, finish, prompt_len, prompt_tokens, completion_tokens, queue_ms, backend_ms, total_ms, error,
         error_kind, started_at, prefix, text_suffix, middle, _ok) in rows:
        prompt = None if suffix is None else apply_prompt(ids, base, shared, orjson.loads(suffix))
        ids[call_id] = (prompt, list(tokens or []))
        text_rows[call_id] = (base, prefix, text_suffix, middle)
        out.append(CallData(call_id=call_id, seq=seq, style=style, path=path, requested_model=requested,
                            served_model=served, stream=stream, status_code=status,
                            policy_version=None if version is None else int(version), finish_reason=finish,
                            prompt_len=prompt_len, prompt_tokens=prompt_tokens, completion_tokens=completion_tokens,
                            queue_ms=_finite(queue_ms), backend_ms=_finite(backend_ms), total_ms=_finite(total_ms),
                            error=error, error_kind=error_kind, started_at=_iso(started_at), prompt=prompt,
                            tokens=list(tokens or []),
                            logprobs=None if logprobs is None else [float(x) for x in logprobs]))

    def text(call_id: str) -> str | None:
        """The call's request text as the harness sent it: the calls view's rule
        (left(base, prefix) || middle || right(base, suffix)) along its chain of bases."""
        chain: list[str] = []
        cur: str | None = call_id
        while cur is not None:
            if cur not in text_rows or len(chain) > len(text_rows):
                return None   # a broken chain: its base is not in this file
            chain.append(cur)
            cur = text_rows[cur][0]
        whole: str | None = None
        for cid in reversed(chain):
            base, prefix, suffix, middle = text_rows[cid]
            whole = middle if base is None else apply_text(whole or "", prefix, suffix, middle)
        return whole
    return out, text


def _conversation(call: CallData, request_text: str | None, response: Any, answered: bool,
                  main_calls: list[int]) -> Conversation:
    style = call["style"] or ""
    turns: list[Turn] = []
    tools: list[dict[str, Any]] = []
    body = None
    try:
        body = orjson.loads(request_text or "")
    except orjson.JSONDecodeError:
        pass
    if body is not None:
        chat = None
        if response is not None:
            try:
                chat = adapter(style).to_chat(body_with_answer(style, body, response), call["path"] or "")
            except (AdapterError, KeyError, IndexError, TypeError, AttributeError, ValueError):
                chat = None
        if chat is None:
            answered = False
            try:
                chat = adapter(style).to_chat(body, call["path"] or "")
            except (AdapterError, KeyError, IndexError, TypeError, AttributeError, ValueError):
                chat = None
        if chat is not None:
            turns = _turns(chat["messages"])
            tools = [{"name": t["name"], "description": t.get("description") or "",
                      "parameters": t.get("parameters") or {}} for t in chat.get("tools") or []]
    return Conversation(call_id=call["call_id"], seq=call["seq"], answered=answered, style=call["style"],
                        turns=turns, tools=tools, main_calls=main_calls)


def _turns(messages: list[Any]) -> list[Turn]:
    """Chat-shape messages as turns, system prompts kept; a tool result named by its call."""
    names: dict[str, str] = {}
    out: list[Turn] = []
    for m in messages:
        role = m["role"]
        text = "".join(p["text"] if p["type"] == "text" else "[image]" for p in m.get("content") or [])
        turn = Turn(role=role, text=text)
        if m.get("reasoning"):
            turn["reasoning"] = m["reasoning"]
        if role == "assistant":
            calls = m.get("tool_calls") or []
            names.update((c["id"], c["name"]) for c in calls)
            turn["tool_calls"] = [{"id": c.get("id") or "", "name": c["name"], "arguments": c["arguments"]}
                                  for c in calls]
        elif role == "tool":
            turn["tool_call_id"] = m.get("tool_call_id") or ""
            turn["name"] = m.get("name") or names.get(m.get("tool_call_id") or "")
            turn["is_error"] = bool(m.get("is_error"))
        out.append(turn)
    return out


# -- compare: a task's sessions by policy version ------------------------------------------------------
class VersionedSession(TypedDict):
    session_id: str
    task_id: str
    run_id: str | None
    iteration: int | None
    held_out: bool
    state: str | None
    reward: float | None
    current: bool
    calls: CallAgg


def task_sessions(db: str | os.PathLike, base_task: str, timeout: float = 30.0) -> list[VersionedSession]:
    """Every session of base task TASK (TASK itself, and the loop's TASK@RUN.I[.eval]), with
    the policy versions of its calls in this file."""
    def matches(task_id: str) -> bool:
        return task_id == base_task or task_of_run(task_id) == base_task

    def read() -> list[VersionedSession]:
        prefix = base_task + RUN_SEPARATOR
        segments = _segments(db)
        with _reading(db, timeout) as con:
            tables = _tables(con)
            sessions: dict[str, SessionLite] = {}
            folded = folded_segment(con)
            if "rollout_sessions" in tables:
                sessions = {sid: s for sid, s in _read_sessions(con, "WHERE task_id = ? OR starts_with(task_id, ?)",
                                                                [base_task, prefix]).items() if matches(s["task_id"])}
            named: dict[str, tuple[str, float | None]] = {}
            if "sessions" in tables:
                named = {r[0]: (r[1], r[2]) for r in con.execute(
                    "SELECT session_id, task_id, reward FROM sessions WHERE task_id = ? OR starts_with(task_id, ?)",
                    [base_task, prefix]).fetchall() if matches(r[1])}
            newer = _newer(segments, folded)
            if newer is not None:
                for srow in newer["sessions"]:
                    if matches(srow["task_id"]):
                        sessions[srow["session_id"]] = _session_lite(srow)
            sids = sorted(set(sessions) | set(named))
            aggs = _session_aggs(con, sids) if sids else {}
        current = {s["session_id"] for s in latest_attempts(sessions.values()).values()}
        out = []
        for sid in sorted(set(sessions) | set(named)):
            s = sessions.get(sid)
            task_id = s["task_id"] if s else named[sid][0]
            rt = run_task(task_id)
            reward = s["reward"] if s and s["reward"] is not None else named.get(sid, (task_id, None))[1]
            out.append(VersionedSession(session_id=sid, task_id=task_id, run_id=rt["run_id"],
                                        iteration=rt["iteration"], held_out=rt["held_out"],
                                        state=s["state"] if s else None, reward=reward,
                                        current=sid in current if s else True, calls=aggs.get(sid, _empty_agg())))
        return out
    return _retrying(read)


def iteration_versions(db: str | os.PathLike, timeout: float = 30.0) -> dict[tuple[str, int], int]:
    """(run, iteration) -> the policy version that sampled it (loop_iterations)."""
    with _reading(db, timeout) as con:
        if "loop_iterations" not in _tables(con):
            return {}
        return {(r[0], r[1]): r[2] for r in con.execute(
            "SELECT run_id, iteration, policy_version FROM loop_iterations").fetchall()}
