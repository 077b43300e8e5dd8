"""The GRPO objective a user expects: the PPO clip acts from the second optimizer step of a
training call on (the "old" policy is the one at its start), every rewarded session counts
in its group's baseline, and groups without advantage cost nothing."""

from __future__ import annotations

import math
from dataclasses import replace

import pytest

from support.grpo_data import synthetic_calls, tiny_model_dir
from polar_mitm.grpo.config import TrainConfig
from polar_mitm.grpo.train import Trainer, TrainError


def test_the_clip_acts_at_one_epoch_and_two_groups_per_step(tmp_path):
    """--epochs 1 --groups-per-step 2 on 4 groups: two optimizer steps. The first step's
    ratios are exactly 1 (the policy has not moved); after a large first update the second
    step's tokens are scored against the policy at the start, so its ratios move and the
    clip acts."""
    model = tiny_model_dir(tmp_path / "m")
    t = Trainer(model, TrainConfig(lr=0.05, epochs=1, groups_per_step=2, token_budget=128))
    history = t.train_on(synthetic_calls(tasks=4, seed=3), tmp_path / "run").history
    assert len(history) == 2
    first, second = history
    assert first.clip_frac == 0.0 and first.ratio_min == first.ratio_max == 1.0
    assert second.ratio_min < 1.0 or second.ratio_max > 1.0
    assert second.clip_frac > 0.0, second


def test_every_rewarded_session_counts_in_its_groups_baseline(tmp_path):
    """Rewards (0, 0, 1, 0) where the last session's calls all failed (it has none to train):
    the advantages are those of the whole group, -0.58 and +1.73 (population std), not
    -0.71 and +1.41 from the three sessions with calls."""
    model = tiny_model_dir(tmp_path / "m")
    rewards = {0: 0.0, 1: 0.0, 2: 1.0, 3: 0.0}
    calls = [replace(c, reward=rewards[int(c.session_id.rsplit("~", 1)[1])])
             for c in synthetic_calls(tasks=1, seed=1, sessions=4) if not c.session_id.endswith("~3")]
    t = Trainer(model, TrainConfig(lr=1e-4, token_budget=128))
    alone = t.train_on(calls, tmp_path / "a").history[0]
    assert (round(alone.adv_min, 2), round(alone.adv_max, 2)) == (-0.71, 1.41)
    whole = t.train_on(calls, tmp_path / "b", session_rewards={"t0~3": ("t0", 0.0)}).history[0]
    assert (round(whole.adv_min, 2), round(whole.adv_max, 2)) == (-0.58, 1.73)
    assert math.isclose(whole.adv_max, 0.75 / math.sqrt(0.1875), rel_tol=1e-4)   # std + eps


def test_groups_with_equal_rewards_are_left_out_and_counted(tmp_path):
    model = tiny_model_dir(tmp_path / "m")
    varied = synthetic_calls(tasks=1, seed=2, prefix="v")
    flat = [replace(c, reward=1.0) for c in synthetic_calls(tasks=2, seed=4, prefix="f")]
    t = Trainer(model, TrainConfig(lr=1e-4, token_budget=128))
    s = t.train_on(varied + flat, tmp_path / "a")
    assert s.groups == 1 and s.zero_adv_groups == 2
    assert s.calls == len(varied)                          # no forward or backward for the flat groups
    assert s.history[0].forward_tokens == t.train_on(varied, tmp_path / "b").history[0].forward_tokens
    with pytest.raises(TrainError, match="rewards are equal"):
        t.train_on(flat, tmp_path / "c")
