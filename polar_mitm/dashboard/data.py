"""What each API endpoint answers, assembled from the store's reads (polar_mitm.store.dashboard)
over every database given: rows say which file they come from, a group or a session is looked
up in each file and put together (the rollout server's rows from one, the calls from the
node's that recorded them). Plain functions of (databases, run directory) to JSON-ready dicts;
app.py caches them. The shapes are in this package's docstring."""

from __future__ import annotations

import json
import math
import os
from pathlib import Path
from typing import Any, Callable, TypeVar

from ..grpo.calls import drift_events, is_prefix
from ..store import dashboard as store
from ..trainer_input import Call
from .tokens import TokenText

T = TypeVar("T")


def _each(dbs: list[str], read: Callable[[str], T]) -> list[tuple[str, T | None, str | None]]:
    """read(db) of every file: (db, result, error); a file that cannot be read says why."""
    out: list[tuple[str, T | None, str | None]] = []
    for db in dbs:
        try:
            out.append((db, read(db), None))
        except FileNotFoundError as e:
            out.append((db, None, str(e)))
        except Exception as e:   # a file of another schema, a locked file past the timeout
            out.append((db, None, f"{type(e).__name__}: {e}"))
    return out


def _stats(values: list[float]) -> dict[str, Any]:
    n = len(values)
    if not n:
        return {"n": 0, "mean": None, "std": None, "se": None, "min": None, "max": None}
    mean = sum(values) / n
    std = math.sqrt(sum((v - mean) ** 2 for v in values) / n)
    return {"n": n, "mean": mean, "std": std, "se": store.standard_error(std, n), "min": min(values),
            "max": max(values)}


def _sum_states(into: dict[str, int], more: dict[str, int]) -> None:
    for k, v in more.items():
        into[k] = into.get(k, 0) + v


# -- runs -----------------------------------------------------------------------------------------
def run_info(run_dir: str | None) -> dict[str, Any] | None:
    """The loop's run directory: loop.json as saved, and what is on disk."""
    if run_dir is None:
        return None
    run = Path(run_dir)
    state: Any = None
    error = None
    try:
        state = json.loads((run / "loop.json").read_text())
    except FileNotFoundError:
        error = "no loop.json yet"
    except (OSError, ValueError) as e:
        error = f"loop.json: {e}"
    try:
        iterations = sorted(p.name for p in (run / "iterations").iterdir() if p.is_dir())
    except OSError:
        iterations = []
    try:
        checkpoints = sorted((p.name for p in (run / "checkpoints").iterdir() if p.is_dir()),
                             key=lambda n: int(n[1:]) if n[1:].isdigit() else -1)
    except OSError:
        checkpoints = []
    return {"dir": str(run), "loop": state, "error": error, "iteration_dirs": iterations,
            "checkpoints": checkpoints, "plot": (run / "loop.png").is_file()}


def runs(dbs: list[str], run_dir: str | None) -> dict[str, Any]:
    files: list[dict[str, Any]] = []
    live: dict[str, Any] = {"tasks_by_state": {}, "sessions_by_state": {}, "attempts": 0, "iterations": []}
    for db, got, error in _each(dbs, store.runs):
        if got is None:
            files.append({"db": db, "error": error, "runs": [], "live": None, "calls": 0, "sessions": 0})
            continue
        files.append({"db": db, "error": None, **got})
        _sum_states(live["tasks_by_state"], got["live"]["tasks_by_state"])
        _sum_states(live["sessions_by_state"], got["live"]["sessions_by_state"])
        live["attempts"] += got["live"]["attempts"]
        live["iterations"] += [{"db": db, **it} for it in got["live"]["iterations"]]
    return {"dbs": files, "live": live, "run": run_info(run_dir)}


# -- groups ---------------------------------------------------------------------------------------
def groups(dbs: list[str]) -> dict[str, Any]:
    merged: dict[str, dict[str, Any]] = {}
    errors = []
    for db, got, error in _each(dbs, store.groups):
        if got is None:
            errors.append({"db": db, "error": error})
            continue
        for g in got["groups"]:
            row = merged.get(g["task_id"])
            if row is None:
                merged[g["task_id"]] = {**dict(g), "db": db, "dbs": [db]}
                continue
            row["dbs"].append(db)
            row["calls"] = store.merge_agg(row["calls"], g["calls"])
            if row["state"] is None and g["state"] is not None:   # the rollout server's file
                calls = row["calls"]
                row.update({**g, "db": db, "dbs": row["dbs"], "calls": calls})
    out: list[dict[str, Any]] = []
    for m in merged.values():
        stats = _stats(m.pop("rewards"))
        out.append({**m, "rewarded": stats["n"], "reward_mean": stats["mean"], "reward_std": stats["std"],
                    "reward_se": stats["se"], "reward_min": stats["min"], "reward_max": stats["max"]})
    out.sort(key=lambda g: (g["run_id"] or "", -1 if g["iteration"] is None else g["iteration"], g["held_out"],
                            g["order"] if g["order"] is not None else 1 << 62, g["task_id"]))
    return {"groups": out, "errors": errors}


