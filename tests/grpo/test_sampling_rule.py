"""The sampling rule: vLLM samples every call from the policy's own distribution (temperature as
the operator set it, top_p 1, top_k off), whatever the harness asked, and the harness's request
is recorded; calls the trainer cannot reproduce (structured output, forced tool choice, and
truncated or other-temperature sampling where the operator passes the harness's through) are
left out of training and counted by rule. Also: rewards written into another --db file count."""

from __future__ import annotations

import json

import anthropic
import httpx
import openai
import pytest
from click.testing import CliRunner
from google import genai
from google.genai import types

from support.fake_vllm import FakeVLLM
from support.grpo_data import synthetic_calls, write_calls
from polar_mitm.adapters import anthropic as anthropic_adapter
from polar_mitm.adapters import backend, backend_request, google, openai_chat
from polar_mitm.store import query, set_reward
from polar_mitm.store.training import SAMPLING_REASONS, sampling_exclusion, set_rewards, training_calls
from polar_mitm.cli.train import main

MSG = [{"role": "user", "content": "hi"}]
ROUTER_SCHEMA = {"type": "OBJECT", "properties": {"complexity_reasoning": {"type": "STRING"},
                                                   "complexity_score": {"type": "INTEGER"}},
                 "required": ["complexity_reasoning", "complexity_score"]}
TITLE_FORMAT = {"type": "json_schema", "schema": {
    "type": "object", "properties": {"title": {"type": "string"}}, "required": ["title"],
    "additionalProperties": False}}
POLICY = {"top_p": 1.0, "top_k": -1, "min_p": 0.0, "repetition_penalty": 1.0,
          "presence_penalty": 0.0, "frequency_penalty": 0.0}


def cli(*args, ok=True):
    r = CliRunner().invoke(main, [str(a) for a in args], catch_exceptions=False)
    assert (r.exit_code == 0) == ok, r.output
    return r.output


# ---- the adapters (pure): what vLLM gets, what is recorded as asked ------------------------

def test_policy_sampling_replaces_the_harness_s_and_pass_through_keeps_it(provider_server):
    gemini = genai.Client(api_key="k", http_options=types.HttpOptions(base_url=provider_server.url,
                                                                       api_version="v1beta"))
    # Gemini CLI's main call: temperature 1, topP 0.95, topK 64 on every call
    gemini.models.generate_content(model="gemini-test", contents="hi", config=types.GenerateContentConfig(
        temperature=1, top_p=0.95, top_k=64, max_output_tokens=32, seed=7))
    gemini.close()
    oa = openai.OpenAI(api_key="k", base_url=provider_server.url + "/v1", max_retries=0)
    oa.chat.completions.create(model="m", messages=MSG, temperature=0.2, top_p=0.5, extra_body={"top_k": 0})
    main_call, chat = provider_server.requests

    sent = backend.to_backend(main_call, "served")
    assert {k: sent[k] for k in (*POLICY, "temperature")} == {**POLICY, "temperature": 1.0}
    assert (sent["max_tokens"], sent["seed"]) == (32, 7)        # not sampling: the harness's
    assert backend.requested_sampling(main_call) == {"temperature": 1, "top_p": 0.95, "top_k": 64}
    # the operator's temperature (polar_sampling) is the policy's
    assert backend.to_backend(chat, "served", {"temperature": 0.7})["temperature"] == 0.7
    # the escape hatch: the harness's own values, what it leaves unset stays the policy's
    passed = backend.to_backend(main_call, "served", harness_sampling=True)
    assert (passed["temperature"], passed["top_p"], passed["top_k"], passed["min_p"]) == (1, 0.95, 64, 0.0)
    passed = backend.to_backend(chat, "served", harness_sampling=True)
    assert (passed["temperature"], passed["top_p"], passed["top_k"]) == (0.2, 0.5, -1)   # 0 is "off"
    assert backend.requested_sampling(chat) == {"temperature": 0.2, "top_p": 0.5, "top_k": 0}


