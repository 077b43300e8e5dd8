"""What the trainer reads: the recorded calls of chosen sessions or tasks, with their
session's reward, as the records the trainer takes (polar_mitm.trainer_input; no torch here);
calls that cannot be trained on are skipped and counted by reason, never silently used.

The sampling rule (sampling_exclusion): a call is trained only if vLLM sampled it from the
distribution the trainer computes, its logits at the trainer's temperature, nothing cut off
or constrained. It is read from what vLLM got (the call's backend_params), so databases
recorded before the rule are judged the same way."""

from __future__ import annotations

import os
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Collection, Iterable, Mapping

import orjson

from ..trainer_input import UNKNOWN_VERSION, Call, SessionReward, policy_version_of
from ..session_ids import attempt_of
from .db import Reward, reading, store_rewards
from .delta import apply_prompt

# A call whose policy version is not known (NULL: the gateway could not verify which weights
# served it) is never trained: its logprobs may be another policy's.
UNKNOWN_VERSION_REASON = "policy_version_unknown"
# Calls vLLM sampled from another distribution than the trainer's, by the first rule that applies.
SAMPLING_REASONS = ("structured_output", "forced_tool_choice", "truncated_sampling", "logit_processing",
                    "temperature_mismatch")
SKIP_REASONS = ("failed", "abandoned", "no_token_ids", "logprobs_mismatch", UNKNOWN_VERSION_REASON,
                *SAMPLING_REASONS, "auxiliary_call", "no_reward", "missing_base", "superseded_attempt")

# vLLM's guided-decoding fields (a request's own, or an operator's polar_sampling override)
_GUIDED = ("structured_outputs", "guided_json", "guided_regex", "guided_choice", "guided_grammar")
# (field, value that leaves the distribution alone): any other value cuts it off (truncated)
# or reweights it (logit processing). An absent field is the default: vLLM's own, which the
# model's generation_config.json may change; the gateway sends each of them since the rule.
_TRUNCATING = (("top_p", 1.0), ("top_k", -1), ("min_p", 0.0))
_PROCESSING = (("repetition_penalty", 1.0), ("presence_penalty", 0.0), ("frequency_penalty", 0.0),
               ("min_tokens", 0))


def _number(value, default: float) -> float | None:
    if value is None:
        return default
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return None   # not a number vLLM would sample with: not the trainer's distribution
    return float(value)


def sampling_exclusion(params: dict | None, temperature: float | None = 1.0) -> str | None:
    """Why a call whose backend got `params` (its backend_params) was not sampled from the
    trainer's distribution at `temperature` (None: any temperature), or None when it was:
    structured_output (response_format json_schema | json_object, or a guided_* field),
    forced_tool_choice (tool_choice required or named: vLLM decodes it against the tools'
    JSON schema), truncated_sampling (top_p < 1, top_k > 0, min_p > 0), logit_processing
    (penalties, logit_bias, min_tokens, bad words, allowed token ids), temperature_mismatch."""
    if not isinstance(params, dict):
        return None   # nothing recorded (a call that failed before its backend request)
    rf = params.get("response_format")
    if (isinstance(rf, dict) and rf.get("type") not in (None, "text")) or any(
            params.get(k) is not None for k in _GUIDED):
        return "structured_output"
    choice = params.get("tool_choice")
    if choice == "required" or isinstance(choice, dict):
        return "forced_tool_choice"
    top_p, top_k, min_p = (_number(params.get(k), d) for k, d in _TRUNCATING)
    if top_p is None or top_p < 1.0 or top_k is None or top_k > 0 or min_p is None or min_p > 0.0:
        return "truncated_sampling"
    if any(_number(params.get(k), d) != d for k, d in _PROCESSING) or any(
            params.get(k) for k in ("logit_bias", "bad_words", "allowed_token_ids")):
        return "logit_processing"
    sampled = _number(params.get("temperature"), 1.0)
    if temperature is not None and (sampled is None or abs(sampled - temperature) > 1e-6):
        return "temperature_mismatch"
    return None


