"""OpenAI Chat Completions (/v1/chat/completions) <-> internal chat shape."""

from __future__ import annotations

from typing import Any

from .chat import (COMMENT_KEEPALIVE, SSE, ChatRequest, ChatResult, MalformedRequest, Message, Part,
                   ResponseFormat, StreamKeepalive, Tool, ToolCall, ToolChoice, UnsupportedContent,
                   choice_mode, chunk_text, dumps, expect_type, int_or_none, json_response_format,
                   kind_for_status, merge_system_first, model_and_messages, new_request,
                   number_or_none, parts_text, require, sse_event, text_part)

STYLE = "openai_chat"
OVERLOADED_STATUS = 503

# Fields the backend is given; everything else is recorded as dropped.
_HANDLED = {"model", "messages", "stream", "tools", "tool_choice", "parallel_tool_calls",
            "max_tokens", "max_completion_tokens", "temperature", "top_p", "top_k", "seed",
            "stop", "response_format", "reasoning_effort", "n", "functions", "function_call"}


def to_chat(body: Any, path: str = "") -> ChatRequest:
    model, messages = model_and_messages(body)
    n = body.get("n")
    if n not in (None, 1):
        raise UnsupportedContent("n: only one choice per request is supported")

    req = new_request(STYLE, model)
    req["stream"] = bool(body.get("stream", False))
    req["messages"] = merge_system_first([_message(m, i) for i, m in enumerate(messages)], [])
    req["tools"] = [_tool(t, i) for i, t in enumerate(body.get("tools") or [])]
    req["tools"] += [_legacy_function(f, i) for i, f in enumerate(body.get("functions") or [])]
    req["tool_choice"] = _tool_choice(body.get("tool_choice", body.get("function_call")))
    ptc = body.get("parallel_tool_calls")
    req["parallel_tool_calls"] = None if ptc is None else bool(ptc)
    req["max_tokens"] = int_or_none(body.get("max_completion_tokens", body.get("max_tokens")),
                                    "max_completion_tokens")
    req["temperature"] = number_or_none(body.get("temperature"), "temperature")
    req["top_p"] = number_or_none(body.get("top_p"), "top_p")
    req["top_k"] = int_or_none(body.get("top_k"), "top_k")
    req["seed"] = int_or_none(body.get("seed"), "seed")
    req["stop"] = _stop(body.get("stop"))
    req["response_format"] = _response_format(body.get("response_format"))
    effort = body.get("reasoning_effort")
    req["reasoning"] = {"effort": effort, "budget_tokens": None} if effort else None
    # stream_options only shapes our answer (the backend call is never streamed).
    options = body.get("stream_options")
    if options is not None:
        expect_type(options, dict, "stream_options")
    req["provider"]["include_usage"] = bool((options or {}).get("include_usage"))
    req["dropped"] = sorted(k for k in body if k not in _HANDLED)
    return req


def _message(m: Any, i: int) -> Message:
    where = f"messages[{i}]"
    expect_type(m, dict, where)
    role = m.get("role")
    if role == "developer":
        role = "system"
    if role == "function":  # legacy function result
        return {"role": "tool", "content": [text_part(_text_content(m.get("content"), where))],
                "tool_call_id": m.get("name") or "", "name": m.get("name"), "is_error": False}
    require(role in ("system", "user", "assistant", "tool"),
            f"{where}.role: unknown role {role!r}")
    if role == "tool":
        call_id = m.get("tool_call_id")
        require(isinstance(call_id, str), f"{where}.tool_call_id: a string is required")
        return {"role": "tool", "content": [text_part(_text_content(m.get("content"), where))],
                "tool_call_id": call_id, "name": m.get("name"), "is_error": False}
    out: Message = {"role": role, "content": _content(m.get("content"), where)}
    if role == "assistant":
        calls = [_tool_call(c, f"{where}.tool_calls[{j}]")
                 for j, c in enumerate(m.get("tool_calls") or [])]
        if m.get("function_call"):
            fc = m["function_call"]
            calls.append({"id": fc.get("name", ""), "name": fc.get("name", ""),
                          "arguments": fc.get("arguments") or "{}", "kind": "function"})
        if calls:
            out["tool_calls"] = calls
        reasoning = m.get("reasoning", m.get("reasoning_content"))
        if reasoning:
            out["reasoning"] = expect_type(reasoning, str, f"{where}.reasoning")
        if m.get("refusal") and not out["content"]:
            out["content"] = [text_part(m["refusal"])]
    return out


