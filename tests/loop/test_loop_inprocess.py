"""The loop in this process, against stand-ins (a dev-mode vLLM stand-in, the fake harness, a
tiny random model): its steps run in order, its row is built once from their typed parts,
and the sync figures the gateway reports reach the loop's columns through one shared type.
A finished run starts nothing, and loads neither torch nor the model."""

from __future__ import annotations

import json
import subprocess
import sys
import typing
from dataclasses import fields

from support.fake_vllm import FakeVLLM
from support.grpo_data import tiny_model_dir
from support.loop_run import fake_tasks
from polar_mitm.addons.sync_report import SwapSeconds, SwapStep, SyncReport, slowest
from polar_mitm.grpo.config import TrainConfig
from polar_mitm.loop.options import LoopOptions
from polar_mitm.loop.run import run_loop
from polar_mitm.loop.state import LoopState
from polar_mitm.store.loop import ITERATION_COLUMNS


def test_two_iterations_in_process_fill_every_column_from_the_steps(tmp_path):
    model = str(tiny_model_dir(tmp_path / "model"))
    out = tmp_path / "run"
    said: list[str] = []
    with FakeVLLM(delay=0.01) as fake:
        opts = LoopOptions(tasks_file=str(fake_tasks(tmp_path, "ok 2")), iterations=2, out=out, harness="command",
                           samples=2, backend=fake.url, model=model, workers=2, max_tokens=8)
        rows = run_loop(opts, TrainConfig(lr=1e-3, token_budget=256), echo=said.append)
        state = LoopState.load(out)
        assert state is not None and (state.completed, state.version) == (2, 2)
        assert fake.weights == state.checkpoint == str(out / "checkpoints" / "v2")
    assert [(r["iteration"], r["policy_version"]) for r in rows] == [(0, 0), (1, 1)]
    # the row is whole: what the steps measured, each in its column (the sync's through SyncReport)
    filled = {"checkpoint", "reward_mean", "reward_std", "reward_n", "sessions_done", "calls",
              "tokens", "stale_dropped", "stale_tokens", "unknown_version_tokens", "loss", "clip_frac",
              "logprob_abs_diff", "rollout_s", "train_s", "sync_s",
              "sync_drain_s", "sync_reload_s", "sync_reset_s", "journal_saves", "per_task", "released_why"}
    for r in rows:
        assert set(r) >= set(ITERATION_COLUMNS)
        assert not [c for c in filled if r[c] is None], r
        assert r["sync_wake_s"] is None and r["sleep_s"] is None       # not colocated: no sleep, no wake
        assert r["eval_reward_mean"] is None                           # no held-out tasks
        assert r["calls"] > 0 and r["sessions_done"] == 4 and json.loads(r["per_task"]).keys() == {"a", "b"}
    assert [line for line in said if line.startswith("iteration ") and "(policy v" in line][-1].startswith(
        "iteration 2 (policy v1): reward")
    assert all(r["stale_tokens"] == 0 and r["tokens"] > 0 for r in rows)   # K=0: every token the policy's own
    assert sum("tokens, 0.0% stale" in line for line in said) == 2
    # the stand-in has the token route: syncs are in flight (vLLM paused, nothing drained)
    assert any(line.startswith("synced policy v2 (inflight): drained 0 calls") for line in said), said
    assert all(r["sync_mode"] == "inflight" and r["sync_stall_s"] > 0 for r in rows)
    assert any(line.startswith("iter ver  reward") for line in said)   # the table

    # a rerun of the finished loop: nothing starts, and neither torch nor the model is loaded
    probe = (
        "import sys\n"
        "from polar_mitm.cli.train import main\n"
        "try:\n"
        f"    main(['loop', '--tasks', {opts.tasks_file!r}, '--iterations', '2', '--out', {str(out)!r},\n"
        f"          '--backend', 'http://127.0.0.1:9', '--model', {model!r}], standalone_mode=False)\n"
        "finally:\n"
        "    print('loaded:', sorted(m for m in ('torch', 'transformers', 'vllm') if m in sys.modules))\n")
    r = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stdout + r.stderr
    assert "2 iterations done already (--iterations 2); nothing to run" in r.stdout
    assert "loaded: []" in r.stdout, r.stdout


