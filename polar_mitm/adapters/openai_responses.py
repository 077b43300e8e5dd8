"""OpenAI Responses (/v1/responses) <-> internal chat shape. Codex CLI speaks only this.

The proxy is stateless: Codex sends `store: false` and its whole history as `input` items
every turn, so `previous_response_id` (server-side state) is refused with a clear message.
"""

from __future__ import annotations

from typing import Any, Callable

import orjson

from . import openai_chat
from .chat import (SSE, ChatRequest, ChatResult, MalformedRequest, Message, Part, Provider, Reasoning, Role,
                   ResponseFormat, StreamKeepalive, Tool, ToolCall, ToolChoice, UnsupportedContent,
                   choice_mode, chunk_text, dumps, expect_type, int_or_none, json_response_format,
                   kind_for_status, merge_system_first, new_request, number_or_none, require,
                   sse_event, stable_id, suffix_of, text_part)

STYLE = "openai_responses"
OVERLOADED_STATUS = 503

# Top-level fields the backend is given; everything else is recorded as dropped.
_HANDLED = {"model", "input", "instructions", "stream", "tools", "tool_choice",
            "parallel_tool_calls", "max_output_tokens", "temperature", "top_p", "text",
            "reasoning", "previous_response_id"}
_ROLES: dict[str, Role] = {"user": "user", "assistant": "assistant", "system": "system",
                           "developer": "system"}
_TEXT_PARTS = {"input_text", "output_text", "text", "summary_text", "reasoning_text"}


def to_chat(body: Any, path: str = "") -> ChatRequest:
    expect_type(body, dict, "request body")
    model = body.get("model")
    if not (isinstance(model, str) and model):
        raise MalformedRequest("model: a non-empty string is required")
    if body.get("previous_response_id") is not None:
        raise UnsupportedContent("previous_response_id needs server-side state; "
                                 "send the full input (store: false)")
    req = new_request(STYLE, model)
    conv = _Conversation()
    conv.dropped = [k for k in body if k not in _HANDLED]

    instructions = body.get("instructions")
    if instructions is not None:
        conv.system.append(text_part(expect_type(instructions, str, "instructions")))
    items = body.get("input")
    if isinstance(items, str):
        conv.add({"role": "user", "content": [text_part(items)] if items else []})
    elif isinstance(items, list):
        for i, item in enumerate(items):
            _item(conv, item, i)
    else:
        raise MalformedRequest("input: a string or an array of items is required")
    if body.get("tools") is not None:
        conv.tools += _tools(conv, body["tools"], "tools")
    req["messages"] = merge_system_first(conv.messages, conv.system)
    require(req["messages"], "input: there is no message to answer")
    req["tools"] = _unique_tools(conv)
    req["tool_choice"] = _tool_choice(conv, body.get("tool_choice"))

    req["stream"] = _bool(body.get("stream"), "stream") or False
    req["parallel_tool_calls"] = _bool(body.get("parallel_tool_calls"), "parallel_tool_calls")
    req["max_tokens"] = int_or_none(body.get("max_output_tokens"), "max_output_tokens")
    req["temperature"] = number_or_none(body.get("temperature"), "temperature")
    req["top_p"] = number_or_none(body.get("top_p"), "top_p")
    req["response_format"] = _text(conv, body.get("text"))
    req["reasoning"] = _reasoning(conv, req["provider"], body.get("reasoning"))
    if conv.namespaces:  # from_chat puts the namespace back on calls to these tools
        req["provider"]["namespaces"] = conv.namespaces
    req["dropped"] = sorted(set(conv.dropped))
    return req


class _Conversation:
    """What the input items add up to while they are read in order."""

    def __init__(self) -> None:
        self.messages: list[Message] = []
        self.system: list[Part] = []      # instructions + developer/system text, in order
        self.tools: list[Tool] = []
        self.dropped: list[str] = []
        self.namespaces: dict[str, str] = {}
        self.call_names: dict[str, str] = {}
        self._open: Message | None = None   # the assistant message model-side items join

    def assistant(self) -> Message:
        # Consecutive model-side items (message, reasoning, calls) are ONE assistant turn,
        # so parallel tool calls stay in one message as chat templates expect.
        if self._open is None:
            self._open = {"role": "assistant", "content": []}
            self.messages.append(self._open)
        return self._open

    def add(self, message: Message) -> None:
        self._open = None
        self.messages.append(message)


