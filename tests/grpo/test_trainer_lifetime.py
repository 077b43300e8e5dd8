"""The Trainer lives across a loop's iterations: one AdamW state and learning-rate schedule
over all of them, the KL reference fixed at the initial policy, and a state that resumes."""

from __future__ import annotations

import torch

from support.grpo_data import synthetic_calls, tiny_model_dir
from polar_mitm.grpo.config import LossConfig, TrainConfig
from polar_mitm.grpo.train import Trainer


def params(trainer) -> torch.Tensor:
    return torch.cat([p.detach().flatten().clone() for p in trainer.policy.parameters()])


def test_the_schedule_and_the_optimizer_run_over_the_whole_loop(tmp_path):
    model = tiny_model_dir(tmp_path / "m")
    cfg = TrainConfig(lr=1e-3, warmup_steps=4, token_budget=64)
    t = Trainer(model, cfg)
    lrs = []
    for it in range(3):   # three iterations, one step each (all groups in one step)
        s = t.train_on(synthetic_calls(tasks=2, seed=it), tmp_path / f"it{it}")
        lrs += [m.lr for m in s.history]
    assert lrs == [1e-3 * 1 / 4, 1e-3 * 2 / 4, 1e-3 * 3 / 4]   # warmup continues, not restarted
    assert t.step == 3 and t.opt.state   # AdamW's moments are kept


def test_the_kl_reference_is_the_initial_policy_not_each_iterations_start(tmp_path):
    model = tiny_model_dir(tmp_path / "m")
    cfg = TrainConfig(lr=1e-2, token_budget=64, loss=LossConfig(kl_coef=0.1))
    t = Trainer(model, cfg)
    first = t.train_on(synthetic_calls(tasks=2, seed=0), tmp_path / "a").history[0]
    assert abs(first.kl) < 1e-6              # the policy is still the reference
    second = t.train_on(synthetic_calls(tasks=2, seed=0), tmp_path / "b").history[0]
    assert second.kl > 1e-6                  # it moved away from the initial policy


def test_a_saved_trainer_resumes_where_it_stopped(tmp_path):
    model = tiny_model_dir(tmp_path / "m")
    cfg = TrainConfig(lr=1e-3, warmup_steps=10, token_budget=64)
    a = Trainer(model, cfg)
    a.train_on(synthetic_calls(tasks=2, seed=0), tmp_path / "a0")
    a.save(tmp_path / "ckpt")
    a.save_state(tmp_path / "state.pt")
    a.train_on(synthetic_calls(tasks=2, seed=1), tmp_path / "a1")

    b = Trainer(tmp_path / "ckpt", cfg)      # a new process: the checkpoint and the state
    b.load_state(tmp_path / "state.pt")
    assert b.step == 1
    b.train_on(synthetic_calls(tasks=2, seed=1), tmp_path / "b1")
    assert torch.allclose(params(a), params(b), atol=1e-6)
