"""Anthropic Messages adapter, proven with the official anthropic SDK."""

import copy
import json

import anthropic
import httpx
import orjson
import pytest
from hypothesis import HealthCheck, given, settings, strategies as st

from support.adapter_fuzz import BOUNDED_INTS, FINITE_FLOATS, check_total, json_paths, json_values, parent_of
from polar_mitm.adapters import AdapterError, UnsupportedContent, adapter as adapter_of, anthropic as adapter, detect
from polar_mitm.adapters.chat import parts_text, suffix_of
from support.provider_server import ProviderServer, make_result, tool_then_text

BASH = {"name": "Bash", "description": "Run a shell command",
        "input_schema": {"type": "object", "properties": {"command": {"type": "string"}},
                         "required": ["command"]}}
BILLING = "x-anthropic-billing-header: cc_version=2.1.197.a1b; cc_entrypoint=sdk-cli; cch={};"


@pytest.fixture
def server():
    with ProviderServer(tool_then_text(lambda req: {"name": "Bash", "arguments": '{"command": "echo hi"}'})) as s:
        yield s


@pytest.fixture
def client(server):
    return anthropic.Anthropic(base_url=server.url, api_key="sk-ant-test", max_retries=0)


def body(**extra):
    return {"model": "claude-opus-4-8", "max_tokens": 1024,
            "messages": [{"role": "user", "content": "hi"}], **extra}


def claude_code_body(cch="0a1b2", messages=None):
    """The main request as Claude Code 2.1 sends it (trimmed)."""
    return {
        "model": "claude-opus-4-8", "max_tokens": 64000, "stream": True,
        "system": [{"type": "text", "text": BILLING.format(cch)},
                   {"type": "text", "text": "You are Claude Code.",
                    "cache_control": {"type": "ephemeral"}}],
        "messages": messages or [
            {"role": "system", "content": "Available agent types: general-purpose."},
            {"role": "user", "content": [{"type": "text", "text": "Run echo hi",
                                          "cache_control": {"type": "ephemeral"}}]}],
        "tools": [BASH],
        "thinking": {"type": "adaptive"}, "output_config": {"effort": "high"},
        "context_management": {"edits": [{"type": "clear_thinking_20251015", "keep": "all"}]},
        "metadata": {"user_id": '{"device_id": "d", "session_id": "s"}'},
    }


# ---- the official SDK against the provider server -------------------------------------

def test_sdk_plain_text(client, server):
    r = client.messages.create(model="claude-sonnet-4-5", max_tokens=100,
                               messages=[{"role": "user", "content": "hi"}])
    assert r.content[0].type == "text" and r.content[0].text == "It printed hi."
    assert r.model == "claude-sonnet-4-5"  # the name the client asked for
    assert r.id.startswith("msg_") and r.stop_reason == "end_turn" and r.stop_sequence is None
    assert r.usage.input_tokens == 11 and r.usage.output_tokens == 7
    assert server.requests[0]["messages"] == [{"role": "user", "content": [{"type": "text", "text": "hi"}]}]
    assert server.requests[0]["max_tokens"] == 100


def test_sdk_stream_helper(client):
    with client.messages.stream(model="m", max_tokens=100,
                                messages=[{"role": "user", "content": "hi"}]) as s:
        text = "".join(s.text_stream)
        final = s.get_final_message()
    assert text == "It printed hi."
    assert final.content[0].text == "It printed hi." and final.stop_reason == "end_turn"
    assert final.usage.input_tokens == 11 and final.usage.output_tokens == 7


def test_sdk_raw_stream_events(client):
    events = list(client.messages.create(model="m", max_tokens=100, stream=True,
                                         messages=[{"role": "user", "content": "hi"}]))
    kinds = [e.type for e in events]
    assert kinds[0] == "message_start" and kinds[-2:] == ["message_delta", "message_stop"]
    assert kinds[1:4] == ["content_block_start", "content_block_delta", "content_block_stop"]
    assert events[0].message.usage.output_tokens == 1
    assert "".join(e.delta.text for e in events if e.type == "content_block_delta") == "It printed hi."
    assert events[-2].delta.stop_reason == "end_turn" and events[-2].usage.output_tokens == 7