def _item(conv: _Conversation, item: Any, i: int) -> None:
    where = f"input[{i}]"
    expect_type(item, dict, where)
    kind = item.get("type")
    if kind is None:  # the "easy" message form has only role and content
        require("role" in item, f"{where}: an item needs a type or a role")
        kind = "message"
    expect_type(kind, str, f"{where}.type")
    if kind == "message":
        role = item.get("role")
        role = _ROLES.get(role) if isinstance(role, str) else None
        require(role, f"{where}.role: unknown role {item.get('role')!r}")
        parts = _content(item.get("content"), where)
        if role == "system":
            conv.system += parts  # system text never breaks an assistant turn
        elif role == "user":
            conv.add({"role": "user", "content": parts})
        else:
            conv.assistant()["content"] += parts
    elif kind in ("function_call", "custom_tool_call"):
        call_id = expect_type(item.get("call_id"), str, f"{where}.call_id")
        name = expect_type(item.get("name"), str, f"{where}.name")
        call: ToolCall
        if kind == "function_call":
            args = item.get("arguments")
            if isinstance(args, dict):  # lenient: an object instead of JSON text
                args = _json_text(args, f"{where}.arguments")
            call = {"id": call_id, "name": name, "kind": "function",
                    "arguments": expect_type(args, str, f"{where}.arguments")}
        else:
            call = {"id": call_id, "name": name, "kind": "custom",
                    "arguments": expect_type(item.get("input"), str, f"{where}.input")}
        conv.call_names[call_id] = name
        conv.assistant().setdefault("tool_calls", []).append(call)
    elif kind in ("function_call_output", "custom_tool_call_output"):
        call_id = expect_type(item.get("call_id"), str, f"{where}.call_id")
        output = item.get("output")
        # Codex sends an array of parts for custom_tool_call_output (code mode).
        content: list[Part] = [text_part(output)] if isinstance(output, str) else \
            _parts(expect_type(output, list, f"{where}.output"), f"{where}.output")
        conv.add({"role": "tool", "content": content, "tool_call_id": call_id,
                  "name": conv.call_names.get(call_id), "is_error": False})
    elif kind == "reasoning":
        _reasoning_item(conv, item, where)
    elif kind == "additional_tools":  # Codex code mode ships its tools as an input item
        conv.tools += _tools(conv, item.get("tools"), f"{where}.tools")
    else:
        # configuration_update, and items the backend cannot replay (local_shell_call,
        # web_search_call, item_reference, compaction...). Codex resends its whole
        # history each turn, so refusing one old item would fail every later turn.
        conv.dropped.append(f"input.{kind}")


def _reasoning_item(conv: _Conversation, item: dict, where: str) -> None:
    if item.get("encrypted_content"):  # opaque to any model but OpenAI's
        conv.dropped.append("input.reasoning.encrypted_content")
    # Raw reasoning (content) when present, else its summary: both would say it twice.
    content = expect_type(item.get("content") or [], list, f"{where}.content")
    texts = [p["text"] for p in _parts(content, f"{where}.content") if p["type"] == "text"]
    if not texts:
        summary = expect_type(item.get("summary") or [], list, f"{where}.summary")
        texts = [p["text"] for p in _parts(summary, f"{where}.summary") if p["type"] == "text"]
    text = "\n\n".join(t for t in texts if t)
    if text:
        msg = conv.assistant()
        msg["reasoning"] = f"{msg['reasoning']}\n\n{text}" if msg.get("reasoning") else text


def _content(content: Any, where: str) -> list[Part]:
    if content is None:
        return []
    if isinstance(content, str):
        return [text_part(content)] if content else []
    return _parts(expect_type(content, list, f"{where}.content"), f"{where}.content")