def test_structured_output_of_every_style_is_recorded_as_asked():
    router = google.to_chat({"contents": [{"role": "user", "parts": [{"text": "route"}]}],
                             "generationConfig": {"responseMimeType": "application/json",
                                                  "responseSchema": ROUTER_SCHEMA}},
                            "/v1beta/models/gemini-flash-lite:generateContent")
    title = anthropic_adapter.to_chat({"model": "claude-haiku", "max_tokens": 64, "messages": MSG,
                                       "output_config": {"format": TITLE_FORMAT}}, "/v1/messages")
    legacy = anthropic_adapter.to_chat({"model": "c", "max_tokens": 8, "messages": MSG,
                                        "output_format": TITLE_FORMAT}, "/v1/messages")
    obj = openai_chat.to_chat({"model": "m", "messages": MSG, "response_format": {"type": "json_object"}},
                              "/v1/chat/completions")
    for req, kind in ((router, "json_schema"), (title, "json_schema"), (legacy, "json_schema"),
                      (obj, "json_object")):
        assert backend.requested_sampling(req) == {"response_format": kind}
        params = {k: v for k, v in backend.to_backend(req, "served").items() if k != "messages"}
        assert params["response_format"]["type"] == kind     # vLLM still gets it: the harness needs it
        assert sampling_exclusion(params) == "structured_output"


def test_the_rule_on_recorded_backend_params():
    policy = {**POLICY, "temperature": 1.0}
    assert sampling_exclusion(policy) is None
    assert sampling_exclusion(None) is None and sampling_exclusion({}) is None   # nothing recorded: defaults
    assert sampling_exclusion({**policy, "top_p": 0.95}) == "truncated_sampling"
    assert sampling_exclusion({**policy, "top_k": 64}) == "truncated_sampling"
    assert sampling_exclusion({**policy, "top_k": 0}) is None                    # vLLM 0.10+: off
    assert sampling_exclusion({**policy, "min_p": 0.05}) == "truncated_sampling"
    assert sampling_exclusion({**policy, "repetition_penalty": 1.05}) == "logit_processing"
    assert sampling_exclusion({**policy, "logit_bias": {"7": -100}}) == "logit_processing"
    assert sampling_exclusion({**policy, "tool_choice": "required"}) == "forced_tool_choice"
    assert sampling_exclusion({**policy, "tool_choice": {"type": "function", "function": {"name": "f"}}}) \
        == "forced_tool_choice"
    assert sampling_exclusion({**policy, "tool_choice": "auto"}) is None
    assert sampling_exclusion({**policy, "guided_json": {"type": "object"}}) == "structured_output"
    assert sampling_exclusion({**policy, "response_format": {"type": "text"}}) is None
    assert sampling_exclusion({**policy, "temperature": 0.7}) == "temperature_mismatch"
    assert sampling_exclusion({**policy, "temperature": 0.7}, 0.7) is None
    assert sampling_exclusion({**policy, "temperature": 0.7}, None) is None
    assert sampling_exclusion({**policy, "temperature": 0}) == "temperature_mismatch"   # greedy


def test_a_rebuilt_backend_request_leaves_out_what_the_harness_asked():
    text = json.dumps({"model": "m", "messages": MSG, "top_p": 0.5})
    params = {"model": "served", "temperature": 1.0, "top_p": 1.0, "harness": {"top_p": 0.5}}
    rebuilt = backend_request("openai_chat", "/v1/chat/completions", text, params)
    assert "harness" not in rebuilt and rebuilt["top_p"] == 1.0
    assert rebuilt["messages"] == [{"role": "user", "content": "hi"}]


# ---- through the real proxy ----------------------------------------------------------------

def harness_calls(proxy):
    """Gemini CLI's main and router calls, Claude Code's title call, and an OpenAI client that
    sets top_p and top_k; then one call that asks nothing of its sampling."""
    gem = genai.Client(api_key="polar-gem~0", http_options=types.HttpOptions(
        base_url=proxy.base_url, retry_options=types.HttpRetryOptions(attempts=1)))
    gem.models.generate_content(model="gemini-pro", contents="fix it", config=types.GenerateContentConfig(
        temperature=1, top_p=0.95, top_k=64, max_output_tokens=16))
    gem.close()
    r = httpx.post(proxy.base_url + "/v1beta/models/gemini-flash-lite:generateContent", trust_env=False,
                   headers={"x-goog-api-key": "polar-gem~0"}, timeout=60, json={
                       "contents": [{"role": "user", "parts": [{"text": "route this"}]}],
                       "generationConfig": {"responseMimeType": "application/json",
                                            "responseJsonSchema": ROUTER_SCHEMA, "maxOutputTokens": 16}})
    assert r.status_code == 200, r.text
    an = anthropic.Anthropic(api_key="polar-claude~0", base_url=proxy.base_url, max_retries=0)
    an.messages.create(model="claude-haiku", max_tokens=16, messages=MSG,   # (this SDK has no temperature)
                       extra_body={"temperature": 0.7, "output_config": {"format": TITLE_FORMAT}})
    oa = openai.OpenAI(api_key="polar-oa~0", base_url=proxy.base_url + "/v1", max_retries=0)
    oa.chat.completions.create(model="m", messages=MSG, temperature=0.5, top_p=0.9, extra_body={"top_k": 40})
    oa.chat.completions.create(model="m", messages=MSG)


