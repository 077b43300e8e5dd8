"""Anthropic Messages (/v1/messages) <-> internal chat shape."""

from __future__ import annotations

from typing import Any, NoReturn

import orjson

from .chat import (COMMENT_KEEPALIVE, SSE, ChatRequest, ChatResult, MalformedRequest, Message, Part,
                   Reasoning, ResponseFormat, StreamKeepalive, Tool, ToolCall, ToolChoice,
                   UnsupportedContent, chunk_text, dumps, expect_type, int_or_none, kind_for_status,
                   merge_system_first, model_and_messages, new_request, number_or_none,
                   parse_arguments, require, sse_event, stable_id, suffix_of, text_part)
from .detect import is_count_tokens

STYLE = "anthropic"

# Anthropic answers "overloaded" with its own status code.
OVERLOADED_STATUS = 529

# Clients send the signature back verbatim; only Anthropic itself validates it.
SIGNATURE = "polar-mitm-unsigned"

# Fields the backend is given; every other top-level key is recorded as dropped.
_HANDLED = {"model", "messages", "max_tokens", "system", "tools", "tool_choice", "thinking",
            "output_config", "output_format", "temperature", "top_p", "top_k",
            "stop_sequences", "stream"}

# Claude Code's first system block; its cch= hash changes every request.
_BILLING = "x-anthropic-billing-header:"

# Valid Anthropic blocks that only Anthropic's servers can act on.
_SERVER_BLOCKS = {"server_tool_use", "web_search_tool_result", "web_fetch_tool_result",
                  "code_execution_tool_result", "bash_code_execution_tool_result",
                  "text_editor_code_execution_tool_result", "tool_search_tool_result",
                  "container_upload", "search_result", "mcp_tool_use", "mcp_tool_result"}


def to_chat(body: Any, path: str = "") -> ChatRequest:
    model, messages = model_and_messages(body)
    max_tokens = body.get("max_tokens")
    if not is_count_tokens(path):  # count_tokens bodies carry no max_tokens
        require(max_tokens is not None, "max_tokens: an integer is required")
    max_tokens = int_or_none(max_tokens, "max_tokens")
    require(max_tokens is None or max_tokens >= 1, "max_tokens: must be at least 1")

    req = new_request(STYLE, model)
    dropped: set[str] = {k for k in body if k not in _HANDLED}
    req["stream"] = expect_type(body.get("stream") or False, bool, "stream")
    system = _system_parts(body.get("system"), "system", dropped)
    req["messages"] = merge_system_first(_messages(messages, dropped), system)
    tools = expect_type(body.get("tools") or [], list, "tools")
    req["tools"] = [t for t in (_tool(t, i, dropped) for i, t in enumerate(tools)) if t]
    req["tool_choice"], req["parallel_tool_calls"] = _tool_choice(body.get("tool_choice"))
    req["max_tokens"] = max_tokens
    req["temperature"] = number_or_none(body.get("temperature"), "temperature")
    req["top_p"] = number_or_none(body.get("top_p"), "top_p")
    req["top_k"] = int_or_none(body.get("top_k"), "top_k")
    stops = expect_type(body.get("stop_sequences") or [], list, "stop_sequences")
    req["stop"] = [expect_type(s, str, f"stop_sequences[{i}]") for i, s in enumerate(stops)]

    config = expect_type(body.get("output_config") or {}, dict, "output_config")
    dropped |= {f"output_config.{k}" for k in config if k not in ("effort", "format")}
    fmt = config.get("format") or body.get("output_format")  # output_format: older beta name
    req["response_format"] = _response_format(fmt)
    effort = config.get("effort")
    require(effort is None or isinstance(effort, str), "output_config.effort: a string is required")
    req["reasoning"], thinking, display = _thinking(body.get("thinking"), effort)
    if effort and not (req["reasoning"] and req["reasoning"]["effort"]):
        dropped.add("output_config.effort")
    # from_chat emits thinking blocks only when the client asked for them.
    req["provider"]["thinking"] = thinking
    req["provider"]["thinking_omitted"] = display == "omitted"
    req["dropped"] = sorted(dropped)
    return req


# ---- request pieces -------------------------------------------------------------------

def _block(b: Any, where: str, dropped: set) -> str:
    """Validate a content block and return its type; cache_control is noted, never forwarded."""
    expect_type(b, dict, where)
    if "cache_control" in b:
        dropped.add("cache_control")
    kind = b.get("type")
    require(isinstance(kind, str), f"{where}.type: a string is required")
    return kind


def _text(b: dict, where: str) -> str:
    return expect_type(b.get("text"), str, f"{where}.text")