def _parts(parts: list, where: str) -> list[Part]:
    out: list[Part] = []
    for j, p in enumerate(parts):
        at = f"{where}[{j}]"
        expect_type(p, dict, at)
        kind = p.get("type")
        if kind is not None:
            expect_type(kind, str, f"{at}.type")
        if kind in _TEXT_PARTS or (kind is None and "text" in p):
            out.append(text_part(expect_type(p.get("text"), str, f"{at}.text")))
        elif kind == "refusal":
            out.append(text_part(expect_type(p.get("refusal"), str, f"{at}.refusal")))
        elif kind == "input_image":
            url = p.get("image_url")
            if url is None and p.get("file_id") is not None:
                raise UnsupportedContent(f"{at}.file_id: uploaded files are not supported; "
                                         "send image_url (an http(s) or data: URL)")
            out.append({"type": "image", "url": expect_type(url, str, f"{at}.image_url")})
        else:
            raise UnsupportedContent(f"{at}.type: content type {kind!r} is not supported")
    return out


def _json_text(value: Any, where: str) -> str:
    try:
        return dumps(value)
    except (TypeError, orjson.JSONEncodeError):
        raise MalformedRequest(f"{where}: not JSON-serialisable") from None


def _tools(conv: _Conversation, tools: Any, where: str, namespace: str | None = None) -> list[Tool]:
    expect_type(tools, list, where)
    out: list[Tool] = []
    for j, t in enumerate(tools):
        at = f"{where}[{j}]"
        expect_type(t, dict, at)
        kind = expect_type(t.get("type", "function"), str, f"{at}.type")
        if kind == "namespace" and namespace is None:
            ns = expect_type(t.get("name"), str, f"{at}.name")
            out += _tools(conv, t.get("tools"), f"{at}.tools", ns)
            continue
        if kind not in ("function", "custom"):  # hosted: web_search, file_search, local_shell...
            conv.dropped.append(f"tools.{kind}")
            continue
        name = expect_type(t.get("name"), str, f"{at}.name")
        description = t.get("description")
        tool: Tool = {"name": name, "kind": kind, "parameters": {}, "format": None,
                "description": "" if description is None else
                expect_type(description, str, f"{at}.description")}
        if kind == "function":
            params = t.get("parameters")
            tool["parameters"] = {"type": "object", "properties": {}} if params is None else \
                expect_type(params, dict, f"{at}.parameters")
        elif t.get("format") is not None:  # text, or a lark/regex grammar the backend describes
            tool["format"] = expect_type(t["format"], dict, f"{at}.format")
        if namespace is not None:
            conv.namespaces[name] = namespace
        out.append(tool)
    return out


def _unique_tools(conv: _Conversation) -> list[Tool]:
    # Namespaces are flattened to plain names; a clash would confuse the model, keep the first.
    seen: set[str] = set()
    out = []
    for t in conv.tools:
        if t["name"] in seen:
            conv.dropped.append(f"tools.duplicate.{t['name']}")
        else:
            seen.add(t["name"])
            out.append(t)
    return out


def _tool_choice(conv: _Conversation, choice: Any) -> ToolChoice:
    if choice is None:
        return None
    if isinstance(choice, str):
        return choice_mode(choice, "tool_choice")
    expect_type(choice, dict, "tool_choice")
    kind = choice.get("type")
    if kind in ("function", "custom"):
        return {"name": expect_type(choice.get("name"), str, "tool_choice.name")}
    if kind == "allowed_tools":
        return choice_mode(choice.get("mode", "auto"), "tool_choice.mode", ("auto", "required"))
    conv.dropped.append(f"tool_choice.{kind}")  # a hosted tool: let the model choose
    return "auto"


def _text(conv: _Conversation, text: Any) -> ResponseFormat | None:
    if text is None:
        return None
    expect_type(text, dict, "text")
    conv.dropped += [f"text.{k}" for k in text if k != "format"]  # verbosity
    fmt = text.get("format")
    if fmt is None:
        return None
    expect_type(fmt, dict, "text.format")
    return json_response_format(fmt.get("type"), fmt.get("name"), fmt.get("schema"), "text.format")


def _reasoning(conv: _Conversation, provider: Provider, reasoning: Any) -> Reasoning | None:
    if reasoning is None:
        return None
    expect_type(reasoning, dict, "reasoning")
    effort, summary = reasoning.get("effort"), reasoning.get("summary")
    if effort is not None:
        expect_type(effort, str, "reasoning.effort")
    if summary is not None:
        expect_type(summary, str, "reasoning.summary")
    conv.dropped += [f"reasoning.{k}" for k in reasoning if k not in ("effort", "summary")]
    provider["reasoning"] = {"effort": effort, "summary": summary}  # echoed in the response
    return {"effort": effort, "budget_tokens": None}