def _check_tool_use(block):
    assert block.type == "tool_use" and block.id.startswith("toolu_")
    assert block.name == "Bash" and block.input == {"command": "echo hi"}


def test_sdk_tool_call(client):
    r = client.messages.create(model="m", max_tokens=100, tools=[BASH],
                               messages=[{"role": "user", "content": "Run echo hi"}])
    assert r.stop_reason == "tool_use"
    assert [b.type for b in r.content] == ["tool_use"]
    _check_tool_use(r.content[0])


def test_sdk_tool_call_streaming(client):
    with client.messages.stream(model="m", max_tokens=100, tools=[BASH],
                                messages=[{"role": "user", "content": "Run echo hi"}]) as s:
        final = s.get_final_message()
    assert final.stop_reason == "tool_use"
    _check_tool_use(final.content[0])


def test_sdk_second_turn_extends_the_first(client, server):
    messages = [{"role": "user", "content": [{"type": "text", "text": "Run echo hi",
                                              "cache_control": {"type": "ephemeral"}}]}]
    r = client.messages.create(model="m", max_tokens=100, tools=[BASH], system="Be brief.",
                               messages=messages)
    call = r.content[0]
    # Claude Code moves the cache_control marker to the newest message.
    messages2 = [{"role": "user", "content": [{"type": "text", "text": "Run echo hi"}]},
                 {"role": "assistant", "content": [b.model_dump() for b in r.content]},
                 {"role": "user", "content": [{"type": "tool_result", "tool_use_id": call.id,
                                               "content": "hi\n", "is_error": False,
                                               "cache_control": {"type": "ephemeral"}}]}]
    r2 = client.messages.create(model="m", max_tokens=100, tools=[BASH], system="Be brief.",
                                messages=messages2)
    assert r2.content[0].text == "It printed hi."
    first, second = server.requests
    n = len(first["messages"])
    assert second["messages"][:n] == first["messages"]
    assistant, tool = second["messages"][n:]
    assert assistant == {"role": "assistant", "content": [], "tool_calls": [
        {"id": call.id, "name": "Bash", "arguments": assistant["tool_calls"][0]["arguments"],
         "kind": "function"}]}
    assert json.loads(assistant["tool_calls"][0]["arguments"]) == call.input
    assert tool == {"role": "tool", "content": [{"type": "text", "text": "hi\n"}],
                    "tool_call_id": call.id, "name": "Bash", "is_error": False}


def test_sdk_sees_bad_request(client):
    with pytest.raises(anthropic.BadRequestError) as e:
        client.messages.create(model="m", max_tokens=100,
                               messages=[{"role": "user", "content": [{"type": "foo"}]}])
    assert e.value.status_code == 400
    assert e.value.body["error"] == {
        "type": "invalid_request_error",
        "message": "messages[0].content[0].type: unknown block type 'foo'"}


def test_raw_post_missing_max_tokens(server):
    r = httpx.post(server.url + "/v1/messages?beta=true",
                   json={"model": "m", "messages": [{"role": "user", "content": "hi"}]})
    assert r.status_code == 400
    assert r.json() == {"type": "error", "error": {"type": "invalid_request_error",
                                                   "message": "max_tokens: an integer is required"}}


