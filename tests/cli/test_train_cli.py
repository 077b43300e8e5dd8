"""polar-train on synthetic recorded sessions with a tiny random model: reading, rewards,
stats, a training run's outputs, and clear errors for bad input."""

import json

import pytest
import torch
from click.testing import CliRunner

from support.grpo_data import synthetic_calls, tiny_model_dir, write_calls
from polar_mitm.store.training import training_calls
from polar_mitm.cli.train import main


def run(*args, ok=True):
    r = CliRunner().invoke(main, [str(a) for a in args], catch_exceptions=False)
    assert (r.exit_code == 0) == ok, r.output
    return r.output


@pytest.fixture
def recorded(tmp_path):
    calls = synthetic_calls(drifts=1, side_calls=1, retries=1)
    db = tmp_path / "a.duckdb"
    bad = [({"session_id": "t0~0", "task_id": "t0"},
            {"status_code": 502, "error": "backend down", "prompt_token_ids": [1], "token_ids": [2], "logprobs": [0.0]}),
           ({"session_id": "t0~0", "task_id": "t0"},
            {"status_code": 200, "prompt_token_ids": [1, 2], "token_ids": [3, 4], "logprobs": [-1.0]}),
           ({"session_id": "t0~1", "task_id": "t0"}, {"status_code": 200, "prompt_token_ids": [1, 2]})]
    write_calls(db, calls, bad)
    rewards = tmp_path / "rewards.jsonl"
    by_session = {c.session_id: c.reward for c in calls}
    rewards.write_text("\n".join(json.dumps({"session_id": s, "reward": r}) for s, r in by_session.items()
                                 if s != "t1~2"))
    return db, calls, rewards


def test_reading_skips_and_counts_what_cannot_be_trained(recorded, tmp_path):
    db, calls, rewards = recorded
    data = training_calls([db], require_reward=False)
    assert len(data.calls) == len(calls)
    assert dict(data.skipped) == {"failed": 1, "logprobs_mismatch": 1, "no_token_ids": 1}
    assert "set 5 rewards" in run("reward", "--db", db, rewards)
    data = training_calls([db])
    assert data.skipped["no_reward"] == sum(c.session_id == "t1~2" for c in calls)
    assert data.sessions_without_reward == 1
    assert {c.session_id for c in data.calls} == {c.session_id for c in calls} - {"t1~2"}
    # several files (one per gateway machine) are read together
    db2 = tmp_path / "b.duckdb"
    more = synthetic_calls(tasks=1, seed=5, prefix="u")
    write_calls(db2, more)
    two = training_calls([db, db2], require_reward=False)
    assert len(two.calls) == len(calls) + len(more)
    assert {c.db for c in two.calls} == {str(db), str(db2)}
    only = training_calls([db, db2], tasks=["u0"], require_reward=False)
    assert len(only.calls) == len(more) and {c.group for c in only.calls} == {"u0"}


def test_stats_prints_the_builder_comparison(recorded):
    db, calls, _ = recorded
    out = run("stats", "--db", db)
    for b in ("per_request", "prefix_merging", "trie", "drift_events", "forward_tokens"):
        assert b in out
    report = json.loads(run("stats", "--db", db, "--json"))
    rows = {r["builder"]: r for r in report["builders"]}
    assert rows["trie"]["trained_tokens"] == sum(len(c.tokens) for c in calls)
    assert rows["trie"]["forward_tokens"] < rows["prefix_merging"]["forward_tokens"] < rows["per_request"]["forward_tokens"]
    assert report["skipped"] == {"failed": 1, "logprobs_mismatch": 1, "no_token_ids": 1}


def test_train_writes_metrics_a_plot_and_a_checkpoint(recorded, tmp_path):
    from transformers import AutoModelForCausalLM

    db, calls, rewards = recorded
    run("reward", "--db", db, rewards)
    model = tiny_model_dir(tmp_path / "model")
    out = tmp_path / "run"
    text = run("train", "--db", db, "--model", model, "--out", out, "--lr", "1e-3", "--epochs", "2",
               "--groups-per-step", "1", "--token-budget", "32")
    assert "steps" in text and "skipped calls: failed 1" in text
    rows = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [1, 2, 3, 4]
    for key in ("loss", "reward_mean", "reward_std", "adv_mean", "adv_std", "clip_frac", "ratio_mean",
                "logprob_abs_diff", "tokens_per_s", "grad_norm"):
        assert key in rows[0]
    assert rows[0]["ratio_mean"] == pytest.approx(1.0)      # first visit: proximal = current
    assert rows[2]["ratio_mean"] != pytest.approx(1.0, abs=1e-9)   # second epoch: the policy moved
    assert (out / "metrics.png").read_bytes()[:4] == b"\x89PNG"
    before = AutoModelForCausalLM.from_pretrained(model)
    after = AutoModelForCausalLM.from_pretrained(out / "checkpoint")
    moved = [n for (n, a), b in zip(before.named_parameters(), after.parameters()) if not torch.equal(a, b)]
    assert moved


def test_bad_input_is_said_plainly(recorded, tmp_path):
    db, _, rewards = recorded
    model = tiny_model_dir(tmp_path / "model")
    assert "no database at" in run("train", "--db", tmp_path / "missing.duckdb", "--model", model,
                                   "--out", tmp_path / "o", ok=False)
    assert "no rewarded sessions" in run("train", "--db", db, "--model", model, "--out", tmp_path / "o", ok=False)
    run("reward", "--db", db, rewards)
    small = tiny_model_dir(tmp_path / "small", vocab=16)
    assert "outside the model's vocabulary" in run("train", "--db", db, "--model", small, "--out", tmp_path / "o",
                                                    ok=False)
    assert "no Hugging Face model" in run("train", "--db", db, "--model", tmp_path, "--out", tmp_path / "o", ok=False)
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"session_id": "t0~0", "reward": "high"}\n')
    assert "reward must be a number" in run("reward", "--db", db, bad, ok=False)
    bad.write_text("{nope\n")
    assert "not JSON" in run("reward", "--db", db, bad, ok=False)
    assert "no database" in run("reward", "--db", tmp_path / "none.duckdb", rewards, ok=False)


def test_a_retry_and_the_attempt_it_replaced_are_one_sample(tmp_path):
    """A node declared lost after it rewarded TASK~1, and the retry TASK~1.r2 rewarded too:
    the group still has one session per sample (the latest attempt)."""
    from support.grpo_data import synthetic_calls, write_calls
    from polar_mitm.store import set_reward
    from polar_mitm.store.training import training_calls

    db = tmp_path / "a.duckdb"
    calls = [c for c in synthetic_calls(tasks=1, seed=0, sessions=2)]
    retry = [type(c)(**{**{f: getattr(c, f) for f in c.__dataclass_fields__}, "session_id": c.session_id + ".r2"})
             for c in calls if c.session_id.endswith("~1")]
    write_calls(db, calls + retry)
    for sid in {c.session_id for c in calls + retry}:
        set_reward(db, sid, 1.0, task_id="t0")
    data = training_calls([db])
    sessions = {c.session_id for c in data.calls}
    assert sessions == {"t0~0", "t0~1.r2"} and data.skipped["superseded_attempt"] == len(retry)
