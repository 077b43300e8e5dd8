"""Google Gemini adapter: the official google-genai SDK against the provider server,
property tests over random conversations, and the quirks Gemini CLI sends."""

from __future__ import annotations

import copy
import json

import httpx
import pytest
from google import genai
from google.genai import errors, types
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from support.adapter_fuzz import BOUNDED_INTS, FINITE_FLOATS, check_total, json_paths, json_values as any_json, parent_of
from polar_mitm.adapters import AdapterError, google, stream_content_type
from polar_mitm.adapters.chat import parts_text
from support.provider_server import make_result

PATH = "/v1beta/models/gemini-test:generateContent"
SSE_PATH = "/v1beta/models/gemini-test:streamGenerateContent?alt=sse"
NO_AFC = types.AutomaticFunctionCallingConfig(disable=True)
WEATHER = types.Tool(function_declarations=[types.FunctionDeclaration(
    name="get_weather", description="Weather for a city",
    parameters=types.Schema(type="OBJECT", properties={"city": types.Schema(type="STRING")},
                            required=["city"]))])


@pytest.fixture
def gemini(provider_server):
    # Held by the fixture: a collected Client closes the HTTP client its .models uses.
    c = genai.Client(api_key="test-key", http_options=types.HttpOptions(
        base_url=provider_server.url, api_version="v1beta"))
    yield c
    c.close()


def user(text: str) -> dict:
    return {"role": "user", "parts": [{"text": text}]}


# ---- the official SDK ---------------------------------------------------------------------

def test_sdk_text(gemini, provider_server):
    response = gemini.models.generate_content(
        model="gemini-test", contents="hi",
        config=types.GenerateContentConfig(system_instruction="Be brief.", temperature=0.3,
                                           max_output_tokens=64))
    assert response.text == "Hello from the proxy."
    assert response.candidates[0].finish_reason == types.FinishReason.STOP
    assert response.usage_metadata.total_token_count == 18
    req = provider_server.requests[0]
    assert req["model"] == "gemini-test" and req["stream"] is False
    assert req["messages"] == [{"role": "system", "content": [{"type": "text", "text": "Be brief."}]},
                               {"role": "user", "content": [{"type": "text", "text": "hi"}]}]
    assert req["temperature"] == 0.3 and req["max_tokens"] == 64


def test_sdk_stream_text(gemini, provider_server):
    answer = "A longer answer that is split into several stream chunks by the adapter, word by word."
    provider_server.responder = lambda req: make_result(answer)
    chunks = list(gemini.models.generate_content_stream(
        model="gemini-test", contents="hi"))
    assert len(chunks) > 1
    assert "".join(c.text or "" for c in chunks) == answer
    assert chunks[-1].candidates[0].finish_reason == types.FinishReason.STOP
    assert provider_server.raw[0]["path"].endswith(":streamGenerateContent?alt=sse")
    assert provider_server.requests[0]["stream"] is True


def _tool_responder(req):
    if req["messages"][-1]["role"] == "tool":
        return make_result("It is sunny.", seed="second")
    return make_result("", [{"name": "get_weather", "arguments": '{"city": "Paris"}'}])


@pytest.mark.parametrize("streaming", [False, True])
def test_sdk_function_call(gemini, provider_server, streaming):
    provider_server.responder = _tool_responder
    config = types.GenerateContentConfig(tools=[WEATHER], automatic_function_calling=NO_AFC)
    models = gemini.models
    if streaming:
        chunks = list(models.generate_content_stream(model="gemini-test", contents="weather?",
                                                     config=config))
        calls = [fc for c in chunks for fc in (c.function_calls or [])]
    else:
        calls = models.generate_content(model="gemini-test", contents="weather?",
                                        config=config).function_calls
    assert [(c.name, c.args) for c in calls] == [("get_weather", {"city": "Paris"})]
    assert calls[0].id
    tool = provider_server.requests[0]["tools"][0]
    assert tool["parameters"] == {"type": "object", "properties": {"city": {"type": "string"}},
                                  "required": ["city"]}