def _bool(value: Any, where: str) -> bool | None:
    return None if value is None else expect_type(value, bool, where)


# ---- responses ------------------------------------------------------------------------

def _status(result: ChatResult) -> str:
    return "incomplete" if result["finish_reason"] in ("length", "content_filter") else "completed"


def _output(result: ChatResult, request: ChatRequest) -> list[dict]:
    """The output items; ids derive from the result id so JSON and stream agree."""
    items: list[dict] = []
    reasoning = result.get("reasoning")
    if reasoning:
        items.append({"type": "reasoning", "id": stable_id("rs_", result["id"]),
                      "summary": [{"type": "summary_text", "text": reasoning}]})
    if result["text"]:
        items.append({"type": "message", "id": stable_id("msg_", result["id"]),
                      "status": _status(result), "role": "assistant",
                      "content": [{"type": "output_text", "text": result["text"], "annotations": []}]})
    namespaces = request["provider"].get("namespaces") or {}
    for call in result["tool_calls"]:
        item: dict[str, Any]
        if call["kind"] == "custom":
            item = {"type": "custom_tool_call", "id": "ctc_" + suffix_of(call["id"]),
                    "call_id": call["id"], "name": call["name"], "input": call["arguments"]}
        else:
            item = {"type": "function_call", "id": "fc_" + suffix_of(call["id"]),
                    "call_id": call["id"], "name": call["name"],
                    "arguments": call["arguments"], "status": "completed"}
        if call["name"] in namespaces:
            item["namespace"] = namespaces[call["name"]]
        items.append(item)
    return items


def _usage(result: ChatResult) -> dict:
    u = result["usage"]
    return {"input_tokens": u["prompt_tokens"],
            "input_tokens_details": {"cached_tokens": 0, "cache_write_tokens": 0},
            "output_tokens": u["completion_tokens"],
            "output_tokens_details": {"reasoning_tokens": 0},
            "total_tokens": u["prompt_tokens"] + u["completion_tokens"]}


def _tool_out(t: Tool) -> dict:
    if t["kind"] == "custom":
        return {"type": "custom", "name": t["name"], "description": t["description"],
                "format": t["format"] or {"type": "text"}}
    return {"type": "function", "name": t["name"], "description": t["description"],
            "parameters": t["parameters"], "strict": None}


def _choice_out(request: ChatRequest) -> dict | str:
    choice = request["tool_choice"]
    if isinstance(choice, dict):
        kind = next((t["kind"] for t in request["tools"] if t["name"] == choice["name"]), "function")
        return {"type": kind, "name": choice["name"]}
    return choice or "auto"


def _format_out(rf: ResponseFormat | None) -> dict:
    if rf is None:
        return {"type": "text"}
    if rf["type"] == "json_schema":
        return {"type": "json_schema", "name": rf["name"], "schema": rf["schema"], "strict": None}
    return {"type": "json_object"}


def _response(result: ChatResult, request: ChatRequest, status: str, output: list[dict], usage: bool) -> dict:
    incomplete = None
    if status == "incomplete":
        reason = "content_filter" if result["finish_reason"] == "content_filter" else "max_output_tokens"
        incomplete = {"reason": reason}
    reasoning = request["provider"].get("reasoning") or {"effort": None, "summary": None}
    # `instructions` is not echoed: it is merged into the system text and would double
    # the stored request; the SDK allows null.
    return {"id": request.get("response_id") or stable_id("resp_", result["id"]), "object": "response",
            "created_at": result["created"], "status": status, "background": False,
            "error": None, "incomplete_details": incomplete, "instructions": None,
            "max_output_tokens": request["max_tokens"], "metadata": {},
            "model": request["model"], "output": output,
            "parallel_tool_calls": request["parallel_tool_calls"] is not False,
            "previous_response_id": None, "reasoning": reasoning,
            "temperature": request["temperature"],
            "text": {"format": _format_out(request["response_format"])},
            "tool_choice": _choice_out(request), "tools": [_tool_out(t) for t in request["tools"]],
            "top_p": request["top_p"], "truncation": "disabled",
            "usage": _usage(result) if usage else None, "user": None}


def from_chat(result: ChatResult, request: ChatRequest) -> dict:
    return _response(result, request, _status(result), _output(result, request), usage=True)


