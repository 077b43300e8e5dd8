"""The closed loop, two iterations, with real vLLM and real Pi: every call of iteration 1 is
sampled by version 0 and every call of iteration 2 by version 1; after the sync vLLM's
logprobs match the trainer's saved checkpoint; the database holds both iterations."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import httpx
import pytest

from polar_mitm.models import DEFAULT_MODEL_NAME, ensure_default_model
from polar_mitm.rollout import harnesses
from polar_mitm.store import query

TRAIN = str(Path(sys.executable).parent / "polar-train")
PROMPT = "The capital of France is"


def vllm_logprobs(backend: str) -> tuple[list[int], list[int], list[float]]:
    """Greedy tokens after PROMPT, with vLLM's logprobs of them."""
    r = httpx.post(backend + "/v1/completions", timeout=120, trust_env=False, json={
        "model": DEFAULT_MODEL_NAME, "prompt": PROMPT, "max_tokens": 8, "temperature": 0, "logprobs": 0,
        "return_token_ids": True})
    r.raise_for_status()
    choice = r.json()["choices"][0]
    return r.json()["choices"][0].get("prompt_token_ids") or r.json()["prompt_token_ids"], \
        choice["token_ids"], choice["logprobs"]["token_logprobs"]


def hf_logprobs(model_dir: str, prompt: list[int], tokens: list[int]) -> list[float]:
    import torch
    from transformers import AutoModelForCausalLM

    lm = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    ids = torch.tensor([prompt + tokens])
    with torch.no_grad():
        logits = lm(ids).logits[0, len(prompt) - 1:-1].float()
    return logits.log_softmax(-1).gather(1, torch.tensor(tokens)[:, None])[:, 0].tolist()


def mean_abs(a, b) -> float:
    return sum(abs(x - y) for x, y in zip(a, b)) / len(a)


def reload(backend: str, model_dir: str) -> None:
    httpx.post(backend + "/collective_rpc", json={"method": "reload_weights", "kwargs": {"weights_path": model_dir}},
               timeout=300, trust_env=False).raise_for_status()
    httpx.post(backend + "/reset_prefix_cache", timeout=60, trust_env=False).raise_for_status()


@pytest.mark.vllm
def test_two_iterations_of_the_loop_on_real_vllm_and_pi(vllm_backend, tmp_path):
    try:
        harnesses.install("pi")
    except harnesses.HarnessMissing as e:
        pytest.skip(f"pi could not be installed from npm: {e}")
    base = str(ensure_default_model())
    tasks = tmp_path / "tasks.jsonl"
    # the sample index as reward: every group has variance, so each step moves the weights
    tasks.write_text("\n".join(json.dumps(t) for t in [
        {"task_id": "count", "instruction": "Count from 1 to 3.", "timeout": 240,
         "evaluator": "echo $POLAR_SAMPLE"},
        {"task_id": "colors", "instruction": "Name two colors.", "timeout": 240,
         "evaluator": 'test -s "$POLAR_OUTPUT" && echo $POLAR_SAMPLE'},
    ]) + "\n")
    out = tmp_path / "run"
    try:
        r = subprocess.run([TRAIN, "loop", "--tasks", str(tasks), "--iterations", "2", "--out", str(out),
                            "--harness", "pi", "--samples", "2", "--backend", vllm_backend, "--max-tokens", "32",
                            "--lr", "1e-4", "--workers", "4"], capture_output=True, text=True, timeout=1200)
        assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
        state = json.loads((out / "loop.json").read_text())
        assert state["completed"] == 2 and state["version"] == 2
        # vLLM now serves the trainer's last checkpoint, not the base model
        prompt, tokens, served = vllm_logprobs(vllm_backend)
        trained = hf_logprobs(state["checkpoint"], prompt, tokens)
        initial = hf_logprobs(base, prompt, tokens)
        assert mean_abs(served, trained) < 0.05, (served, trained)
        assert mean_abs(served, initial) > mean_abs(served, trained)
        assert mean_abs(trained, initial) > 1e-4
    finally:
        reload(vllm_backend, base)   # the shared server serves the base model again
    db = out / "rollouts.duckdb"
    run = state["run_id"]
    # every call of iteration i was sampled by version i (the gateway's own, never polled)
    _, rows = query(db, "SELECT split_part(split_part(session_id, '@', 2), '~', 1) AS it, "
                        "list(DISTINCT policy_version), count(*) FROM calls GROUP BY 1 ORDER BY 1")
    assert rows == [(f"{run}.0", ["0"], rows[0][2]), (f"{run}.1", ["1"], rows[1][2])], rows
    assert all(n >= 4 for *_, n in rows)
    # both iterations' sessions, rewards and training metrics, with SQL
    _, rows = query(db, "SELECT iteration, policy_version, calls > 0, loss IS NOT NULL, checkpoint "
                        "FROM loop_iterations ORDER BY iteration")
    assert [r[:4] for r in rows] == [(0, 0, True, True), (1, 1, True, True)]
    _, rows = query(db, "SELECT count(*) FROM loop_steps WHERE run_id = ?", [run])
    assert rows[0][0] >= 2
    _, rows = query(db, "SELECT version FROM policy_versions ORDER BY 1")
    assert rows == [(1,), (2,)]
    _, rows = query(db, "SELECT count(*), count(reward) FROM sessions WHERE session_id LIKE '%@%'")
    assert rows == [(8, 8)]
    assert (out / "loop.png").exists() and "reward" in r.stdout
