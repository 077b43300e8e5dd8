"""The closed loop, two iterations, with real vLLM and real Pi: every call of iteration 1 is
sampled by version 0 and every call of iteration 2 by version 1; after the sync vLLM's
logprobs match the trainer's saved checkpoint; the database holds both iterations."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from polar_mitm.models import ensure_default_model
from polar_mitm.store import query
from support.rollouts import installed
from support.vllm_parity import hf_logprobs, mean_abs, reload, vllm_logprobs

TRAIN = str(Path(sys.executable).parent / "polar-train")
@pytest.mark.vllm
def test_two_iterations_of_the_loop_on_real_vllm_and_pi(vllm_backend, tmp_path):
    installed("pi")
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
    assert rows == [(f"{run}.0", [0], rows[0][2]), (f"{run}.1", [1], rows[1][2])], rows
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
    # on disk: the last --keep (2) checkpoints, and only the trainer state a resume reads
    assert sorted(p.name for p in (out / "checkpoints").iterdir()) == ["v1", "v2"]
    assert [p.name for p in (out / "trainer").iterdir()] == ["v2.pt"]
