"""OpenAI Responses adapter (what Codex CLI speaks), proven with the official openai SDK."""

import copy
import json

import openai
import pytest
from hypothesis import HealthCheck, given, settings, strategies as st
from openai.types.responses import Response, ResponseStreamEvent
from pydantic import TypeAdapter

from support.adapter_fuzz import check_total, json_values as any_json
from polar_mitm.adapters import AdapterError, UnsupportedContent, detect, openai_responses as R
from polar_mitm.adapters.chat import text_part
from support.provider_server import ProviderServer, make_result, tool_then_text

SHELL = {"type": "function", "name": "shell", "description": "Run a command", "strict": False,
         "parameters": {"type": "object", "properties": {"command": {"type": "array", "items": {"type": "string"}}},
                        "required": ["command"]}}
LARK = "start: begin_patch hunk+ end_patch\nbegin_patch: \"*** Begin Patch\" LF\n"
APPLY_PATCH = {"type": "custom", "name": "apply_patch", "description": "Apply a patch",
               "format": {"type": "grammar", "syntax": "lark", "definition": LARK}}
PATCH = "*** Begin Patch\n*** Add File: a.txt\n+hi\n*** End Patch"
EVENTS = TypeAdapter(ResponseStreamEvent)


def first_tool(req):
    """A call of the first offered tool (a patch for a custom one)."""
    tool = req["tools"][0]
    args = PATCH if tool["kind"] == "custom" else '{"command": ["echo", "hi"]}'
    return {"name": tool["name"], "arguments": args, "kind": tool["kind"]}


@pytest.fixture
def server():
    with ProviderServer(tool_then_text(first_tool, reasoning=("I should run it.", "The tool said hi."))) as s:
        yield s


@pytest.fixture
def client(server):
    return openai.OpenAI(base_url=server.url + "/v1", api_key="sk-test", max_retries=0)


def parse_sse(events):
    """(event name, data) pairs from the adapter's SSE bytes."""
    out = []
    for raw in events:
        head, data = raw.decode().strip("\n").split("\n")
        out.append((head.removeprefix("event: "), json.loads(data.removeprefix("data: "))))
    return out


def test_detect_paths():
    assert detect("POST", "/v1/responses", {}, {}) == "openai_responses"
    assert detect("POST", "/proxy", {}, {"model": "m", "input": "hi"}) == "openai_responses"


# ---- the official SDK against the provider server -------------------------------------------

def test_sdk_plain_text(client, server):
    r = client.responses.create(model="gpt-5-codex", input="hi", instructions="Be brief.")
    assert r.output_text == "It printed hi."
    assert r.model == "gpt-5-codex" and r.status == "completed"
    assert r.id.startswith("resp_")
    assert r.usage.input_tokens == 11 and r.usage.output_tokens == 7 and r.usage.total_tokens == 18
    assert [o.type for o in r.output] == ["reasoning", "message"]
    assert r.output[0].summary[0].text == "The tool said hi."
    assert server.requests[0]["messages"] == [
        {"role": "system", "content": [text_part("Be brief.")]},
        {"role": "user", "content": [text_part("hi")]}]


def test_sdk_stream_events(client):
    events = list(client.responses.create(model="m", input="hi", stream=True))
    types = [e.type for e in events]
    assert types[:2] == ["response.created", "response.in_progress"]
    assert types[-1] == "response.completed"
    assert [e.sequence_number for e in events] == list(range(len(events)))
    assert "".join(e.delta for e in events if e.type == "response.output_text.delta") == "It printed hi."
    assert "".join(e.delta for e in events if e.type == "response.reasoning_summary_text.delta") == \
        "The tool said hi."
    assert events[-1].response.output_text == "It printed hi."
    assert events[-1].response.usage.total_tokens == 18


def test_sdk_stream_helper_final_response(client):
    with client.responses.stream(model="m", input="hi") as s:
        final = s.get_final_response()
    assert final.output_text == "It printed hi."


def test_sdk_function_call(client, server):
    r = client.responses.create(model="m", input="run echo hi", tools=[SHELL])
    call = [o for o in r.output if o.type == "function_call"][0]
    assert call.name == "shell" and json.loads(call.arguments) == {"command": ["echo", "hi"]}
    assert call.call_id.startswith("call_") and call.id == "fc_" + call.call_id.removeprefix("call_")
    assert server.requests[0]["tools"][0]["kind"] == "function"