def test_sdk_second_turn_extends_the_first(gemini, provider_server):
    provider_server.responder = _tool_responder
    config = types.GenerateContentConfig(tools=[WEATHER], automatic_function_calling=NO_AFC,
                                         system_instruction="You are a weather bot.")
    models = gemini.models
    first_turn = [types.Content(role="user", parts=[types.Part(text="weather in Paris?")])]
    first = models.generate_content(model="gemini-test", contents=first_turn, config=config)
    call = first.function_calls[0]
    history = first_turn + [first.candidates[0].content, types.Content(role="user", parts=[
        types.Part.from_function_response(name=call.name, response={"output": "22C, sunny"})])]
    second = models.generate_content(model="gemini-test", contents=history, config=config)
    assert second.text == "It is sunny."

    r0, r1 = provider_server.requests
    n = len(r0["messages"])
    assert r1["messages"][:n] == r0["messages"]
    assistant, tool = r1["messages"][n:]
    assert assistant["role"] == "assistant" and assistant["content"] == []
    [tc] = assistant["tool_calls"]
    assert tc["id"] == call.id and tc["name"] == "get_weather"
    assert json.loads(tc["arguments"]) == {"city": "Paris"}
    assert tool == {"role": "tool", "content": [{"type": "text", "text": "22C, sunny"}],
                    "tool_call_id": call.id, "name": "get_weather", "is_error": False}


def test_json_array_stream(provider_server):
    answer = "Streaming without alt=sse returns one JSON array holding every chunk of the answer."
    provider_server.responder = lambda req: make_result(answer)
    r = httpx.post(provider_server.url + "/v1beta/models/m:streamGenerateContent",
                   json={"contents": [user("hi")]}, headers={"x-goog-api-key": "k"})
    assert r.status_code == 200 and r.headers["content-type"] == "application/json"
    chunks = json.loads(r.content)
    assert isinstance(chunks, list) and len(chunks) > 1
    text = "".join(p.get("text", "") for c in chunks for p in c["candidates"][0]["content"]["parts"])
    assert text == answer
    assert chunks[-1]["candidates"][0]["finishReason"] == "STOP"
    assert "usageMetadata" in chunks[-1]


def test_sdk_rejected_body_is_a_client_error(gemini, provider_server):
    with pytest.raises(errors.ClientError) as info:
        gemini.models.generate_content(
            model="gemini-test", contents="hi", config=types.GenerateContentConfig(candidate_count=2))
    assert info.value.code == 400
    assert info.value.status == "INVALID_ARGUMENT"
    assert "candidateCount" in info.value.message
    assert provider_server.requests == []


# ---- unit checks --------------------------------------------------------------------------

def test_paths_and_stream_flags():
    body = {"contents": [user("hi")]}
    req = google.to_chat(body, SSE_PATH)
    assert req["stream"] and req["provider"]["alt_sse"] and stream_content_type(req) == "text/event-stream"
    req = google.to_chat(body, "/v1beta/models/gemini-test:streamGenerateContent")
    assert req["stream"] and not req["provider"]["alt_sse"]
    assert stream_content_type(req) == "application/json"
    for bad in ("", "/v1/chat/completions", "/v1beta/models/m:countTokens"):
        with pytest.raises(AdapterError):
            google.to_chat(body, bad)


@pytest.mark.parametrize("body, where", [
    ({}, "contents"),
    ({"contents": []}, "contents"),
    ({"contents": "hi"}, "contents"),
    ({"contents": [{"role": "system", "parts": [{"text": "x"}]}]}, "contents[0].role"),
    ({"contents": [user("a"), {"role": "user", "parts": [{"nope": 1}]}]}, "contents[1].parts[0]"),
    ({"contents": [{"parts": [{"text": 3}]}]}, "contents[0].parts[0].text"),
    ({"contents": [{"parts": [{"fileData": {"fileUri": "gs://x"}}]}]}, "fileData"),
    ({"contents": [{"parts": [{"inlineData": {"mimeType": "audio/wav", "data": "AA=="}}]}]}, "audio/wav"),
    ({"contents": [{"parts": [{"executableCode": {"code": "1"}}]}]}, "executableCode"),
    ({"contents": [user("a")], "tools": [{"functionDeclarations": [{"name": 1}]}]},
     "tools[0].functionDeclarations[0].name"),
    ({"contents": [user("a")], "generationConfig": {"temperature": "hot"}}, "generationConfig.temperature"),
])
def test_malformed_bodies_name_the_field(body, where):
    with pytest.raises(AdapterError) as info:
        google.to_chat(body, PATH)
    assert where in str(info.value)


