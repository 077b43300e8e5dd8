"""Rollouts as SFT data (`polar-mitm export sft`): the chains of the chosen sessions, as
chat messages or as the exact token ids.

A chain is one conversation of a session: its main loop, or a sub-agent's. A harness re-sends
the whole conversation on every turn, so a call continues a chain when the chain's last call's
prompt ids + sampled ids are a prefix of its prompt ids (what vLLM rendered extends what it
sampled), or, where the harness re-rendered the history (drift), when its messages start with
the chain's last call's messages. A call that continues no chain starts one (a sub-agent: a
system prompt or a conversation of its own). The main chain is the chain with the most calls
to the session's most used model (store/transcripts.py's notion; the grpo package's prefix
logic is not imported here: the store never imports it, so the little needed is below).

Which sessions: as the trainer's reader (store/training.py) counts them: a session with a
reward, the latest rewarded attempt of its sample (TASK~i.rN supersedes TASK~i), its reward
from its own file, else from the first file given that has one. Failed and abandoned calls
are never a row's completion. Held-out copies (TASK@RUN.I.eval) are left out unless asked.

Two shapes, one row per chain:

- messages: {"messages", "tools", ...}: OpenAI chat messages, the body vLLM got for the
  chain's last call (rebuilt from the harness's request by the same adapters the proxy ran:
  adapters.backend_request) and the answer it gave (read back from the provider-shaped
  answer, as the harness's next turn carries it), tool calls and tool results included.
  A tool call's `function.arguments` is a JSON object, not JSON text, and `tools` is the list
  of OpenAI tool objects: what vLLM hands the chat template (it parses the arguments text),
  what TRL's SFTTrainer and transformers' apply_chat_template take, so that rendering
  `messages[:-1]` with the model's chat template (add_generation_prompt) gives the recorded
  prompt ids of the chain's last call.
  Arrow would merge the keys of every tool's schema and every call's arguments into one
  struct, adding null keys that change the rendering. So the Parquet file types `messages`
  and `tools` as list<json> (Arrow's JSON extension type: one JSON text per message or tool,
  read back as the very dicts by `datasets` >= 5, which maps it to List(Json())); in JSONL
  they are plain JSON, which `datasets`' JSON loader reads as List(Json()) wherever the
  dicts' keys differ (its on_mixed_types="use_json", the default), exact too.
- tokens: {"input_ids", "completion_mask", ...}: the chain's last call's prompt ids + its
  sampled ids, with mask 1 on every position the model sampled in some call of the chain
  and that is there exactly as sampled (after exactly the context it was sampled in), 0 on
  prompt tokens and on whatever the harness re-rendered. TRL's names for a tokenized
  dataset's ids and loss mask.

Every row carries db, session_id, task_id, reward, policy_version (the last call's: the
version that sampled the final answer), chain (its index in the session, in start order),
main_chain and call_ids (the chain's calls, in order)."""

from __future__ import annotations

import fnmatch
import os
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Iterable, Iterator, Literal, Mapping, TypedDict

import orjson

from ..adapters import AdapterError, adapter, backend_request
from ..adapters.backend import to_backend
from ..session_ids import latest_attempts, parse_run_task, task_of, task_of_run
from .db import reading
from .delta import apply_prompt, apply_text
from .transcripts import body_with_answer

Format = Literal["messages", "tokens"]
FORMATS: tuple[Format, ...] = ("messages", "tokens")
SUFFIXES = (".jsonl", ".parquet")

# Why a session was not exported (counted per session) ...
SESSION_SKIPS = ("no_reward", "below_min_reward", "superseded_attempt", "held_out", "no_chain")
# ... and why a call of an exported session is in no row (counted per call).
CALL_SKIPS = ("failed", "abandoned", "missing_base", "unreadable", "no_answer", "no_token_ids")


class _RowBase(TypedDict):
    db: str
    session_id: str
    task_id: str
    reward: float
    policy_version: int | None
    chain: int
    main_chain: bool
    call_ids: list[str]


class MessagesRow(_RowBase):
    messages: list[dict[str, Any]]
    tools: list[dict[str, Any]]


class TokensRow(_RowBase):
    input_ids: list[int]
    completion_mask: list[int]