def test_sdk_function_call_streaming(client):
    events = list(client.responses.create(model="m", input="go", tools=[SHELL], stream=True))
    args = "".join(e.delta for e in events if e.type == "response.function_call_arguments.delta")
    assert json.loads(args) == {"command": ["echo", "hi"]}
    done = [e.item for e in events if e.type == "response.output_item.done" and e.item.type == "function_call"]
    assert done[0].arguments == args and done[0].status == "completed"
    with client.responses.stream(model="m", input="go", tools=[SHELL]) as s:
        final = s.get_final_response()
    assert final.output[-1].type == "function_call" and final.output[-1].call_id == done[0].call_id


def test_sdk_custom_tool_call(client, server):
    r = client.responses.create(model="m", input="patch it", tools=[APPLY_PATCH])
    call = r.output[-1]
    assert call.type == "custom_tool_call" and call.name == "apply_patch" and call.input == PATCH
    assert call.id.startswith("ctc_")
    assert server.requests[0]["tools"][0]["format"] == APPLY_PATCH["format"]


def test_sdk_custom_tool_call_streaming(client):
    events = list(client.responses.create(model="m", input="patch it", tools=[APPLY_PATCH], stream=True))
    assert "".join(e.delta for e in events if e.type == "response.custom_tool_call_input.delta") == PATCH
    assert [e.input for e in events if e.type == "response.custom_tool_call_input.done"] == [PATCH]
    with client.responses.stream(model="m", input="patch it", tools=[APPLY_PATCH]) as s:
        final = s.get_final_response()
    assert final.output[-1].type == "custom_tool_call" and final.output[-1].input == PATCH


def test_sdk_second_turn_replays_the_call(client, server):
    first_input = [{"type": "message", "role": "developer", "content": [{"type": "input_text", "text": "rules"}]},
                   {"role": "user", "content": "run echo hi"}]
    r = client.responses.create(model="m", input=first_input, tools=[SHELL])
    call = r.output[-1]
    second_input = first_input + [o.model_dump(exclude_none=True) for o in r.output] + [
        {"type": "function_call_output", "call_id": call.call_id, "output": "hi\n"}]
    r2 = client.responses.create(model="m", input=second_input, tools=[SHELL])
    assert r2.output_text == "It printed hi."
    first, second = server.requests
    assert second["messages"][:len(first["messages"])] == first["messages"]
    assert second["messages"][len(first["messages"]):] == [
        {"role": "assistant", "content": [], "reasoning": "I should run it.",
         "tool_calls": [{"id": call.call_id, "name": "shell", "arguments": call.arguments, "kind": "function"}]},
        {"role": "tool", "content": [text_part("hi\n")], "tool_call_id": call.call_id,
         "name": "shell", "is_error": False}]


def test_sdk_rejected_request_is_bad_request(client):
    with pytest.raises(openai.BadRequestError) as e:
        client.responses.create(model="m", input="hi", previous_response_id="resp_123")
    assert "previous_response_id" in e.value.message
    assert e.value.body["type"] == "invalid_request_error"


def test_sdk_truncated_answer_is_incomplete():
    with ProviderServer(lambda req: make_result("cut", finish_reason="length")) as s:
        c = openai.OpenAI(base_url=s.url + "/v1", api_key="sk-test", max_retries=0)
        r = c.responses.create(model="m", input="hi")
        assert r.status == "incomplete" and r.incomplete_details.reason == "max_output_tokens"
        events = list(c.responses.create(model="m", input="hi", stream=True))
        assert events[-1].type == "response.incomplete" and events[-1].response.output_text == "cut"


# ---- shapes validated against the SDK's pydantic models ----------------------------------------

def _request(**extra):
    return R.to_chat({"model": "m", "input": "x", "tools": [SHELL, APPLY_PATCH], **extra})


