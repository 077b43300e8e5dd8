"""A session's transcript as a judge reads it: the task's instruction, the conversation its
harness had with the model (user turns, the assistant's text and tool calls, tool results)
and its final answer, from the calls the proxy recorded.

A harness re-sends the whole conversation on every turn, so the last call of the session's
main chain (the calls to the model it asked for most: a router's or a title call's other
model is left out) holds all of it; its answer is the last assistant turn. The request is
rebuilt whole from its deltas by the session_calls macro (schema.py) and read into the one
chat shape by the adapters (the same code that reads it at the proxy), whatever API style
the harness spoke."""

from __future__ import annotations

import copy
import os
from collections import Counter
from dataclasses import dataclass
from typing import Any, NamedTuple

import orjson

from ..adapters import AdapterError, adapter
from ..adapters.chat import Message
from .db import reading


@dataclass(frozen=True)
class Transcript:
    """What a session did. turns: {"role": "user" | "assistant" | "tool", "text": str}, and
    on an assistant turn "tool_calls": [{"name", "arguments"}], on a tool turn "name" (the
    tool's, when known) and "is_error"."""
    session_id: str
    instruction: str | None
    turns: list[dict]
    final: str                  # the last assistant text ("" when it never wrote any)
    # the workspace's final diff, when the node took one (bytes it holds, from a sandbox's
    # stdout: never a file read from the session's space); not stored here
    diff: str | None = None


# Per call of the session: what picks the main chain's last call.
_CALLS = """
SELECT call_id, requested_model, error IS NULL AND coalesce(status_code, 200) < 400 AS ok
FROM call_records WHERE session_id = ? ORDER BY seq"""

# One call, its request rebuilt whole (the macro walks only this session's deltas).
_CALL = "SELECT style, path, request_text, response_json FROM session_calls(?) WHERE call_id = ?"

# The task's instruction, when this file has the rollout server's tasks.
_INSTRUCTION = """
SELECT t.spec->>'instruction' FROM rollout_tasks t
WHERE t.task_id = coalesce((SELECT task_id FROM rollout_sessions WHERE session_id = $sid),
                           (SELECT task_id FROM sessions WHERE session_id = $sid))"""


def transcript(db: str | os.PathLike, session_id: str, instruction: str | None = None,
               timeout: float = 30.0) -> Transcript:
    """The session's transcript from its recorded calls. instruction: the task's, when the
    caller knows it; else the task's stored spec, else the first user turn. Raises
    LookupError for a session with no recorded call."""
    with reading(db, timeout) as con:
        calls = con.execute(_CALLS, [session_id]).fetchall()
        if not calls:
            raise LookupError(f"{session_id}: no recorded call in {db}")
        call_id, answered = last_main_call(calls)
        row = con.execute(_CALL, [session_id, call_id]).fetchone()
        if row is None:   # its delta chain is broken: no request to read
            raise LookupError(f"{session_id}: call {call_id} cannot be rebuilt from {db}")
        style, path, request_text, response_json = row
        if instruction is None:
            row = con.execute(_INSTRUCTION, {"sid": session_id}).fetchone()
            instruction = row[0] if row else None
    response = orjson.loads(response_json) if answered and response_json else None
    turns = conversation(style, path or "", request_text, response)
    if instruction is None:
        instruction = next((t["text"] for t in turns if t["role"] == "user"), None)
    final = next((t["text"] for t in reversed(turns) if t["role"] == "assistant" and t["text"].strip()), "")
    return Transcript(session_id, instruction, turns, final)


class MainCall(NamedTuple):
    call_id: str
    answered: bool


def last_main_call(calls: list[tuple[str, str | None, bool]]) -> MainCall:
    """Of a session's calls, (call id, requested model, ok) in order: the main chain's last
    answered call; with no answered call, its last call (its request still holds the
    conversation so far)."""
    main = Counter(model for _, model, _ in calls).most_common(1)[0][0]   # the first on a tie
    chain = [(call_id, ok) for call_id, model, ok in calls if model == main]
    answered = [call_id for call_id, ok in chain if ok]
    return MainCall(answered[-1], True) if answered else MainCall(chain[-1][0], False)


def conversation(style: str, path: str, request_text: str | None, response: Any = None) -> list[dict]:
    """The turns of a recorded request (its harness's body as sent, in its API style) and of
    its answer (the provider-shaped body, or None), system prompts left out. A body the
    adapters cannot read gives no turns; an answer they cannot read is left out."""
    try:
        body = orjson.loads(request_text or "")
    except orjson.JSONDecodeError:
        return []   # a failed call's bounded head: not JSON
    if response is not None:
        try:   # the answer read as the next request would carry it back
            return _turns(adapter(style).to_chat(body_with_answer(style, body, response), path)["messages"])
        except (AdapterError, KeyError, IndexError, TypeError, AttributeError):
            pass
    try:
        return _turns(adapter(style).to_chat(body, path)["messages"])
    except (AdapterError, KeyError):
        return []


def body_with_answer(style: str, body: Any, response: dict) -> Any:
    """The request body with its answer appended as the assistant's turn, in the style's own
    shape: what the harness sends on its next turn."""
    body = copy.deepcopy(body)
    if style == "anthropic":
        body["messages"].append({"role": "assistant", "content": response["content"]})
    elif style == "openai_chat":
        body["messages"].append(response["choices"][0]["message"])
    elif style == "openai_responses":
        given = body["input"]
        body["input"] = ([{"role": "user", "content": given}] if isinstance(given, str) else given) \
            + response["output"]
    elif style == "google":
        inner = body["request"] if isinstance(body.get("request"), dict) and "contents" not in body else body
        answer = response.get("response", response)   # Code Assist wraps it
        inner["contents"].append(answer["candidates"][0]["content"])
    else:
        raise KeyError(style)
    return body


def _turns(messages: list[Message]) -> list[dict]:
    """Chat-shape messages as transcript turns; a tool result is named by the call it answers."""
    names: dict[str, str] = {}
    out: list[dict] = []
    for m in messages:
        role = m["role"]
        if role == "system":
            continue
        text = "".join(p["text"] if p["type"] == "text" else "[image]" for p in m["content"])
        turn: dict[str, Any] = {"role": role, "text": text}
        if role == "assistant":
            calls = m.get("tool_calls") or []
            names.update((c["id"], c["name"]) for c in calls)
            turn["tool_calls"] = [{"name": c["name"], "arguments": c["arguments"]} for c in calls]
        elif role == "tool":
            turn["name"] = m.get("name") or names.get(m.get("tool_call_id") or "")
            turn["is_error"] = bool(m.get("is_error"))
        out.append(turn)
    return out
