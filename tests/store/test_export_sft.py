"""`polar-mitm export sft`: rollouts as SFT data, from a database the proxy recorded.

The calls are real: the official SDKs (OpenAI chat, Anthropic) drive multi-turn tool
conversations through the gateway (in this process, tests/support/inprocess_proxy.py) to a vLLM
stand-in that renders each request with the default model's tokenizer and the tool-aware chat
template vLLM runs with (after parsing tool-call arguments to objects, as vLLM does), and
samples a scripted answer as the hermes template writes it. So the recorded prompt ids are
what vLLM would have recorded, and the exported messages must render back to them."""

from __future__ import annotations

import copy
import json
import math
from pathlib import Path

import anthropic
import openai
import orjson
import pytest
from click.testing import CliRunner

from support.fake_vllm import FakeVLLM
from support.inprocess_proxy import InProcessProxy
from polar_mitm.stack import launch
from polar_mitm.cli.main import main as polar_mitm
from polar_mitm.models import ensure_default_model
from polar_mitm.store import query, set_reward
from polar_mitm.store.sft import ExportStats, chains, export_sft, held_out, iteration_of, sft_rows

TEMPLATE = (launch.TEMPLATES / "smollm2_tools.jinja").read_text()
FAIL = "please fail"
DONE = "Are you done?"

BASH = {"type": "function", "function": {
    "name": "bash", "description": "Run a shell command",
    "parameters": {"type": "object", "properties": {"command": {"type": "string"}}, "required": ["command"]}}}
READ = {"type": "function", "function": {
    "name": "read_file", "description": "Read a file",
    "parameters": {"type": "object", "properties": {"path": {"type": "string"},
                                                    "limit": {"type": "integer", "description": "lines"}},
                   "required": ["path"]}}}
CALC = {"name": "calc", "description": "Evaluate arithmetic",
        "input_schema": {"type": "object", "properties": {"expression": {"type": "string"}},
                         "required": ["expression"]}}
ARGS = {"bash": {"command": "ls -la"}, "read_file": {"path": "a.txt", "limit": 20}, "calc": {"expression": "2+3"}}


def vllm_args(messages: list[dict]) -> list[dict]:
    """Tool-call arguments parsed to objects, as vLLM hands them to the chat template."""
    messages = copy.deepcopy(messages)
    for m in messages:
        for call in m.get("tool_calls") or []:
            if isinstance(call["function"]["arguments"], str):
                call["function"]["arguments"] = json.loads(call["function"]["arguments"])
    return messages


class TemplateVLLM(FakeVLLM):
    """vLLM as far as the records go: prompt ids are the chat template's rendering of the
    request, tokenized; the answer is scripted (the tools in turn, then text) and sampled as
    the hermes template renders it, ending in <|im_end|>. A last user turn FAIL gets a 500."""

    def __init__(self, tokenizer):
        super().__init__("scripted")
        self.tok = tokenizer
        self.eot = tokenizer.convert_tokens_to_ids("<|im_end|>")

    def prompt_ids(self, messages, tools=None) -> list[int]:
        text = self.tok.apply_chat_template(vllm_args(messages), tools=tools, chat_template=TEMPLATE,
                                            add_generation_prompt=True, tokenize=False)
        return self.tok.encode(text, add_special_tokens=False)

    def _completion(self, body: dict, weights):
        last = (body.get("messages") or [{}])[-1]
        if last.get("role") == "user" and last.get("content") == FAIL:
            return 500, b'{"error":{"message":"engine crashed","type":"InternalServerError"}}'
        return super()._completion(body, weights)

    def answer(self, body: dict) -> dict:
        messages, tools = body.get("messages") or [], body.get("tools") or []
        done = sum(m["role"] == "tool" for m in messages)
        system = messages[0]["content"] if messages and messages[0]["role"] == "system" else ""
        msg: dict = {"role": "assistant", "content": None}
        if "sub-agent" in system:
            text = "Summary: a.txt says hello."
        elif messages[-1]["role"] == "user" and messages[-1]["content"] == DONE:
            text = "Yes, done."
        elif done < len(tools):
            name = tools[done]["function"]["name"]
            args = json.dumps(ARGS[name])   # the template's tojson: json.dumps's separators
            text = f'<tool_call>\n{{"name": "{name}", "arguments": {args}}}\n</tool_call>'
            msg["tool_calls"] = [{"id": f"call_{next(self._ids)}", "type": "function",
                                  "function": {"name": name, "arguments": args}}]
        else:
            text = "The file says hello.\n"   # the harness strips it when it sends it back: drift
        if not msg.get("tool_calls"):
            msg["content"] = text
        out_ids = self.tok.encode(text, add_special_tokens=False) + [self.eot]
        return self.completion(body, msg, out_ids, self.prompt_ids(messages, tools or None), logprob=-0.5)