def _strip_billing(text: str, dropped: set) -> str:
    # Drop the whole billing line: it is metadata for Anthropic, not an instruction, and its
    # per-request hash would break prefix caching and cross-turn prompt comparison.
    if not text.startswith(_BILLING):
        return text
    dropped.add("system.billing_header")
    return text.partition("\n")[2].lstrip("\n")


def _system_parts(content: Any, where: str, dropped: set) -> list[Part]:
    if content is None:
        return []
    if isinstance(content, str):
        return [text_part(_strip_billing(content, dropped))]
    expect_type(content, list, where)
    parts: list[Part] = []
    for j, b in enumerate(content):
        w = f"{where}[{j}]"
        kind = _block(b, w, dropped)
        require(kind == "text", f"{w}.type: system blocks must be text, got {kind!r}")
        parts.append(text_part(_strip_billing(_text(b, w), dropped)))
    return parts


def _messages(messages: list, dropped: set) -> list[Message]:
    out: list[Message] = []
    names: dict[str, str] = {}  # tool_use id -> tool name, to name the tool results
    for i, m in enumerate(messages):
        where = f"messages[{i}]"
        expect_type(m, dict, where)
        role = m.get("role")
        require(role in ("user", "assistant", "system"), f"{where}.role: unknown role {role!r}")
        content = m.get("content")
        require(content is not None, f"{where}.content: a string or an array is required")
        if role == "system":  # Claude Code's mid-conversation-system beta
            out.append({"role": "system",
                        "content": _system_parts(content, f"{where}.content", dropped)})
        elif isinstance(content, str):
            out.append({"role": role, "content": [text_part(content)]})
        else:
            expect_type(content, list, f"{where}.content")
            if role == "assistant":
                out.append(_assistant(content, f"{where}.content", dropped, names))
            else:
                out.extend(_user(content, f"{where}.content", dropped, names))
    return out


def _assistant(blocks: list, where: str, dropped: set, names: dict) -> Message:
    parts: list[Part] = []
    calls: list[ToolCall] = []
    thoughts: list[str] = []
    for j, b in enumerate(blocks):
        w = f"{where}[{j}]"
        kind = _block(b, w, dropped)
        if kind == "text":
            parts.append(text_part(_text(b, w)))
        elif kind == "thinking":
            thoughts.append(expect_type(b.get("thinking"), str, f"{w}.thinking"))
        elif kind == "redacted_thinking":  # encrypted for Anthropic's models only
            dropped.add("redacted_thinking")
        elif kind == "tool_use":
            call_id = expect_type(b.get("id"), str, f"{w}.id")
            name = expect_type(b.get("name"), str, f"{w}.name")
            args = dumps(_object(b.get("input", {}), f"{w}.input"))
            names[call_id] = name
            calls.append({"id": call_id, "name": name, "arguments": args, "kind": "function"})
        else:
            _reject(kind, w, "assistant")
    msg: Message = {"role": "assistant", "content": parts}
    if calls:
        msg["tool_calls"] = calls
    if thoughts:
        msg["reasoning"] = "\n\n".join(thoughts)
    return msg


def _user(blocks: list, where: str, dropped: set, names: dict) -> list[Message]:
    """Tool results become tool messages, in order, before the user's own content."""
    tools: list[Message] = []
    parts: list[Part] = []
    for j, b in enumerate(blocks):
        w = f"{where}[{j}]"
        kind = _block(b, w, dropped)
        if kind == "text":
            parts.append(text_part(_text(b, w)))
        elif kind == "image":
            parts.append(_image(b, w))
        elif kind == "tool_result":
            call_id = expect_type(b.get("tool_use_id"), str, f"{w}.tool_use_id")
            is_error = expect_type(b.get("is_error") or False, bool, f"{w}.is_error")
            text = _tool_result_text(b.get("content"), f"{w}.content", dropped)
            tools.append({"role": "tool", "content": [text_part(text)], "tool_call_id": call_id,
                          "name": names.get(call_id), "is_error": is_error})
        else:
            _reject(kind, w, "user")
    user: list[Message] = [{"role": "user", "content": parts}] if parts or not tools else []
    return tools + user


def _tool_result_text(content: Any, where: str, dropped: set) -> str:
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    expect_type(content, list, where)
    texts = []
    for j, b in enumerate(content):
        w = f"{where}[{j}]"
        kind = _block(b, w, dropped)
        if kind == "text":
            texts.append(_text(b, w))
        elif kind == "image":
            # Chat templates take no images in tool messages. Failing would end a Claude
            # Code session whenever it Reads a picture, so keep a marker and record it.
            _image(b, w)
            dropped.add("tool_result.image")
            texts.append("[image omitted: tool results cannot carry images here]")
        elif kind == "tool_reference":  # tool search: Anthropic expands these server-side
            name = expect_type(b.get("tool_name"), str, f"{w}.tool_name")
            texts.append(f"Tool available: {name}")
        else:
            _reject(kind, w, "tool_result")
    return "\n".join(texts)