@dataclass
class TrainingData:
    # The kept calls, ordered by group, session and seq so that every builder sees one order.
    calls: list[Call]
    skipped: Counter[str] = field(default_factory=Counter)   # reason -> calls skipped
    sessions_without_reward: int = 0
    sessions: int = 0                                   # sessions with at least one kept call
    # Every rewarded session (one per sample) of the groups read, those with no trainable
    # call included. The trainer's group baselines count them all.
    rewards: dict[str, SessionReward] = field(default_factory=dict)
    # Calls of each session's main loop (its most used model) and the others (a router's, a
    # title call's), however the reward covers them: {"main": n, "auxiliary": m}.
    call_kinds: Counter[str] = field(default_factory=Counter)


# The stored rows, not the calls view: prompt ids are rebuilt here from their deltas
# (delta.apply_prompt), a session at a time, which is much cheaper than the view's recursion.
_SQL = """
SELECT c.session_id, s.task_id, c.seq, c.call_id, c.base_call, c.prompt_shared,
       c.prompt_suffix, c.token_ids, c.logprobs, c.finish_reason, c.policy_version, s.reward,
       c.backend_params, c.requested_model,
       CASE WHEN c.error_kind = 'abandoned' THEN 'abandoned'
            WHEN c.error IS NOT NULL OR coalesce(c.status_code, 200) >= 400 THEN 'failed' END AS failed
FROM call_records c LEFT JOIN sessions s USING (session_id)
WHERE {where}
ORDER BY c.session_id, c.seq
"""


def training_calls(dbs: Iterable[str | os.PathLike], *, tasks: list[str] | None = None,
                   sessions: list[str] | None = None, require_reward: bool = True,
                   temperature: float | None = 1.0, reward_covers: str | Mapping[str, str] = "all",
                   timeout: float = 30.0) -> TrainingData:
    """Read the trainable calls of every database (one per gateway machine), optionally
    only those of TASKS or SESSIONS. A session id seen in two files is one session, and its
    reward may be in any of them: the one in its calls' own file, else the first file given
    that has one. `temperature` is the trainer's: calls sampled otherwise (sampling_exclusion)
    are skipped and counted by reason (None: temperature not checked). reward_covers: "all",
    or "main" (only the calls of each session's main loop, the model it called most), for
    every task or per task ({task_id: "all" | "main"}, "all" for a task not named)."""
    where: list[str] = ["TRUE"]
    params: list[str] = []
    if tasks:
        where.append(f"s.task_id IN ({', '.join('?' * len(tasks))})")
        params += list(tasks)
    if sessions:
        where.append(f"c.session_id IN ({', '.join('?' * len(sessions))})")
        params += list(sessions)
    sql = _SQL.format(where=" AND ".join(where))
    out = TrainingData(calls=[])
    unrewarded: set[str] = set()
    kept_sessions: set[str] = set()
    files: list[tuple[Path, list[tuple[Any, ...]]]] = []
    rewards: dict[str, float] = {}   # session -> the first file's reward (in the order given)
    groups: dict[str, str] = {}   # rewarded session -> its GRPO group (its task, or itself)
    for db in dbs:
        path = Path(db)
        if not path.exists():
            raise FileNotFoundError(f"no database at {path}")
        with reading(path, timeout) as con:
            files.append((path, con.execute(sql, params).fetchall()))
            for session_id, task_id, reward in con.execute(
                    "SELECT session_id, task_id, reward FROM sessions WHERE reward IS NOT NULL").fetchall():
                rewards.setdefault(session_id, reward)
                groups.setdefault(session_id, task_id or session_id)
    while files:   # each file's rows are let go once read
        path, rows = files.pop(0)
        main_model = _main_models(rows)
        ids: dict[str, tuple[list[int] | None, list[int]]] = {}   # call_id -> (prompt, tokens)
        current = None
        for (session_id, task_id, seq, call_id, base, shared, suffix, tokens, logprobs, finish,
             version, reward, backend_params, model, failed) in rows:
            if current != session_id:   # bases are always earlier calls of the same session
                ids, current = {}, session_id
            prompt = None
            if suffix is not None:
                prompt = apply_prompt(ids, base, shared, orjson.loads(suffix))
                if prompt is None:   # its base is not in the file
                    out.skipped["missing_base"] += 1
                    continue
            ids[call_id] = (prompt, tokens or [])
            if failed:   # 'failed', or 'abandoned' (the harness gave up on the call)
                out.skipped[failed] += 1
                continue
            if not prompt or not tokens:
                out.skipped["no_token_ids"] += 1
                continue
            if logprobs is None or len(logprobs) != len(tokens):
                out.skipped["logprobs_mismatch"] += 1
                continue
            version = policy_version_of(version)
            if version == UNKNOWN_VERSION:
                out.skipped[UNKNOWN_VERSION_REASON] += 1
                continue
            excluded = sampling_exclusion(orjson.loads(backend_params) if backend_params else None, temperature)
            if excluded:
                out.skipped[excluded] += 1
                continue
            auxiliary = model != main_model[session_id]
            out.call_kinds["auxiliary" if auxiliary else "main"] += 1
            covers = reward_covers if isinstance(reward_covers, str) else reward_covers.get(task_id or "", "all")
            if auxiliary and covers == "main":
                out.skipped["auxiliary_call"] += 1
                continue
            if reward is None:
                reward = rewards.get(session_id)
            if reward is None and require_reward:
                out.skipped["no_reward"] += 1
                unrewarded.add(session_id)
                continue
            kept_sessions.add(session_id)
            out.calls.append(Call(
                session_id=session_id, group=task_id or session_id, seq=seq, prompt=list(prompt),
                tokens=list(tokens), logprobs=[float(x) for x in logprobs], finish_reason=finish,
                policy_version=version, reward=reward, db=str(path)))
    # one session per sample: the calls of an attempt a retry superseded are left out
    superseded = kept_sessions - latest_attempts(kept_sessions)
    if superseded:
        out.skipped["superseded_attempt"] += sum(c.session_id in superseded for c in out.calls)
        out.calls = [c for c in out.calls if c.session_id not in superseded]
        kept_sessions -= superseded
    out.sessions = len(kept_sessions)
    out.sessions_without_reward = len(unrewarded)
    out.calls.sort(key=lambda c: (c.group, c.session_id, c.seq))
    read = {c.group for c in out.calls}
    chosen = [sid for sid in rewards if groups[sid] in read and (not sessions or sid in sessions)]
    final = latest_attempts(chosen)
    out.rewards = {sid: SessionReward(groups[sid], float(rewards[sid])) for sid in chosen if sid in final}
    return out