ASKED = [{"temperature": 1, "top_p": 0.95, "top_k": 64},               # Gemini CLI, main call
         {"response_format": "json_schema"},                           # Gemini CLI, router
         {"temperature": 0.7, "response_format": "json_schema"},       # Claude Code, title
         {"temperature": 0.5, "top_p": 0.9, "top_k": 40},              # an OpenAI client
         {}]


def recorded(db):
    cols, rows = query(db, "SELECT session_id, backend_params FROM call_records ORDER BY started_at")
    return [(sid, json.loads(params)) for sid, params in rows]


def test_the_gateway_samples_the_policy_and_the_trainer_skips_structured_output(start_proxy):
    with FakeVLLM() as fake:
        proxy = start_proxy(fake.url)
        harness_calls(proxy)
        # (a) what vLLM got: the policy's sampling, whatever the harness asked
        assert len(fake.bodies) == 5
        for body in fake.bodies:
            assert {k: body[k] for k in (*POLICY, "temperature")} == {**POLICY, "temperature": 1.0}
        assert [bool(b.get("response_format")) for b in fake.bodies] == [False, True, True, False, False]
        # (b) what the harness asked, recorded with each call (and what vLLM got, beside it)
        calls = recorded(proxy.db)
        assert [p["harness"] for _, p in calls] == ASKED
        assert all((p["top_p"], p["top_k"], p["temperature"]) == (1.0, -1, 1.0) for _, p in calls)
        # (c) the trainer's reader leaves out the structured-output calls, and counts them
        data = training_calls([proxy.db], require_reward=False)
        assert dict(data.skipped) == {"structured_output": 2}
        assert sorted(c.session_id for c in data.calls) == ["gem~0", "oa~0", "oa~0"]
        at = training_calls([proxy.db], require_reward=False, temperature=0.7)
        assert dict(at.skipped) == {"structured_output": 2, "temperature_mismatch": 3} and not at.calls
        # (d) polar-train stats says so, rule by rule
        out = cli("stats", "--db", proxy.db)
        assert "skipped calls: structured_output 2" in out
        assert ("not sampled as the trainer samples (temperature 1, top_p 1, top_k off): structured_output 2, "
                "forced_tool_choice 0, truncated_sampling 0, logit_processing 0, temperature_mismatch 0") in out
        report = json.loads(cli("stats", "--db", proxy.db, "--json"))
        assert report["sampling"] == {"temperature": 1.0, "excluded": dict.fromkeys(SAMPLING_REASONS, 0)
                                      | {"structured_output": 2}}
        assert "temperature_mismatch 3" in cli("stats", "--db", proxy.db, "--temperature", "0.7", ok=False)


def test_the_operator_s_temperature_is_the_policy_s(start_proxy):
    with FakeVLLM() as fake:
        proxy = start_proxy(fake.url, ["polar_sampling=temperature=0.7"])
        harness_calls(proxy)
        assert all({k: b[k] for k in (*POLICY, "temperature")} == {**POLICY, "temperature": 0.7}
                   for b in fake.bodies)
        assert [p["harness"] for _, p in recorded(proxy.db)] == ASKED
        assert dict(training_calls([proxy.db], require_reward=False, temperature=0.7).skipped) == {
            "structured_output": 2}
        assert dict(training_calls([proxy.db], require_reward=False).skipped) == {
            "structured_output": 2, "temperature_mismatch": 3}
        out = cli("stats", "--db", proxy.db, "--temperature", "0.7")
        assert "(temperature 0.7, top_p 1, top_k off): structured_output 2," in out


def test_harness_sampling_passed_through_is_recorded_and_not_trained(start_proxy):
    with FakeVLLM() as fake:
        proxy = start_proxy(fake.url, ["polar_harness_sampling=true"])
        harness_calls(proxy)
        got = [(b["temperature"], b["top_p"], b["top_k"]) for b in fake.bodies]
        assert got == [(1, 0.95, 64), (1.0, 1.0, -1), (0.7, 1.0, -1), (0.5, 0.9, 40), (1.0, 1.0, -1)]
        assert [p["harness"] for _, p in recorded(proxy.db)] == ASKED
        data = training_calls([proxy.db], require_reward=False)
        assert dict(data.skipped) == {"structured_output": 2, "truncated_sampling": 2}
        assert [c.session_id for c in data.calls] == ["oa~0"]   # the call that asked nothing
        out = cli("stats", "--db", proxy.db)
        assert "structured_output 2, forced_tool_choice 0, truncated_sampling 2" in out