def _image(b: dict, where: str) -> Part:
    source = expect_type(b.get("source"), dict, f"{where}.source")
    kind = source.get("type")
    if kind == "base64":
        media = expect_type(source.get("media_type"), str, f"{where}.source.media_type")
        data = expect_type(source.get("data"), str, f"{where}.source.data")
        return {"type": "image", "url": f"data:{media};base64,{data}"}
    if kind == "url":
        return {"type": "image", "url": expect_type(source.get("url"), str, f"{where}.source.url")}
    if kind == "file":
        raise UnsupportedContent(f"{where}.source: Files API images (file_id) are not supported; "
                                 "send the image as base64 or url")
    raise MalformedRequest(f"{where}.source.type: unknown image source {kind!r}")


def _reject(kind: str, where: str, place: str) -> NoReturn:
    if kind == "document":
        raise UnsupportedContent(f"{where}: document blocks (PDF/text files) are not supported")
    if kind in _SERVER_BLOCKS:
        raise UnsupportedContent(f"{where}: server-side block type {kind!r} is not supported")
    known = {"text", "image", "tool_result", "tool_use", "thinking", "redacted_thinking",
             "tool_reference"}
    if kind in known:
        raise MalformedRequest(f"{where}.type: {kind!r} blocks are not allowed in {place} content")
    raise MalformedRequest(f"{where}.type: unknown block type {kind!r}")


def _object(value: Any, where: str) -> dict:
    """A JSON object that can be stored and forwarded as-is."""
    expect_type(value, dict, where)
    try:
        dumps(value)
    except orjson.JSONEncodeError as e:  # orjson nests at most 255 deep, ints fit 64 bits
        raise MalformedRequest(f"{where}: cannot be encoded as JSON ({e})") from None
    return value


def _tool(t: Any, i: int, dropped: set) -> Tool | None:
    where = f"tools[{i}]"
    expect_type(t, dict, where)
    if "cache_control" in t:
        dropped.add("cache_control")
    kind = t.get("type")
    if kind not in (None, "custom"):
        # Server tools (web_search_20250305, bash_20250124...) run on Anthropic's side.
        dropped.add(f"tools.{expect_type(kind, str, f'{where}.type')}")
        return None
    if t.get("defer_loading"):
        dropped.add("tools.defer_loading")  # offered up front instead of via tool search
    description = t.get("description") or ""
    return {"name": expect_type(t.get("name"), str, f"{where}.name"),
            "description": expect_type(description, str, f"{where}.description"),
            "parameters": _object(t.get("input_schema"), f"{where}.input_schema"),
            "kind": "function", "format": None}


def _tool_choice(choice: Any) -> tuple[ToolChoice, bool | None]:
    """(tool_choice, parallel_tool_calls)."""
    if choice is None:
        return None, None
    expect_type(choice, dict, "tool_choice")
    disable = expect_type(choice.get("disable_parallel_tool_use") or False, bool,
                          "tool_choice.disable_parallel_tool_use")
    parallel = False if disable else None
    kind = choice.get("type")
    if kind in ("auto", "none"):
        return kind, parallel
    if kind == "any":
        return "required", parallel
    if kind == "tool":
        return {"name": expect_type(choice.get("name"), str, "tool_choice.name")}, parallel
    raise MalformedRequest(f"tool_choice.type: unknown value {kind!r}")


def _thinking(thinking: Any, effort: str | None) -> tuple[Reasoning | None, bool, Any]:
    """(reasoning, whether the client asked for thinking, display)."""
    if thinking is None:
        return None, False, None
    expect_type(thinking, dict, "thinking")
    kind = thinking.get("type")
    display = thinking.get("display")
    if kind == "enabled":
        budget = expect_type(thinking.get("budget_tokens"), int, "thinking.budget_tokens")
        return {"effort": None, "budget_tokens": budget}, True, display
    if kind in ("adaptive", "between_tools"):
        return {"effort": effort or None, "budget_tokens": None}, True, display
    if kind == "disabled":
        return None, False, None
    raise MalformedRequest(f"thinking.type: unknown value {kind!r}")


def _response_format(fmt: Any) -> ResponseFormat | None:
    if fmt is None:
        return None
    expect_type(fmt, dict, "output_config.format")
    require(fmt.get("type") == "json_schema",
            f"output_config.format.type: unknown value {fmt.get('type')!r}")
    name = fmt.get("name") or "response"
    return {"type": "json_schema", "name": expect_type(name, str, "output_config.format.name"),
            "schema": _object(fmt.get("schema"), "output_config.format.schema")}