def _content(content: Any, where: str) -> list[Part]:
    if content is None:
        return []
    if isinstance(content, str):
        return [text_part(content)] if content else []
    expect_type(content, list, f"{where}.content")
    parts: list[Part] = []
    for j, p in enumerate(content):
        expect_type(p, dict, f"{where}.content[{j}]")
        kind = p.get("type")
        if kind == "text" or (kind is None and "text" in p):
            parts.append(text_part(expect_type(p.get("text"), str, f"{where}.content[{j}].text")))
        elif kind == "image_url":
            url = p.get("image_url")
            url = url.get("url") if isinstance(url, dict) else url
            if not isinstance(url, str):
                raise MalformedRequest(f"{where}.content[{j}].image_url.url: string required")
            parts.append({"type": "image", "url": url})
        elif kind == "refusal":
            parts.append(text_part(p.get("refusal") or ""))
        else:
            raise UnsupportedContent(f"{where}.content[{j}]: content type {kind!r} is not supported")
    return parts


def _text_content(content: Any, where: str) -> str:
    # Qwen Code sends tool results as an array of text parts.
    return parts_text(p for p in _content(content, where) if p["type"] == "text")


def _tool_call(c: Any, where: str) -> ToolCall:
    expect_type(c, dict, where)
    if c.get("type") == "custom":
        custom = expect_type(c.get("custom"), dict, f"{where}.custom")
        return {"id": expect_type(c.get("id"), str, f"{where}.id"),
                "name": expect_type(custom.get("name"), str, f"{where}.custom.name"),
                "arguments": custom.get("input") or "", "kind": "custom"}
    fn = expect_type(c.get("function"), dict, f"{where}.function")
    args = fn.get("arguments")
    if isinstance(args, dict):  # some clients send an object instead of JSON text
        args = dumps(args)
    return {"id": expect_type(c.get("id"), str, f"{where}.id"),
            "name": expect_type(fn.get("name"), str, f"{where}.function.name"),
            "arguments": args if isinstance(args, str) else "{}", "kind": "function"}


def _tool(t: Any, i: int) -> Tool:
    where = f"tools[{i}]"
    expect_type(t, dict, where)
    if t.get("type") == "custom":
        c = expect_type(t.get("custom"), dict, f"{where}.custom")
        return {"name": expect_type(c.get("name"), str, f"{where}.custom.name"),
                "description": c.get("description") or "", "parameters": {},
                "kind": "custom", "format": c.get("format")}
    require(t.get("type", "function") == "function", f"{where}.type: unknown tool type {t.get('type')!r}")
    fn = expect_type(t.get("function"), dict, f"{where}.function")
    return {"name": expect_type(fn.get("name"), str, f"{where}.function.name"),
            "description": fn.get("description") or "",
            "parameters": fn.get("parameters") or {"type": "object", "properties": {}},
            "kind": "function", "format": None}


def _legacy_function(f: Any, i: int) -> Tool:
    expect_type(f, dict, f"functions[{i}]")
    return {"name": expect_type(f.get("name"), str, f"functions[{i}].name"),
            "description": f.get("description") or "",
            "parameters": f.get("parameters") or {"type": "object", "properties": {}},
            "kind": "function", "format": None}


def _tool_choice(choice: Any) -> ToolChoice:
    if choice is None:
        return None
    if isinstance(choice, str):
        return choice_mode(choice, "tool_choice")
    expect_type(choice, dict, "tool_choice")
    if choice.get("type") == "allowed_tools":
        allowed: Any = choice.get("allowed_tools", {})
        return allowed.get("mode", "auto")   # as sent: the backend judges it
    name = (choice.get("function") or choice.get("custom") or choice).get("name")
    require(isinstance(name, str), "tool_choice: a function name is required")
    return {"name": name}


def _stop(stop: Any) -> list[str]:
    if stop is None:
        return []
    if isinstance(stop, str):
        return [stop]
    expect_type(stop, list, "stop")
    return [expect_type(s, str, "stop[]") for s in stop]