def openai_session(proxy, sid: str, turns: str = "tools") -> None:
    """An agent loop on OpenAI chat: tool calls answered until the model writes text; with
    turns="full" a sub-agent's conversation, a failed call and a follow-up turn besides."""
    oa = openai.OpenAI(api_key=f"polar-{sid}", base_url=proxy.base_url + "/v1", max_retries=0, timeout=60)
    messages: list[dict] = [{"role": "system", "content": "You are a coding agent."},
                            {"role": "user", "content": "Fix the bug in a.txt."}]
    while True:
        r = oa.chat.completions.create(model="gpt-5", messages=messages, tools=[BASH, READ])
        m = r.choices[0].message
        if not m.tool_calls:
            break
        messages.append({"role": "assistant", "content": m.content, "tool_calls": [
            {"id": c.id, "type": "function", "function": {"name": c.function.name, "arguments": c.function.arguments}}
            for c in m.tool_calls]})
        messages += [{"role": "tool", "tool_call_id": c.id, "content": f"output of {c.function.name}"}
                     for c in m.tool_calls]
        if turns == "full" and len(messages) == 4:   # the agent hands a sub-task to a sub-agent
            oa.chat.completions.create(model="gpt-5", messages=[
                {"role": "system", "content": "You are a sub-agent: summarize."},
                {"role": "user", "content": "Summarize a.txt."}])
    if turns != "full":
        return
    messages.append({"role": "assistant", "content": m.content.strip()})   # re-rendered: drift
    with pytest.raises(openai.InternalServerError):
        oa.chat.completions.create(model="gpt-5", messages=[*messages, {"role": "user", "content": FAIL}],
                                   tools=[BASH, READ])
    oa.chat.completions.create(model="gpt-5", messages=[*messages, {"role": "user", "content": DONE}],
                               tools=[BASH, READ])


def anthropic_session(proxy, sid: str, tools: bool = True) -> None:
    an = anthropic.Anthropic(api_key=f"polar-{sid}", base_url=proxy.base_url, max_retries=0, timeout=60)
    history: list[dict] = [{"role": "user", "content": "What is 2+3?"}]
    while True:
        m = an.messages.create(model="claude-sonnet-4-5", max_tokens=64, messages=history,
                               **({"tools": [CALC]} if tools else {}))
        uses = [b for b in m.content if b.type == "tool_use"]
        if not uses:
            return
        history.append({"role": "assistant", "content": [
            {"type": "tool_use", "id": b.id, "name": b.name, "input": b.input} if b.type == "tool_use"
            else {"type": "text", "text": b.text} for b in m.content]})
        history.append({"role": "user", "content": [{"type": "tool_result", "tool_use_id": b.id, "content": "5"}
                                                    for b in uses]})


REWARDS = {"fix@r1.0~0": 1.0, "fix@r1.0~1": 0.0, "fix@r1.0~2": 1.0, "fix@r1.0~2.r2": 1.0,
           "add@r1.1~0": 1.0, "add@r1.1.eval~0": 1.0}


@pytest.fixture(scope="module")
def tokenizer():
    from transformers import AutoTokenizer
    return AutoTokenizer.from_pretrained(ensure_default_model())


