"""Google Gemini (generateContent / streamGenerateContent) <-> internal chat shape.

The model name and the streaming flag come from the path, not the body. Gemini CLI with
Google login talks to the Code Assist API instead, whose request is wrapped as
{"model", "project", "request": {...}} and whose answers are wrapped as {"response": ...}.
"""

from __future__ import annotations

import math
from typing import Any, Iterator

import orjson

from .chat import (SSE, ChatRequest, ChatResult, ChoiceMode, MalformedRequest, Message, Part,
                   ResponseFormat, StreamKeepalive, Tool, ToolCall, ToolChoice, UnsupportedContent,
                   chunk_text, dumps, expect_type, int_or_none, kind_for_status, merge_system_first,
                   new_request, number_or_none, parse_arguments, require, sse_event, stable_id,
                   text_part)
from .detect import CODE_ASSIST_PATH, google_path, split_path

STYLE = "google"
OVERLOADED_STATUS = 503
# Google's SDKs choke on SSE comment lines (they match `^\s*data: ` on their buffer) but skip
# whitespace, which a JSON-array stream allows too.
_KEEPALIVE = StreamKeepalive(b"", b"\n", 0)
_HANDLED = {"contents", "systemInstruction", "tools", "toolConfig", "generationConfig", "model"}
_GENERATION = {"temperature", "topP", "topK", "maxOutputTokens", "stopSequences", "seed",
               "candidateCount", "responseMimeType", "responseSchema", "responseJsonSchema",
               "thinkingConfig"}
# Part fields that carry content; a part must have one (or only metadata, which we skip).
_DATA = ("text", "inlineData", "fileData", "functionCall", "functionResponse",
         "executableCode", "codeExecutionResult")
_META = ("thought", "thoughtSignature")
_MODES: dict[str, ChoiceMode | None] = {"AUTO": "auto", "VALIDATED": "auto", "NONE": "none", "ANY": "required",
          "MODE_UNSPECIFIED": None}
_MAX_SCHEMA_DEPTH = 64


def _parse_path(path: str) -> tuple[str | None, bool, bool]:
    parsed = google_path(path)
    if parsed:
        return parsed
    base, query = split_path(path)
    m = CODE_ASSIST_PATH.search(base)
    if not m:
        raise MalformedRequest(f"path {path!r}: not a generateContent or streamGenerateContent path")
    return None, m["method"] == "streamGenerateContent", "alt=sse" in query.split("&")


def _dumps(value: Any, where: str) -> str:
    try:
        return dumps(value)
    except TypeError as e:  # orjson: integers over 64 bits, too deep, lone surrogates
        raise MalformedRequest(f"{where}: not serialisable as JSON ({e})") from None


def to_chat(body: Any, path: str = "") -> ChatRequest:
    expect_type(body, dict, "request body")
    model, streaming, alt_sse = _parse_path(path)
    code_assist = isinstance(body.get("request"), dict) and "contents" not in body
    dropped: set[str] = set()
    if code_assist:
        wrapper, body = body, body["request"]
        model = wrapper.get("model") or model
        dropped |= {k for k in wrapper if k not in ("model", "request")}
    if not (isinstance(model, str) and model):
        raise MalformedRequest("model: a non-empty model name is required")
    contents = body.get("contents")
    if not (isinstance(contents, list) and contents):
        raise MalformedRequest("contents: a non-empty array is required")

    req = new_request(STYLE, model)
    req["stream"] = streaming
    req["provider"] = {"alt_sse": alt_sse, "code_assist": code_assist, "include_thoughts": False}
    messages = _contents(contents, dropped)
    system = _system(body.get("systemInstruction"))
    req["messages"] = merge_system_first(messages, system)
    req["tools"] = _tools(body.get("tools"), dropped)
    req["tool_choice"] = _tool_choice(body.get("toolConfig"), dropped)
    _generation(body.get("generationConfig"), req, dropped)
    dropped |= {k for k in body if k not in _HANDLED}
    req["dropped"] = sorted(dropped)
    return req


# ---- contents ---------------------------------------------------------------------------

