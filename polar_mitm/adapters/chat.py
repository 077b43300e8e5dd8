"""The internal chat shape every adapter translates to and from.

Plain JSON-serialisable dicts, so a normalized request can be stored as-is and
compared across turns.

Normalized request::

    {"style": str, "model": str, "stream": bool,
     "messages": [Message], "tools": [Tool], "tool_choice": None | "auto" | "none"
        | "required" | {"name": str},
     "parallel_tool_calls": bool | None,
     "max_tokens", "temperature", "top_p", "top_k", "seed": number | None,
     "stop": [str], "response_format": None | {"type": "json_object"}
        | {"type": "json_schema", "name": str, "schema": dict},
     "reasoning": None | {"effort": str | None, "budget_tokens": int | None},
     "provider": {...style-specific facts needed to answer...},
     "dropped": [str]}                       # provider-only fields not forwarded

Message: {"role": "system" | "user" | "assistant" | "tool", "content": [Part]}
  assistant may add "tool_calls": [ToolCall] and "reasoning": str
  tool adds "tool_call_id": str, "name": str | None, "is_error": bool
Part: {"type": "text", "text": str} | {"type": "image", "url": str}
      (url is an http(s) URL or a data: URL)
ToolCall: {"id": str, "name": str, "arguments": str, "kind": "function" | "custom"}
  function arguments are a JSON object text; custom arguments are the raw input.
Tool: {"name": str, "description": str, "parameters": dict, "kind": "function" | "custom",
       "format": dict | None}

Normalized result (what the backend produced, provider-neutral)::

    {"id": str, "created": int, "model": str, "text": str, "reasoning": str | None,
     "tool_calls": [ToolCall], "finish_reason": "stop" | "length" | "tool_calls"
        | "content_filter", "stop_sequence": str | None,
     "usage": {"prompt_tokens": int, "completion_tokens": int}}
"""

from __future__ import annotations

import hashlib
from typing import Any, Iterable

import orjson


class AdapterError(ValueError):
    """A request the adapters cannot translate. `status` is the HTTP status the
    client should get; `kind` picks the provider's error type."""

    status = 400
    kind = "invalid_request"

    def __init__(self, message: str, *, status: int | None = None, kind: str | None = None):
        super().__init__(message)
        if status is not None:
            self.status = status
        if kind is not None:
            self.kind = kind


class MalformedRequest(AdapterError):
    """The body is not what the provider API accepts (wrong type, missing field)."""


class UnsupportedContent(AdapterError):
    """Valid for the provider, but not something the backend can take (e.g. audio)."""


# The error kinds every provider's error() maps to its own body, with their usual status.
DEFAULT_STATUS = {"invalid_request": 400, "context_too_long": 400, "overloaded": 503,
                  "timeout": 504, "backend_error": 502, "not_found": 404,
                  "authentication": 401, "rate_limit": 429, "too_large": 413}


def kind_for_status(status: int) -> str:
    if status == 404:
        return "not_found"
    if status in (401, 403):
        return "authentication"
    if status == 429:
        return "rate_limit"
    if status == 413:
        return "too_large"
    if status in (503, 529):
        return "overloaded"
    if status == 504:
        return "timeout"
    if status >= 500:
        return "backend_error"
    return "invalid_request"


def require(cond: Any, message: str) -> None:
    if not cond:
        raise MalformedRequest(message)


def expect_type(value: Any, types: type | tuple[type, ...], where: str) -> Any:
    if not isinstance(value, types) or (isinstance(value, bool) and bool not in _as_tuple(types)):
        names = "/".join(t.__name__ for t in _as_tuple(types))
        raise MalformedRequest(f"{where}: expected {names}, got {type(value).__name__}")
    return value


def _as_tuple(types):
    return types if isinstance(types, tuple) else (types,)


def number_or_none(value: Any, where: str) -> float | int | None:
    if value is None:
        return None
    return expect_type(value, (int, float), where)


def int_or_none(value: Any, where: str) -> int | None:
    if value is None:
        return None
    return expect_type(value, int, where)