@pytest.fixture(scope="module")
def recorded(tmp_path_factory, tokenizer):
    """The database of a small rollout: six rewarded sessions and one without a reward."""
    root = tmp_path_factory.mktemp("sft")
    with TemplateVLLM(tokenizer) as backend:
        proxy = InProcessProxy(root, backend.url)
        try:
            openai_session(proxy, "fix@r1.0~0", "full")
            openai_session(proxy, "fix@r1.0~1")
            openai_session(proxy, "fix@r1.0~2")
            openai_session(proxy, "fix@r1.0~2.r2")
            anthropic_session(proxy, "add@r1.1~0")
            anthropic_session(proxy, "add@r1.1.eval~0", tools=False)
            anthropic_session(proxy, "loose~0", tools=False)
        finally:
            proxy.stop()
    for sid, reward in REWARDS.items():
        set_reward(proxy.db, sid, reward)
    return proxy.db


def calls_by_id(db) -> dict[str, tuple[list[int], list[int]]]:
    return {cid: (prompt, tokens) for cid, prompt, tokens in
            query(db, "SELECT call_id, prompt_token_ids, token_ids FROM calls")[1]}


def render(tokenizer, messages, tools, generation: bool) -> str:
    return tokenizer.apply_chat_template(messages, tools=tools or None, chat_template=TEMPLATE,
                                         add_generation_prompt=generation, tokenize=False)


def test_sessions_chains_and_skips(recorded):
    stats = ExportStats()
    rows = list(sft_rows([recorded], min_reward=1.0, stats=stats))
    assert sorted((r["session_id"], r["chain"], r["main_chain"], len(r["call_ids"])) for r in rows) == [
        ("add@r1.1~0", 0, True, 2),
        ("fix@r1.0~0", 0, True, 4),     # main loop: 3 tool turns and the follow-up; the failed call is in no row
        ("fix@r1.0~0", 1, False, 1),    # the sub-agent
        ("fix@r1.0~2.r2", 0, True, 3)]
    assert stats.skipped_sessions == {"below_min_reward": 1, "superseded_attempt": 1, "held_out": 1,
                                      "no_reward": 1}
    assert stats.skipped_calls == {"failed": 1}
    assert (stats.rows, stats.sessions) == (4, 3)
    main = next(r for r in rows if r["session_id"] == "fix@r1.0~0" and r["main_chain"])
    assert [m["role"] for m in main["messages"]] == ["system", "user", "assistant", "tool", "assistant", "tool",
                                                     "assistant", "user", "assistant"]
    assert main["messages"][2]["tool_calls"][0]["function"] == {"name": "bash", "arguments": ARGS["bash"]}
    assert main["messages"][3]["content"] == "output of bash"
    assert main["messages"][-1] == {"role": "assistant", "content": "Yes, done."}
    assert [t["function"]["name"] for t in main["tools"]] == ["bash", "read_file"]
    assert main["task_id"] == "fix@r1.0" and main["reward"] == 1.0 and main["policy_version"] == 0
    assert main["db"] == str(recorded)
    add = next(r for r in rows if r["session_id"] == "add@r1.1~0")
    assert add["messages"][1]["tool_calls"][0]["function"] == {"name": "calc", "arguments": ARGS["calc"]}
    assert add["messages"][2]["role"] == "tool" and add["messages"][2]["content"] == "5"

    # the filters
    def sessions(**kw):
        return sorted({(r["session_id"], r["chain"]) for r in sft_rows([recorded], **kw)})
    assert sessions(min_reward=0.0, main_chain=True) == [
        ("add@r1.1~0", 0), ("fix@r1.0~0", 0), ("fix@r1.0~1", 0), ("fix@r1.0~2.r2", 0)]
    assert sessions(min_reward=1.0, iteration=1) == [("add@r1.1~0", 0)]
    assert sessions(min_reward=1.0, iteration=1, include_held_out=True) == [("add@r1.1.eval~0", 0), ("add@r1.1~0", 0)]
    assert sessions(min_reward=1.0, task="fix", main_chain=True) == [("fix@r1.0~0", 0), ("fix@r1.0~2.r2", 0)]
    assert sessions(min_reward=1.0, task="fix@r1.*") == sessions(min_reward=1.0, task="f*")
    assert sessions(min_reward=1.0, task="add@r1.1") == [("add@r1.1~0", 0)]
    assert iteration_of("add@5f1c2a.12.eval") == 12 and held_out("add@5f1c2a.12.eval")
    assert iteration_of("add") is None and not held_out("add.eval")