def test_response_and_events_validate_against_sdk_models():
    req = _request(tool_choice={"type": "custom", "name": "apply_patch"}, max_output_tokens=50)
    result = make_result("hello there", [{"name": "shell", "arguments": '{"command": ["ls"]}'},
                                         {"name": "apply_patch", "arguments": PATCH, "kind": "custom"}],
                         reasoning="thinking")
    body = R.from_chat(result, req)
    Response.model_validate(body)
    assert body["tool_choice"] == {"type": "custom", "name": "apply_patch"}
    events = parse_sse(R.stream(result, req))
    for name, data in events:
        assert name == data["type"]
        EVENTS.validate_python(data)
    assert [d["sequence_number"] for _, d in events] == list(range(len(events)))
    assert events[-1][1]["response"] == body  # stream ends with exactly the JSON answer
    assert [d["item"] for _, d in events if d["type"] == "response.output_item.done"] == body["output"]


def test_ids_are_stable():
    req, result = _request(), make_result("a", [{"name": "shell"}])
    assert R.from_chat(result, req) == R.from_chat(copy.deepcopy(result), req)
    assert R.stream(result, req) == R.stream(result, req)


def test_error_shapes():
    assert R.error(400, "bad")["error"] == {"message": "bad", "type": "invalid_request_error",
                                             "param": None, "code": None}
    assert R.error(400, "long", "context_too_long")["error"]["code"] == "context_length_exceeded"
    assert R.error(429, "slow")["error"]["code"] == "rate_limit_exceeded"
    assert R.error(503, "busy")["error"]["type"] == "server_error"


# ---- normalization details ------------------------------------------------------------------

def test_normalization_details():
    req = R.to_chat({
        "model": "m", "input": [{"role": "user", "content": [
            {"type": "input_text", "text": "look"},
            {"type": "input_image", "image_url": "data:image/png;base64,AAAA", "detail": "auto"}]}],
        "max_output_tokens": 99, "temperature": 0.5, "top_p": 0.9, "stream": True,
        "parallel_tool_calls": False, "tools": [SHELL], "tool_choice": {"type": "function", "name": "shell"},
        "text": {"format": {"type": "json_schema", "name": "t", "schema": {"type": "object"}, "strict": True}},
        "reasoning": {"effort": "high", "summary": "auto"}, "metadata": {"a": "1"}, "user": "u",
        "service_tier": "auto", "truncation": "auto", "stream_options": {"include_obfuscation": False}})
    assert req["messages"][0]["content"][1] == {"type": "image", "url": "data:image/png;base64,AAAA"}
    assert (req["max_tokens"], req["temperature"], req["top_p"], req["stream"]) == (99, 0.5, 0.9, True)
    assert req["parallel_tool_calls"] is False and req["tool_choice"] == {"name": "shell"}
    assert req["response_format"] == {"type": "json_schema", "name": "t", "schema": {"type": "object"}}
    assert req["reasoning"] == {"effort": "high", "budget_tokens": None}
    assert req["provider"]["reasoning"] == {"effort": "high", "summary": "auto"}
    assert req["dropped"] == ["metadata", "service_tier", "stream_options", "truncation", "user"]
    assert R.to_chat({"model": "m", "input": "x", "text": {"format": {"type": "json_object"}}}
                     )["response_format"] == {"type": "json_object"}
    for choice in ("auto", "none", "required"):
        assert R.to_chat({"model": "m", "input": "x", "tool_choice": choice})["tool_choice"] == choice


def test_parallel_calls_stay_in_one_assistant_message():
    req = R.to_chat({"model": "m", "input": [
        {"role": "user", "content": "two things"},
        {"type": "reasoning", "id": "rs_1", "summary": [{"type": "summary_text", "text": "both"}]},
        {"type": "message", "role": "assistant", "content": [{"type": "output_text", "text": "On it."}]},
        {"type": "function_call", "call_id": "call_a", "name": "shell", "arguments": "{}"},
        {"type": "function_call", "call_id": "call_b", "name": "shell", "arguments": '{"x": 1}'},
        {"type": "function_call_output", "call_id": "call_a", "output": "A"},
        {"type": "function_call_output", "call_id": "call_b", "output": "B"}]})
    user, assistant, tool_a, tool_b = req["messages"]
    assert assistant["content"] == [text_part("On it.")] and assistant["reasoning"] == "both"
    assert [c["id"] for c in assistant["tool_calls"]] == ["call_a", "call_b"]
    assert (tool_a["tool_call_id"], tool_b["tool_call_id"]) == ("call_a", "call_b")