def test_parts_and_config_mapping():
    body = {
        "systemInstruction": "sys",
        "contents": [{"parts": [{"text": "look"},
                                {"inlineData": {"mimeType": "image/png", "data": "iVBO"}}]}],
        "tools": [{"googleSearch": {}}, {"codeExecution": {}}],
        "toolConfig": {"functionCallingConfig": {"mode": "ANY", "allowedFunctionNames": ["f"]}},
        "generationConfig": {"topP": 0.9, "topK": 40.0, "stopSequences": ["END"], "seed": 7,
                             "responseMimeType": "application/json", "presencePenalty": 0.1},
        "safetySettings": [], "cachedContent": "c/1", "labels": {"a": "b"},
    }
    req = google.to_chat(body, PATH)
    assert req["messages"][0] == {"role": "system", "content": [{"type": "text", "text": "sys"}]}
    assert req["messages"][1]["content"][1] == {"type": "image", "url": "data:image/png;base64,iVBO"}
    assert req["tool_choice"] == {"name": "f"} and req["tools"] == []
    assert (req["top_p"], req["top_k"], req["stop"], req["seed"]) == (0.9, 40, ["END"], 7)
    assert req["response_format"] == {"type": "json_object"}
    assert req["dropped"] == ["cachedContent", "generationConfig.presencePenalty", "labels",
                              "safetySettings", "tools.codeExecution", "tools.googleSearch"]
    for mode, choice in (("AUTO", "auto"), ("ANY", "required"), ("NONE", "none"),
                         ("VALIDATED", "auto")):
        body["toolConfig"] = {"functionCallingConfig": {"mode": mode}}
        assert google.to_chat(body, PATH)["tool_choice"] == choice


def test_function_response_shapes():
    model = {"role": "model", "parts": [{"functionCall": {"name": "a", "args": {}}},
                                        {"functionCall": {"name": "b", "args": {}}},
                                        {"functionCall": {"name": "a", "args": {"x": 1}}}]}
    answers = {"role": "user", "parts": [
        {"functionResponse": {"name": "a", "response": {"output": "first a"}}},
        {"functionResponse": {"name": "a", "response": {"result": 1, "more": 2}}},
        {"functionResponse": {"name": "b", "response": {"error": "boom"}}},
        {"text": "and now?"}]}
    req = google.to_chat({"contents": [user("go"), model, answers]}, PATH)
    calls = req["messages"][1]["tool_calls"]
    tools = req["messages"][2:5]
    assert [t["tool_call_id"] for t in tools] == [calls[0]["id"], calls[2]["id"], calls[1]["id"]]
    assert [parts_text(t["content"]) for t in tools] == ["first a", '{"result":1,"more":2}', "boom"]
    assert [t["is_error"] for t in tools] == [False, False, True]
    assert req["messages"][5] == {"role": "user", "content": [{"type": "text", "text": "and now?"}]}
    # Derived ids are stable: the same history gives the same ids on the next turn.
    assert google.to_chat({"contents": [user("go"), model, answers]}, PATH) == req