def test_sdk_thinking_round_trip(server):
    server.responder = lambda req: make_result("Done.", reasoning="Let me think.")
    client = anthropic.Anthropic(base_url=server.url, api_key="sk-ant-test", max_retries=0)
    kw = dict(model="m", max_tokens=2000, messages=[{"role": "user", "content": "hi"}])
    r = client.messages.create(thinking={"type": "enabled", "budget_tokens": 1024}, **kw)
    assert [b.type for b in r.content] == ["thinking", "text"]
    assert r.content[0].thinking == "Let me think." and r.content[0].signature
    with client.messages.stream(thinking={"type": "adaptive"}, **kw) as s:
        final = s.get_final_message()
    assert final.content[0].thinking == "Let me think." and final.content[0].signature
    # Without thinking asked for, the reasoning stays out of the answer.
    assert [b.type for b in client.messages.create(**kw).content] == ["text"]


# ---- response and error shapes --------------------------------------------------------

def test_stop_reasons():
    req = adapter.to_chat(body(stop_sequences=["END"]))
    for finish, reason in [("stop", "end_turn"), ("length", "max_tokens"),
                           ("content_filter", "refusal")]:
        assert adapter.from_chat(make_result("x", finish_reason=finish), req)["stop_reason"] == reason
    result = make_result("x") | {"stop_sequence": "END"}
    out = adapter.from_chat(result, req)
    assert (out["stop_reason"], out["stop_sequence"]) == ("stop_sequence", "END")
    assert b'"stop_sequence":"END"' in adapter.stream(result, req)[-2]


def test_empty_answer_has_one_empty_text_block():
    out = adapter.from_chat(make_result(""), adapter.to_chat(body()))
    assert out["content"] == [{"type": "text", "text": ""}]
    assert anthropic.types.Message.model_validate(out).content[0].text == ""


def test_stream_events_all_named():
    req = adapter.to_chat(body(thinking={"type": "enabled", "budget_tokens": 2000}))
    result = make_result("Reading it.", [{"name": "Read", "arguments": '{"file_path": "/a"}'}],
                         reasoning="Let me look.")
    events = [e.decode() for e in adapter.stream(result, req)]
    for e in events:
        head, data = e.split("\n", 1)
        assert head.startswith("event: ") and data.startswith("data: ") and e.endswith("\n\n")
        assert json.loads(data[6:])["type"] == head[7:]
    kinds = [e.split("\n", 1)[0][7:] for e in events]
    assert kinds == ["message_start", "ping",
                     "content_block_start", "content_block_delta", "content_block_delta",
                     "content_block_stop",
                     "content_block_start", "content_block_delta", "content_block_stop",
                     "content_block_start", "content_block_delta", "content_block_stop",
                     "message_delta", "message_stop"]
    assert '"signature_delta"' in events[4] and '"input":{}' in events[9]


def test_errors():
    assert adapter.error(400, "prompt is too long", "context_too_long") == {
        "type": "error", "error": {"type": "invalid_request_error", "message": "prompt is too long"}}
    assert adapter.error(529, "Overloaded")["error"]["type"] == "overloaded_error"
    assert adapter.error(503, "busy", "overloaded")["error"]["type"] == "overloaded_error"
    assert adapter.error(502, "boom")["error"]["type"] == "api_error"
    assert adapter.error(504, "slow")["error"]["type"] == "timeout_error"
    assert adapter.error(404, "no model")["error"]["type"] == "not_found_error"
    assert adapter.error(401, "key")["error"]["type"] == "authentication_error"
    assert adapter.error(429, "slow down")["error"]["type"] == "rate_limit_error"
    # Anthropic clients retry 529 (overloaded); the other providers use 503.
    assert adapter_of("anthropic").OVERLOADED_STATUS == adapter.OVERLOADED_STATUS == 529
    assert {adapter_of(s).OVERLOADED_STATUS for s in ("openai_chat", "openai_responses", "google")} == {503}


