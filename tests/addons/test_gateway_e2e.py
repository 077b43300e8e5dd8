"""End to end: real vLLM (SmolLM2 on CPU) behind mitmdump with the addon; the official
SDKs call through HTTPS_PROXY with the mitmproxy CA and through a base URL."""

import json
import os
import signal
import ssl
import subprocess
import sys
import threading
from pathlib import Path

import anthropic
import httpx
import openai
import pytest
from google import genai
from google.genai import types

from polar_mitm import adapters

from polar_mitm.stack import launch
from polar_mitm.models import default_model_dir
from polar_mitm.store import query

pytestmark = pytest.mark.vllm
MAX = 12
PROMPT = "Name three colors."


@pytest.fixture(scope="module")
def tokenizer(vllm_backend):
    from transformers import AutoTokenizer
    return AutoTokenizer.from_pretrained(default_model_dir())


@pytest.fixture
def proxy(vllm_backend, start_proxy):
    return start_proxy(vllm_backend)


def sdk_clients(proxy, mode: str, key_prefix: str, monkeypatch):
    """Regular mode: the harness keeps its real provider hosts; HTTPS_PROXY and
    SSL_CERT_FILE in the environment route it through the proxy with the CA trusted."""
    if mode == "regular":
        monkeypatch.setenv("HTTPS_PROXY", proxy.proxy_url(f"{key_prefix}~regular"))
        monkeypatch.setenv("SSL_CERT_FILE", proxy.ca)
        monkeypatch.setenv("NO_PROXY", "")
        base = None
    else:
        monkeypatch.delenv("HTTPS_PROXY", raising=False)
        base = proxy.base_url
    return (openai.OpenAI(api_key=f"polar-{key_prefix}~{mode}-openai", max_retries=0, timeout=120,
                          base_url=base + "/v1" if base else None),
            anthropic.Anthropic(api_key=f"polar-{key_prefix}~{mode}-anthropic", max_retries=0, timeout=120,
                                base_url=base),
            genai.Client(api_key=f"polar-{key_prefix}~{mode}-google", http_options=types.HttpOptions(
                base_url=base, retry_options=types.HttpRetryOptions(attempts=1),
                client_args={"verify": ssl.create_default_context(cafile=proxy.ca)} if mode == "regular" else None)))


def every_style(oa, an, gg) -> list[tuple[str, bool, str, str]]:
    """(style, stream, requested model, text the SDK parsed) for each call made."""
    out = []
    r = oa.chat.completions.create(model="gpt-5", max_tokens=MAX, messages=[{"role": "user", "content": PROMPT}])
    assert r.model == "gpt-5"
    out.append(("openai_chat", False, "gpt-5", r.choices[0].message.content))
    text = "".join(c.choices[0].delta.content or "" for c in oa.chat.completions.create(
        model="gpt-5", max_tokens=MAX, stream=True, messages=[{"role": "user", "content": PROMPT}]) if c.choices)
    out.append(("openai_chat", True, "gpt-5", text))

    r = oa.responses.create(model="gpt-5-codex", input=PROMPT, max_output_tokens=MAX)
    assert r.model == "gpt-5-codex" and r.status in ("completed", "incomplete")
    out.append(("openai_responses", False, "gpt-5-codex", r.output_text))
    # A cap hit ends the stream with response.incomplete, as OpenAI does; the final
    # response object rides on whichever terminal event came.
    events = list(oa.responses.create(model="gpt-5-codex", input=PROMPT, max_output_tokens=MAX, stream=True))
    assert events[-1].type in ("response.completed", "response.incomplete")
    out.append(("openai_responses", True, "gpt-5-codex", events[-1].response.output_text))

    m = an.messages.create(model="claude-sonnet-4-5", max_tokens=MAX, messages=[{"role": "user", "content": PROMPT}])
    assert m.model == "claude-sonnet-4-5" and m.stop_reason in ("end_turn", "max_tokens")
    out.append(("anthropic", False, "claude-sonnet-4-5", "".join(b.text for b in m.content if b.type == "text")))
    with an.messages.stream(model="claude-sonnet-4-5", max_tokens=MAX,
                            messages=[{"role": "user", "content": PROMPT}]) as s:
        out.append(("anthropic", True, "claude-sonnet-4-5", s.get_final_text()))

    cfg = types.GenerateContentConfig(max_output_tokens=MAX)
    r = gg.models.generate_content(model="gemini-2.5-flash", contents=PROMPT, config=cfg)
    out.append(("google", False, "gemini-2.5-flash", r.text or ""))
    text = "".join(c.text or "" for c in gg.models.generate_content_stream(
        model="gemini-2.5-flash", contents=PROMPT, config=cfg))
    out.append(("google", True, "gemini-2.5-flash", text))
    return out


