"""FSDP2 across 2 CPU processes (gloo) trains exactly what 1 process does: same loss,
same updated weights. Rows are small, so keys/values are reused across rows on each rank."""

import json
import os
import subprocess
import sys
from pathlib import Path

import torch

from support.grpo_data import synthetic_calls, tiny_model_dir, write_calls
from polar_mitm.store.training import set_rewards

ARGS = ["--lr", "1e-3", "--token-budget", "32", "--epochs", "2", "--groups-per-step", "2"]


def train(db, model, out, nproc):
    torchrun = Path(sys.executable).parent / "torchrun"
    cmd = ([str(torchrun), f"--nproc-per-node={nproc}", "--standalone"] if nproc > 1 else [sys.executable]) + \
        ["-m", "polar_mitm.cli.train", "train", "--db", str(db), "--model", str(model), "--out", str(out), *ARGS]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=120, env=env)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    return [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]


def test_two_processes_match_one(tmp_path):
    from safetensors.torch import load_file

    calls = synthetic_calls(tasks=3, drifts=1, retries=1)
    db = tmp_path / "a.duckdb"
    write_calls(db, calls)
    set_rewards(db, [{"session_id": c.session_id, "reward": c.reward} for c in calls])
    model = tiny_model_dir(tmp_path / "model")
    one = train(db, model, tmp_path / "one", 1)
    two = train(db, model, tmp_path / "two", 2)
    assert len(one) == len(two) == 4
    for a, b in zip(one, two):
        assert abs(a["loss"] - b["loss"]) <= 1e-6 + 1e-4 * abs(a["loss"])
        assert a["tokens"] == b["tokens"]
        assert abs(a["grad_norm"] - b["grad_norm"]) <= 1e-4 * a["grad_norm"]
    w1 = load_file(tmp_path / "one" / "checkpoint" / "model.safetensors")
    w2 = load_file(tmp_path / "two" / "checkpoint" / "model.safetensors")
    w0 = load_file(model / "model.safetensors")
    assert w1.keys() == w2.keys()
    moved = 0
    for k in w1:
        assert torch.allclose(w1[k], w2[k], atol=1e-5), k
        moved += not torch.equal(w1[k], w0[k])
    assert moved > 0
