"""OpenAI Chat Completions adapter, proven with the official openai SDK."""

import json

import openai
import pytest
from hypothesis import HealthCheck, given, settings, strategies as st

from support.adapter_fuzz import check_total, json_values as any_json
from polar_mitm.adapters import AdapterError, detect, openai_chat
from support.provider_server import ProviderServer, make_result, tool_then_text

TOOLS = [{"type": "function", "function": {
    "name": "run_shell_command", "description": "Run a shell command",
    "parameters": {"type": "object", "properties": {"command": {"type": "string"}},
                   "required": ["command"]}}}]


@pytest.fixture
def server():
    shell = {"name": "run_shell_command", "arguments": '{"command": "echo hi"}'}
    with ProviderServer(tool_then_text(lambda req: shell)) as s:
        yield s


@pytest.fixture
def client(server):
    return openai.OpenAI(base_url=server.url + "/v1", api_key="sk-test", max_retries=0)


def test_detect_paths():
    assert detect("POST", "/v1/chat/completions", {}, {}) == "openai_chat"
    assert detect("POST", "/chat/completions", {}, {}) == "openai_chat"
    assert detect("POST", "/compatible-mode/v1/chat/completions?x=1", {}, {}) == "openai_chat"
    assert detect("GET", "/v1/chat/completions", {}, {}) is None
    # unknown path: body shape decides
    assert detect("POST", "/proxy", {}, {"model": "m", "messages": []}) == "openai_chat"


def test_sdk_plain_text(client, server):
    r = client.chat.completions.create(model="qwen3-coder-plus",
                                       messages=[{"role": "user", "content": "hi"}])
    assert r.choices[0].message.content == "It printed hi."
    assert r.model == "qwen3-coder-plus"  # the name the client asked for
    assert r.usage.prompt_tokens == 11 and r.usage.completion_tokens == 7
    assert server.requests[0]["messages"] == [{"role": "user", "content": [{"type": "text", "text": "hi"}]}]


def test_sdk_stream_text(client):
    chunks = list(client.chat.completions.create(
        model="m", stream=True, stream_options={"include_usage": True},
        messages=[{"role": "user", "content": "hi"}]))
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == "It printed hi."
    assert chunks[-1].usage.total_tokens == 18
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "stop"


def test_sdk_tool_call_and_second_turn(client, server):
    messages = [{"role": "developer", "content": "You are a coding agent."},
                {"role": "user", "content": "Run echo hi"}]
    r = client.chat.completions.create(model="m", messages=messages, tools=TOOLS)
    call = r.choices[0].message.tool_calls[0]
    assert r.choices[0].finish_reason == "tool_calls"
    assert call.id.startswith("call_") and call.function.name == "run_shell_command"
    assert json.loads(call.function.arguments) == {"command": "echo hi"}

    messages2 = messages + [r.choices[0].message.model_dump(exclude_none=True),
                            {"role": "tool", "tool_call_id": call.id,
                             "content": [{"type": "text", "text": "hi\n"}]}]  # Qwen sends an array
    r2 = client.chat.completions.create(model="m", messages=messages2, tools=TOOLS)
    assert r2.choices[0].message.content == "It printed hi."
    first, second = server.requests
    assert first["messages"][0] == {"role": "system", "content": [{"type": "text", "text": "You are a coding agent."}]}
    assert second["messages"][:len(first["messages"])] == first["messages"]
    assistant, tool = second["messages"][len(first["messages"]):]
    assert assistant["tool_calls"] == [{"id": call.id, "name": "run_shell_command",
                                        "arguments": call.function.arguments, "kind": "function"}]
    assert tool == {"role": "tool", "content": [{"type": "text", "text": "hi\n"}],
                    "tool_call_id": call.id, "name": None, "is_error": False}


def test_sdk_stream_tool_call(client):
    stream = client.chat.completions.create(model="m", messages=[{"role": "user", "content": "go"}],
                                            tools=TOOLS, stream=True)
    calls = {}
    for chunk in stream:
        for d in chunk.choices[0].delta.tool_calls or []:
            entry = calls.setdefault(d.index, {"id": None, "name": None, "args": ""})
            entry["id"] = d.id or entry["id"]
            entry["name"] = (d.function.name if d.function and d.function.name else entry["name"])
            entry["args"] += (d.function.arguments or "") if d.function else ""
    assert calls[0]["name"] == "run_shell_command"
    assert json.loads(calls[0]["args"]) == {"command": "echo hi"}


def test_sdk_stream_helper_accumulates(client):
    with client.chat.completions.stream(model="m", messages=[{"role": "user", "content": "go"}],
                                        tools=TOOLS) as s:
        final = s.get_final_completion()
    assert final.choices[0].message.tool_calls[0].function.name == "run_shell_command"


def test_sdk_bad_request_is_provider_error(client):
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(model="m", messages=[{"role": "wizard", "content": "x"}])
    assert "messages[0].role" in e.value.message
    assert e.value.body["type"] == "invalid_request_error"


def test_normalization_details():
    req = openai_chat.to_chat({
        "model": "m", "max_completion_tokens": 99, "temperature": 0.5, "stop": "END",
        "store": False, "metadata": {"a": 1}, "stream_options": {"include_usage": True},
        "response_format": {"type": "json_schema", "json_schema": {"name": "t", "schema": {"type": "object"}}},
        "tool_choice": {"type": "function", "function": {"name": "x"}},
        "messages": [{"role": "system", "content": "a"}, {"role": "user", "content": [
            {"type": "text", "text": "look"},
            {"type": "image_url", "image_url": {"url": "data:image/png;base64,AAAA"}}]},
            {"role": "system", "content": "b"}]})
    assert req["messages"][0]["content"][0]["text"] == "a\n\nb"  # system merged first
    assert req["messages"][1]["content"][1] == {"type": "image", "url": "data:image/png;base64,AAAA"}
    assert (req["max_tokens"], req["temperature"], req["stop"]) == (99, 0.5, ["END"])
    assert req["tool_choice"] == {"name": "x"}
    assert req["response_format"] == {"type": "json_schema", "name": "t", "schema": {"type": "object"}}
    assert req["dropped"] == ["metadata", "store", "stream_options"]