@pytest.mark.parametrize("mutate, message", [
    (lambda b: b.pop("model"), "model:"),
    (lambda b: b.pop("messages"), "messages:"),
    (lambda b: b.update(max_tokens="10"), "max_tokens:"),
    (lambda b: b["messages"].append({"role": "robot", "content": "x"}), "messages[1].role"),
    (lambda b: b["messages"].append({"role": "assistant", "content": [{"type": "tool_use", "id": 1}]}),
     "messages[1].content[0].id"),
    (lambda b: b.update(system=[{"type": "image"}]), "system[0].type"),
    (lambda b: b.update(tools=[{"name": "x"}]), "tools[0].input_schema"),
    (lambda b: b.update(tool_choice={"type": "maybe"}), "tool_choice.type"),
    (lambda b: b.update(thinking={"type": "enabled"}), "thinking.budget_tokens"),
    (lambda b: b.update(stop_sequences="END"), "stop_sequences"),
])
def test_malformed_names_the_field(mutate, message):
    b = body()
    mutate(b)
    with pytest.raises(AdapterError, match=message.replace("[", r"\[").replace("]", r"\]")):
        adapter.to_chat(b)


def test_unsupported_content():
    doc = {"type": "document", "source": {"type": "base64", "media_type": "application/pdf", "data": "x"}}
    file_image = {"type": "image", "source": {"type": "file", "file_id": "file_1"}}
    for block in (doc, file_image):
        with pytest.raises(UnsupportedContent, match=r"messages\[0\].content\[0\]"):
            adapter.to_chat(body(messages=[{"role": "user", "content": [block]}]))


def test_images():
    blocks = [{"type": "image", "source": {"type": "base64", "media_type": "image/png", "data": "iVBO"}},
              {"type": "image", "source": {"type": "url", "url": "https://x/a.png"}},
              {"type": "text", "text": "What is this?"}]
    req = adapter.to_chat(body(messages=[{"role": "user", "content": blocks}]))
    assert req["messages"][0]["content"] == [{"type": "image", "url": "data:image/png;base64,iVBO"},
                                             {"type": "image", "url": "https://x/a.png"},
                                             {"type": "text", "text": "What is this?"}]


def test_tool_result_image_is_dropped_with_a_marker():
    # Claude Code's Read tool returns images inside tool results; failing would end the session.
    img = {"type": "image", "source": {"type": "base64", "media_type": "image/png", "data": "iVBO"}}
    req = adapter.to_chat(body(messages=[
        {"role": "assistant", "content": [{"type": "tool_use", "id": "toolu_1", "name": "Read", "input": {}}]},
        {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "toolu_1",
                                      "content": [{"type": "text", "text": "a.png:"}, img]}]}]))
    tool = req["messages"][1]
    assert tool["role"] == "tool" and tool["content"][0]["text"].startswith("a.png:\n[image omitted")
    assert "tool_result.image" in req["dropped"]


def test_tool_results_come_before_user_text():
    req = adapter.to_chat(body(messages=[
        {"role": "assistant", "content": [{"type": "text", "text": "Running both."},
                                          {"type": "tool_use", "id": "toolu_a", "name": "Bash", "input": {"command": "a"}},
                                          {"type": "tool_use", "id": "toolu_b", "name": "Bash", "input": {"command": "b"}}]},
        {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "toolu_a", "content": "A"},
                                     {"type": "tool_result", "tool_use_id": "toolu_b", "content": "B"},
                                     {"type": "text", "text": "and then?"}]}]))
    assert [(m["role"], m.get("tool_call_id")) for m in req["messages"]] == [
        ("assistant", None), ("tool", "toolu_a"), ("tool", "toolu_b"), ("user", None)]
    assert req["messages"][-1]["content"] == [{"type": "text", "text": "and then?"}]