def test_unsupported_and_malformed_content_names_the_field():
    def fails(items, match, cls=AdapterError):
        with pytest.raises(cls, match=match):
            R.to_chat({"model": "m", "input": items})
    fails([{"role": "user", "content": [{"type": "input_file", "file_id": "f"}]}],
          r"input\[0\]\.content\[0\]\.type", UnsupportedContent)
    fails([{"role": "user", "content": [{"type": "input_image", "file_id": "f"}]}],
          r"input\[0\]\.content\[0\]\.file_id", UnsupportedContent)
    fails([{"role": "user", "content": "a"}, {"role": "user", "content": [{"type": "wat"}]}],
          r"input\[1\]\.content\[0\]\.type")
    fails([{"role": "wizard", "content": "x"}], r"input\[0\]\.role")
    fails([{"type": "function_call", "call_id": 3, "name": "f", "arguments": "{}"}], r"input\[0\]\.call_id")
    fails([{"content": "no role"}], r"input\[0\]")
    with pytest.raises(AdapterError, match="model"):
        R.to_chat({"input": "x"})
    with pytest.raises(AdapterError, match="input"):
        R.to_chat({"model": "m"})


def test_previous_response_id_is_refused_but_null_is_fine():
    with pytest.raises(UnsupportedContent, match="store: false"):
        R.to_chat({"model": "m", "input": "x", "previous_response_id": "resp_1"})
    assert R.to_chat({"model": "m", "input": "x", "previous_response_id": None})["dropped"] == []


def test_unknown_items_are_dropped_and_recorded():
    # Decision: unknown/unreplayable item types are dropped, not refused: Codex resends its
    # whole history, so one old web_search_call must not fail every later turn.
    req = R.to_chat({"model": "m", "input": [
        {"role": "user", "content": "x"},
        {"type": "local_shell_call", "call_id": "c", "status": "completed",
         "action": {"type": "exec", "command": ["ls"]}},
        {"type": "web_search_call", "id": "ws_1", "status": "completed", "action": {"type": "search"}}]})
    assert len(req["messages"]) == 1
    assert "input.local_shell_call" in req["dropped"] and "input.web_search_call" in req["dropped"]


# ---- Codex quirks -------------------------------------------------------------------------

CODEX_BODY = {
    "model": "gpt-5.1-codex", "instructions": None, "stream": True, "store": False,
    "include": ["reasoning.encrypted_content"], "prompt_cache_key": "0b7c-session",
    "client_metadata": {"installation_id": "i", "thread_id": "t"}, "parallel_tool_calls": True,
    "tool_choice": "auto", "reasoning": {"summary": "auto"}, "text": {"verbosity": "low"},
    "input": [
        {"type": "message", "id": "msg_0", "role": "developer",
         "content": [{"type": "input_text", "text": "<permissions>full</permissions>"}]},
        {"type": "message", "id": "msg_1", "role": "user",
         "content": [{"type": "input_text", "text": "say hi"}],
         "internal_chat_message_metadata_passthrough": {"turn": 1}}],
    "tools": [SHELL]}


def test_codex_developer_role_merged_first():
    body = copy.deepcopy(CODEX_BODY)
    body["instructions"] = "You are Codex."
    body["input"].append({"type": "message", "role": "developer",
                          "content": [{"type": "input_text", "text": "late rule"}]})
    req = R.to_chat(body)
    assert req["messages"][0] == {"role": "system", "content": [
        text_part("You are Codex.\n\n<permissions>full</permissions>\n\nlate rule")]}
    assert [m["role"] for m in req["messages"]] == ["system", "user"]


def test_codex_instructions_null():
    req = R.to_chat(CODEX_BODY)
    assert req["messages"][0]["content"] == [text_part("<permissions>full</permissions>")]
    assert req["stream"] is True and req["parallel_tool_calls"] is True
    assert req["reasoning"] == {"effort": None, "budget_tokens": None}


def test_codex_item_ids_and_passthrough_ignored():
    req = R.to_chat(CODEX_BODY)
    assert req["messages"][1] == {"role": "user", "content": [text_part("say hi")]}