def test_messages_render_to_the_recorded_prompt_ids(recorded, tokenizer):
    """The round trip: each row's messages but the last, rendered with the model's chat
    template, are the prompt ids vLLM recorded for the chain's last call, and with the last
    (the answer) they continue with the ids it sampled."""
    ids = calls_by_id(recorded)
    rows = list(sft_rows([recorded], min_reward=0.0))
    assert len(rows) == 5
    for row in rows:
        prompt, tokens = ids[row["call_ids"][-1]]
        text = render(tokenizer, row["messages"][:-1], row["tools"], generation=True)
        assert tokenizer.encode(text, add_special_tokens=False) == prompt, row["session_id"]
        whole = render(tokenizer, row["messages"], row["tools"], generation=False)
        assert whole.startswith(tokenizer.decode(prompt + tokens)), row["session_id"]


def test_tokens_rows_mask_what_was_sampled_as_sampled(recorded, tokenizer):
    ids = calls_by_id(recorded)
    rows = {(r["session_id"], r["chain"]): r for r in sft_rows([recorded], min_reward=1.0, fmt="tokens")}
    assert set(rows) == {("add@r1.1~0", 0), ("fix@r1.0~0", 0), ("fix@r1.0~0", 1), ("fix@r1.0~2.r2", 0)}
    for row in rows.values():
        prompt, tokens = ids[row["call_ids"][-1]]
        assert row["input_ids"] == prompt + tokens
        assert len(row["completion_mask"]) == len(row["input_ids"])
        assert row["completion_mask"][len(prompt):] == [1] * len(tokens)   # the last answer, whole
    # an exact chain: every call's sampled ids are in the last prompt as sampled
    exact = rows[("fix@r1.0~2.r2", 0)]
    calls = [ids[c] for c in exact["call_ids"]]
    assert sum(exact["completion_mask"]) == sum(len(t) for _, t in calls)
    for p, t in calls:
        assert exact["input_ids"][len(p):len(p) + len(t)] == t
        assert exact["completion_mask"][len(p):len(p) + len(t)] == [1] * len(t)
    assert exact["completion_mask"][:len(calls[0][0])] == [0] * len(calls[0][0])
    # drift: the harness sent the text answer back stripped; the follow-up joined the chain by
    # its messages, and of the re-rendered answer only what is still as sampled is trained
    main = rows[("fix@r1.0~0", 0)]
    (p3, t3), (p4, _) = ids[main["call_ids"][2]], ids[main["call_ids"][3]]
    assert p4[:len(p3)] == p3 and p4[len(p3):len(p3) + len(t3)] != t3
    kept = main["completion_mask"][len(p3):len(p3) + len(t3)]
    assert 0 < sum(kept) < len(t3) and kept == sorted(kept, reverse=True)
    assert tokenizer.decode(p4[len(p3):len(p3) + sum(kept)]).startswith("The file says hello")


def test_files_load_with_datasets_as_written(recorded, tmp_path, tokenizer):
    import datasets

    ids = calls_by_id(recorded)
    for fmt in ("messages", "tokens"):
        written = [orjson.loads(line) for line in _export(recorded, tmp_path / f"{fmt}.jsonl", fmt).splitlines()]
        assert len(written) == 4
        for suffix in ("jsonl", "parquet"):
            out = tmp_path / f"{fmt}.{suffix}"
            if suffix == "parquet":
                _export(recorded, out, fmt)
                ds = datasets.Dataset.from_parquet(str(out), cache_dir=str(tmp_path / "cache"))
            else:
                ds = datasets.load_dataset("json", data_files=str(out), split="train",
                                           cache_dir=str(tmp_path / "cache"))
            assert ds.to_list() == written, (fmt, suffix)   # no key added, none lost, arguments intact
            if fmt == "messages":
                row = ds[0]
                text = render(tokenizer, row["messages"][:-1], row["tools"], generation=True)
                assert tokenizer.encode(text, add_special_tokens=False) == ids[row["call_ids"][-1]][0]


