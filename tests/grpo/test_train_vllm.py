"""The trainer on sessions that real vLLM (SmolLM2 on CPU) served through the proxy:
trainer-vs-vLLM logprob parity, a training run whose checkpoint vLLM reloads and answers
with, and one GRPO step moving the policy the right way."""

import concurrent.futures
import json
import os
import random

import httpx
import openai
import pytest
import torch
from click.testing import CliRunner

from support.mitmdump_proxy import Proxy
from polar_mitm.grpo.packing import merge
from polar_mitm.grpo.policy import ForestRunner, TokenLogprobs
from polar_mitm.grpo.calls import drift_events
from polar_mitm.grpo.train import logprob_parity
from polar_mitm.grpo.trajectories import build
from polar_mitm.models import DEFAULT_MODEL_NAME, default_model_dir
from polar_mitm.store.training import training_calls
from polar_mitm.cli.train import main as polar_train
from support.vllm_parity import hf_logprobs, mean_abs, vllm_logprobs

pytestmark = pytest.mark.vllm

TASKS = {"colors": "Name three colors, then look up the weather in Paris.",
         "math": "What is 12 times 7? Use the calculator tool if you need it."}
SAMPLES, TURNS, MAX_TOKENS = 3, 3, 24
TOOLS = [{"type": "function", "function": {
    "name": "lookup", "description": "Look something up.",
    "parameters": {"type": "object", "properties": {"query": {"type": "string"}}, "required": ["query"]}}}]


def run_session(base_url: str, session: str, prompt: str, seed: int) -> list[str]:
    """A multi-turn tool loop as a harness runs it: every turn resends the whole history.
    Sample 0 of each task re-renders its earlier answers as some harnesses do (whitespace
    around the text normalized to one newline each side, tool arguments re-serialized), so the next
    prompt holds other tokens than vLLM sampled: a real drift event."""
    rerender = session.endswith("~0")
    client = openai.OpenAI(api_key=f"polar-{session}", base_url=base_url + "/v1", max_retries=0, timeout=300)
    rng = random.Random(seed)
    messages = [{"role": "system", "content": "You are a helpful assistant with tools."},
                {"role": "user", "content": prompt}]
    texts = []
    for turn in range(TURNS):
        r = client.chat.completions.create(model="gpt-5", messages=messages, tools=TOOLS,
                                           max_tokens=MAX_TOKENS, temperature=1.0)
        msg = r.choices[0].message
        texts.append(msg.content or "")
        content = "\n" + (msg.content or "").strip() + "\n" if rerender else msg.content
        if msg.tool_calls:
            calls = [tc.model_dump() for tc in msg.tool_calls]
            if rerender:
                for tc in calls:
                    try:
                        tc["function"]["arguments"] = json.dumps(json.loads(tc["function"]["arguments"]), indent=1)
                    except ValueError:
                        pass
            messages.append({"role": "assistant", "content": content, "tool_calls": calls})
            for tc in msg.tool_calls:
                messages.append({"role": "tool", "tool_call_id": tc.id, "content": f"result {rng.randint(1, 99)}"})
        else:
            messages.append({"role": "assistant", "content": content or ""})
            messages.append({"role": "user", "content": rng.choice(["Go on.", "Are you sure?", "Shorter."])})
    return texts


@pytest.fixture(scope="module")
def recorded(vllm_backend, tmp_path_factory):
    root = tmp_path_factory.mktemp("train-vllm")
    proxy = Proxy(root, vllm_backend)
    try:
        jobs = [(f"{task}~{i}", prompt, i) for task, prompt in TASKS.items() for i in range(SAMPLES)]
        with concurrent.futures.ThreadPoolExecutor(len(jobs)) as pool:
            outputs = dict(zip([j[0] for j in jobs], pool.map(lambda j: run_session(proxy.base_url, *j), jobs)))
    finally:
        proxy.stop()
    # A reward that differs within each group: the longer the answers, the better.
    rewards = root / "rewards.jsonl"
    rewards.write_text("\n".join(json.dumps({"session_id": s, "reward": float(sum(map(len, t)))})
                                 for s, t in outputs.items()))
    r = CliRunner().invoke(polar_train, ["reward", "--db", str(proxy.db), str(rewards)])
    assert r.exit_code == 0, r.output
    return proxy.db, root