def _response_format(rf: Any) -> ResponseFormat | None:
    if rf is None:
        return None
    expect_type(rf, dict, "response_format")
    kind = rf.get("type")
    # Chat nests name and schema under json_schema; Responses has them flat.
    js = expect_type(rf.get("json_schema"), dict, "response_format.json_schema") \
        if kind == "json_schema" else {}
    return json_response_format(kind, js.get("name"), js.get("schema"), "response_format")


# ---- responses ------------------------------------------------------------------------

def _message_out(result: ChatResult) -> dict:
    msg: dict = {"role": "assistant", "content": result["text"] or None, "refusal": None}
    if result.get("reasoning"):
        msg["reasoning_content"] = result["reasoning"]
    if result["tool_calls"]:
        msg["tool_calls"] = [_call_out(c) for c in result["tool_calls"]]
    return msg


def _call_out(c: ToolCall) -> dict:
    if c["kind"] == "custom":
        return {"id": c["id"], "type": "custom", "custom": {"name": c["name"], "input": c["arguments"]}}
    return {"id": c["id"], "type": "function",
            "function": {"name": c["name"], "arguments": c["arguments"]}}


def _usage(result: ChatResult) -> dict:
    u = result["usage"]
    return {"prompt_tokens": u["prompt_tokens"], "completion_tokens": u["completion_tokens"],
            "total_tokens": u["prompt_tokens"] + u["completion_tokens"]}


def from_chat(result: ChatResult, request: ChatRequest) -> dict:
    return {"id": result["id"], "object": "chat.completion", "created": result["created"],
            "model": request["model"], "system_fingerprint": None,
            "choices": [{"index": 0, "message": _message_out(result), "logprobs": None,
                         "finish_reason": result["finish_reason"]}],
            "usage": _usage(result)}


def stream(result: ChatResult, request: ChatRequest) -> list[bytes]:
    base = {"id": result["id"], "object": "chat.completion.chunk", "created": result["created"],
            "model": request["model"], "system_fingerprint": None}

    def chunk(delta: dict, finish: str | None = None) -> bytes:
        return sse_event(base | {"choices": [{"index": 0, "delta": delta, "logprobs": None,
                                              "finish_reason": finish}]})

    events = [chunk({"role": "assistant", "content": ""})]
    reasoning = result.get("reasoning")
    if reasoning:
        events += [chunk({"reasoning_content": piece}) for piece in chunk_text(reasoning)]
    events += [chunk({"content": piece}) for piece in chunk_text(result["text"])]
    for index, call in enumerate(result["tool_calls"]):
        head = _call_out(call)
        if call["kind"] == "function":
            head["function"] = {"name": call["name"], "arguments": ""}
            events.append(chunk({"tool_calls": [{"index": index} | head]}))
            events += [chunk({"tool_calls": [{"index": index, "function": {"arguments": piece}}]})
                       for piece in chunk_text(call["arguments"], 32)]
        else:
            events.append(chunk({"tool_calls": [{"index": index} | head]}))
    events.append(chunk({}, result["finish_reason"]))
    if request["provider"].get("include_usage"):
        events.append(sse_event(base | {"choices": [], "usage": _usage(result)}))
    events.append(b"data: [DONE]\n\n")
    return events


_TYPES = {"invalid_request": "invalid_request_error", "context_too_long": "invalid_request_error",
          "overloaded": "server_error", "timeout": "server_error", "backend_error": "server_error",
          "not_found": "invalid_request_error", "authentication": "authentication_error",
          "rate_limit": "rate_limit_error", "too_large": "invalid_request_error"}


def error(status: int, message: str, kind: str | None = None) -> dict:
    kind = kind or kind_for_status(status)
    code = {"context_too_long": "context_length_exceeded", "not_found": "model_not_found",
            "timeout": "timeout", "overloaded": "overloaded"}.get(kind)
    return {"error": {"message": message, "type": _TYPES[kind], "param": None, "code": code}}


def stream_content_type(request: ChatRequest) -> str:
    return SSE


def stream_keepalive(request: ChatRequest, created: int) -> StreamKeepalive:
    return COMMENT_KEEPALIVE