def test_tool_choice_and_sampling():
    req = adapter.to_chat(body(tools=[BASH], tool_choice={"type": "any", "disable_parallel_tool_use": True},
                               temperature=0.5, top_p=0.9, top_k=40, stop_sequences=["X"], stream=True))
    assert (req["tool_choice"], req["parallel_tool_calls"]) == ("required", False)
    assert (req["temperature"], req["top_p"], req["top_k"], req["stop"], req["stream"]) == (
        0.5, 0.9, 40, ["X"], True)
    assert req["tools"] == [{"name": "Bash", "description": "Run a shell command",
                             "parameters": BASH["input_schema"], "kind": "function", "format": None}]
    assert adapter.to_chat(body(tool_choice={"type": "tool", "name": "Bash"}))["tool_choice"] == {"name": "Bash"}
    assert adapter.to_chat(body(tool_choice={"type": "none"}))["tool_choice"] == "none"
    assert adapter.to_chat(body(thinking={"type": "enabled", "budget_tokens": 4000}))["reasoning"] == {
        "effort": None, "budget_tokens": 4000}
    assert adapter.to_chat(body(thinking={"type": "disabled"}))["reasoning"] is None


def test_server_tools_dropped():
    req = adapter.to_chat(body(tools=[BASH, {"type": "web_search_20250305", "name": "web_search",
                                             "max_uses": 5}]))
    assert [t["name"] for t in req["tools"]] == ["Bash"]
    assert "tools.web_search_20250305" in req["dropped"]


# ---- Claude Code quirks ---------------------------------------------------------------

def test_beta_query_path():
    assert detect("POST", "/v1/messages?beta=true", {"anthropic-version": "2023-06-01"},
                  claude_code_body()) == "anthropic"
    assert adapter.to_chat(claude_code_body(), "/v1/messages?beta=true")["model"] == "claude-opus-4-8"


def test_count_tokens_body_needs_no_max_tokens():
    b = claude_code_body()
    del b["max_tokens"], b["stream"]
    assert adapter.to_chat(b, "/v1/messages/count_tokens?beta=true")["max_tokens"] is None
    with pytest.raises(AdapterError, match="max_tokens"):
        adapter.to_chat(b, "/v1/messages?beta=true")


def test_billing_header_is_stripped():
    a = adapter.to_chat(claude_code_body("0a1b2"))
    b = adapter.to_chat(claude_code_body("f9e8d"))
    assert a["messages"][0] == b["messages"][0]
    assert "cch=" not in a["messages"][0]["content"][0]["text"]
    assert "system.billing_header" in a["dropped"]
    # also when system is one string
    s = adapter.to_chat(body(system=BILLING.format("123") + "\nYou are Claude Code."))
    assert s["messages"][0]["content"] == [{"type": "text", "text": "You are Claude Code."}]


def test_system_message_inside_messages_is_merged_first():
    req = adapter.to_chat(claude_code_body())
    assert [m["role"] for m in req["messages"]] == ["system", "user"]
    assert req["messages"][0]["content"] == [
        {"type": "text", "text": "You are Claude Code.\n\nAvailable agent types: general-purpose."}]


def test_cache_control_ignored():
    plain = claude_code_body()
    marked = copy.deepcopy(plain)
    marked["messages"][1]["content"][0].pop("cache_control")
    marked["system"][1].pop("cache_control")
    marked["tools"] = [BASH | {"cache_control": {"type": "ephemeral"}}]
    a, b = adapter.to_chat(plain), adapter.to_chat(marked)
    assert a["messages"] == b["messages"] and a["tools"] == b["tools"]
    assert a["dropped"].count("cache_control") == 1


def test_adaptive_thinking_with_effort():
    req = adapter.to_chat(claude_code_body())
    assert req["reasoning"] == {"effort": "high", "budget_tokens": None}
    assert req["provider"]["thinking"] is True
    assert "output_config.effort" not in req["dropped"]
    # effort without adaptive thinking has nowhere to go
    req = adapter.to_chat(body(output_config={"effort": "low"}))
    assert req["reasoning"] is None and "output_config.effort" in req["dropped"]


def test_context_management_and_metadata_recorded():
    dropped = adapter.to_chat(claude_code_body())["dropped"]
    assert {"context_management", "metadata", "cache_control", "system.billing_header"} <= set(dropped)
    assert dropped == sorted(set(dropped))


