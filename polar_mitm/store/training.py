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
from typing import Any, Iterable, Iterator, Mapping, NamedTuple

import orjson

from ..trainer_input import UNKNOWN_VERSION, Call, SessionReward, policy_version_of
from ..session_ids import latest_attempts
from .db import Reward, reading, store_rewards
from .delta import apply_prompt

# A call with no token of a known version is never trained: its logprobs may be another
# policy's. Known: its token_versions entry (vLLM's own label), or with none recorded, its
# policy_version (NULL: the gateway could not verify which weights served it). A call with some
# tokens of an unknown version is kept, those tokens context only (trainer_input.Call.trained).
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
       c.backend_params, c.requested_model, {token_versions},
       CASE WHEN c.error_kind = 'abandoned' THEN 'abandoned'
            WHEN c.error IS NOT NULL OR coalesce(c.status_code, 200) >= 400 THEN 'failed' END AS failed
FROM call_records c LEFT JOIN sessions s USING (session_id)
WHERE {where}
ORDER BY c.session_id, c.seq
"""


class _Row(NamedTuple):
    """One row of _SQL, in its column order."""
    session_id: str
    task_id: str | None
    seq: int
    call_id: str
    base: str | None
    shared: int | None
    suffix: bytes | str | None
    tokens: list[int] | None
    logprobs: list[float] | None
    finish: str | None
    version: str | int | None
    reward: float | None
    backend_params: bytes | str | None
    model: str | None
    token_versions: list[int | None] | None   # per sampled token (NULL entry: unknown); NULL: all
                                              # policy_version's
    failed: str | None   # 'failed', 'abandoned' (the harness gave up on the call), or None


@dataclass(frozen=True)
class _Rule:
    """The caller's choices that decide, call by call, what is trained."""
    temperature: float | None
    reward_covers: str | Mapping[str, str]
    require_reward: bool

    def covers(self, task_id: str | None) -> str:
        if isinstance(self.reward_covers, str):
            return self.reward_covers
        return self.reward_covers.get(task_id or "", "all")


@dataclass
class _Stored:
    """What every file read holds: its rows, and the rewards seen in any of them."""
    files: list[tuple[Path, list[_Row]]] = field(default_factory=list)
    # session -> the first file's reward (in the order given)
    rewards: dict[str, float] = field(default_factory=dict)
    # rewarded session -> its GRPO group (its task, or itself)
    groups: dict[str, str] = field(default_factory=dict)


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
    stored = _read_stored(dbs, *_selection(tasks, sessions), timeout)
    rule = _Rule(temperature, reward_covers, require_reward)
    out = TrainingData(calls=[])
    unrewarded: set[str] = set()
    kept_sessions: set[str] = set()
    while stored.files:   # each file's rows are let go once read
        path, rows = stored.files.pop(0)
        _keep_trainable(path, rows, rule, stored.rewards, out, unrewarded, kept_sessions)
    kept_sessions -= _drop_superseded(out, kept_sessions)
    out.sessions = len(kept_sessions)
    out.sessions_without_reward = len(unrewarded)
    out.calls.sort(key=lambda c: (c.group, c.session_id, c.seq))
    out.rewards = _group_rewards(out.calls, stored, sessions)
    return out


def _selection(tasks: list[str] | None, sessions: list[str] | None) -> tuple[str, list[str]]:
    """_SQL's condition for the chosen tasks and sessions (all when neither), and its parameters."""
    where: list[str] = ["TRUE"]
    params: list[str] = []
    if tasks:
        where.append(f"s.task_id IN ({', '.join('?' * len(tasks))})")
        params += list(tasks)
    if sessions:
        where.append(f"c.session_id IN ({', '.join('?' * len(sessions))})")
        params += list(sessions)
    return " AND ".join(where), params


def _read_stored(dbs: Iterable[str | os.PathLike], where: str, params: list[str], timeout: float) -> _Stored:
    """Every file's selected rows and rewarded sessions, all read before any call is judged:
    a session's reward may be in a file given after its calls' own."""
    stored = _Stored()
    for db in dbs:
        path = Path(db)
        if not path.exists():
            raise FileNotFoundError(f"no database at {path}")
        with reading(path, timeout) as con:
            sql = _SQL.format(where=where, token_versions="c.token_versions" if _has_token_versions(con)
                              else "NULL::INTEGER[] AS token_versions")
            stored.files.append((path, [_Row(*row) for row in con.execute(sql, params).fetchall()]))
            for session_id, task_id, reward in con.execute(
                    "SELECT session_id, task_id, reward FROM sessions WHERE reward IS NOT NULL").fetchall():
                stored.rewards.setdefault(session_id, reward)
                stored.groups.setdefault(session_id, task_id or session_id)
    return stored


def _has_token_versions(con) -> bool:
    """Whether the file has the column (migration 13); a file no writer of this version has
    opened yet is read as it is, every call's tokens its policy_version's."""
    return bool(con.execute("SELECT count(*) FROM information_schema.columns "
                            "WHERE table_name = 'call_records' AND column_name = 'token_versions'").fetchone()[0])