def group(dbs: list[str], task_id: str) -> dict[str, Any] | None:
    found = [(db, got) for db, got, _ in _each(dbs, lambda db: store.group(db, task_id)) if got is not None]
    if not found:
        return None
    # the rollout server's file first (its samples' states), then any other
    found.sort(key=lambda f: f[1]["state"] is None)
    db, g = found[0]
    samples: dict[str, dict[str, Any]] = {s["session_id"]: {**dict(s), "db": db} for s in g["samples"]}
    for other_db, other in found[1:]:
        for s in other["samples"]:
            if s["session_id"] not in samples:
                samples[s["session_id"]] = {**dict(s), "db": other_db}
            else:
                mine = samples[s["session_id"]]
                if other_db != mine["db"]:
                    mine["calls"] = store.merge_agg(mine["calls"], s["calls"])
                if mine["reward"] is None:
                    mine["reward"] = s["reward"]
    if len(dbs) > 1:   # calls of these sessions in files that know nothing else of the task
        seen = {d for d, _ in found}
        for other_db in dbs:
            if other_db in seen:
                continue
            try:
                aggs = store.session_aggs(other_db, list(samples))
            except Exception:
                continue
            for sid, agg in aggs.items():
                samples[sid]["calls"] = store.merge_agg(samples[sid]["calls"], agg)
    rows = sorted(samples.values(), key=lambda r: (r["sample"] if r["sample"] is not None else 1 << 30,
                                                   r["attempt"], r["session_id"]))
    current = [r["reward"] for r in rows if r["current"] and r["reward"] is not None]
    return {**g, "db": db, "dbs": [d for d, _ in found], "samples": rows, "reward": _stats(current)}


# -- one session ----------------------------------------------------------------------------------
def _drift(records: list[Call]) -> list[tuple[int, int, int, int]]:
    """grpo.calls.drift_events of one session's calls, as (earlier, later, at, tokens) by index,
    without its all-pairs prefix checks (a session of hundreds of long calls): for each call
    the earlier call whose prompt it strictly extends, longest first (the one drift_events
    picks: the first of the longest), and drift_events on that pair."""
    longest_first = sorted(range(len(records)), key=lambda i: -len(records[i].prompt))
    out = []
    for k, c in enumerate(records):
        pk = c.prompt
        for e in longest_first:
            pe = records[e].prompt
            if e >= k or len(pe) >= len(pk):
                continue
            if pe and (pe[0] != pk[0] or pe[-1] != pk[len(pe) - 1]) or not is_prefix(pe, pk):
                continue
            out += [(e, k, d.at, d.tokens) for d in drift_events([records[e], c])]
            break
    return out