def _system(si: Any) -> list[Part]:
    if si is None:
        return []
    if isinstance(si, str):
        return [text_part(si)]
    expect_type(si, dict, "systemInstruction")
    parts = expect_type(si.get("parts", []), list, "systemInstruction.parts")
    out: list[Part] = []
    for j, p in enumerate(parts):
        where = f"systemInstruction.parts[{j}]"
        expect_type(p, dict, where)
        if "text" not in p:
            raise UnsupportedContent(f"{where}: only text parts are supported in a system instruction")
        out.append(text_part(expect_type(p["text"], str, f"{where}.text")))
    return out


def _contents(contents: list, dropped: set[str]) -> list[Message]:
    messages: list[Message] = []
    pending: list[tuple[str, str]] = []  # (id, name) of calls not answered yet, in order
    for i, turn in enumerate(contents):
        where = f"contents[{i}]"
        expect_type(turn, dict, where)
        role = turn.get("role") or "user"
        require(role in ("user", "model", "function"), f"{where}.role: unknown role {role!r}")
        parts = expect_type(turn.get("parts", []), list, f"{where}.parts")
        if role == "model":
            messages += _model_turn(parts, i, pending, dropped)
        else:  # "function" is the older role for functionResponse turns
            messages += _user_turn(parts, i, pending, dropped)
    require(messages, "contents: no turn holds any content")
    return messages


def _parts(parts: list, i: int, dropped: set[str]) -> Iterator[tuple[int, str, dict, str]]:
    """(index, where, part, data field) for each content-bearing part."""
    for j, p in enumerate(parts):
        where = f"contents[{i}].parts[{j}]"
        expect_type(p, dict, where)
        if "thoughtSignature" in p:
            # Opaque to us; Gemini CLI even sends the "skip_thought_signature_validator" stub.
            dropped.add("thoughtSignature")
        fields = [k for k in _DATA if k in p]
        if not fields:
            require(any(k in p for k in _META), f"{where}: a part needs one of {', '.join(_DATA)}")
            continue  # a bare signature or thought flag carries nothing to forward
        require(len(fields) == 1, f"{where}: a part holds exactly one of {', '.join(fields)}")
        kind = fields[0]
        if kind in ("executableCode", "codeExecutionResult"):
            raise UnsupportedContent(f"{where}: {kind} parts (code execution) are not supported")
        if kind == "fileData":
            raise UnsupportedContent(f"{where}: fileData (uploaded file URIs) is not supported; "
                                     "send the data inline")
        yield j, where, p, kind


def _media(p: dict, where: str) -> Part:
    data = expect_type(p["inlineData"], dict, f"{where}.inlineData")
    mime = expect_type(data.get("mimeType"), str, f"{where}.inlineData.mimeType")
    b64 = expect_type(data.get("data"), str, f"{where}.inlineData.data")
    if not mime.startswith("image/"):
        raise UnsupportedContent(f"{where}.inlineData: mime type {mime!r} is not supported "
                                 "(images only)")
    return {"type": "image", "url": f"data:{mime};base64,{b64}"}


def _text(p: dict, where: str) -> str:
    return expect_type(p["text"], str, f"{where}.text")


def _model_turn(parts: list, i: int, pending: list, dropped: set[str]) -> list[Message]:
    content: list[Part] = []
    reasoning: list[str] = []
    calls: list[ToolCall] = []
    for j, where, p, kind in _parts(parts, i, dropped):
        if kind == "text":
            thought = p.get("thought", False)
            expect_type(thought, bool, f"{where}.thought")
            text = _text(p, where)
            if thought:
                reasoning.append(text)
            elif text:
                content.append(text_part(text))
        elif kind == "inlineData":
            content.append(_media(p, where))
        elif kind == "functionCall":
            calls.append(_call(p["functionCall"], f"{where}.functionCall", i, j))
            pending.append((calls[-1]["id"], calls[-1]["name"]))
        else:
            raise MalformedRequest(f"{where}: {kind} belongs in a user turn")
    if not (content or reasoning or calls):
        return []
    msg: Message = {"role": "assistant", "content": content}
    if calls:
        msg["tool_calls"] = calls
    if reasoning:
        msg["reasoning"] = "".join(reasoning)
    return [msg]


def _call(fc: Any, where: str, i: int, j: int) -> ToolCall:
    expect_type(fc, dict, where)
    name = expect_type(fc.get("name"), str, f"{where}.name")
    args = fc.get("args")
    args = {} if args is None else expect_type(args, dict, f"{where}.args")
    call_id = fc.get("id")
    if call_id is None or call_id == "":
        # Ids are optional in Gemini; derive one that is the same on every replay.
        call_id = stable_id("call_", i, j, name)
    expect_type(call_id, str, f"{where}.id")
    return {"id": call_id, "name": name, "arguments": _dumps(args, f"{where}.args"),
            "kind": "function"}