def stream(result: ChatResult, request: ChatRequest) -> list[bytes]:
    events: list[bytes] = []

    def emit(kind: str, **data: Any) -> None:
        events.append(sse_event({"type": kind, "sequence_number": len(events), **data}, event=kind))

    head = _response(result, request, "in_progress", [], usage=False)
    emit("response.created", response=head)
    emit("response.in_progress", response=head)
    items = _output(result, request)
    for index, item in enumerate(items):
        _stream_item(emit, index, item)
    status = _status(result)
    # Like OpenAI: a truncated answer ends with response.incomplete, not .completed.
    emit("response.completed" if status == "completed" else "response.incomplete",
         response=_response(result, request, status, items, usage=True))
    return events


def _stream_item(emit: Callable[..., None], index: int, item: dict) -> None:
    at = {"item_id": item["id"], "output_index": index}
    kind = item["type"]
    if kind == "reasoning":
        emit("response.output_item.added", output_index=index, item=item | {"summary": []})
        for s, part in enumerate(item["summary"]):
            emit("response.reasoning_summary_part.added", **at, summary_index=s,
                 part={"type": "summary_text", "text": ""})
            for piece in chunk_text(part["text"]):
                emit("response.reasoning_summary_text.delta", **at, summary_index=s, delta=piece)
            emit("response.reasoning_summary_text.done", **at, summary_index=s, text=part["text"])
            emit("response.reasoning_summary_part.done", **at, summary_index=s, part=part)
    elif kind == "message":
        emit("response.output_item.added", output_index=index,
             item=item | {"status": "in_progress", "content": []})
        for c, part in enumerate(item["content"]):
            emit("response.content_part.added", **at, content_index=c, part=part | {"text": ""})
            for piece in chunk_text(part["text"]):
                emit("response.output_text.delta", **at, content_index=c, delta=piece, logprobs=[])
            emit("response.output_text.done", **at, content_index=c, text=part["text"], logprobs=[])
            emit("response.content_part.done", **at, content_index=c, part=part)
    elif kind == "function_call":
        emit("response.output_item.added", output_index=index,
             item=item | {"arguments": "", "status": "in_progress"})
        for piece in chunk_text(item["arguments"], 32):
            emit("response.function_call_arguments.delta", **at, delta=piece)
        emit("response.function_call_arguments.done", **at, arguments=item["arguments"])
    else:
        emit("response.output_item.added", output_index=index, item=item | {"input": ""})
        for piece in chunk_text(item["input"], 32):
            emit("response.custom_tool_call_input.delta", **at, delta=piece)
        emit("response.custom_tool_call_input.done", **at, input=item["input"])
    emit("response.output_item.done", output_index=index, item=item)


def error(status: int, message: str, kind: str | None = None) -> dict:
    body = openai_chat.error(status, message, kind)
    if (kind or kind_for_status(status)) == "rate_limit":
        body["error"]["code"] = "rate_limit_exceeded"  # Codex retries on this code
    return body


def stream_content_type(request: ChatRequest) -> str:
    return SSE


def stream_keepalive(request: ChatRequest, created: int) -> StreamKeepalive:
    """(head, tick, events of stream() the head replaces) for a long generation. Codex's
    idle timer counts SSE events, not comment lines, so the keepalive carries data:
    response.created and .in_progress at once, then .in_progress again each interval,
    which clients take as nothing new. The answer's own two opening events are then left
    out. Clients check that the response id never changes: request["response_id"] must be
    set, and the answer made from the same request."""
    nothing_yet: ChatResult = {"id": "", "created": created, "model": "", "text": "", "reasoning": None,
                               "tool_calls": [], "finish_reason": "stop", "stop_sequence": None,
                               "usage": {"prompt_tokens": 0, "completion_tokens": 0}}
    head_obj = _response(nothing_yet, request, "in_progress", [], usage=False)
    head = (sse_event({"type": "response.created", "sequence_number": 0, "response": head_obj},
                      event="response.created")
            + sse_event({"type": "response.in_progress", "sequence_number": 1, "response": head_obj},
                        event="response.in_progress"))
    tick = sse_event({"type": "response.in_progress", "sequence_number": 1, "response": head_obj},
                     event="response.in_progress")
    return StreamKeepalive(head, tick, 2)