def test_from_chat_and_error_shapes():
    req = google.to_chat({"contents": [user("hi")]}, PATH)
    out = google.from_chat(make_result("", finish_reason="length"), req)
    cand = out["candidates"][0]
    assert cand["content"] == {"role": "model", "parts": [{"text": ""}]}
    assert cand["finishReason"] == "MAX_TOKENS" and cand["index"] == 0
    assert out["modelVersion"] == "gemini-test" and out["responseId"]
    assert out["usageMetadata"] == {"promptTokenCount": 11, "candidatesTokenCount": 7,
                                    "totalTokenCount": 18}
    assert google.from_chat(make_result("x", finish_reason="content_filter"), req)[
        "candidates"][0]["finishReason"] == "SAFETY"
    assert google.error(400, "bad")["error"] == {"code": 400, "message": "bad",
                                                 "status": "INVALID_ARGUMENT"}
    for status, kind, name in ((503, None, "UNAVAILABLE"), (504, None, "DEADLINE_EXCEEDED"),
                               (502, None, "INTERNAL"), (404, None, "NOT_FOUND"),
                               (401, None, "UNAUTHENTICATED"), (429, None, "RESOURCE_EXHAUSTED"),
                               (400, "context_too_long", "INVALID_ARGUMENT"),
                               (503, "overloaded", "UNAVAILABLE")):
        assert google.error(status, "m", kind)["error"]["status"] == name


def test_stream_function_calls_are_whole_chunks():
    req = google.to_chat({"contents": [user("hi")]}, SSE_PATH)
    result = make_result("Let me check.", [{"name": "f", "arguments": '{"a": 1}'},
                                           {"name": "g", "arguments": "{}"}])
    events = google.stream(result, req)
    chunks = [json.loads(e.removeprefix(b"data: ")) for e in events]
    assert all(e.startswith(b"data: ") and e.endswith(b"\n\n") for e in events)
    parts = [c["candidates"][0]["content"]["parts"] for c in chunks]
    assert parts[-2:] == [[{"functionCall": {"id": result["tool_calls"][0]["id"], "name": "f",
                                             "args": {"a": 1}}}],
                          [{"functionCall": {"id": result["tool_calls"][1]["id"], "name": "g",
                                             "args": {}}}]]
    assert [("finishReason" in c["candidates"][0], "usageMetadata" in c) for c in chunks] == \
        [(False, False)] * (len(chunks) - 1) + [(True, True)]


# ---- Gemini CLI quirks --------------------------------------------------------------------

def test_cli_parameters_json_schema():
    schema = {"type": "object", "properties": {"path": {"type": "string"}}, "required": ["path"]}
    body = {"contents": [user("hi")], "tools": [{"functionDeclarations": [
        {"name": "read_file", "description": "Read a file", "parametersJsonSchema": schema}]}]}
    [tool] = google.to_chat(body, SSE_PATH)["tools"]
    assert tool == {"name": "read_file", "description": "Read a file", "parameters": schema,
                    "kind": "function", "format": None}


def test_cli_upper_case_parameters_converted():
    params = {"type": "OBJECT", "propertyOrdering": ["a", "b"], "required": ["a"], "properties": {
        "a": {"type": "STRING", "enum": ["X", "Y"], "format": "enum", "description": "pick"},
        "b": {"type": "ARRAY", "nullable": True, "items": {"type": "INTEGER", "format": "int32"}},
        "c": {"type": "OBJECT", "properties": {"d": {"type": "NUMBER", "format": "double"},
                                                "type": {"type": "BOOLEAN"}}}}}
    body = {"contents": [user("hi")],
            "tools": [{"functionDeclarations": [{"name": "f", "parameters": params}]}]}
    [tool] = google.to_chat(body, PATH)["tools"]
    assert tool["parameters"] == {"type": "object", "required": ["a"], "properties": {
        "a": {"type": "string", "enum": ["X", "Y"], "description": "pick"},
        "b": {"type": ["array", "null"], "items": {"type": "integer"}},
        "c": {"type": "object", "properties": {"d": {"type": "number"},
                                                "type": {"type": "boolean"}}}}}


def test_cli_skip_thought_signature_ignored():
    model = {"role": "model", "parts": [
        {"functionCall": {"id": "fc-1", "name": "ls", "args": {"dir": "."}},
         "thoughtSignature": "skip_thought_signature_validator"},
        {"functionCall": {"id": "fc-2", "name": "ls", "args": {"dir": "src"}},
         "thoughtSignature": "skip_thought_signature_validator"}]}
    req = google.to_chat({"contents": [user("list"), model]}, SSE_PATH)
    assert req["dropped"] == ["thoughtSignature"]
    assert [c["id"] for c in req["messages"][1]["tool_calls"]] == ["fc-1", "fc-2"]