def _user_turn(parts: list, i: int, pending: list, dropped: set[str]) -> list[Message]:
    tools: list[Message] = []
    content: list[Part] = []
    for j, where, p, kind in _parts(parts, i, dropped):
        if kind == "text":
            text = _text(p, where)
            if text:
                content.append(text_part(text))
        elif kind == "inlineData":
            content.append(_media(p, where))
        elif kind == "functionResponse":
            tools.append(_tool_result(p["functionResponse"], f"{where}.functionResponse",
                                      i, j, pending))
        else:
            raise MalformedRequest(f"{where}: {kind} belongs in a model turn")
    # Tool results answer the previous assistant turn, so they come before new user text.
    user: list[Message] = [{"role": "user", "content": content}] if content else []
    return tools + user


def _tool_result(fr: Any, where: str, i: int, j: int, pending: list) -> Message:
    expect_type(fr, dict, where)
    name = expect_type(fr.get("name"), str, f"{where}.name")
    response = fr.get("response")
    response = {} if response is None else expect_type(response, dict, f"{where}.response")
    rid = fr.get("id")
    if rid is not None:
        expect_type(rid, str, f"{where}.id")
    match = next((k for k, (cid, _) in enumerate(pending) if rid and cid == rid), None)
    if match is None:  # no id, or one we never saw: the oldest open call of that name
        match = next((k for k, (_, cname) in enumerate(pending) if cname == name), None)
    if match is not None:
        call_id = pending.pop(match)[0]
    else:
        call_id = rid or stable_id("call_", i, j, name)
    if len(response) == 1:
        only = next(iter(response.values()))
        text = only if isinstance(only, str) and next(iter(response)) in (
            "output", "content", "error") else _dumps(response, f"{where}.response")
    else:
        text = _dumps(response, f"{where}.response")
    return {"role": "tool", "content": [text_part(text)], "tool_call_id": call_id, "name": name,
            "is_error": "error" in response}


# ---- tools and config -------------------------------------------------------------------

def _schema(s: Any, where: str, depth: int = 0) -> dict:
    """Gemini's OpenAPI-subset Schema (UPPER-case types, nullable) as plain JSON Schema."""
    expect_type(s, dict, where)
    require(depth < _MAX_SCHEMA_DEPTH, f"{where}: schema nested too deeply")
    out = {}
    for key, value in s.items():
        if key in ("propertyOrdering", "nullable"):
            continue
        if key == "type":
            value = _schema_type(value, where)
            if value is None:
                continue
        elif key == "format" and value in ("int32", "int64", "float", "double", "enum"):
            continue  # Gemini-only formats that JSON Schema validators do not know
        elif key in ("properties", "$defs", "definitions", "patternProperties"):
            expect_type(value, dict, f"{where}.{key}")
            value = {k: _schema(v, f"{where}.{key}.{k}", depth + 1) for k, v in value.items()}
        elif key in ("items", "not", "additionalProperties") and isinstance(value, dict):
            value = _schema(value, f"{where}.{key}", depth + 1)
        elif key in ("anyOf", "oneOf", "allOf", "prefixItems"):
            expect_type(value, list, f"{where}.{key}")
            value = [_schema(v, f"{where}.{key}[{n}]", depth + 1) for n, v in enumerate(value)]
        out[key] = value
    if s.get("nullable") is True and "type" in out:
        types = out["type"] if isinstance(out["type"], list) else [out["type"]]
        out["type"] = types + ["null"] if "null" not in types else types
    return out


def _schema_type(value: Any, where: str):
    if isinstance(value, list):
        return [expect_type(t, str, f"{where}.type[]").lower() for t in value]
    value = expect_type(value, str, f"{where}.type").lower()
    return None if value == "type_unspecified" else value


def _tools(tools: Any, dropped: set[str]) -> list[Tool]:
    if tools is None:
        return []
    expect_type(tools, list, "tools")
    out = []
    for i, tool in enumerate(tools):
        expect_type(tool, dict, f"tools[{i}]")
        for key, value in tool.items():
            if key != "functionDeclarations":
                dropped.add(f"tools.{key}")  # hosted tools (googleSearch, codeExecution, ...)
                continue
            expect_type(value, list, f"tools[{i}].functionDeclarations")
            out += [_declaration(d, f"tools[{i}].functionDeclarations[{j}]")
                    for j, d in enumerate(value)]
    return out