def session(dbs: list[str], session_id: str, tokens: TokenText) -> dict[str, Any] | None:
    found = [(db, got) for db, got, _ in _each(dbs, lambda db: store.session(db, session_id)) if got is not None]
    if not found:
        return None
    with_calls = next(((db, s) for db, s in found if s["calls"]), found[0])
    db, s = with_calls
    rollout = next((got["rollout"] for _, got in found if got["rollout"] is not None), None)
    reward = next((got["reward"] for _, got in found if got["reward"] is not None), None)
    reward_info = next((got["reward_info"] for _, got in found if got["reward_info"] is not None), None)
    instruction = next((got["instruction"] for _, got in found if got["instruction"]), None)
    task_id = s["task_id"] or next((got["task_id"] for _, got in found if got["task_id"]), None)
    siblings = sorted({x for _, got in found for x in got["siblings"]})
    calls = s["calls"]
    # drift: a later prompt that re-renders an earlier call's sampled tokens
    records = [Call(session_id=session_id, group=session_id, seq=c["seq"], prompt=c["prompt"], tokens=c["tokens"],
                    logprobs=c["logprobs"] or [], finish_reason=c["finish_reason"])
               for c in calls if c["prompt"] is not None]
    drift = [{"call_seq": records[a].seq, "later_seq": records[b].seq, "at": at, "tokens": n}
             for a, b, at, n in _drift(records)]
    out_calls = []
    for c in calls:
        texts = tokens.texts(c["tokens"])
        lps = c["logprobs"] if c["logprobs"] is not None and len(c["logprobs"]) == len(c["tokens"]) else None
        out_calls.append({
            "seq": c["seq"], "call_id": c["call_id"], "style": c["style"], "path": c["path"],
            "requested_model": c["requested_model"], "served_model": c["served_model"], "stream": c["stream"],
            "status_code": c["status_code"], "policy_version": c["policy_version"],
            "finish_reason": c["finish_reason"],
            "latency": {"total_ms": c["total_ms"], "backend_ms": c["backend_ms"], "queue_ms": c["queue_ms"]},
            "prompt_len": c["prompt_len"] if c["prompt_len"] is not None else (
                len(c["prompt"]) if c["prompt"] is not None else None),
            "completion_tokens": len(c["tokens"]) or c["completion_tokens"],
            "logprobs_aligned": lps is not None or not c["tokens"],
            "error": c["error"], "error_kind": c["error_kind"], "started_at": c["started_at"],
            "tokens": [[i, t, None if lps is None else lps[k]] for k, (i, t) in enumerate(zip(c["tokens"], texts))],
            "drift": [d for d in drift if d["call_seq"] == c["seq"] or d["later_seq"] == c["seq"]],
        })
    conv = s["conversation"]
    turns: list[dict[str, Any]] = []
    tools: list[dict[str, Any]] = []
    if conv is not None:
        turns = [dict(t) for t in conv["turns"]]
        tools = conv["tools"]
        # each assistant turn's call: the main chain's answered calls, aligned from the end
        # (a harness that compacted its history shows fewer turns than it made calls)
        assistant = [t for t in turns if t["role"] == "assistant"]
        for t, seq in zip(reversed(assistant), reversed(conv["main_calls"])):
            t["call_seq"] = seq
    rt = store.run_task(task_id) if task_id else None
    return {
        "session_id": session_id, "db": db, "dbs": [d for d, _ in found], "open_dbs": len(dbs), "task_id": task_id,
        "base_task": rt["base_task"] if rt else None, "run_id": rt["run_id"] if rt else None,
        "iteration": rt["iteration"] if rt else None, "held_out": rt["held_out"] if rt else False,
        "state": rollout["state"] if rollout else None,
        "reward": rollout["reward"] if rollout and rollout["reward"] is not None else reward,
        "reason": rollout["reason"] if rollout else None, "attempt": rollout["attempt"] if rollout else None,
        "sample": rollout["sample"] if rollout else None, "node_id": rollout["node_id"] if rollout else None,
        "stats": rollout["stats"] if rollout else None, "reward_info": reward_info, "instruction": instruction,
        "siblings": siblings, "turns": turns, "tools": tools,
        "conversation_call": conv["seq"] if conv else None, "calls": out_calls, "drift": drift,
        "harness_output": rollout["harness_output"] if rollout else None,
        "eval_output": rollout["eval_output"] if rollout else None,
        "tokenizer": tokens.source if tokens.error is None else None,
    }


# -- compare ---------------------------------------------------------------------------------------
def compare_task(dbs: list[str], base_task: str) -> dict[str, Any]:
    """The sessions of base task TASK grouped by the policy version that sampled them."""
    merged: dict[str, dict[str, Any]] = {}
    iteration_versions: dict[tuple[str, int], int] = {}
    for db, found, _ in _each(dbs, lambda db: store.task_sessions(db, base_task)):
        for s in found or []:
            row = merged.get(s["session_id"])
            if row is None:
                merged[s["session_id"]] = {**dict(s), "db": db}
            else:
                row["calls"] = store.merge_agg(row["calls"], s["calls"])
                if row["state"] is None:
                    row.update({k: v for k, v in s.items() if k != "calls"}, db=db)
    for _, known, _ in _each(dbs, store.iteration_versions):
        iteration_versions.update(known or {})
    by_version: dict[int | None, list[dict[str, Any]]] = {}
    for m in merged.values():
        served = m["calls"]["versions"]
        if served:
            v: int | None = served[0]
        elif m["run_id"] is not None and m["iteration"] is not None:
            v = iteration_versions.get((m["run_id"], m["iteration"]))
        else:
            v = None
        m["policy_version"] = v
        by_version.setdefault(v, []).append(m)
    out = []
    for v in sorted(by_version, key=lambda x: (x is None, x if x is not None else 0)):
        rows = sorted(by_version[v], key=lambda r: (r["held_out"], r["task_id"], r["session_id"]))
        out.append({"policy_version": v, "sessions": rows,
                    "reward": _stats([r["reward"] for r in rows if r["current"] and r["reward"] is not None])})
    return {"task": base_task, "versions": out}


def db_list(dbs: list[str]) -> list[dict[str, Any]]:
    out = []
    for db in dbs:
        try:
            size = os.path.getsize(db)
        except OSError:
            size = None
        out.append({"db": db, "bytes": size})
    return out