# ---- responses ------------------------------------------------------------------------

def _stop(result: ChatResult, request: ChatRequest) -> tuple[str, str | None]:
    finish = result["finish_reason"]
    seq = result.get("stop_sequence")
    if finish == "stop" and seq and seq in request["stop"]:
        return "stop_sequence", seq
    return {"stop": "end_turn", "length": "max_tokens", "tool_calls": "tool_use",
            "content_filter": "refusal"}.get(finish, "end_turn"), None


def _blocks(result: ChatResult, request: ChatRequest) -> list[dict]:
    blocks: list[dict] = []
    if result.get("reasoning") and request["provider"].get("thinking"):
        thinking = "" if request["provider"].get("thinking_omitted") else result["reasoning"]
        blocks.append({"type": "thinking", "thinking": thinking, "signature": SIGNATURE})
    if result["text"]:
        blocks.append({"type": "text", "text": result["text"]})
    for c in result["tool_calls"]:
        blocks.append({"type": "tool_use", "id": "toolu_" + suffix_of(c["id"]), "name": c["name"],
                       "input": parse_arguments(c["arguments"])})
    if not any(b["type"] != "thinking" for b in blocks):
        blocks.append({"type": "text", "text": ""})  # content is never left without an answer
    return blocks


def _usage(result: ChatResult, output_tokens: int | None = None) -> dict:
    u = result["usage"]
    return {"input_tokens": u["prompt_tokens"],
            "output_tokens": u["completion_tokens"] if output_tokens is None else output_tokens,
            "cache_creation_input_tokens": 0, "cache_read_input_tokens": 0}


def _message(result: ChatResult, request: ChatRequest, content: list, usage: dict,
             stop: tuple[str | None, str | None]) -> dict:
    return {"id": stable_id("msg_", result["id"]), "type": "message", "role": "assistant",
            "model": request["model"], "content": content, "stop_reason": stop[0],
            "stop_sequence": stop[1], "usage": usage}


def from_chat(result: ChatResult, request: ChatRequest) -> dict:
    return _message(result, request, _blocks(result, request), _usage(result),
                    _stop(result, request))


def stream(result: ChatResult, request: ChatRequest) -> list[bytes]:
    def ev(kind: str, **data) -> bytes:
        return sse_event({"type": kind, **data}, event=kind)

    start = _message(result, request, [], _usage(result, output_tokens=1), (None, None))
    events = [ev("message_start", message=start), ev("ping")]
    for index, block in enumerate(_blocks(result, request)):
        kind = block["type"]
        if kind == "thinking":
            head = {"type": "thinking", "thinking": "", "signature": ""}
            deltas = [{"type": "thinking_delta", "thinking": p}
                      for p in chunk_text(block["thinking"])]
            deltas.append({"type": "signature_delta", "signature": block["signature"]})
        elif kind == "text":
            head = {"type": "text", "text": ""}
            deltas = [{"type": "text_delta", "text": p} for p in chunk_text(block["text"])]
        else:
            # The SDK joins partial_json and parses it, so stream the parsed input's JSON.
            head = block | {"input": {}}
            deltas = [{"type": "input_json_delta", "partial_json": p}
                      for p in chunk_text(dumps(block["input"]), 32)]
        events.append(ev("content_block_start", index=index, content_block=head))
        events += [ev("content_block_delta", index=index, delta=d) for d in deltas]
        events.append(ev("content_block_stop", index=index))
    stop_reason, stop_sequence = _stop(result, request)
    events.append(ev("message_delta", delta={"stop_reason": stop_reason,
                                             "stop_sequence": stop_sequence},
                     usage=_usage(result)))
    events.append(ev("message_stop"))
    return events


# ---- errors ---------------------------------------------------------------------------

_TYPES = {"invalid_request": "invalid_request_error", "context_too_long": "invalid_request_error",
          "overloaded": "overloaded_error", "timeout": "timeout_error",
          "backend_error": "api_error", "not_found": "not_found_error",
          "authentication": "authentication_error", "rate_limit": "rate_limit_error",
          "too_large": "request_too_large"}


def error(status: int, message: str, kind: str | None = None) -> dict:
    kind = kind or kind_for_status(status)
    etype = _TYPES.get(kind, "api_error")
    if kind == "authentication" and status == 403:
        etype = "permission_error"
    return {"type": "error", "error": {"type": etype, "message": message}}


def stream_content_type(request: ChatRequest) -> str:
    return SSE


def stream_keepalive(request: ChatRequest, created: int) -> StreamKeepalive:
    return COMMENT_KEEPALIVE