def test_cli_function_ids_pair_call_and_response():
    model = {"role": "model", "parts": [
        {"functionCall": {"id": "fc-a", "name": "ls", "args": {"dir": "a"}}},
        {"functionCall": {"id": "fc-b", "name": "ls", "args": {"dir": "b"}}}]}
    # Answered out of order: the ids, not the names, decide the pairing.
    answers = {"role": "user", "parts": [
        {"functionResponse": {"id": "fc-b", "name": "ls", "response": {"output": "B"}}},
        {"functionResponse": {"id": "fc-a", "name": "ls", "response": {"output": "A"}}}]}
    msgs = google.to_chat({"contents": [user("x"), model, answers]}, SSE_PATH)["messages"]
    assert [(m["tool_call_id"], parts_text(m["content"])) for m in msgs[2:]] == \
        [("fc-b", "B"), ("fc-a", "A")]


def test_cli_router_json_schema():
    body = {"systemInstruction": {"role": "user", "parts": [{"text": "You are a Task Routing AI"}]},
            "contents": [user("fix the bug")],
            "generationConfig": {"temperature": 0, "maxOutputTokens": 1024,
                                 "responseMimeType": "application/json",
                                 "responseJsonSchema": {
                                     "type": "OBJECT", "required": ["complexity_score"],
                                     "properties": {"complexity_reasoning": {"type": "STRING"},
                                                    "complexity_score": {"type": "INTEGER"}}}}}
    req = google.to_chat(body, "/v1beta/models/gemini-3.5-flash-lite:generateContent")
    assert req["model"] == "gemini-3.5-flash-lite" and not req["stream"]
    assert req["response_format"] == {"type": "json_schema", "name": "response", "schema": {
        "type": "object", "required": ["complexity_score"],
        "properties": {"complexity_reasoning": {"type": "string"},
                       "complexity_score": {"type": "integer"}}}}


def test_cli_thinking_config():
    body = {"contents": [user("hi")], "generationConfig": {
        "temperature": 1, "topP": 0.95, "topK": 64,
        "thinkingConfig": {"includeThoughts": True, "thinkingLevel": "HIGH"}}}
    req = google.to_chat(body, SSE_PATH)
    assert req["reasoning"] == {"effort": "high", "budget_tokens": None}
    assert req["provider"]["include_thoughts"] is True
    result = make_result("Done.", reasoning="Thinking it over.")
    assert google.from_chat(result, req)["candidates"][0]["content"]["parts"] == [
        {"text": "Thinking it over.", "thought": True}, {"text": "Done."}]
    body["generationConfig"]["thinkingConfig"] = {"includeThoughts": False, "thinkingBudget": 2048}
    req = google.to_chat(body, SSE_PATH)
    assert req["reasoning"] == {"effort": None, "budget_tokens": 2048}
    assert google.from_chat(result, req)["candidates"][0]["content"]["parts"] == [{"text": "Done."}]


def test_cli_code_assist_wrapped():
    inner = {"contents": [user("hi")], "generationConfig": {"temperature": 0.5}, "session_id": "s"}
    body = {"model": "gemini-3.8-flash", "project": "proj-1", "user_prompt_id": "u1", "request": inner}
    req = google.to_chat(body, "/v1internal:streamGenerateContent?alt=sse")
    assert req["model"] == "gemini-3.8-flash" and req["stream"] and req["provider"]["alt_sse"]
    assert req["provider"]["code_assist"] and req["temperature"] == 0.5
    assert set(req["dropped"]) == {"project", "user_prompt_id", "session_id"}
    result = make_result("Hello there, wrapped.")
    out = google.from_chat(result, req)
    assert out["response"]["candidates"][0]["content"]["parts"] == [{"text": "Hello there, wrapped."}]
    chunks = [json.loads(e.removeprefix(b"data: ")) for e in google.stream(result, req)]
    assert all(set(c) == {"response"} for c in chunks)
    assert chunks[-1]["response"]["candidates"][0]["finishReason"] == "STOP"
    # The wrapped shape on a standard path takes the wrapper's model too.
    assert google.to_chat(body, PATH)["model"] == "gemini-3.8-flash"