def _keep_trainable(path: Path, rows: list[_Row], rule: _Rule, rewards: Mapping[str, float],
                    out: TrainingData, unrewarded: set[str], kept_sessions: set[str]) -> None:
    """Add one file's trainable calls to out.calls, counting each skipped one by its reason
    in out.skipped; sessions with a call kept go to kept_sessions, those skipped for want
    of a reward to unrewarded."""
    main_model = _main_models(rows)
    for row, prompt in _with_prompts(rows, out.skipped):
        reason = _untrainable(row, prompt, rule.temperature)
        if reason:
            out.skipped[reason] += 1
            continue
        # counted before the reward_covers and reward checks: every sampled call of either kind
        auxiliary = row.model != main_model[row.session_id]
        out.call_kinds["auxiliary" if auxiliary else "main"] += 1
        if auxiliary and rule.covers(row.task_id) == "main":
            out.skipped["auxiliary_call"] += 1
            continue
        reward = row.reward if row.reward is not None else rewards.get(row.session_id)
        if reward is None and rule.require_reward:
            out.skipped["no_reward"] += 1
            unrewarded.add(row.session_id)
            continue
        kept_sessions.add(row.session_id)
        assert prompt is not None and row.tokens is not None and row.logprobs is not None   # _untrainable's
        out.calls.append(Call(
            session_id=row.session_id, group=row.task_id or row.session_id, seq=row.seq,
            prompt=list(prompt), tokens=list(row.tokens), logprobs=[float(x) for x in row.logprobs],
            finish_reason=row.finish, policy_version=policy_version_of(row.version), reward=reward,
            db=str(path), token_versions=_token_versions(row.token_versions)))


def _with_prompts(rows: list[_Row], skipped: Counter[str]) -> Iterator[tuple[_Row, list[int] | None]]:
    """Each row with its prompt ids rebuilt from their delta (None: none stored); a row whose
    base is not in the file is counted as missing_base in skipped instead. Every rebuilt call,
    failed ones too, stays known as a base for the later calls of its session."""
    ids: dict[str, tuple[list[int] | None, list[int]]] = {}   # call_id -> (prompt, tokens)
    current = None
    for row in rows:
        if current != row.session_id:   # bases are always earlier calls of the same session
            ids, current = {}, row.session_id
        prompt = None
        if row.suffix is not None:
            prompt = apply_prompt(ids, row.base, row.shared, orjson.loads(row.suffix))
            if prompt is None:
                skipped["missing_base"] += 1
                continue
        ids[row.call_id] = (prompt, row.tokens or [])
        yield row, prompt


def _untrainable(row: _Row, prompt: list[int] | None, temperature: float | None) -> str | None:
    """Why this call's tokens cannot be trained on, by the first reason that applies, or None."""
    if row.failed:
        return row.failed
    if not prompt or not row.tokens:
        return "no_token_ids"
    if row.logprobs is None or len(row.logprobs) != len(row.tokens):
        return "logprobs_mismatch"
    if not _known_version(row):
        return UNKNOWN_VERSION_REASON
    return sampling_exclusion(orjson.loads(row.backend_params) if row.backend_params else None, temperature)


def _token_versions(stored: list[int | None] | None) -> list[int] | None:
    """The stored column as the record's: a NULL entry is UNKNOWN_VERSION."""
    if stored is None:
        return None
    return [UNKNOWN_VERSION if v is None else int(v) for v in stored]


def _known_version(row: _Row) -> bool:
    """Whether any of the call's tokens was sampled by a known version. Versions that do not
    match the tokens one for one say nothing about which token is whose."""
    if row.token_versions is None:
        return policy_version_of(row.version) != UNKNOWN_VERSION
    return len(row.token_versions) == len(row.tokens or ()) and any(v is not None for v in row.token_versions)


def _drop_superseded(out: TrainingData, kept_sessions: set[str]) -> set[str]:
    """One session per sample: the calls of an attempt a retry superseded are left out of
    out.calls (counted as superseded_attempt); returns those sessions."""
    superseded = kept_sessions - latest_attempts(kept_sessions)
    if superseded:
        out.skipped["superseded_attempt"] += sum(c.session_id in superseded for c in out.calls)
        out.calls = [c for c in out.calls if c.session_id not in superseded]
    return superseded


def _group_rewards(calls: list[Call], stored: _Stored,
                   sessions: list[str] | None) -> dict[str, SessionReward]:
    """The rewarded sessions (each sample's latest attempt) of every group with a kept call,
    those with no trainable call included, for the trainer's group baselines."""
    read = {c.group for c in calls}
    chosen = [sid for sid in stored.rewards
              if stored.groups[sid] in read and (not sessions or sid in sessions)]
    final = latest_attempts(chosen)
    return {sid: SessionReward(stored.groups[sid], float(stored.rewards[sid]))
            for sid in chosen if sid in final}


def _main_models(rows: Iterable[_Row]) -> dict[str, str | None]:
    """Per session, the model its calls asked for most (the first such on a tie): its main
    loop. A harness's router or title calls ask a smaller model."""
    counts: dict[str, Counter[str | None]] = {}
    for row in rows:
        counts.setdefault(row.session_id, Counter())[row.model] += 1
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