def _declaration(d: Any, where: str) -> Tool:
    expect_type(d, dict, where)
    name = expect_type(d.get("name"), str, f"{where}.name")
    description = d.get("description")
    description = "" if description is None else expect_type(description, str, f"{where}.description")
    if d.get("parametersJsonSchema") is not None:
        params = _schema(d["parametersJsonSchema"], f"{where}.parametersJsonSchema")
    elif d.get("parameters") is not None:
        params = _schema(d["parameters"], f"{where}.parameters")
    else:
        params = {"type": "object", "properties": {}}
    return {"name": name, "description": description, "parameters": params,
            "kind": "function", "format": None}


def _tool_choice(config: Any, dropped: set[str]) -> ToolChoice:
    if config is None:
        return None
    expect_type(config, dict, "toolConfig")
    dropped |= {f"toolConfig.{k}" for k in config if k != "functionCallingConfig"}
    fcc = config.get("functionCallingConfig")
    if fcc is None:
        return None
    expect_type(fcc, dict, "toolConfig.functionCallingConfig")
    mode = fcc.get("mode")
    if mode is None:
        return None
    mode = expect_type(mode, str, "toolConfig.functionCallingConfig.mode").upper()
    require(mode in _MODES, f"toolConfig.functionCallingConfig.mode: unknown mode {mode!r}")
    names = fcc.get("allowedFunctionNames") or []
    expect_type(names, list, "toolConfig.functionCallingConfig.allowedFunctionNames")
    if mode == "ANY" and len(names) == 1:
        return {"name": expect_type(names[0], str,
                                    "toolConfig.functionCallingConfig.allowedFunctionNames[0]")}
    return _MODES[mode]


def _generation(gc: Any, req: ChatRequest, dropped: set[str]) -> None:
    if gc is None:
        return
    where = "generationConfig"
    expect_type(gc, dict, where)
    dropped |= {f"{where}.{k}" for k in gc if k not in _GENERATION}
    req["temperature"] = number_or_none(gc.get("temperature"), f"{where}.temperature")
    req["top_p"] = number_or_none(gc.get("topP"), f"{where}.topP")
    top_k = number_or_none(gc.get("topK"), f"{where}.topK")  # the SDK types it as a float
    require(top_k is None or math.isfinite(top_k), f"{where}.topK: a finite number is required")
    req["top_k"] = None if top_k is None else int(top_k)
    req["max_tokens"] = int_or_none(gc.get("maxOutputTokens"), f"{where}.maxOutputTokens")
    req["seed"] = int_or_none(gc.get("seed"), f"{where}.seed")
    stop = gc.get("stopSequences") or []
    expect_type(stop, list, f"{where}.stopSequences")
    req["stop"] = [expect_type(s, str, f"{where}.stopSequences[{n}]") for n, s in enumerate(stop)]
    count = int_or_none(gc.get("candidateCount"), f"{where}.candidateCount")
    if count is not None and count > 1:
        raise UnsupportedContent(f"{where}.candidateCount: only one candidate per request is supported")
    req["response_format"] = _response_format(gc, dropped)
    _thinking(gc.get("thinkingConfig"), req)


def _response_format(gc: dict, dropped: set[str]) -> ResponseFormat | None:
    where = "generationConfig"
    mime = gc.get("responseMimeType")
    schema = gc.get("responseJsonSchema", gc.get("responseSchema"))
    key = "responseJsonSchema" if "responseJsonSchema" in gc else "responseSchema"
    if mime is not None:
        expect_type(mime, str, f"{where}.responseMimeType")
    if mime != "application/json":
        if mime not in (None, "text/plain"):
            dropped.add(f"{where}.responseMimeType")
        if schema is not None:
            dropped.add(f"{where}.{key}")
        return None
    if schema is None:
        return {"type": "json_object"}
    return {"type": "json_schema", "name": "response", "schema": _schema(schema, f"{where}.{key}")}


