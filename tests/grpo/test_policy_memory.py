"""Memory of a step is bounded by the token budget, not the prefix: a prefix thousands of
rows deep runs (no recursion), trains exactly what one row does, and a smaller budget
never costs more memory."""

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from polar_mitm.grpo.policy import ForestRunner
from polar_mitm.grpo.config import TrainConfig
from polar_mitm.grpo.step import prepare_step
from polar_mitm.trainer_input import Call
from support.grpo_step import make_calls, rel, step_loss_and_grads, tiny_lm

ROOT = Path(__file__).resolve().parents[2]


def long_prompt_calls(prompt_len: int):
    """Two sessions under one long prompt, two calls each."""
    g = torch.Generator().manual_seed(0)
    toks = lambda n: torch.randint(3, 64, (n,), generator=g).tolist()  # noqa: E731
    prompt = toks(prompt_len)
    calls = []
    for s, reward in enumerate([1.0, 0.0]):
        r1, r2 = toks(5), toks(4)
        for seq, (p, r) in enumerate([(prompt, r1), (prompt + r1 + toks(3), r2)], 1):
            calls.append(Call(session_id=f"t~{s}", group="t", seq=seq, prompt=p, tokens=r,
                              logprobs=[-1.0] * len(r), finish_reason="stop", reward=reward))
    return calls


@pytest.fixture
def one_thread():
    """A thousand tiny rows: on a loaded machine, thread hand-offs would dominate. Python's
    default recursion limit (pytest-xdist's workers raise it), so that a step that recursed
    once per row would fail here."""
    n, limit = torch.get_num_threads(), sys.getrecursionlimit()
    torch.set_num_threads(1)
    sys.setrecursionlimit(1000)
    yield
    sys.setrecursionlimit(limit)
    torch.set_num_threads(n)


def test_a_prefix_over_a_thousand_rows_deep_trains_exactly_what_one_row_does(one_thread):
    lm = tiny_lm()
    calls = long_prompt_calls(2100)
    loss_a, g_a, whole = step_loss_and_grads(lm, calls, "trie", budget=100000)
    loss_b, g_b, split = step_loss_and_grads(lm, calls, "trie", budget=2)
    rows = split.runner.rows
    depth, r = 0, max(range(len(rows)), key=lambda i: rows[i].attach)
    while r >= 0:
        depth, r = depth + 1, rows[r].parent_row
    assert depth > sys.getrecursionlimit()
    assert abs(loss_a - loss_b) <= 1e-9 * abs(loss_a) and rel(g_b, g_a) <= 1e-9


def test_peak_memory_does_not_grow_as_the_budget_shrinks():
    """bench_memory's step at a small scale: a 6,000-token prefix on a Llama 4 x 128."""
    peaks = []
    for budget in (8192, 2048, 512):
        r = subprocess.run([sys.executable, str(ROOT / "scripts" / "bench_memory.py"), "--one", "6000", "4", "128",
                            str(budget)], capture_output=True, text=True, timeout=600, cwd=ROOT)
        assert r.returncode == 0, r.stderr[-3000:]
        peaks.append(json.loads(r.stdout.strip().splitlines()[-1])["peak"])
    assert peaks[1] < peaks[0] and peaks[2] < peaks[1], peaks


def test_steps_are_planned_when_they_run():
    """prepare_step builds nothing; each layout() plans the step afresh (the same plan),
    and the per-target tensors follow the forest's target order."""
    calls = make_calls(drifts=1, retries=1)
    offsets = [0]
    for c in calls:
        offsets.append(offsets[-1] + len(c.tokens))
    step = prepare_step(calls, list(range(len(calls))), ["t0", "t1"], offsets, TrainConfig(token_budget=23),
                        torch.device("cpu"), 0, 1, "polar_sdpa")
    assert not any(isinstance(v, ForestRunner) for v in vars(step).values())
    layout = step.layout()
    a, b = layout.runner, step.layout().runner
    assert a is not b and [r.nodes for r in a.rows] == [r.nodes for r in b.rows]
    f, targets = a.f, layout.targets
    assert targets.flat.tolist() == [offsets[c] + j for c, j in zip(f.target_call, f.target_index)]
    assert targets.call_ids.tolist() == f.target_call and torch.equal(targets.rollout, torch.tensor(f.target_logprob))
    assert layout.stats.forward_tokens == len(f.tokens)