def test_title_request_json_schema():
    schema = {"type": "object", "properties": {"title": {"type": "string"}}, "required": ["title"],
              "additionalProperties": False}
    req = adapter.to_chat({"model": "claude-haiku-4-5-20251001", "max_tokens": 512, "tools": [],
                           "thinking": {"type": "disabled"},
                           "system": [{"type": "text", "text": BILLING.format("9")},
                                      {"type": "text", "text": "Generate a title."}],
                           "messages": [{"role": "user", "content": "Run echo hi"}],
                           "output_config": {"format": {"type": "json_schema", "schema": schema}}})
    assert req["response_format"] == {"type": "json_schema", "name": "response", "schema": schema}
    assert req["reasoning"] is None and req["provider"]["thinking"] is False


def test_tool_result_is_error():
    req = adapter.to_chat(body(messages=[
        {"role": "assistant", "content": [{"type": "tool_use", "id": "toolu_1", "name": "Bash", "input": {}}]},
        {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "toolu_1",
                                      "content": "command not found", "is_error": True}]}]))
    assert req["messages"][1] == {"role": "tool", "content": [{"type": "text", "text": "command not found"}],
                                  "tool_call_id": "toolu_1", "name": "Bash", "is_error": True}


def test_tool_reference_blocks():
    req = adapter.to_chat(body(messages=[
        {"role": "assistant", "content": [{"type": "tool_use", "id": "toolu_s", "name": "ToolSearch",
                                           "input": {"query": "notebook"}}]},
        {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "toolu_s", "content": [
            {"type": "tool_reference", "tool_name": "NotebookEdit"},
            {"type": "tool_reference", "tool_name": "NotebookRead"}]}]}]))
    text = req["messages"][1]["content"][0]["text"]
    assert "NotebookEdit" in text and "NotebookRead" in text


def test_thinking_and_redacted_thinking_in_history():
    req = adapter.to_chat(body(messages=[
        {"role": "user", "content": "hi"},
        {"role": "assistant", "content": [{"type": "thinking", "thinking": "Hmm.", "signature": "EqQB"},
                                          {"type": "redacted_thinking", "data": "xyz"},
                                          {"type": "text", "text": "Hello."}]}]))
    assert req["messages"][1] == {"role": "assistant", "content": [{"type": "text", "text": "Hello."}],
                                  "reasoning": "Hmm."}
    assert "redacted_thinking" in req["dropped"]


# ---- properties -----------------------------------------------------------------------

TEXT = st.text(max_size=30)
IDS = st.text("abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789_", min_size=1, max_size=16)
NAMES = st.from_regex(r"[A-Za-z][A-Za-z0-9_]{0,12}", fullmatch=True)
JSON = json_values(ints=BOUNDED_INTS, floats=FINITE_FLOATS, text_size=30, key_size=30, max_leaves=8)
INPUTS = st.dictionaries(TEXT, JSON, max_size=4)
CACHE = st.sampled_from([{}, {"cache_control": {"type": "ephemeral"}}])


@st.composite
def conversations(draw):
    """A valid Anthropic body: user turns, assistant turns with tool calls, their results."""
    messages = []
    for _ in range(draw(st.integers(1, 4))):
        user = [{"type": "text", "text": t} | draw(CACHE) for t in draw(st.lists(TEXT, min_size=1, max_size=2))]
        if messages and messages[-1]["role"] == "assistant":
            calls = [b for b in messages[-1]["content"] if b["type"] == "tool_use"]
            results = [{"type": "tool_result", "tool_use_id": c["id"], "is_error": draw(st.booleans()),
                        "content": draw(TEXT | st.lists(TEXT.map(lambda t: {"type": "text", "text": t}),
                                                        max_size=2))} for c in calls]
            user = results + (user if draw(st.booleans()) or not results else [])
        messages.append({"role": "user", "content": user})
        if draw(st.booleans()) and all(b["type"] == "text" for b in user) and len(user) == 1:
            messages[-1]["content"] = user[0]["text"]  # string content
        blocks = []
        if draw(st.booleans()):
            blocks.append({"type": "thinking", "thinking": draw(TEXT), "signature": draw(TEXT)})
        blocks += [{"type": "text", "text": t} for t in draw(st.lists(TEXT, max_size=2))]
        blocks += [{"type": "tool_use", "id": "toolu_" + i, "name": draw(NAMES), "input": draw(INPUTS)}
                   for i in draw(st.lists(IDS, max_size=3, unique=True))]
        if blocks:
            messages.append({"role": "assistant", "content": blocks})
    system = draw(st.none() | TEXT | st.lists(TEXT.map(lambda t: {"type": "text", "text": t}), max_size=3))
    b = {"model": "claude-x", "max_tokens": draw(st.integers(1, 64000)), "messages": messages}
    if system is not None:
        b["system"] = system
    return b