# ---- property tests -----------------------------------------------------------------------

names = st.sampled_from(["read_file", "ls", "grep", "edit"])
texts = st.text(min_size=1, max_size=40)
json_values = any_json(ints=BOUNDED_INTS, floats=FINITE_FLOATS, text_size=12, key_size=6, max_leaves=10)
args_objects = st.dictionaries(st.text(max_size=8), json_values, max_size=4)


@st.composite
def conversations(draw):
    """A valid Gemini body plus what to_chat must keep: texts, calls, and pairings."""
    contents, expect_texts, expect_calls, counter = [], [], [], iter(range(10**6))
    system = draw(st.none() | texts)
    for _ in range(draw(st.integers(1, 4))):
        text = draw(texts)
        contents.append(user(text))
        expect_texts.append(text)
        parts, calls = [], []
        if draw(st.booleans()):
            parts.append({"text": draw(texts), "thought": True})
        if draw(st.booleans()):
            reply = draw(texts)
            parts.append({"text": reply})
            expect_texts.append(reply)
        for _ in range(draw(st.integers(0, 3))):
            fc = {"name": draw(names), "args": draw(args_objects)}
            if draw(st.booleans()):
                fc["id"] = f"fc-{next(counter)}"
            part = {"functionCall": fc}
            if draw(st.booleans()):
                part["thoughtSignature"] = "skip_thought_signature_validator"
            parts.append(part)
            calls.append(fc)
        if not parts:
            continue
        contents.append({"role": "model", "parts": parts})
        expect_calls.append(calls)
        if calls:
            answers = []
            for fc in calls:
                fr = {"name": fc["name"], "response": draw(args_objects)}
                if "id" in fc and draw(st.booleans()):
                    fr["id"] = fc["id"]
                answers.append({"functionResponse": fr})
            if draw(st.booleans()):
                tail = draw(texts)
                answers.append({"text": tail})
                expect_texts.append(tail)
            contents.append({"role": "user", "parts": answers})
    body = {"contents": contents}
    if system is not None:
        body["systemInstruction"] = {"parts": [{"text": system}]}
    return body, system, expect_texts, expect_calls


@settings(max_examples=150, deadline=None)
@given(conversations())
def test_property_to_chat_keeps_everything(case):
    body, system, expect_texts, expect_calls = case
    req = google.to_chat(body, SSE_PATH)
    msgs = req["messages"]
    if system:
        assert msgs[0] == {"role": "system", "content": [{"type": "text", "text": system}]}
        msgs = msgs[1:]
    assert [parts_text(m["content"]) for m in msgs if m["role"] in ("user", "assistant")
            and m["content"]] == expect_texts
    got_calls = [m.get("tool_calls", []) for m in msgs if m["role"] == "assistant"]
    assert [[(c["name"], json.loads(c["arguments"])) for c in calls] for calls in got_calls] == \
        [[(fc["name"], fc["args"]) for fc in calls] for calls in expect_calls]
    for calls, expected in zip(got_calls, expect_calls):
        for c, fc in zip(calls, expected):
            assert c["id"] == fc.get("id", c["id"]) and c["id"]
    # Each tool message follows its assistant turn and answers that turn's calls in order.
    for k, m in enumerate(msgs):
        if m["role"] == "assistant" and m.get("tool_calls"):
            tools = msgs[k + 1:k + 1 + len(m["tool_calls"])]
            assert [t["role"] for t in tools] == ["tool"] * len(m["tool_calls"])
            assert [t["tool_call_id"] for t in tools] == [c["id"] for c in m["tool_calls"]]
    assert google.to_chat(body, SSE_PATH) == req  # derived ids are deterministic


results = st.builds(
    lambda text, calls, reasoning: make_result(text, calls, reasoning=reasoning),
    st.text(max_size=60),
    st.lists(st.builds(lambda name, args, cid: {"name": name, "arguments": json.dumps(args),
                                                "id": cid},
                       names, args_objects, st.none() | st.text(min_size=1, max_size=10)),
             max_size=3, unique_by=lambda c: c["id"] or c["name"]),
    st.none() | texts)