def test_trainer_logprobs_match_vllm(recorded):
    db, _ = recorded
    r = CliRunner().invoke(polar_train, ["stats", "--db", str(db), "--model", str(default_model_dir()), "--json"])
    assert r.exit_code == 0, r.output
    report = json.loads(r.output[r.output.index("{"):])
    rows = {b["builder"]: b for b in report["builders"]}
    assert rows["trie"]["calls"] == len(TASKS) * SAMPLES * TURNS
    assert rows["trie"]["forward_tokens"] < rows["prefix_merging"]["forward_tokens"] < rows["per_request"]["forward_tokens"]
    parity = report["parity"]
    print(f"\nreal SmolLM2 sessions: {rows['trie']['calls']} calls, {parity['tokens']} sampled tokens; "
          f"|trainer - vLLM| logprob mean {parity['mean_abs_diff']:.4f}, p99 {parity['p99_abs_diff']:.4f}; "
          f"forward tokens trie {rows['trie']['forward_tokens']} / prefix_merging "
          f"{rows['prefix_merging']['forward_tokens']} / per_request {rows['per_request']['forward_tokens']}; "
          f"drift events {rows['trie']['drift_events']}")
    assert parity["tokens"] == rows["trie"]["trained_tokens"] > 0
    assert parity["mean_abs_diff"] < 0.05
    # the re-rendering sessions drifted, and the trie trains their tokens in the contexts
    # vLLM sampled them in: the trainer's logprobs match vLLM's on exactly those sessions
    calls = training_calls([db]).calls
    events = drift_events(calls)
    drifted = {calls[d.later].session_id for d in events}
    assert any(s.endswith("~0") for s in drifted), drifted
    p = logprob_parity([c for c in calls if c.session_id in drifted], default_model_dir(), token_budget=2048)
    print(f"drift: {len(events)} events in {sorted(drifted)}; their sessions' |trainer - vLLM| logprob "
          f"mean {p['mean_abs_diff']:.4f} over {p['tokens']} tokens")
    assert p["tokens"] > 0 and p["mean_abs_diff"] < 0.05


@pytest.fixture(scope="module")
def trained(recorded):
    db, root = recorded
    out = root / "run"
    r = CliRunner().invoke(polar_train, ["train", "--db", str(db), "--out", str(out), "--lr", "2e-5",
                                         "--token-budget", "2048"])
    assert r.exit_code == 0, r.output
    return db, out / "checkpoint"


def test_one_grpo_step_moves_the_policy_the_right_way(trained):
    from transformers import AutoModelForCausalLM

    db, checkpoint = trained
    calls = training_calls([db]).calls
    forest = merge(build(calls, "trie").samples)
    runner = ForestRunner(forest, 2048, torch.device("cpu"))
    from polar_mitm.grpo.advantages import group_advantages
    adv = group_advantages({c.session_id: c.reward for c in calls}, {c.session_id: c.group for c in calls})
    a = torch.tensor([adv[calls[k].session_id] for k in forest.target_call])
    means = []
    for model in (default_model_dir(), checkpoint):
        lm = AutoModelForCausalLM.from_pretrained(model, dtype=torch.float32)
        with torch.no_grad():
            lp = runner.run(TokenLogprobs(lm), None)
        means.append((float(lp[a > 0].mean()), float(lp[a < 0].mean())))
    (pos0, neg0), (pos1, neg1) = means
    print(f"\nmean logprob of sampled tokens, before -> after one step: advantage > 0: {pos0:.4f} -> {pos1:.4f}; "
          f"advantage < 0: {neg0:.4f} -> {neg1:.4f}")
    assert (a > 0).any() and (a < 0).any()
    assert pos1 > pos0 and neg1 < neg0


def test_vllm_reloads_the_checkpoint_and_answers(trained, vllm_backend):
    _, checkpoint = trained
    original = default_model_dir()
    http = httpx.Client(base_url=vllm_backend, timeout=120, trust_env=False)

    def ask() -> dict:
        r = http.post("/v1/chat/completions", json={
            "model": DEFAULT_MODEL_NAME, "messages": [{"role": "user", "content": "Name three colors."}],
            "max_tokens": 8, "temperature": 0, "logprobs": True})
        assert r.status_code == 200, r.text
        return r.json()["choices"][0]

    def reload(path) -> None:
        r = http.post("/collective_rpc", json={"method": "reload_weights", "kwargs": {"weights_path": str(path)}})
        assert r.status_code == 200, r.text
        http.post("/reset_prefix_cache")

    before = ask()
    try:
        reload(checkpoint)
        after = ask()
        assert after["message"]["content"]
        lp = lambda c: [t["logprob"] for t in c["logprobs"]["content"]]  # noqa: E731
        assert lp(after) != lp(before)     # the served weights changed...
        prompt, tokens, served = vllm_logprobs(vllm_backend)   # ...and they are the trained ones
        trained, initial = hf_logprobs(str(checkpoint), prompt, tokens), hf_logprobs(str(original), prompt, tokens)
        print(f"\nafter the reload, |vLLM - checkpoint| {mean_abs(served, trained):.4f}, "
              f"|vLLM - base| {mean_abs(served, initial):.4f}")
        assert mean_abs(served, trained) < 0.05
        assert mean_abs(served, trained) < mean_abs(served, initial)
    finally:
        reload(original)                   # other tests share this server
    assert ask()["logprobs"] == before["logprobs"]
    assert os.path.exists(checkpoint / "tokenizer.json")