def _flat(b):
    """(texts, tool calls, tool results, thinking) in conversation order."""
    texts, calls, results, thoughts = [], [], [], []
    for m in b["messages"]:
        content = m["content"]
        for block in ([{"type": "text", "text": content}] if isinstance(content, str) else content):
            if block["type"] == "text":
                texts.append(block["text"])
            elif block["type"] == "tool_use":
                calls.append((block["id"], block["name"], block["input"]))
            elif block["type"] == "tool_result":
                c = block["content"]
                results.append((block["tool_use_id"], c if isinstance(c, str) else "\n".join(x["text"] for x in c),
                                block["is_error"]))
            elif block["type"] == "thinking":
                thoughts.append(block["thinking"])
    return texts, calls, results, thoughts


@settings(max_examples=150, suppress_health_check=[HealthCheck.too_slow])
@given(conversations())
def test_to_chat_keeps_everything(b):
    req = adapter.to_chat(b)
    texts, calls, results, thoughts = _flat(b)
    msgs = req["messages"]
    convo = [m for m in msgs if m["role"] != "system"]
    assert [p["text"] for m in convo if m["role"] in ("user", "assistant")
            for p in m["content"]] == texts
    assert [(c["id"], c["name"], json.loads(c["arguments"])) for m in convo
            for c in m.get("tool_calls", [])] == calls
    assert [(m["tool_call_id"], m["content"][0]["text"], m["is_error"]) for m in convo
            if m["role"] == "tool"] == results
    assert [m["reasoning"] for m in convo if "reasoning" in m] == thoughts
    system = b.get("system")
    sys_texts = [system] if isinstance(system, str) else [s["text"] for s in system or []]
    sys_texts = [t for t in sys_texts if t]
    if sys_texts:
        assert msgs[0] == {"role": "system", "content": [{"type": "text", "text": "\n\n".join(sys_texts)}]}
    else:
        assert msgs[0]["role"] != "system"


RESULT_CALLS = st.lists(st.fixed_dictionaries({"id": IDS.map(lambda i: "call_" + i), "name": NAMES,
                                                "arguments": INPUTS.map(orjson.dumps).map(bytes.decode)}),
                        max_size=3, unique_by=lambda c: c["id"])


def _accumulate(events: list[bytes]) -> dict:
    """A minimal client: rebuild the message from the SSE events."""
    msg, bufs = None, {}
    for raw in events:
        head, data = raw.decode().split("\n", 1)
        e = json.loads(data[6:])
        assert head == f"event: {e['type']}"
        if e["type"] == "message_start":
            msg = e["message"]
        elif e["type"] == "content_block_start":
            assert e["index"] == len(msg["content"])
            msg["content"].append(e["content_block"])
        elif e["type"] == "content_block_delta":
            block, d = msg["content"][e["index"]], e["delta"]
            key = {"text_delta": "text", "thinking_delta": "thinking", "signature_delta": "signature"}.get(d["type"])
            if key:
                block[key] = (block[key] if key != "signature" else "") + d[key]
            else:
                bufs[e["index"]] = bufs.get(e["index"], "") + d["partial_json"]
        elif e["type"] == "content_block_stop" and e["index"] in bufs:
            msg["content"][e["index"]]["input"] = json.loads(bufs[e["index"]])
        elif e["type"] == "message_delta":
            msg.update(e["delta"])
            msg["usage"].update(e["usage"])
    return msg