# ---- recordings in the store: old rows, and rewards in another file -------------------------

def test_recorded_sampling_is_judged_in_databases_written_before_the_rule(tmp_path):
    """Rows with no `harness` key and a partial backend_params (as the gateway wrote them before)
    are judged by what they say vLLM got; a missing field is vLLM's default."""
    db = tmp_path / "old.duckdb"
    calls = synthetic_calls(tasks=1, sessions=2, turns=1)
    tail = [({"session_id": "g~0", "task_id": "g"},
             {"status_code": 200, "prompt_token_ids": [1, 2], "token_ids": [3], "logprobs": [-0.5],
              "backend_params": params})
            for params in ({"model": "m", "temperature": 1, "top_p": 0.95, "top_k": 64},
                           {"model": "m", "response_format": {"type": "json_schema", "json_schema": {}}},
                           {"model": "m", "tool_choice": {"type": "function", "function": {"name": "f"}}},
                           {"model": "m", "temperature": 0.6},
                           {"model": "m", "max_tokens": 5})]
    write_calls(db, calls, tail)
    data = training_calls([db], require_reward=False)
    assert dict(data.skipped) == {"truncated_sampling": 1, "structured_output": 1, "forced_tool_choice": 1,
                                  "temperature_mismatch": 1}
    assert len(data.calls) == len(calls) + 1
    out = cli("stats", "--db", db)
    assert ("structured_output 1, forced_tool_choice 1, truncated_sampling 1, logit_processing 0, "
            "temperature_mismatch 1") in out


def test_rewards_in_another_file_count(tmp_path):
    """One gateway's calls, their rewards written into another --db file (and the other way
    round): every call is rewarded; a reward in the calls' own file comes first."""
    a, b = tmp_path / "a.duckdb", tmp_path / "b.duckdb"
    mine, theirs = synthetic_calls(tasks=1, seed=1, prefix="t"), synthetic_calls(tasks=1, seed=2, prefix="u")
    write_calls(a, mine)
    write_calls(b, theirs)
    set_rewards(b, [{"session_id": s, "reward": 1.0} for s in {c.session_id for c in mine}])
    set_rewards(a, [{"session_id": s, "reward": 0.25} for s in {c.session_id for c in theirs}])
    assert dict(training_calls([a]).skipped) == {"no_reward": len(mine)}   # alone, a has no rewards for t
    data = training_calls([a, b])
    assert not data.skipped and data.sessions_without_reward == 0
    assert len(data.calls) == len(mine) + len(theirs)
    assert {c.reward for c in data.calls if c.session_id.startswith("t")} == {1.0}
    assert {c.reward for c in data.calls if c.session_id.startswith("u")} == {0.25}
    assert {c.db for c in data.calls if c.session_id.startswith("t")} == {str(a)}
    # the calls' own file first, then the files in the order given
    set_reward(a, "t0~0", 0.5)
    c = tmp_path / "c.duckdb"
    write_calls(c, [])
    set_rewards(c, [{"session_id": "t0~1", "reward": 0.0}])
    rewards = {r.session_id: r.reward for r in training_calls([a, c, b], tasks=["t0"]).calls}
    assert (rewards["t0~0"], rewards["t0~1"], rewards["t0~2"]) == (0.5, 0.0, 1.0)
    rewards = {r.session_id: r.reward for r in training_calls([a, b, c], tasks=["t0"]).calls}
    assert (rewards["t0~0"], rewards["t0~1"], rewards["t0~2"]) == (0.5, 1.0, 1.0)


@pytest.mark.parametrize("harness_sampling", [False, True])
def test_top_k_off_is_what_vllm_takes(harness_sampling):
    """vLLM 0.10+ takes 0 or -1 for "off" (0 preferred), older ones only -1: -1 is sent."""
    req = google.to_chat({"contents": [{"role": "user", "parts": [{"text": "x"}]}],
                          "generationConfig": {"topK": 0}}, "/v1beta/models/g:generateContent")
    assert backend.to_backend(req, "m", harness_sampling=harness_sampling)["top_k"] == -1