def test_codex_custom_tool_with_lark_grammar():
    body = copy.deepcopy(CODEX_BODY)
    body["tools"] = [APPLY_PATCH]
    (tool,) = R.to_chat(body)["tools"]
    assert tool == {"name": "apply_patch", "kind": "custom", "parameters": {},
                    "description": "Apply a patch", "format": APPLY_PATCH["format"]}


def test_codex_additional_tools_item_code_mode():
    body = copy.deepcopy(CODEX_BODY)
    del body["tools"]
    body["input"].insert(0, {"type": "additional_tools", "role": "developer", "tools": [
        {"type": "namespace", "name": "functions", "description": "tools", "tools": [
            {"type": "custom", "name": "exec", "description": "Run JS",
             "format": {"type": "grammar", "syntax": "lark", "definition": "start: /.+/s"}},
            {"type": "function", "name": "wait", "parameters": {"type": "object", "properties": {}}}]},
        {"type": "namespace", "name": "clock", "description": "time", "tools": [
            {"type": "function", "name": "now", "description": "Now"}]}]})
    req = R.to_chat(body)
    assert [(t["name"], t["kind"]) for t in req["tools"]] == [("exec", "custom"), ("wait", "function"),
                                                              ("now", "function")]
    assert req["messages"][-1]["role"] == "user"  # the item is not a message
    # the model's call to a namespaced tool goes back with its namespace
    out = R.from_chat(make_result(tool_calls=[{"name": "exec", "arguments": "text(1)", "kind": "custom"}]), req)
    assert out["output"][0]["namespace"] == "functions" and out["output"][0]["input"] == "text(1)"


def test_codex_configuration_update_ignored():
    body = copy.deepcopy(CODEX_BODY)
    body["input"].append({"type": "configuration_update", "reasoning": {"effort": "low"}})
    body["reasoning"] = {"effort": "low", "context": "all_turns"}
    req = R.to_chat(body)
    assert len(req["messages"]) == 2
    assert "input.configuration_update" in req["dropped"] and "reasoning.context" in req["dropped"]


def test_codex_namespace_tools_flattened():
    body = copy.deepcopy(CODEX_BODY)
    body["tools"].append({"type": "namespace", "name": "multi_agent_v1", "description": "agents", "tools": [
        {"type": "function", "name": "spawn_agent", "description": "Spawn",
         "parameters": {"type": "object", "properties": {"task": {"type": "string"}}}}]})
    req = R.to_chat(body)
    assert [t["name"] for t in req["tools"]] == ["shell", "spawn_agent"]
    assert req["provider"]["namespaces"] == {"spawn_agent": "multi_agent_v1"}


def test_codex_hosted_web_search_dropped_and_recorded():
    body = copy.deepcopy(CODEX_BODY)
    body["tools"].append({"type": "web_search", "external_web_access": True})
    req = R.to_chat(body)
    assert [t["name"] for t in req["tools"]] == ["shell"]
    assert "tools.web_search" in req["dropped"]


def test_codex_client_fields_recorded_as_dropped():
    req = R.to_chat(CODEX_BODY)
    for field in ("store", "include", "prompt_cache_key", "client_metadata", "text.verbosity"):
        assert field in req["dropped"]


def test_codex_custom_tool_call_output_array():
    body = copy.deepcopy(CODEX_BODY)
    body["input"] += [
        {"type": "custom_tool_call", "id": "ctc_1", "status": "completed", "call_id": "call_x",
         "name": "exec", "input": "const r = await tools.exec_command({cmd: 'echo hi'}); text(r);"},
        {"type": "custom_tool_call_output", "call_id": "call_x",
         "output": [{"type": "input_text", "text": "Script completed\n"}, {"type": "input_text", "text": "hi\n"}]}]
    assistant, tool = R.to_chat(body)["messages"][-2:]
    assert assistant["tool_calls"] == [{"id": "call_x", "name": "exec", "kind": "custom",
                                        "arguments": "const r = await tools.exec_command({cmd: 'echo hi'}); text(r);"}]
    assert tool == {"role": "tool", "content": [text_part("Script completed\n"), text_part("hi\n")],
                    "tool_call_id": "call_x", "name": "exec", "is_error": False}


