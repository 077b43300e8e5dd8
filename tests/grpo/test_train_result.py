"""A training call's typed result: its history is metrics.jsonl line for line, summary.json
is its summary, and the proximal logprobs keep each token's first score."""

from __future__ import annotations

import json
import math

import torch

from support.grpo_data import synthetic_calls, tiny_model_dir
from polar_mitm.grpo.config import TrainConfig
from polar_mitm.grpo.step import ProximalLogprobs
from polar_mitm.grpo.train import train


def test_the_result_holds_what_the_files_hold(tmp_path):
    """Two groups, one per step, two epochs: four steps over two plans."""
    out = tmp_path / "out"
    cfg = TrainConfig(lr=1e-3, epochs=2, groups_per_step=1, token_budget=64)
    r = train(synthetic_calls(tasks=2, seed=0), tiny_model_dir(tmp_path / "m"), out, cfg)
    rows = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]
    assert rows == [m.as_dict() for m in r.history] and r.metrics_path == out / "metrics.jsonl"
    assert [(m.step, m.epoch, m.global_step) for m in r.history] == [(1, 0, 1), (2, 0, 2), (3, 1, 3), (4, 1, 4)]
    assert r.steps == 4 and r.last == r.history[-1] and (r.groups, r.zero_adv_groups) == (2, 0)
    assert [b.forward_tokens for b in r.build] * 2 == [m.forward_tokens for m in r.history]
    assert json.loads((out / "summary.json").read_text()) == r.summary()
    assert r.checkpoint == out / "checkpoint" and (r.checkpoint / "config.json").exists()


def test_the_proximal_logprobs_keep_each_tokens_first_score():
    p = ProximalLogprobs.unscored(4)
    p.values[3] = -3.0   # a later step's token, scored up front
    assert p.first_visit(torch.tensor([0, 3]), torch.tensor([-0.5, -9.0])).tolist() == [-0.5, -3.0]
    assert p.first_visit(torch.tensor([0, 1]), torch.tensor([-7.0, -1.0])).tolist() == [-0.5, -1.0]
    assert math.isnan(p.values[2])   # never visited
