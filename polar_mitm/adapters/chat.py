"""The internal chat shape every adapter translates to and from.

Plain JSON-serialisable dicts (TypedDicts below), so a normalized request can be stored
as-is and compared across turns.
"""

from __future__ import annotations

import hashlib
from typing import Any, Iterable, Literal, NamedTuple, NotRequired, TypedDict

import orjson

Role = Literal["system", "user", "assistant", "tool"]
ToolKind = Literal["function", "custom"]
FinishReason = Literal["stop", "length", "tool_calls", "content_filter"]


class TextPart(TypedDict):
    type: Literal["text"]
    text: str


class ImagePart(TypedDict):
    type: Literal["image"]
    url: str                      # an http(s) URL or a data: URL


Part = TextPart | ImagePart


class ToolCall(TypedDict):
    id: str
    name: str
    arguments: str                # function: a JSON object's text; custom: the raw input
    kind: ToolKind


class Message(TypedDict):
    role: Role
    content: list[Part]
    tool_calls: NotRequired[list[ToolCall]]     # assistant
    reasoning: NotRequired[str]                 # assistant
    tool_call_id: NotRequired[str]              # tool
    name: NotRequired[str | None]               # tool
    is_error: NotRequired[bool]                 # tool


class Tool(TypedDict):
    name: str
    description: str
    parameters: dict[str, Any]    # JSON Schema ({} for a custom tool)
    kind: ToolKind
    format: dict[str, Any] | None  # a custom tool's input format (text, a grammar)


class NamedTool(TypedDict):
    name: str


ChoiceMode = Literal["auto", "none", "required"]
ToolChoice = ChoiceMode | NamedTool | None


class ResponseFormat(TypedDict):
    type: Literal["json_object", "json_schema"]
    name: NotRequired[str]                      # json_schema
    schema: NotRequired[dict[str, Any]]         # json_schema


class Reasoning(TypedDict):
    effort: str | None
    budget_tokens: int | None


class Provider(TypedDict, total=False):
    """Style-specific facts needed to answer in the client's own format."""
    thinking: bool                # anthropic: the client asked for thinking blocks
    thinking_omitted: bool        # anthropic: ... with display "omitted"
    include_usage: bool           # openai_chat: stream_options.include_usage
    reasoning: dict[str, Any]     # openai_responses: the reasoning settings, echoed
    namespaces: dict[str, str]    # openai_responses: tool name -> its namespace
    alt_sse: bool                 # google: ?alt=sse (else a JSON-array stream)
    code_assist: bool             # google: the Code Assist wrapping
    include_thoughts: bool        # google: thinkingConfig.includeThoughts


class ChatRequest(TypedDict):
    """A normalized request."""
    style: str
    model: str
    stream: bool
    messages: list[Message]
    tools: list[Tool]
    tool_choice: ToolChoice
    parallel_tool_calls: bool | None
    max_tokens: int | None
    temperature: float | None
    top_p: float | None
    top_k: int | None
    seed: int | None
    stop: list[str]
    response_format: ResponseFormat | None
    reasoning: Reasoning | None
    provider: Provider
    dropped: list[str]            # provider-only fields not forwarded
    # OpenAI Responses: the id a keepalive's opening events named, which the answer keeps
    response_id: NotRequired[str]


class Usage(TypedDict):
    prompt_tokens: int
    completion_tokens: int


class ChatResult(TypedDict):
    """What the backend produced, provider-neutral."""
    id: str
    created: int
    model: str
    text: str
    reasoning: str | None
    tool_calls: list[ToolCall]
    finish_reason: FinishReason
    stop_sequence: str | None
    usage: Usage


class StreamKeepalive(NamedTuple):
    """What keeps a streaming client waiting for a long generation, in its provider's shape."""
    head: bytes                   # sent with the headers
    tick: bytes                   # sent each interval
    skip_events: int              # leading SSE events of the answer that the head stood for


SSE = "text/event-stream"
# SSE comment lines keep connections and body timeouts alive and every SSE parser skips them.
COMMENT_KEEPALIVE = StreamKeepalive(b"", b": keepalive\n\n", 0)


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


def kind_for_status(status: int) -> str:
    """The error kind (which every provider's error() maps to its own body) of a status."""
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


def json_response_format(kind: Any, name: Any, schema: Any, where: str) -> ResponseFormat | None:
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


_CHOICE_MODES: dict[str, ChoiceMode] = {"auto": "auto", "none": "none", "required": "required"}


def choice_mode(value: Any, where: str, allowed: tuple[str, ...] = ("auto", "none", "required")) -> ChoiceMode:
    """A tool choice given by its mode (one of `allowed`), else a MalformedRequest."""
    mode = _CHOICE_MODES.get(value) if isinstance(value, str) and value in allowed else None
    if mode is None:
        raise MalformedRequest(f"{where}: unknown value {value!r}")
    return mode


def text_part(text: str) -> TextPart:
    return {"type": "text", "text": text}


def parts_text(parts: Iterable[Part]) -> str:
    return "".join(p["text"] for p in parts if p["type"] == "text")


def new_request(style: str, model: str) -> ChatRequest:
    return {"style": style, "model": model, "stream": False, "messages": [], "tools": [],
            "tool_choice": None, "parallel_tool_calls": None, "max_tokens": None,
            "temperature": None, "top_p": None, "top_k": None, "seed": None, "stop": [],
            "response_format": None, "reasoning": None, "provider": {}, "dropped": []}


def merge_system_first(messages: list[Message], system_parts: list[Part]) -> list[Message]:
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
    system: Message = {"role": "system", "content": [text_part("\n\n".join(texts))]}
    return [system, *rest]


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