@pytest.mark.parametrize("mode", ["regular", "reverse"])
def test_every_sdk_through_the_proxy_is_recorded_token_faithfully(proxy, tokenizer, mode, monkeypatch):
    calls = every_style(*sdk_clients(proxy, mode, "e2e", monkeypatch))
    monkeypatch.delenv("HTTPS_PROXY", raising=False)
    cols, rows = query(proxy.db, """
        SELECT style, stream, requested_model, session_id, status_code, prompt_token_ids, token_ids,
               logprobs, path, request_text, backend_params, response_json, finish_reason, policy_version
        FROM calls ORDER BY created_at, seq""")
    assert len(rows) == len(calls) == 8  # one row per call
    template = (launch.TEMPLATES / "smollm2_tools.jinja").read_text()
    for (style, stream, model, text), row in zip(calls, rows):
        r = dict(zip(cols, row))
        assert (r["style"], r["stream"], r["requested_model"], r["status_code"]) == (style, stream, model, 200)
        expected_session = "e2e~regular" if mode == "regular" else f"e2e~reverse-{style.split('_')[0]}"
        assert r["session_id"] == expected_session
        assert r["prompt_token_ids"] and r["token_ids"]
        assert len(r["logprobs"]) == len(r["token_ids"]) and all(lp <= 0 for lp in r["logprobs"])
        backend_req = adapters.backend_request(r["style"], r["path"], r["request_text"],
                                               json.loads(r["backend_params"]))
        prompt = tokenizer.apply_chat_template(backend_req["messages"], tools=backend_req.get("tools"),
                                               chat_template=template, add_generation_prompt=True,
                                               tokenize=False)
        assert tokenizer.decode(r["prompt_token_ids"]) == prompt
        assert PROMPT in prompt
        assert tokenizer.decode(r["token_ids"], skip_special_tokens=True) == text, style
        assert len(r["token_ids"]) <= MAX
        assert r["policy_version"] == 0  # the gateway's version: no sync yet


def test_sessions_from_keys_never_store_secrets(proxy, monkeypatch):
    secret = "sk-ant-api03-THIS-IS-A-SECRET-KEY"
    an = anthropic.Anthropic(api_key=secret, base_url=proxy.base_url, max_retries=0)
    an.messages.create(model="claude", max_tokens=4, messages=[{"role": "user", "content": "hi"}])
    oa = openai.OpenAI(api_key=secret, base_url=proxy.base_url + "/v1", max_retries=0)
    oa.chat.completions.create(model="m", max_tokens=4, messages=[{"role": "user", "content": "hi"}])
    rows = query(proxy.db, "SELECT DISTINCT session_id FROM calls")[1]
    assert len(rows) == 1 and rows[0][0].startswith("key-")  # same key -> same session
    dump = query(proxy.db, "SELECT * FROM calls")[1] + query(proxy.db, "SELECT * FROM sessions")[1]
    assert secret not in repr(dump)
    assert secret.encode() not in Path(proxy.db).read_bytes()


def test_sql_reader_while_proxy_writes(proxy):
    """Two processes on one file: mitmdump writing, `polar-mitm sql` reading."""
    oa = openai.OpenAI(api_key="polar-conc~1", base_url=proxy.base_url + "/v1", max_retries=0, timeout=120)
    answers, errors = [], []

    def write():
        try:
            for _ in range(6):
                r = oa.chat.completions.create(model="m", max_tokens=3, messages=[{"role": "user", "content": "hi"}])
                answers.append(r.choices[0].message.content)
        except Exception as e:  # surfaced below
            errors.append(e)

    t = threading.Thread(target=write)
    t.start()
    counts = []
    cli = [sys.executable, "-m", "polar_mitm.cli.main", "sql", "--db", str(proxy.db), "--format", "csv",
           "select count(*) from calls"]
    while t.is_alive() or not counts:
        out = subprocess.run(cli, capture_output=True, text=True, timeout=120)
        assert out.returncode == 0, out.stderr
        counts.append(int(out.stdout.splitlines()[1]))
    t.join()
    assert not errors and len(answers) == 6
    assert counts == sorted(counts)  # every read saw a consistent, growing table
    final = subprocess.run(cli, capture_output=True, text=True, timeout=60)
    assert int(final.stdout.splitlines()[1]) == 6


def test_sigkill_keeps_every_acknowledged_call(vllm_backend, start_proxy, tmp_path):
    proxy = start_proxy(vllm_backend)
    oa = openai.OpenAI(api_key="polar-kill~1", base_url=proxy.base_url + "/v1", max_retries=0, timeout=120)
    n = 8
    for _ in range(n):
        oa.chat.completions.create(model="m", max_tokens=2, messages=[{"role": "user", "content": "hi"}])
    os.killpg(proxy.service.proc.pid, signal.SIGKILL)
    proxy.service.proc.wait(10)
    rows = query(proxy.db, "SELECT seq FROM calls WHERE session_id = 'kill~1' ORDER BY seq")[1]
    assert [r[0] for r in rows] == list(range(1, n + 1))
    # a new proxy on the same file carries on the session's numbering
    port, rp = launch.free_ports(2)
    proxy2 = launch.start_proxy(db=proxy.db, backend=vllm_backend, port=port,
                                confdir=proxy.confdir, log_path=tmp_path / "p2.log", reverse_port=rp)
    try:
        oa2 = openai.OpenAI(api_key="polar-kill~1", base_url=f"http://127.0.0.1:{rp}/v1", max_retries=0)
        oa2.chat.completions.create(model="m", max_tokens=2, messages=[{"role": "user", "content": "hi"}])
    finally:
        proxy2.stop()
    assert query(proxy.db, "SELECT max(seq), count(*) FROM calls")[1] == [(n + 1, n + 1)]