def model_and_messages(body: Any) -> tuple[str, list]:
    """The two fields every chat-style body (Anthropic, OpenAI Chat) must have."""
    expect_type(body, dict, "request body")
    model = body.get("model")
    require(isinstance(model, str) and model, "model: a non-empty string is required")
    messages = body.get("messages")
    require(isinstance(messages, list) and messages, "messages: a non-empty array is required")
    return model, messages


def json_response_format(kind: Any, name: Any, schema: Any, where: str) -> dict | None:
    """Structured-output request of OpenAI Chat (response_format) and Responses (text.format)."""
    if kind == "text":
        return None
    if kind == "json_object":
        return {"type": "json_object"}
    if kind == "json_schema":
        return {"type": "json_schema",
                "name": expect_type(name, str, f"{where}.name") if name else "response",
                "schema": {} if schema is None else expect_type(schema, dict, f"{where}.schema")}
    raise MalformedRequest(f"{where}.type: unknown value {kind!r}")


def text_part(text: str) -> dict:
    return {"type": "text", "text": text}


def parts_text(parts: Iterable[dict]) -> str:
    return "".join(p["text"] for p in parts if p["type"] == "text")


def new_request(style: str, model: str) -> dict:
    return {"style": style, "model": model, "stream": False, "messages": [], "tools": [],
            "tool_choice": None, "parallel_tool_calls": None, "max_tokens": None,
            "temperature": None, "top_p": None, "top_k": None, "seed": None, "stop": [],
            "response_format": None, "reasoning": None, "provider": {}, "dropped": []}


def merge_system_first(messages: list[dict], system_parts: list[dict]) -> list[dict]:
    """One leading system message holding every system text, in order; chat
    templates of open models accept a system message only in first position."""
    parts = list(system_parts)
    rest = []
    for m in messages:
        if m["role"] == "system":
            parts.extend(m["content"])
        else:
            rest.append(m)
    texts = [p["text"] for p in parts if p["type"] == "text" and p["text"]]
    if not texts:
        return rest
    return [{"role": "system", "content": [text_part("\n\n".join(texts))]}] + rest


def dumps(obj: Any) -> str:
    return orjson.dumps(obj).decode()


def parse_arguments(arguments: str) -> dict:
    """A tool call's JSON text as an object. Small models emit broken JSON; the
    client still needs an object, so keep the raw text under a clear key."""
    try:
        value = orjson.loads(arguments) if arguments else {}
    except orjson.JSONDecodeError:
        return {"_raw_arguments": arguments}
    return value if isinstance(value, dict) else {"_value": value}


def stable_id(prefix: str, *seed: Any, length: int = 24) -> str:
    digest = hashlib.sha256("\x1f".join(map(str, seed)).encode()).hexdigest()
    return f"{prefix}{digest[:length]}"


def suffix_of(call_id: str) -> str:
    """Provider-neutral part of a tool call id (drops call_/toolu_/fc_ prefixes)."""
    for prefix in ("call_", "toolu_", "fc_", "chatcmpl-tool-"):
        if call_id.startswith(prefix):
            return call_id[len(prefix):]
    return call_id


def chunk_text(text: str, size: int = 48) -> list[str]:
    """Split text into stream deltas at word boundaries, each at most ~size chars."""
    if not text:
        return []
    out, current = [], ""
    for piece in _words(text):
        if current and len(current) + len(piece) > size:
            out.append(current)
            current = ""
        current += piece
    if current:
        out.append(current)
    return out


def _words(text: str) -> list[str]:
    words, start = [], 0
    for i, ch in enumerate(text):
        if ch in " \n" and i + 1 > start:
            words.append(text[start:i + 1])
            start = i + 1
    if start < len(text):
        words.append(text[start:])
    return words


def sse_event(data: Any, event: str | None = None) -> bytes:
    payload = data if isinstance(data, (bytes, str)) else orjson.dumps(data)
    if isinstance(payload, str):
        payload = payload.encode()
    head = f"event: {event}\n".encode() if event else b""
    return head + b"data: " + payload + b"\n\n"