def test_weights_from_memory_are_pulled_by_vllm_and_the_folder_is_still_written(tmp_path):
    """--weights-from memory: each sync hands vLLM the trainer's weights over HTTP (the stand-in
    fetches them and checks their sha256, as the worker extension does), in flight; the
    checkpoint folder is written meanwhile, for resume and for a gateway's reload after a
    restart."""
    model = str(tiny_model_dir(tmp_path / "model"))
    out = tmp_path / "run"
    said: list[str] = []
    with FakeVLLM(delay=0.01) as fake:
        fake.fetch_pulls = True
        opts = LoopOptions(tasks_file=str(fake_tasks(tmp_path, "ok 2")), iterations=2, out=out, harness="command",
                           samples=2, backend=fake.url, model=model, workers=2, max_tokens=8, weights_from="memory")
        rows = run_loop(opts, TrainConfig(lr=1e-3, token_budget=256), echo=said.append)
        state = LoopState.load(out)
    assert state is not None and (state.completed, state.version) == (2, 2)
    pulls = [(m, kw) for m, kw in fake.rpcs if m == "polar_pull_weights"]
    prefetches = [kw for m, kw in fake.rpcs if m == "polar_prefetch_weights"]
    assert len(pulls) == 2 and prefetches == [kw for _, kw in pulls], fake.rpcs
    assert len({kw["sha256"] for _, kw in pulls}) == 2 and all(kw["url"].startswith("http://127.0.0.1:")
                                                               for _, kw in pulls)
    assert {s for s, _ in fake.pulled} == {kw["sha256"] for _, kw in pulls} and all(n > 0 for _, n in fake.pulled)
    assert fake.weights == pulls[-1][1]["url"] and fake.weight_version == "polar-v2"
    for v in (1, 2):    # the folders, for resume
        assert (out / "checkpoints" / f"v{v}" / "config.json").is_file()
    assert state.checkpoint == str(out / "checkpoints" / "v2")
    assert [r["sync_mode"] for r in rows] == ["inflight", "inflight"]
    assert sum(line.startswith("published v") and "from memory" in line for line in said) == 2, said


def test_the_gateways_sync_report_reaches_the_loop_through_one_type():
    # every swap step the gateway times has its own figure
    assert {f"{s}_s" for s in typing.get_args(SwapStep)} == {f.name for f in fields(SwapSeconds)}
    steps = SwapSeconds()
    steps.add("reload", 0.5)
    steps.add("reset", 0.25)
    steps.add("reset", 0.25)
    fast = SyncReport(3, "/ckpt/v3", held=1, drained=2, drain_s=0.1, swap_s=1.0, total_s=1.1, steps=steps)
    slow = SyncReport(3, "/ckpt/v3", held=0, drained=5, drain_s=0.4, swap_s=2.0, total_s=2.4,
                      steps=SwapSeconds(reload_s=1.5, reset_s=0.1))
    # as the loop gets them: each node's JSON, or a word where it served the target already
    read = [SyncReport.from_json(json.loads(json.dumps(r.as_json()))) for r in (fast, slow)]
    assert read == [fast, slow]
    assert SyncReport.from_json("already served") is None
    figures = slowest([*read, None])
    assert (figures.drain_s, figures.drained, figures.held) == (0.4, 5, 1)
    assert (figures.reload_s, figures.reset_s, figures.wake_s) == (1.5, 0.5, None)   # the slowest node's each
    asleep = SyncReport.from_json(SyncReport(3, None, 0, 1, 0.2, 0.3, 0.5).as_json())   # a sleep: no steps
    assert slowest([asleep]).drain_s == 0.2 and slowest([asleep]).reload_s is None
