"""The trainer's step on a tiny random Llama in float64 on CPU, for the tests that compare its
losses and gradients (builders, budgets, checkpointing, memory): the model, harness-shaped
calls with drifts, one step through the trainer's own code, and a relative difference.
step_inputs is also the benchmarks' (scripts/bench_trainer.py, scripts/bench_memory.py)."""

import copy
import random

import torch
from transformers import LlamaConfig, LlamaForCausalLM

from polar_mitm.grpo.advantages import group_advantages, token_weights
from polar_mitm.grpo.attention import register
from polar_mitm.grpo.config import TrainConfig
from polar_mitm.grpo.policy import TokenLogprobs
from polar_mitm.grpo.step import ProximalLogprobs, StepInputs, StepLayout, prepare_step, run_step
from polar_mitm.grpo.synthetic import Shape, group
from polar_mitm.trainer_input import Call
from support.grpo_data import VOCAB


def tiny_lm(attn="polar_sdpa", seed=0):
    register()   # the trainer's CPU attention (chain rows); "sdpa" and "eager" are transformers' own
    torch.manual_seed(seed)
    cfg = LlamaConfig(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=1024,
                      attn_implementation=attn)
    return LlamaForCausalLM(cfg).double()


def make_calls(drifts: int, seed: int = 0, **kw):
    rng = random.Random(seed)
    shape = Shape(sessions=3, turns=4, shared=30, tool=(2, 6), response=(2, 6), drifts=drifts,
                  side_calls=kw.get("side_calls", 1), retries=kw.get("retries", 0),
                  subagents=kw.get("subagents", 0), compactions=kw.get("compactions", 0), vocab=VOCAB)
    rewards = [1.0, 0.0, 0.5]
    return [c for t in range(2) for c in group(f"t{t}", shape, rng, reward=lambda s: rewards[s])]


def step_inputs(calls: list[Call], dtype: torch.dtype = torch.float64) -> tuple[list[int], StepInputs]:
    """All the calls as one step: each call's first flat token index (and the total last),
    and the objective's inputs: the sessions' group advantages, the default token weights,
    proximal logprobs not scored yet (the step's first visit scores them)."""
    rewards = {c.session_id: c.reward for c in calls}
    adv_s = group_advantages(rewards, {c.session_id: c.group for c in calls})
    adv = torch.tensor([adv_s[c.session_id] for c in calls], dtype=dtype)
    offsets = [0]
    for c in calls:
        offsets.append(offsets[-1] + len(c.tokens))
    weights = torch.tensor([w for ws in token_weights(calls) for w in ws], dtype=torch.float64)
    return offsets, StepInputs(adv, weights, ProximalLogprobs.unscored(offsets[-1], dtype))


def step_loss_and_grads(lm, calls, builder, budget=4096, checkpoint=False) -> tuple[float, torch.Tensor, StepLayout]:
    """One step's loss, flattened gradients and layout (its rows and the builder's counts),
    through the trainer's own step code, on a copy of lm."""
    cfg = TrainConfig(builder=builder, token_budget=budget)
    lm = copy.deepcopy(lm)
    offsets, inputs = step_inputs(calls)
    plan = prepare_step(calls, list(range(len(calls))), sorted({c.group for c in calls}), offsets, cfg,
                        torch.device("cpu"), 0, 1, lm.config._attn_implementation, lm.dtype)
    run = run_step(TokenLogprobs(lm, checkpoint_rows=checkpoint), plan, inputs, cfg.loss,
                   lambda: torch.autocast("cpu", enabled=False))
    grads = torch.cat([p.grad.flatten() for p in lm.parameters()])
    return run.sums["loss"], grads, plan.layout()


def rel(a, b):
    return float((a - b).norm() / max(b.norm(), 1e-30))