def test_codex_reasoning_with_encrypted_content():
    body = copy.deepcopy(CODEX_BODY)
    body["input"] += [
        {"type": "reasoning", "id": "rs_1", "summary": [{"type": "summary_text", "text": "**Plan**"}],
         "encrypted_content": "gAAAAB..."},
        {"type": "function_call", "id": "fc_1", "call_id": "call_1", "name": "shell",
         "arguments": '{"command":["ls"]}'},
        {"type": "reasoning", "id": "rs_2", "summary": [], "content": None, "encrypted_content": "gAAAAC..."}]
    req = R.to_chat(body)
    assistant = req["messages"][-1]
    assert assistant["reasoning"] == "**Plan**" and assistant["tool_calls"][0]["id"] == "call_1"
    assert "input.reasoning.encrypted_content" in req["dropped"]
    assert "gAAAA" not in json.dumps(req)


# ---- properties -------------------------------------------------------------------------

ids = st.text("abcdefghijklmnopqrstuvwxyz0123456789_-", min_size=1, max_size=12)
texts = st.text(max_size=40)
json_values = any_json(ints=st.integers(), floats=st.floats(allow_nan=False), text_size=8, key_size=8,
                       max_leaves=10)


@st.composite
def conversations(draw):
    """(Responses body, the non-system messages to_chat must produce, the system text)."""
    instructions = draw(st.none() | texts)
    system = [instructions] if instructions else []
    items, expected = [], []
    if draw(st.booleans()):
        dev = draw(texts)
        items.append({"type": "message", "role": "developer", "content": [{"type": "input_text", "text": dev}]})
        system += [dev] if dev else []
    for turn in range(draw(st.integers(1, 4))):
        user = draw(texts)
        if draw(st.booleans()):
            items.append({"role": "user", "content": user})
            expected.append({"role": "user", "content": [text_part(user)] if user else []})
        else:
            items.append({"type": "message", "role": "user", "content": [{"type": "input_text", "text": user}]})
            expected.append({"role": "user", "content": [text_part(user)]})
        reasoning, text = draw(texts), draw(texts)
        calls = []
        for i in range(draw(st.integers(0, 3))):
            call_id = f"call_{draw(ids)}_{turn}_{i}"
            if draw(st.booleans()):
                calls.append({"id": call_id, "name": draw(ids), "kind": "function",
                              "arguments": json.dumps(draw(st.dictionaries(ids, json_values, max_size=3)))})
            else:
                calls.append({"id": call_id, "name": draw(ids), "kind": "custom", "arguments": draw(texts)})
        assistant = {"role": "assistant", "content": []}
        if reasoning:
            items.append({"type": "reasoning", "id": f"rs_{turn}", "summary": [{"type": "summary_text", "text": reasoning}],
                          **({"encrypted_content": "gAAA"} if draw(st.booleans()) else {})})
            assistant["reasoning"] = reasoning
        if text:
            items.append({"type": "message", "role": "assistant", "content": [{"type": "output_text", "text": text}]})
            assistant["content"] = [text_part(text)]
        for c in calls:
            if c["kind"] == "function":
                items.append({"type": "function_call", "call_id": c["id"], "name": c["name"], "arguments": c["arguments"]})
            else:
                items.append({"type": "custom_tool_call", "call_id": c["id"], "name": c["name"], "input": c["arguments"]})
        if calls:
            assistant["tool_calls"] = calls
        if reasoning or text or calls:
            expected.append(assistant)
        for c in calls:
            out = draw(texts)
            as_array = c["kind"] == "custom" and draw(st.booleans())
            items.append({"type": f"{'custom_tool_call' if c['kind'] == 'custom' else 'function_call'}_output",
                          "call_id": c["id"], "output": [{"type": "input_text", "text": out}] if as_array else out})
            expected.append({"role": "tool", "content": [text_part(out)], "tool_call_id": c["id"],
                             "name": c["name"], "is_error": False})
    return {"model": "m", "instructions": instructions, "input": items}, expected, "\n\n".join(system)


@given(conversations())
@settings(max_examples=150, suppress_health_check=[HealthCheck.too_slow])
def test_to_chat_keeps_every_text_and_call(case):
    body, expected, system = case
    req = R.to_chat(body)
    messages = req["messages"]
    if system:
        assert messages[0] == {"role": "system", "content": [text_part(system)]}
        messages = messages[1:]
    assert messages == expected


