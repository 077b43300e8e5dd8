"""The rollout half end to end on the real default model: `polar-mitm rollout` runs a task file
of 2 tasks x 4 samples with Pi (installed from npm) through the proxy and real vLLM (SmolLM2).
The calls land under TASK~i sessions, the evaluator's rewards are stored, the callback gets
each scored group, and every state change is in DuckDB."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

from polar_mitm.store import query
from polar_mitm.store.training import training_calls
from support.callbacks import Callbacks
from support.rollouts import installed

POLAR = str(Path(sys.executable).parent / "polar-mitm")


def test_pi_task_file_end_to_end_on_real_vllm(vllm_backend, tmp_path):
    installed("pi")
    ws = tmp_path / "repo"
    ws.mkdir()
    (ws / "notes.txt").write_text("hello\n")
    cb = Callbacks()
    tasks = tmp_path / "tasks.jsonl"
    tasks.write_text("\n".join(json.dumps(t) for t in [
        {"task_id": "greet", "instruction": "Say hello in one short sentence.", "workspace": str(ws),
         "timeout": 240, "evaluator": "test -f notes.txt && echo 0.25", "callback_url": cb.url,
         "metadata": {"kind": "float reward"}},
        {"task_id": "colors", "instruction": "Name three colors.", "workspace": str(ws), "timeout": 240,
         "evaluator": "grep -q hello notes.txt", "callback_url": cb.url},
    ]) + "\n")
    db = tmp_path / "rollouts.duckdb"
    try:
        out = subprocess.run([POLAR, "rollout", str(tasks), "--harness", "pi", "--samples", "4", "--db", str(db),
                              "--backend", vllm_backend, "--workers", "4", "--max-tokens", "48"],
                             capture_output=True, text=True, timeout=900)
    finally:
        cb.close()
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    assert "sessions:" in out.stdout and "mean reward" in out.stdout, out.stdout    # progress + summary
    sids = [f"{t}~{i}" for t in ("colors", "greet") for i in range(4)]

    _, rows = query(db, "SELECT session_id, state, reward FROM rollout_sessions ORDER BY 1")
    assert rows == [(s, "done", 1.0 if s.startswith("colors") else 0.25) for s in sids], out.stdout
    _, rows = query(db, "SELECT session_id, task_id, reward FROM sessions WHERE reward IS NOT NULL ORDER BY 1")
    assert rows == [(s, s.split("~")[0], 1.0 if s.startswith("colors") else 0.25) for s in sids]
    # every session's calls went through the proxy to vLLM, with tokens and logprobs
    _, rows = query(db, "SELECT session_id, count(*), count(error), min(len(token_ids)) FROM call_records "
                        "GROUP BY 1 ORDER BY 1")
    assert [r[0] for r in rows] == sids and all(n >= 1 and err == 0 and ntok >= 1 for _, n, err, ntok in rows), rows
    # every state each session passed through, in order
    _, rows = query(db, "SELECT session_id, list(state ORDER BY event_at) FROM rollout_events "
                        "WHERE session_id IS NOT NULL GROUP BY 1 ORDER BY 1")
    assert [r[0] for r in rows] == sids
    for _, states in rows:
        assert states == ["pending", "assigned", "init", "ready", "run", "post_run", "done"], states
    _, rows = query(db, "SELECT task_id, state, callback_state FROM rollout_tasks ORDER BY 1")
    assert rows == [("colors", "done", "sent"), ("greet", "done", "sent")]
    groups = {g["task_id"]: g for g in cb.groups}
    assert sorted(groups) == ["colors", "greet"] and groups["greet"]["metadata"] == {"kind": "float reward"}
    assert sorted(s["session_id"] for s in groups["colors"]["sessions"]) == sids[:4]
    assert all(s["stats"]["calls"] >= 1 and s["stats"]["completion_tokens"] >= 1
               for g in groups.values() for s in g["sessions"])
    # and the trainer reads them as two GRPO groups of four
    data = training_calls([db], tasks=["colors", "greet"])
    assert {c.group for c in data.calls} == {"colors", "greet"}
    assert {c.session_id for c in data.calls} == set(sids)