@dataclass
class ExportStats:
    rows: int = 0
    sessions: int = 0                                   # sessions with at least one row
    skipped_sessions: Counter[str] = field(default_factory=Counter)   # reason -> sessions
    skipped_calls: Counter[str] = field(default_factory=Counter)      # reason -> calls


def iteration_of(task_id: str) -> int | None:
    """I of the loop's TASK@RUN.I (or TASK@RUN.I.eval); None for a task outside any run."""
    rt = parse_run_task(task_id)
    return rt.iteration if rt else None


def held_out(task_id: str) -> bool:
    """A held-out copy of the loop's (TASK@RUN.I.eval): never trained on."""
    rt = parse_run_task(task_id)
    return bool(rt and rt.held_out)


def task_matches(task_id: str, pattern: str) -> bool:
    """A shell glob against the task id, whole (TASK@RUN.I) or without its run (TASK)."""
    return fnmatch.fnmatchcase(task_id, pattern) or fnmatch.fnmatchcase(task_of_run(task_id), pattern)


# ---- which sessions ------------------------------------------------------------------------

# Every session with a call, with its stored task and reward (NULL: none in this file).
_SESSIONS = """
SELECT c.session_id, any_value(s.task_id), any_value(s.reward)
FROM (SELECT DISTINCT session_id FROM call_records) c LEFT JOIN sessions s USING (session_id)
GROUP BY c.session_id ORDER BY c.session_id"""


@dataclass(frozen=True)
class _Session:
    session_id: str
    task_id: str
    reward: float


def _chosen_sessions(dbs: list[Path], min_reward: float, task: str | None, iteration: int | None,
                     include_held_out: bool, timeout: float,
                     stats: ExportStats) -> list[list[_Session]]:
    """Per file, the sessions to export, in session order."""
    found: list[list[tuple[str, str, float | None]]] = []
    rewards: dict[str, float] = {}   # session -> the first file's reward, in the order given
    for db in dbs:
        with reading(db, timeout) as con:
            rows = [(sid, task_id or task_of(sid) or sid, reward)
                    for sid, task_id, reward in con.execute(_SESSIONS).fetchall()]
        found.append(rows)
        for sid, _, reward in rows:
            if reward is not None:
                rewards.setdefault(sid, float(reward))
    latest = latest_attempts(rewards)   # the latest rewarded attempt of each sample counts, in every file
    out: list[list[_Session]] = []
    seen: set[str] = set()   # a session in two files is counted once
    for rows in found:
        chosen = []
        for sid, task_id, reward in rows:
            if task is not None and not task_matches(task_id, task):
                continue
            if iteration is not None and iteration_of(task_id) != iteration:
                continue
            reason = None
            own = float(reward) if reward is not None else rewards.get(sid)
            if held_out(task_id) and not include_held_out:
                reason = "held_out"
            elif own is None:
                reason = "no_reward"
            elif sid not in latest:
                reason = "superseded_attempt"
            elif own < min_reward:
                reason = "below_min_reward"
            if reason is None and own is not None:
                chosen.append(_Session(sid, task_id, own))
            elif sid not in seen:
                stats.skipped_sessions[reason or "no_reward"] += 1
            seen.add(sid)
        out.append(chosen)
    return out


# ---- the calls of a session ----------------------------------------------------------------

# The stored rows, rebuilt whole here (request text and prompt ids from their deltas), a
# session at a time, as training.py does: much cheaper than the calls view's recursion.
_CALLS = """
SELECT c.session_id, c.seq, c.call_id, c.base_call, c.request_prefix, c.request_suffix,
       c.request_middle, c.prompt_shared, c.prompt_suffix, c.token_ids, c.style, c.path,
       c.backend_params, c.response_json, c.requested_model, c.policy_version,
       CASE WHEN c.error_kind = 'abandoned' THEN 'abandoned'
            WHEN c.error IS NOT NULL OR coalesce(c.status_code, 200) >= 400 THEN 'failed' END
FROM call_records c JOIN (SELECT unnest(?::VARCHAR[]) AS session_id) chosen USING (session_id)
ORDER BY c.session_id, c.seq"""
SESSIONS_PER_READ = 256   # sessions read at a time: memory stays bounded, and the file is let go between reads