@given(texts, st.none() | texts.filter(bool),
       st.lists(st.tuples(ids, st.booleans(), st.dictionaries(ids, json_values, max_size=3), texts), max_size=3))
@settings(max_examples=150)
def test_from_chat_output_roundtrips_through_to_chat(text, reasoning, calls):
    result = make_result(text, [{"name": n, "kind": "function", "arguments": json.dumps(a)} if fn else
                                {"name": n, "kind": "custom", "arguments": raw}
                                for n, fn, a, raw in calls], reasoning=reasoning)
    req = R.to_chat({"model": "m", "input": "x"})
    body = R.from_chat(result, req)
    streamed = parse_sse(R.stream(result, req))
    assert streamed[-1][1]["response"] == body
    outputs = [{"type": f"{'custom_tool_call' if c['kind'] == 'custom' else 'function_call'}_output",
                "call_id": c["id"], "output": "ok"} for c in result["tool_calls"]]
    back = R.to_chat({"model": "m", "input": [{"role": "user", "content": "x"}] + body["output"] + outputs})
    if not (text or reasoning or calls):
        assert len(back["messages"]) == 1
        return
    assistant = back["messages"][1]
    assert "".join(p["text"] for p in assistant["content"]) == text
    assert assistant.get("reasoning") == reasoning
    assert assistant.get("tool_calls", []) == result["tool_calls"]
    assert [m["tool_call_id"] for m in back["messages"][2:]] == [c["id"] for c in result["tool_calls"]]


def _valid_body():
    return {"model": "m", "instructions": "sys", "input": [
        {"role": "user", "content": [{"type": "input_text", "text": "hi"}]},
        {"type": "reasoning", "summary": [{"type": "summary_text", "text": "r"}]},
        {"type": "function_call", "call_id": "c", "name": "shell", "arguments": "{}"},
        {"type": "function_call_output", "call_id": "c", "output": "ok"},
        {"type": "custom_tool_call", "call_id": "d", "name": "apply_patch", "input": "x"},
        {"type": "custom_tool_call_output", "call_id": "d", "output": [{"type": "input_text", "text": "ok"}]}],
        "tools": [SHELL, APPLY_PATCH, {"type": "namespace", "name": "n", "tools": [SHELL]}],
        "tool_choice": "auto", "text": {"format": {"type": "text"}}, "reasoning": {"effort": "low"}}


@given(json_values)
def test_fuzz_random_bodies_never_crash(body):
    _assert_clean(body)


_TOP = ["model", "input", "instructions", "tools", "tool_choice", "text", "reasoning", "stream",
        "max_output_tokens", "temperature", "parallel_tool_calls", "previous_response_id"]
_ITEM_KEYS = ["type", "role", "content", "call_id", "name", "arguments", "input", "output",
              "summary", "encrypted_content", "tools"]


@given(st.lists(st.tuples(st.sampled_from(_TOP), json_values), max_size=3),
       st.integers(0, 6), st.sampled_from(_ITEM_KEYS), json_values,
       st.integers(0, 3), st.sampled_from(["type", "name", "parameters", "format", "tools", "description"]),
       json_values, st.sampled_from([0, 1, 5]), st.sampled_from(["type", "text", "image_url", "file_id"]),
       json_values)
@settings(max_examples=300)
def test_fuzz_mutated_bodies_never_crash(top_level, item_index, item_key, item_value, tool_index, tool_key,
                                         tool_value, part_item, part_key, part_value):
    body = _valid_body()
    items, tools = body["input"], body["tools"]
    part_holder = items[part_item]["content" if part_item == 0 else ("summary" if part_item == 1 else "output")]
    part_holder[0][part_key] = part_value
    if item_index < len(items):
        items[item_index][item_key] = item_value
    else:
        items.append(item_value)
    if tool_index < len(tools):
        tools[tool_index][tool_key] = tool_value
    for key, value in top_level:
        body[key] = value
    _assert_clean(body)


def _assert_clean(body):
    check_total(R, body, answer=make_result("ok", [{"name": "shell"}]),
                error_shape=lambda err, e: err["error"]["type"] == "invalid_request_error" and err["error"]["message"])