def latest_attempts(session_ids: Collection[str]) -> set[str]:
    """Of these sessions, each sample's latest attempt: when a retry (TASK~i.r2) and the
    attempt it replaced (TASK~i, rewarded before its node was declared lost) both have
    rewards, the latest counts, so a group never holds more rewarded sessions than samples."""
    latest: dict[str, int] = {}
    for sid in session_ids:
        sample, attempt = attempt_of(sid)
        latest[sample] = max(latest.get(sample, 0), attempt)
    return {sid for sid in session_ids if attempt_of(sid)[1] == latest[attempt_of(sid)[0]]}


def _main_models(rows) -> dict[str, str | None]:
    """Per session, the model its calls asked for most (the first such on a tie): its main
    loop. A harness's router or title calls ask a smaller model."""
    counts: dict[str, Counter] = {}
    for row in rows:
        counts.setdefault(row[0], Counter())[row[-2]] += 1   # session_id, requested_model
    return {sid: c.most_common(1)[0][0] for sid, c in counts.items()}


def task_reward_covers(dbs: Iterable[str | os.PathLike], timeout: float = 30.0) -> dict[str, str]:
    """Each stored task's reward_covers choice (rollout_tasks' spec), for the reader."""
    out: dict[str, str] = {}
    for db in dbs:
        with reading(Path(db), timeout) as con:
            for task_id, covers in con.execute(
                    "SELECT task_id, spec->>'reward_covers' FROM rollout_tasks").fetchall():
                out.setdefault(task_id, covers or "all")
    return out


def set_rewards(db: str | os.PathLike, records: Iterable[Mapping[str, Any]], timeout: float = 30.0) -> int:
    """Set sessions.reward from {session_id, reward[, info]} records (a rewards file's, the
    rollout server's), checked first; returns how many. A session not seen yet is created
    with its TASK~SAMPLE task (db.store_rewards)."""
    rewards = []
    for i, r in enumerate(records):
        if not isinstance(r, Mapping) or not isinstance(r.get("session_id"), str):
            raise ValueError(f"record {i + 1}: needs a string session_id")
        reward = r.get("reward")
        if isinstance(reward, bool) or not isinstance(reward, (int, float)):
            raise ValueError(f"record {i + 1} ({r['session_id']}): reward must be a number")
        rewards.append(Reward(r["session_id"], float(reward), r.get("info")))
    return store_rewards(db, rewards, timeout)