def test_tool_conversation_renders_and_decodes(proxy, tokenizer):
    """A second turn carrying a tool call and its result back: vLLM renders it with the
    tool-aware template, and the recorded prompt ids are exactly that rendering."""
    an = anthropic.Anthropic(api_key="polar-tools~1", base_url=proxy.base_url, max_retries=0, timeout=120)
    tools = [{"name": "get_weather", "description": "Current weather for a city",
              "input_schema": {"type": "object", "properties": {"city": {"type": "string"}},
                               "required": ["city"]}}]
    history = [{"role": "user", "content": "Weather in Paris?"},
               {"role": "assistant", "content": [
                   {"type": "text", "text": "Let me check."},
                   {"type": "tool_use", "id": "toolu_01", "name": "get_weather", "input": {"city": "Paris"}}]},
               {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "toolu_01",
                                             "content": "18C and sunny", "is_error": False}]}]
    m = an.messages.create(model="claude", max_tokens=MAX, tools=tools, messages=history)
    assert m.stop_reason in ("end_turn", "max_tokens", "tool_use")
    cols, rows = query(proxy.db, "SELECT prompt_token_ids, style, path, request_text, backend_params, "
                                 "status_code FROM calls")
    ids, style, path, text, params, status = rows[0]
    backend_req = adapters.backend_request(style, path, text, json.loads(params))
    assert status == 200 and backend_req["tools"][0]["function"]["name"] == "get_weather"
    prompt = tokenizer.decode(ids)
    assert '"name": "get_weather"' in prompt  # the tool list reached the model
    assert '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>' in prompt
    assert "<tool_response>\n18C and sunny\n</tool_response>" in prompt
    template = (launch.TEMPLATES / "smollm2_tools.jinja").read_text()
    # vLLM hands templates tool-call arguments as objects, not JSON text; do the same.
    for m in backend_req["messages"]:
        for call in m.get("tool_calls") or []:
            call["function"]["arguments"] = json.loads(call["function"]["arguments"])
    assert prompt == tokenizer.apply_chat_template(backend_req["messages"], tools=backend_req["tools"],
                                                   chat_template=template, add_generation_prompt=True,
                                                   tokenize=False)


def test_count_tokens_answered_from_the_backend_tokenizer(proxy):
    """Claude Code's /v1/messages/count_tokens and Gemini's :countTokens are answered locally
    with the backend's tokenizer, so they agree with the prompt the model then gets."""
    messages = [{"role": "user", "content": "Count my tokens, please."}]
    an = anthropic.Anthropic(api_key="polar-count~1", base_url=proxy.base_url, max_retries=0, timeout=60)
    counted = an.messages.count_tokens(model="claude", messages=messages, system="Be brief.").input_tokens
    an.messages.create(model="claude", max_tokens=2, messages=messages, system="Be brief.")
    gg = genai.Client(api_key="polar-count~2", http_options=types.HttpOptions(base_url=proxy.base_url))
    g_counted = gg.models.count_tokens(model="gemini-2.5-flash", contents="Count my tokens, please.").total_tokens
    rows = query(proxy.db, "SELECT len(prompt_token_ids) FROM calls WHERE session_id = 'count~1'")[1]
    assert rows == [(counted,)] and counted > 5
    assert g_counted > 5


def test_gemini_router_call_gets_schema_shaped_json(proxy):
    """Gemini CLI's first call asks for JSON fitting a schema (upper-case Google types) and
    picks the main model from it; vLLM's structured output keeps the answer parseable."""
    body = {"contents": [{"role": "user", "parts": [{"text": "Route this: fix a typo"}]}],
            "systemInstruction": {"parts": [{"text": "You are a Task Routing AI."}]},
            "generationConfig": {"responseMimeType": "application/json", "maxOutputTokens": 60,
                                 "responseJsonSchema": {"type": "OBJECT", "properties": {
                                     "complexity_reasoning": {"type": "STRING"},
                                     "complexity_score": {"type": "INTEGER"}},
                                     "required": ["complexity_reasoning", "complexity_score"]}}}
    r = httpx.post(proxy.base_url + "/v1beta/models/gemini-3.5-flash-lite:generateContent", json=body,
                   headers={"x-goog-api-key": "polar-router~1"}, trust_env=False, timeout=120)
    assert r.status_code == 200, r.text
    candidate = r.json()["candidates"][0]
    if candidate["finishReason"] == "STOP":  # a cut-off answer cannot be whole JSON
        answer = json.loads(candidate["content"]["parts"][0]["text"])
        assert isinstance(answer["complexity_score"], int)
    backend_req = json.loads(query(proxy.db, "SELECT backend_params FROM calls")[1][0][0])
    assert backend_req["response_format"]["json_schema"]["schema"]["properties"]["complexity_score"] == {"type": "integer"}