def _thinking(tc: Any, req: ChatRequest) -> None:
    if tc is None:
        return
    where = "generationConfig.thinkingConfig"
    expect_type(tc, dict, where)
    budget = int_or_none(tc.get("thinkingBudget"), f"{where}.thinkingBudget")
    level = tc.get("thinkingLevel")
    if level is not None:
        level = expect_type(level, str, f"{where}.thinkingLevel").lower()
        level = None if level == "thinking_level_unspecified" else level
    include = tc.get("includeThoughts", False)
    req["provider"]["include_thoughts"] = expect_type(include, bool, f"{where}.includeThoughts")
    if budget == 0 and level is None:
        level = "none"  # a zero budget is how Gemini switches thinking off
    req["reasoning"] = {"effort": level,
                        "budget_tokens": budget if budget is not None and budget > 0 else None}


# ---- responses --------------------------------------------------------------------------

_FINISH = {"stop": "STOP", "length": "MAX_TOKENS", "tool_calls": "STOP",
           "content_filter": "SAFETY"}


def _call_out(c: ToolCall) -> dict:
    return {"functionCall": {"id": c["id"], "name": c["name"],
                             "args": parse_arguments(c["arguments"])}}


def _usage(result: ChatResult) -> dict:
    u = result["usage"]
    return {"promptTokenCount": u["prompt_tokens"], "candidatesTokenCount": u["completion_tokens"],
            "totalTokenCount": u["prompt_tokens"] + u["completion_tokens"]}


def _response(parts: list[dict], result: ChatResult, request: ChatRequest, final: bool) -> dict:
    candidate: dict = {"content": {"role": "model", "parts": parts or [{"text": ""}]}, "index": 0}
    out: dict = {"candidates": [candidate]}
    if final:
        candidate["finishReason"] = _FINISH.get(result["finish_reason"], "STOP")
        out["usageMetadata"] = _usage(result)
    out["modelVersion"] = request["model"]
    out["responseId"] = stable_id("", result["id"], length=22)
    return out


def _wrap(response: dict, request: ChatRequest) -> dict:
    return {"response": response} if request["provider"].get("code_assist") else response


def _thought(result: ChatResult, request: ChatRequest) -> str:
    return (result.get("reasoning") or "") if request["provider"].get("include_thoughts") else ""


def from_chat(result: ChatResult, request: ChatRequest) -> dict:
    parts = []
    if _thought(result, request):
        parts.append({"text": result["reasoning"], "thought": True})
    if result["text"]:
        parts.append({"text": result["text"]})
    parts += [_call_out(c) for c in result["tool_calls"]]
    return _wrap(_response(parts, result, request, final=True), request)


def stream(result: ChatResult, request: ChatRequest) -> list[bytes]:
    # Text arrives as deltas, each functionCall whole in its own chunk.
    pieces = [[{"text": t, "thought": True}] for t in chunk_text(_thought(result, request))]
    pieces += [[{"text": t}] for t in chunk_text(result["text"])]
    pieces += [[_call_out(c)] for c in result["tool_calls"]]
    pieces = pieces or [[]]
    chunks = [_wrap(_response(p, result, request, final=n == len(pieces) - 1), request)
              for n, p in enumerate(pieces)]
    if request["provider"].get("alt_sse"):
        return [sse_event(c) for c in chunks]
    # Without alt=sse the endpoint streams a single JSON array, element by element.
    body = [orjson.dumps(c) for c in chunks]
    return [b"[" + body[0]] + [b",\r\n" + c for c in body[1:]] + [b"]"]


_STATUS = {"invalid_request": "INVALID_ARGUMENT", "context_too_long": "INVALID_ARGUMENT",
           "overloaded": "UNAVAILABLE", "timeout": "DEADLINE_EXCEEDED",
           "backend_error": "INTERNAL", "not_found": "NOT_FOUND",
           "authentication": "UNAUTHENTICATED", "rate_limit": "RESOURCE_EXHAUSTED",
           "too_large": "INVALID_ARGUMENT"}


def error(status: int, message: str, kind: str | None = None) -> dict:
    code = _STATUS.get(kind or "") or _STATUS[kind_for_status(status)]
    return {"error": {"code": status, "message": message, "status": code}}


def stream_content_type(request: ChatRequest) -> str:
    # Without alt=sse, Google streams one JSON array instead of SSE.
    return SSE if request["provider"].get("alt_sse") else "application/json"


def stream_keepalive(request: ChatRequest, created: int) -> StreamKeepalive:
    return _KEEPALIVE