@settings(max_examples=150, deadline=None)
@given(results, st.booleans())
def test_property_from_chat_round_trips(result, include_thoughts):
    body = {"contents": [user("hi")],
            "generationConfig": {"thinkingConfig": {"includeThoughts": include_thoughts}}}
    req = google.to_chat(body, PATH)
    content = google.from_chat(result, req)["candidates"][0]["content"]
    back = google.to_chat({"contents": [user("hi"), content]}, PATH)["messages"]
    if not (result["text"] or result["tool_calls"] or (include_thoughts and result["reasoning"])):
        assert len(back) == 1  # the empty text part carries nothing
        return
    assistant = back[1]
    assert parts_text(assistant["content"]) == result["text"]
    assert [(c["id"], c["name"], json.loads(c["arguments"])) for c in assistant.get("tool_calls", [])] \
        == [(c["id"], c["name"], json.loads(c["arguments"])) for c in result["tool_calls"]]
    assert assistant.get("reasoning") == (result["reasoning"] if include_thoughts else None)
    # Streaming gives the same content, split into chunks.
    for alt in (True, False):
        req["provider"]["alt_sse"] = alt
        raw = b"".join(google.stream(result, req))
        chunks = [json.loads(e[6:]) for e in raw.split(b"\n\n") if e] if alt else json.loads(raw)
        parts = [p for c in chunks for p in c["candidates"][0]["content"]["parts"]]
        assert "".join(p["text"] for p in parts if "text" in p and not p.get("thought")) \
            == result["text"]
        assert [p["functionCall"]["id"] for p in parts if "functionCall" in p] == \
            [c["id"] for c in result["tool_calls"]]


VALID = {"systemInstruction": {"parts": [{"text": "sys"}]},
         "contents": [user("a"),
                      {"role": "model", "parts": [{"text": "t", "thought": True},
                                                  {"functionCall": {"name": "f", "args": {"x": 1}}}]},
                      {"role": "user", "parts": [{"functionResponse": {"name": "f",
                                                                       "response": {"o": 1}}}]}],
         "tools": [{"functionDeclarations": [{"name": "f", "parameters": {
             "type": "OBJECT", "properties": {"x": {"type": "INTEGER"}}}}]}],
         "toolConfig": {"functionCallingConfig": {"mode": "ANY", "allowedFunctionNames": ["f"]}},
         "generationConfig": {"temperature": 1, "topK": 3, "stopSequences": ["s"],
                              "responseMimeType": "application/json",
                              "responseSchema": {"type": "OBJECT"},
                              "thinkingConfig": {"thinkingBudget": 10}}}


ALL_PATHS = list(json_paths(VALID))[1:]


@st.composite
def mutated(draw):
    body = copy.deepcopy(VALID)
    for _ in range(draw(st.integers(1, 3))):
        path = draw(st.sampled_from(ALL_PATHS))
        try:
            parent = parent_of(body, path)
            if draw(st.booleans()) and isinstance(parent, dict):
                parent.pop(path[-1], None)
            else:
                parent[path[-1]] = draw(json_values)
        except (KeyError, IndexError, TypeError):
            pass  # an earlier mutation removed this path
    return body


def _check_total(body, path):
    check_total(google, body, path, answer=make_result("ok", [{"name": "f", "arguments": "{}"}], reasoning="r"),
                error_shape=lambda err, e: "error" in err)


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(mutated(), st.sampled_from([PATH, SSE_PATH, "/v1internal:generateContent"]))
def test_fuzz_mutations(body, path):
    _check_total(body, path)


@settings(max_examples=300, deadline=None)
@given(st.dictionaries(st.sampled_from(["contents", "systemInstruction", "tools", "toolConfig",
                                        "generationConfig", "request", "model", "x"]),
                       json_values, max_size=5)
       | json_values, st.sampled_from([PATH, SSE_PATH, "/nope"]))
def test_fuzz_random_bodies(body, path):
    _check_total(body, path)