@settings(max_examples=150)
@given(TEXT, RESULT_CALLS, st.none() | st.text(min_size=1, max_size=30), st.booleans())
def test_from_chat_round_trips(text, calls, reasoning, thinking):
    extra = {"thinking": {"type": "enabled", "budget_tokens": 1024}} if thinking else {}
    req = adapter.to_chat(body(**extra))
    result = make_result(text, calls, reasoning=reasoning)
    out = adapter.from_chat(result, req)
    anthropic.types.Message.model_validate(out)
    assert out["id"] == adapter.from_chat(result, req)["id"]  # stable
    assert _accumulate(adapter.stream(result, req)) == out
    # The client sends the answer back as the next turn's assistant message.
    back = adapter.to_chat(body(messages=[{"role": "user", "content": "hi"},
                                          {"role": "assistant", "content": out["content"]},
                                          {"role": "user", "content": "more"}]))
    assistant = back["messages"][1]
    assert parts_text(assistant["content"]) == text
    assert [(suffix_of(c["id"]), c["name"], json.loads(c["arguments"])) for c in assistant.get("tool_calls", [])] \
        == [(suffix_of(c["id"]), c["name"], json.loads(c["arguments"])) for c in calls]
    assert all(c["id"].startswith("toolu_") for c in assistant.get("tool_calls", []))
    assert assistant.get("reasoning") == (reasoning if thinking else None)


@st.composite
def mutated(draw):
    b = draw(conversations())
    b.update(draw(st.fixed_dictionaries({}, optional={
        "tools": st.just([BASH, {"type": "web_search_20250305", "name": "web_search"}]),
        "tool_choice": st.just({"type": "tool", "name": "Bash"}),
        "thinking": st.just({"type": "adaptive"}),
        "output_config": st.just({"effort": "high", "format": {"type": "json_schema", "schema": {}}}),
        "stop_sequences": st.just(["END"])})))
    b = copy.deepcopy(b)  # the strategies share objects (BASH); mutate a private copy
    rnd = draw(st.randoms(use_true_random=False))  # uniform over paths, not biased to the first
    for _ in range(draw(st.integers(0, 3))):
        paths = list(json_paths(b))[1:]
        if not paths:
            break
        path = rnd.choice(paths)
        parent = parent_of(b, path)
        if draw(st.booleans()):
            del parent[path[-1]]
        else:
            parent[path[-1]] = draw(JSON | st.integers() | st.sampled_from(
                ["", "foo", "user", "assistant", "system", "text", "tool_use", "image", -1, 0, 2**70]))
    return b


def _check_total(b):
    answers = {"answer": make_result("ok"), "streamed": make_result("ok", [{"name": "Bash"}]),
               "error_shape": lambda err, e: err["type"] == "error" and err["error"]["message"] == str(e)}
    check_total(adapter, b, **answers)
    # Bodies arrive through orjson, which reads out-of-range integers as floats.
    req = check_total(adapter, orjson.loads(json.dumps(b)), **answers)
    if req is not None:
        orjson.dumps(req)  # the normalized request is stored as-is


@settings(max_examples=250, suppress_health_check=[HealthCheck.too_slow])
@given(mutated())
def test_fuzz_mutated_bodies(b):
    _check_total(b)


@settings(max_examples=300)
@given(JSON | st.dictionaries(st.sampled_from(["model", "max_tokens", "messages", "system", "tools",
                                               "tool_choice", "thinking", "output_config",
                                               "stop_sequences", "stream", "temperature"]), JSON))
def test_fuzz_random_json(b):
    _check_total(b)