def test_audio_is_rejected_clearly():
    with pytest.raises(AdapterError, match="input_audio"):
        openai_chat.to_chat({"model": "m", "messages": [
            {"role": "user", "content": [{"type": "input_audio", "input_audio": {}}]}]})


# ---- properties -------------------------------------------------------------------------

ids = st.text("abcdefghijklmnopqrstuvwxyz0123456789_", min_size=1, max_size=12)
texts = st.text(max_size=40)
json_values = any_json(ints=st.integers(), text_size=8, key_size=5, max_leaves=8)


@st.composite
def conversations(draw):
    msgs = [{"role": "system", "content": draw(texts)}]
    for _ in range(draw(st.integers(1, 4))):
        msgs.append({"role": "user", "content": draw(texts)})
        calls = [{"id": "call_" + draw(ids) + str(i), "type": "function",
                  "function": {"name": draw(ids), "arguments": json.dumps(draw(st.dictionaries(ids, json_values, max_size=3)))}}
                 for i in range(draw(st.integers(0, 2)))]
        msgs.append({"role": "assistant", "content": draw(texts) or None, **({"tool_calls": calls} if calls else {})})
        for c in calls:
            msgs.append({"role": "tool", "tool_call_id": c["id"], "content": draw(texts)})
    return msgs


@given(conversations())
@settings(max_examples=150, suppress_health_check=[HealthCheck.too_slow])
def test_roundtrip_keeps_messages_and_calls(messages):
    req = openai_chat.to_chat({"model": "m", "messages": messages})
    non_system = [m for m in messages if m["role"] != "system"]
    out = req["messages"][1:] if req["messages"][0]["role"] == "system" else req["messages"]
    assert len(out) == len(non_system)
    for src, got in zip(non_system, out):
        assert got["role"] == src["role"]
        assert "".join(p["text"] for p in got["content"]) == (src["content"] or "")
        for c_src, c_got in zip(src.get("tool_calls", []), got.get("tool_calls", [])):
            assert c_got["id"] == c_src["id"] and c_got["name"] == c_src["function"]["name"]
            assert json.loads(c_got["arguments"]) == json.loads(c_src["function"]["arguments"])
        assert len(src.get("tool_calls", [])) == len(got.get("tool_calls", []))
        if src["role"] == "tool":
            assert got["tool_call_id"] == src["tool_call_id"]


@given(texts, st.lists(st.tuples(ids, st.dictionaries(ids, json_values, max_size=3)), max_size=3))
def test_from_chat_roundtrips_through_to_chat(text, calls):
    result = make_result(text, [{"name": n, "arguments": json.dumps(a)} for n, a in calls])
    req = openai_chat.to_chat({"model": "m", "messages": [{"role": "user", "content": "x"}]})
    message = openai_chat.from_chat(result, req)["choices"][0]["message"]
    back = openai_chat.to_chat({"model": "m", "messages": [{"role": "user", "content": "x"}, message]})
    assistant = back["messages"][-1]
    assert "".join(p["text"] for p in assistant["content"]) == text
    assert [(c["id"], c["name"], json.loads(c["arguments"])) for c in assistant.get("tool_calls", [])] == \
        [(c["id"], c["name"], json.loads(c["arguments"])) for c in result["tool_calls"]]


def _valid_body():
    return {"model": "m", "messages": [{"role": "user", "content": "hi"},
                                       {"role": "assistant", "tool_calls": [{"id": "c", "type": "function", "function": {"name": "f", "arguments": "{}"}}]},
                                       {"role": "tool", "tool_call_id": "c", "content": "ok"}],
            "tools": TOOLS, "stop": ["x"]}


@given(json_values)
def test_fuzz_random_bodies_never_crash(body):
    _assert_clean(body)


@given(st.lists(st.tuples(st.sampled_from(["model", "messages", "tools", "stop", "tool_choice", "temperature", "max_tokens", "response_format"]), json_values), max_size=3),
       st.integers(0, 2), json_values)
def test_fuzz_mutated_bodies_never_crash(top_level, msg_index, msg_value):
    body = _valid_body()
    for key, value in top_level:
        body[key] = value
    if isinstance(body.get("messages"), list) and msg_index < len(body["messages"]):
        body["messages"][msg_index] = msg_value
    _assert_clean(body)


def _assert_clean(body):
    check_total(openai_chat, body, answer=make_result("ok"),
                error_shape=lambda err, e: err["error"]["type"] == "invalid_request_error" and err["error"]["message"])


def test_error_shapes():
    assert openai_chat.error(503, "busy")["error"]["type"] == "server_error"
    assert openai_chat.error(400, "too long", "context_too_long")["error"]["code"] == "context_length_exceeded"


def test_detect_leaves_other_endpoints_alone():
    h = {"x-goog-api-key": "k", "anthropic-version": "2023-06-01"}
    assert detect("POST", "/v1beta/models/m:countTokens", h, {"contents": []}) is None
    assert detect("POST", "/v1beta/models/m:embedContent", h, {"contents": []}) is None
    assert detect("POST", "/v1/messages/count_tokens?beta=true", h, {"messages": []}) is None
    assert detect("POST", "/v1/completions", {}, {"model": "m", "prompt": "x", "messages": []}) is None
    assert detect("POST", "/gateway/anthropic", h, {"model": "m", "messages": []}) == "anthropic"