@dataclass
class _Call:
    call_id: str
    model: str | None
    policy_version: int | None
    messages: list[dict[str, Any]]
    tools: list[dict[str, Any]]
    answer: dict[str, Any] | None
    prompt: list[int] | None
    tokens: list[int] | None


def _vllm_arguments(messages: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Tool-call arguments as vLLM hands them to the chat template: the JSON text parsed to
    an object (text that is no JSON object stays text)."""
    for m in messages:
        for call in m.get("tool_calls") or []:
            fn = call.get("function") or {}
            args = fn.get("arguments")
            if isinstance(args, str):
                try:
                    parsed = orjson.loads(args)
                except orjson.JSONDecodeError:
                    continue
                if isinstance(parsed, dict):
                    fn["arguments"] = parsed
    return messages


def _answer(style: str, path: str, body: Any, response: Any, model: str, asked: int) -> dict[str, Any] | None:
    """The assistant message the call answered, in the backend's (OpenAI chat) shape: the
    request with its answer appended, as the harness's next turn carries it, adapted again."""
    if not isinstance(response, dict):
        return None
    try:
        chat = adapter(style).to_chat(body_with_answer(style, body, response), path)
        messages = to_backend(chat, model)["messages"]
    except (AdapterError, KeyError, IndexError, TypeError, AttributeError, ValueError):
        return None
    if len(messages) != asked + 1 or messages[-1].get("role") != "assistant":
        return None
    return _vllm_arguments(messages[-1:])[0]


def _session_calls(rows: list[tuple], skipped: Counter[str]) -> list[_Call]:
    """The session's answered calls, in order, rebuilt whole; the others counted."""
    texts: dict[str, str] = {}
    ids: dict[str, tuple[list[int] | None, list[int]]] = {}
    out: list[_Call] = []
    for (_, _, call_id, base, prefix, suffix_len, middle, shared, suffix, tokens, style, path,
         backend_params, response_json, model, version, failed) in rows:
        if base is not None and base not in texts:
            skipped["missing_base"] += 1
            continue
        text = (middle or "") if base is None else apply_text(texts[base], prefix, suffix_len, middle)
        texts[call_id] = text
        prompt = None if suffix is None else apply_prompt(ids, base, shared, orjson.loads(suffix))
        ids[call_id] = (prompt, list(tokens or []))
        if failed:
            skipped[failed] += 1
            continue
        params = orjson.loads(backend_params) if backend_params else {}
        try:
            body = orjson.loads(text)
            vllm = backend_request(style, path or "", text, params if isinstance(params, dict) else {})
        except (orjson.JSONDecodeError, AdapterError, KeyError, TypeError, ValueError, AttributeError):
            skipped["unreadable"] += 1
            continue
        messages = _vllm_arguments(vllm.get("messages") or [])
        answer = _answer(style, path or "", body, orjson.loads(response_json) if response_json else None,
                         params.get("model", "") if isinstance(params, dict) else "", len(messages))
        out.append(_Call(call_id, model, version, messages, vllm.get("tools") or [], answer,
                         prompt, list(tokens) if tokens else None))
    return out


# ---- chains --------------------------------------------------------------------------------

def _is_prefix(p: list[int], s: list[int]) -> bool:
    return len(p) <= len(s) and s[:len(p)] == p


def _common(a: list[int], b: list[int]) -> int:
    n = min(len(a), len(b))
    i = 0
    while i < n and a[i] == b[i]:
        i += 1
    return i


def _continues(last: _Call, call: _Call) -> tuple[bool, int] | None:
    """How `call` continues a chain whose last call is `last`: (by token ids, how many
    messages), or None. By ids: the prompt extends last's prompt + sampled ids. By messages
    (the history re-rendered): its messages start with last's."""
    by_ids = bool(last.prompt and last.tokens and call.prompt
                  and _is_prefix(last.prompt + last.tokens, call.prompt))
    n = len(last.messages)
    if by_ids or (len(call.messages) >= n and call.messages[:n] == last.messages):
        return by_ids, n
    return None


def chains(calls: list[_Call]) -> list[list[_Call]]:
    """The session's calls in chains (each a conversation), in the order they started."""
    out: list[list[_Call]] = []
    for call in calls:
        best, score = None, None
        for chain in out:
            how = _continues(chain[-1], call)
            if how is not None and (score is None or how > score):
                best, score = chain, how
        if best is None:
            out.append([call])
        else:
            best.append(call)
    return out


def _main_chain(session: list[_Call], found: list[list[_Call]]) -> int:
    """The chain with the most calls to the session's most used model (the first on a tie)."""
    models = Counter(c.model for c in session)
    main = models.most_common(1)[0][0]
    counts = [sum(c.model == main for c in chain) for chain in found]
    return counts.index(max(counts))


def completion_mask(chain: list[_Call], input_ids: list[int]) -> list[int]:
    """1 where a call of the chain sampled the token there, after exactly its context."""
    mask = [0] * len(input_ids)
    for call in chain:
        if not call.prompt or not call.tokens or not _is_prefix(call.prompt, input_ids):
            continue
        start = len(call.prompt)
        for j in range(_common(input_ids[start:start + len(call.tokens)], call.tokens)):
            mask[start + j] = 1
    return mask


# ---- the rows ------------------------------------------------------------------------------

def sft_rows(dbs: Iterable[str | os.PathLike], *, min_reward: float, fmt: Format = "messages",
             task: str | None = None, iteration: int | None = None, main_chain: bool = False,
             include_held_out: bool = False, timeout: float = 30.0,
             stats: ExportStats | None = None) -> Iterator[MessagesRow | TokensRow]:
    """The rows of every chosen session's chains (only its main chain with main_chain), file
    by file and session by session. task: a glob on the task id (TASK@RUN.I or TASK);
    iteration: the loop's iteration I of TASK@RUN.I. `stats` counts what was skipped."""
    if fmt not in FORMATS:
        raise ValueError(f"format must be one of {', '.join(FORMATS)}, not {fmt!r}")
    stats = stats if stats is not None else ExportStats()
    paths = [Path(db) for db in dbs]
    for path in paths:
        if not path.exists():
            raise FileNotFoundError(f"no database at {path}")
    chosen = _chosen_sessions(paths, min_reward, task, iteration, include_held_out, timeout, stats)
    exported: set[str] = set()
    for path, sessions in zip(paths, chosen):
        for at in range(0, len(sessions), SESSIONS_PER_READ):
            part = sessions[at:at + SESSIONS_PER_READ]
            with reading(path, timeout) as con:
                rows = con.execute(_CALLS, [[s.session_id for s in part]]).fetchall()
            by_session: dict[str, list[tuple]] = {}
            for record in rows:
                by_session.setdefault(record[0], []).append(record)
            del rows
            for session in part:
                made = 0
                for row in _session_rows(path, session, by_session.pop(session.session_id, []), fmt,
                                         main_chain, stats.skipped_calls):
                    made += 1
                    yield row
                stats.rows += made
                if made and session.session_id not in exported:
                    exported.add(session.session_id)
                    stats.sessions += 1
                elif not made:
                    stats.skipped_sessions["no_chain"] += 1


def _session_rows(path: Path, session: _Session, rows: list[tuple], fmt: Format, main_only: bool,
                  skipped: Counter[str]) -> Iterator[MessagesRow | TokensRow]:
    calls = _session_calls(rows, skipped)
    if not calls:
        return
    found = chains(calls)
    main = _main_chain(calls, found)
    for index, chain in enumerate(found):
        if main_only and index != main:
            continue
        # a row ends at the chain's last call whose answer could be read
        while chain and (chain[-1].answer is None if fmt == "messages" else not (chain[-1].prompt and chain[-1].tokens)):
            skipped["no_answer" if fmt == "messages" else "no_token_ids"] += 1
            chain = chain[:-1]
        if not chain:
            continue
        last = chain[-1]
        base: _RowBase = {"db": str(path), "session_id": session.session_id, "task_id": session.task_id,
                          "reward": session.reward, "policy_version": last.policy_version,
                          "chain": index, "main_chain": index == main,
                          "call_ids": [c.call_id for c in chain]}
        if fmt == "messages":
            assert last.answer is not None
            yield MessagesRow(messages=[*last.messages, last.answer], tools=last.tools, **base)
        else:
            assert last.prompt and last.tokens
            input_ids = last.prompt + last.tokens
            yield TokensRow(input_ids=input_ids, completion_mask=completion_mask(chain, input_ids), **base)


# ---- the files -----------------------------------------------------------------------------

_JSON_COLUMNS = ("messages", "tools")   # list<json> in Parquet


def write_rows(rows: Iterable[Mapping[str, Any]], out: str | os.PathLike, fmt: Format) -> int:
    """Write the rows to OUT (.jsonl or .parquet, by its suffix), atomically renamed into
    place; returns how many."""
    target = Path(out)
    if target.suffix not in SUFFIXES:
        raise ValueError(f"{target}: the output must end in {' or '.join(SUFFIXES)}")
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = target.with_name(f".{target.name}.tmp")
    try:
        n = _write_jsonl(rows, tmp) if target.suffix == ".jsonl" else _write_parquet(rows, tmp, fmt)
        os.replace(tmp, target)
    finally:
        tmp.unlink(missing_ok=True)
    return n


def _write_jsonl(rows: Iterable[Mapping[str, Any]], tmp: Path) -> int:
    n = 0
    with open(tmp, "wb") as f:
        for row in rows:
            f.write(orjson.dumps(row, option=orjson.OPT_APPEND_NEWLINE))
            n += 1
    return n


def _schema(fmt: Format):
    import pyarrow as pa

    json_list = pa.list_(pa.json_())
    head = ([pa.field("messages", json_list), pa.field("tools", json_list)] if fmt == "messages" else
            [pa.field("input_ids", pa.list_(pa.int32())), pa.field("completion_mask", pa.list_(pa.int8()))])
    return pa.schema(head + [
        pa.field("db", pa.string()), pa.field("session_id", pa.string()), pa.field("task_id", pa.string()),
        pa.field("reward", pa.float64()), pa.field("policy_version", pa.int64()), pa.field("chain", pa.int32()),
        pa.field("main_chain", pa.bool_()), pa.field("call_ids", pa.list_(pa.string()))])


def _write_parquet(rows: Iterable[Mapping[str, Any]], tmp: Path, fmt: Format, batch: int = 256) -> int:
    import pyarrow as pa
    import pyarrow.parquet as pq

    schema = _schema(fmt)
    n = 0
    with pq.ParquetWriter(tmp, schema) as writer:
        pending: list[Mapping[str, Any]] = []

        def flush() -> None:
            columns = []
            for f in schema:
                values = [r[f.name] for r in pending]
                if f.name in _JSON_COLUMNS:
                    columns.append(_json_list(values))
                else:
                    columns.append(pa.array(values, f.type))
            writer.write_table(pa.Table.from_arrays(columns, schema=schema))
            pending.clear()

        for row in rows:
            pending.append(row)
            n += 1
            if len(pending) >= batch:
                flush()
        if pending or n == 0:
            flush()
    return n


def _json_list(values: list[list[Any]]):
    """A list<json> column: each item as its JSON text."""
    import pyarrow as pa

    offsets = [0]
    texts: list[str] = []
    for items in values:
        texts.extend(orjson.dumps(x).decode() for x in items)
        offsets.append(len(texts))
    flat = pa.array(texts, pa.string()).cast(pa.json_())
    return pa.ListArray.from_arrays(pa.array(offsets, pa.int32()), flat, type=pa.list_(pa.json_()))


def export_sft(dbs: Iterable[str | os.PathLike], out: str | os.PathLike, *, min_reward: float,
               fmt: Format = "messages", task: str | None = None, iteration: int | None = None,
               main_chain: bool = False, include_held_out: bool = False,
               timeout: float = 30.0) -> ExportStats:
    """Export the chosen sessions' chains to OUT (.jsonl or .parquet); returns the counts."""
    if Path(out).suffix not in SUFFIXES:
        raise ValueError(f"{out}: the output must end in {' or '.join(SUFFIXES)}")
    dbs = list(dbs)
    for db in dbs:
        if not Path(db).exists():
            raise FileNotFoundError(f"no database at {db}")
    stats = ExportStats()
    rows = sft_rows(dbs, min_reward=min_reward, fmt=fmt, task=task, iteration=iteration,
                    main_chain=main_chain, include_held_out=include_held_out, timeout=timeout, stats=stats)
    write_rows(rows, out, fmt)
    return stats