def _export(db, out: Path, fmt: str) -> str:
    r = CliRunner().invoke(polar_mitm, ["export", "sft", "--db", str(db), "--min-reward", "1",
                                        "--format", fmt, "--out", str(out)])
    assert r.exit_code == 0, r.output
    assert f"wrote 4 rows ({fmt}) from 3 sessions" in r.output
    assert "skipped 4 sessions: below_min_reward 1, held_out 1, no_reward 1, superseded_attempt 1" in r.output
    assert "calls in no row: failed 1" in r.output
    return out.read_text() if out.suffix == ".jsonl" else ""


def test_cli_errors_and_the_parquet_export_beside_it(recorded, tmp_path):
    runner = CliRunner()
    r = runner.invoke(polar_mitm, ["export", "sft", "--db", str(recorded), "--min-reward", "1", "--out",
                                   str(tmp_path / "x.csv")])
    assert r.exit_code == 2 and "ending in .jsonl or .parquet" in r.output
    r = runner.invoke(polar_mitm, ["export", "sft", "--db", str(tmp_path / "none.duckdb"), "--min-reward", "1",
                                   "--out", str(tmp_path / "x.jsonl")])
    assert r.exit_code == 2 and "no database at" in r.output
    assert not (tmp_path / "x.jsonl").exists()
    # two files: rows from each, each naming its file
    r = runner.invoke(polar_mitm, ["export", "sft", "--db", str(recorded), "--db", str(recorded), "--min-reward",
                                   "1", "--main-chain", "--out", str(tmp_path / "two.jsonl")])
    assert r.exit_code == 0, r.output
    assert "wrote 6 rows (messages) from 3 sessions" in r.output
    # `export` alone is still the Parquet export of the tables
    r = runner.invoke(polar_mitm, ["export", "--db", str(recorded), "--out", str(tmp_path / "pq")])
    assert r.exit_code == 0, r.output
    assert (tmp_path / "pq" / "calls.parquet").exists() and (tmp_path / "pq" / "sessions.parquet").exists()


def test_chain_rules():
    """By ids, by messages (re-rendered history), a retry of the same prompt replaces the tip,
    and anything else starts a chain."""
    from polar_mitm.store.sft import _Call

    def call(cid, messages, prompt, tokens):
        return _Call(cid, "m", 0, [{"role": "user", "content": m} for m in messages], [], None, prompt, tokens)
    a = call("a", ["u1"], [1, 2], [3])
    b = call("b", ["u1", "x", "u2"], [1, 2, 3, 9], [4])   # extends a's ids
    sub = call("s", ["other"], [7], [8])
    c = call("c", ["u1", "x", "u2", "y", "u3"], [1, 2, 3, 9, 5, 6], [4])   # b's 4 re-rendered as 5: by messages
    again = call("d", ["u1", "x", "u2", "y", "u3"], [1, 2, 3, 9, 5, 6], [7])   # the same prompt again
    assert [[x.call_id for x in ch] for ch in chains([a, b, sub, c, again])] == [["a", "b", "c", "d"], ["s"]]


def test_one_trl_sft_step_on_each_format(recorded, tmp_path, tokenizer):
    """One optimizer step of TRL's SFTTrainer on the exported files, as they are (both
    formats, both file types), with a tiny random Llama that has the default model's tokenizer
    and chat template: its loss is about ln(vocabulary), as a random model's is."""
    pytest.importorskip("trl")
    import sft_trl_step

    model = sft_trl_step.tiny_model(tmp_path / "model", ensure_default_model())
    for fmt, suffix in (("messages", "parquet"), ("tokens", "jsonl")):
        out = tmp_path / f"{fmt}.{suffix}"
        export_sft([recorded], out, min_reward=1.0, fmt=fmt) 
        loss = sft_trl_step.one_step(out, tmp_path / f"run-{fmt}-{suffix}", model_dir=model, batch_size=2)
        assert math.isfinite(loss) and abs(loss - math.log(len(tokenizer))) < 0.5, (fmt, suffix, loss)


@pytest.fixture(autouse=True, scope="module")
def _scripts_on_path():
    import sys
    scripts = str(Path(__file__).resolve().parents[2] / "scripts")
    sys.path.insert(0, scripts)
    yield
    sys.path.remove(scripts)
