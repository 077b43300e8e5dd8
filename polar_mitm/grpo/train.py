"""GRPO on recorded harness sessions, top to bottom.

Choices, stated up front:
- Data: every trainable call of the chosen sessions, rewarded per session. One GRPO group
  = the sessions of one task (TASK~i). Advantages are group-normalized per session and
  put on every token that session's calls sampled; the std is the population std of the
  group's rewards (every rewarded session counts, even one with no trainable call). Groups
  with equal rewards carry no advantage and are left out (counted as zero_adv_groups).
- Contexts: the `trie` builder (default) trains each sampled token in exactly the context
  vLLM sampled it in, and runs whatever a group shares once. `prefix_merging` (NVIDIA
  Polar) and `per_request` are there for comparison; all three optimize one objective.
- Loss: PPO clipped ratio (0.2 / 0.28) against the policy at the start of the training
  call (the first step's tokens are scored by it on their first visit, later steps' in a
  no-grad pass up front, as PPO minibatches do), truncated importance sampling (cap 2)
  for the vLLM/trainer gap, optional k3 KL;
  normalized per token or per session over the whole step, so micro-batches and ranks
  add up to the same gradient.
- Micro-batches are rows of at most `token_budget` tokens; a prefix longer than a row is
  computed once and its keys/values reused by the rows below it.
- Scale: under torchrun, FSDP2 shards the model and ranks split the groups.

A training call (Trainer.train_on), step by step: the rewarded calls (RewardedCalls), the
groups with an advantage (TrainingData), a plan per optimizer step (StepPlan, step.py),
the objective's inputs (StepInputs), one StepResult per step and epoch, and the
TrainResult (results.py).
"""

from __future__ import annotations

import json
import logging
import math
import os
import shutil
import time
from dataclasses import asdict, dataclass, replace
from functools import cached_property
from pathlib import Path
from typing import TYPE_CHECKING, Mapping, Sequence, cast

import torch

from ..trainer_input import Call, SessionReward
from .advantages import GroupStats, group_advantages, group_stats, token_weights
from .config import BUILDERS, AdvantageConfig, LossConfig, Normalization, TrainConfig  # noqa: F401 - re-exported
from .loss import METRIC_SUMS, summarize
from .metrics import StepLog
from .packing import merge
from .policy import ForestRunner, TokenLogprobs
from .results import Progress, StepMetrics, StepResult, TrainResult
from .step import ProximalLogprobs, StepInputs, StepPlan, prepare_step, run_step, score_tokens
from .trajectories import build

if TYPE_CHECKING:
    from torch.distributed.fsdp import FSDPModule

    from .weight_server import Published, WeightServer

logger = logging.getLogger("polar.train")


class TrainError(ValueError):
    """Bad input for training, said plainly (the CLI shows it as is)."""


# ---- set-up helpers ------------------------------------------------------------------------

def dist_env() -> tuple[int, int]:
    return int(os.environ.get("RANK", 0)), int(os.environ.get("WORLD_SIZE", 1))


def load_model(model_dir: str | os.PathLike, device: torch.device, dtype: torch.dtype = torch.float32):
    from transformers import AutoModelForCausalLM
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()   # a bar per load would drown the loop's own progress
    path = Path(model_dir)
    if not (path / "config.json").exists():
        raise TrainError(f"no Hugging Face model at {path} (config.json missing)")
    lm: torch.nn.Module = AutoModelForCausalLM.from_pretrained(path, dtype=dtype,
                                                               attn_implementation=_attention(device))
    return lm.to(device)


def _attention(device: torch.device) -> str:
    """flex attention's block masks on GPUs; on CPU, SDPA with chain rows (attention.py)."""
    if device.type == "cuda":
        try:
            import torch.nn.attention.flex_attention  # noqa: F401
            return "flex_attention"
        except ImportError:
            return "sdpa"
    from .attention import register
    return register()


def check_vocabulary(lm, calls: Sequence[Call]) -> None:
    rows = lm.get_input_embeddings().weight.shape[0]
    top = max((max(max(c.prompt, default=0), max(c.tokens, default=0)) for c in calls), default=0)
    if top >= rows:
        raise TrainError(f"token id {top} is outside the model's vocabulary ({rows} rows): "
                         "these calls were recorded from a different model")


# ---- the training call's data -----------------------------------------------------------------

@dataclass(frozen=True)
class RewardedCalls:
    """The calls of rewarded sessions, and every rewarded session's reward and group."""
    calls: list[Call]
    rewards: dict[str, float]      # session -> reward, those with no trainable call included
    group_of: dict[str, str]       # session -> its GRPO group


def rewarded_calls(calls: Sequence[Call], session_rewards: Mapping[str, SessionReward] | None) -> RewardedCalls:
    """session_rewards (session -> (group, reward)): every rewarded session of the groups,
    those with no trainable call included, so each group's baseline counts them."""
    rewards = {c.session_id: c.reward for c in calls if c.reward is not None}
    group_of = {c.session_id: c.group for c in calls}
    for sid, (group, reward) in (session_rewards or {}).items():
        rewards.setdefault(sid, reward)
        group_of.setdefault(sid, group)
    kept = [c for c in calls if c.session_id in rewards]
    if not kept:
        raise TrainError("no rewarded sessions to train on (set rewards with `polar-train reward`)")
    return RewardedCalls(kept, rewards, group_of)


@dataclass(frozen=True)
class TrainingData:
    """What a training call trains on: the rewarded calls of the groups with an advantage,
    and where their sampled tokens sit in the flat arrays (see step.py)."""
    calls: list[Call]
    rewards: dict[str, float]      # session -> reward, every rewarded session
    group_of: dict[str, str]
    advantages: dict[str, float]   # session -> advantage, every rewarded session
    groups: list[str]              # the groups trained, sorted
    zero_adv_groups: int           # the groups left out: equal rewards
    offsets: list[int]             # call i's sampled tokens are flat[offsets[i]:offsets[i + 1]]

    @property
    def tokens(self) -> int:
        return self.offsets[-1]

    @cached_property
    def reward_stats(self) -> GroupStats:
        """Every rewarded session's: the same for each step of the call, computed once."""
        return group_stats(list(self.rewards.values()))

    def step_advantages(self, groups: Sequence[str]) -> list[float]:
        """The advantages of these groups' sessions, those with no trainable call included."""
        chosen = set(groups)
        return [a for s, a in self.advantages.items() if self.group_of[s] in chosen]


def with_signal(data: RewardedCalls, cfg: AdvantageConfig) -> TrainingData:
    """Advantages depend on the calls only, never on the builder. A group whose advantages
    are all zero (equal rewards) has no signal: it would cost a forward and backward and
    dilute the per-token normalization, so it is left out."""
    advantages = group_advantages(data.rewards, data.group_of, cfg)
    signal = {data.group_of[s] for s, a in advantages.items() if a != 0.0}
    all_groups = {c.group for c in data.calls}
    calls = [c for c in data.calls if c.group in signal]
    if not calls:
        logger.warning("polar-train: all %d groups have equal rewards: nothing to learn from", len(all_groups))
        raise TrainError(f"every group's rewards are equal ({len(all_groups)} groups): no advantage to train on")
    offsets = [0]
    for c in calls:
        offsets.append(offsets[-1] + len(c.tokens))
    return TrainingData(calls, data.rewards, data.group_of, advantages, sorted(signal & all_groups),
                        len(all_groups - signal), offsets)


def flat_weights(data: TrainingData, plans: Sequence[StepPlan], normalization: Normalization) -> torch.Tensor:
    """Per flat token, its share of its step's loss (each step's weights sum to 1)."""
    weights = torch.zeros(data.tokens, dtype=torch.float64)
    for plan in plans:
        for i, w in zip(plan.call_idx, token_weights(plan.calls, normalization)):
            weights[data.offsets[i]:data.offsets[i] + len(w)] = torch.tensor(w, dtype=torch.float64)
    return weights


# ---- the trainer ------------------------------------------------------------------------------

class Trainer:
    """The policy, its AdamW state and its KL reference, alive across training calls: the
    loop (polar-train loop) trains each iteration's groups with one Trainer, and `train`
    below uses one once. The learning-rate schedule counts optimizer steps over the
    trainer's whole life; the KL reference is the initial policy (or `ref_model`)."""

    def __init__(self, model_dir: str | os.PathLike, cfg: TrainConfig = TrainConfig(),
                 ref_model: str | os.PathLike | None = None):
        if cfg.builder not in BUILDERS:
            raise TrainError(f"unknown builder {cfg.builder!r}")
        self.cfg, self.model_dir = cfg, model_dir
        self.rank, self.world = dist_env()
        if self.world > 1 and not torch.distributed.is_initialized():
            backend = "nccl" if torch.cuda.is_available() else "gloo"
            torch.distributed.init_process_group(backend)
        device = torch.device(f"cuda:{int(os.environ.get('LOCAL_RANK', 0))}" if torch.cuda.is_available() else "cpu")
        if device.type == "cuda":
            torch.cuda.set_device(device)
        self.device = device
        torch.manual_seed(cfg.seed)

        # model ------------------------------------------------------------------------------
        self.lm = lm = load_model(model_dir, device)
        if cfg.gradient_checkpointing:
            lm.config.use_cache = True   # our row checkpointing keeps the cache; see TokenLogprobs
        self.policy = TokenLogprobs(lm, chunk=cfg.logprob_chunk, temperature=cfg.temperature,
                                    checkpoint_rows=cfg.gradient_checkpointing)
        self.bf16 = cfg.dtype == "bf16" or (cfg.dtype == "auto" and device.type == "cuda"
                                            and torch.cuda.is_bf16_supported())
        self.attention = lm.config._attn_implementation
        if self.world > 1:
            from torch.distributed.fsdp import fully_shard
            for layer in lm.get_decoder().layers:
                fully_shard(layer)
            fully_shard(self.policy)
        self.ref_policy = None
        if cfg.loss.kl_coef > 0:
            ref_lm = load_model(ref_model or model_dir, device)
            ref_lm.requires_grad_(False)
            self.ref_policy = TokenLogprobs(ref_lm, chunk=cfg.logprob_chunk, temperature=cfg.temperature)
        self.opt = torch.optim.AdamW(self.policy.parameters(), lr=cfg.lr, betas=cfg.betas,
                                     weight_decay=cfg.weight_decay)
        self.step = 0   # optimizer steps so far: the schedule's clock

    def autocast(self):
        return torch.autocast(self.device.type, dtype=torch.bfloat16, enabled=self.bf16)

    def lr_now(self) -> float:
        """Linear warmup over cfg.warmup_steps optimizer steps, then constant."""
        warm = self.cfg.warmup_steps
        return self.cfg.lr * min(1.0, (self.step + 1) / warm) if warm > 0 else self.cfg.lr

    def train_on(self, calls: Sequence[Call], out_dir: str | os.PathLike, progress: Progress | None = None,
                 session_rewards: Mapping[str, SessionReward] | None = None) -> TrainResult:
        """Optimizer steps on these calls' GRPO groups (cfg.epochs passes); writes
        metrics.jsonl and metrics.png into out_dir. session_rewards (session -> (group,
        reward)): every rewarded session of the groups, see rewarded_calls."""
        rewarded = rewarded_calls(calls, session_rewards)
        check_vocabulary(self.lm, rewarded.calls)
        data = with_signal(rewarded, self.cfg.advantage)
        plans = self.plan_steps(data)
        inputs = self.step_inputs(data, plans)
        out = Path(out_dir)
        out.mkdir(parents=True, exist_ok=True)
        total = self.cfg.epochs * len(plans)
        done: list[StepResult] = []
        with StepLog(out / "metrics.jsonl", write=self.rank == 0) as log:
            for epoch in range(self.cfg.epochs):
                for plan in plans:
                    r = self.optimizer_step(plan, inputs, data, epoch, len(done) + 1)
                    done.append(r)
                    log.write(r.metrics)
                    if progress:
                        progress(r.metrics.step, total, r.metrics)
        if self.rank == 0:
            from .metrics import plot
            plot(log.path, out / "metrics.png")
        # the builder's counts per step, from the first epoch (none ran: laid out for them alone)
        built = [r.build for r in done[:len(plans)]] or [p.layout().stats for p in plans]
        return TrainResult(calls=len(data.calls), sessions=len(data.rewards), groups=len(data.groups),
                           zero_adv_groups=data.zero_adv_groups, config=self.cfg,
                           history=[r.metrics for r in done], build=built, metrics_path=log.path)

    def plan_steps(self, data: TrainingData) -> list[StepPlan]:
        """cfg.groups_per_step groups per optimizer step (0: all in one), in sorted order."""
        per_step = self.cfg.groups_per_step or len(data.groups)
        plans = []
        for i in range(0, len(data.groups), per_step):
            groups = data.groups[i:i + per_step]
            chosen = set(groups)
            idx = [j for j, c in enumerate(data.calls) if c.group in chosen]
            plans.append(prepare_step(data.calls, idx, groups, data.offsets, self.cfg, self.device, self.rank,
                                      self.world, self.attention, self.lm.dtype))
        return plans

    def step_inputs(self, data: TrainingData, plans: list[StepPlan]) -> StepInputs:
        """The objective's inputs over the whole call. The PPO "old" policy is the one at the
        start of this call, as for PPO minibatches: the first step's tokens take it on their
        first visit (the weights have not moved yet); later steps' tokens are scored now, so
        their ratios, and the clip, act. The KL reference scores every step's tokens now."""
        advantages = torch.tensor([data.advantages[c.session_id] for c in data.calls], dtype=torch.float32)
        proximal = ProximalLogprobs(score_tokens(self.policy, plans[1:], data.tokens, self.autocast))
        ref = None
        if self.ref_policy is not None:
            ref = score_tokens(self.ref_policy, plans, data.tokens, self.autocast)
        return StepInputs(advantages, flat_weights(data, plans, self.cfg.normalization), proximal, ref)

    def optimizer_step(self, plan: StepPlan, inputs: StepInputs, data: TrainingData, epoch: int,
                       n: int) -> StepResult:
        """One step on the plan's groups (the n-th of this training call), and its metrics."""
        t0 = time.perf_counter()
        for param_group in self.opt.param_groups:
            param_group["lr"] = self.lr_now()
        self.opt.zero_grad(set_to_none=True)
        if self.world > 1:   # gather once per step, sync once at its end (see _sync_gradients)
            _hold_gradients(self.policy)
        sums, stats = run_step(self.policy, plan, inputs, self.cfg.loss, self.autocast, self.world)
        if self.world > 1:
            _sync_gradients(self.policy, self.device)
            sums = _all_reduce_metrics(sums)
        grad_norm = float(torch.nn.utils.clip_grad_norm_(self.policy.parameters(), self.cfg.max_grad_norm))
        lr = self.opt.param_groups[0]["lr"]
        self.opt.step()
        self.step += 1
        rewards = data.reward_stats
        adv = data.step_advantages(plan.groups)
        adv_stats = group_stats(adv)
        seconds = time.perf_counter() - t0
        metrics = StepMetrics(
            **asdict(summarize(sums)), step=n, global_step=self.step, lr=lr, epoch=epoch, groups=len(plan.groups),
            zero_adv_groups=data.zero_adv_groups, grad_norm=grad_norm,
            reward_mean=rewards.mean, reward_std=rewards.std, adv_mean=adv_stats.mean, adv_std=adv_stats.std,
            adv_min=min(adv), adv_max=max(adv), seconds=seconds, forward_tokens=stats.forward_tokens,
            tokens_per_s=stats.forward_tokens / max(seconds, 1e-9))
        return StepResult(metrics, stats)

    def save(self, target: Path) -> None:
        """The weights as a directory vLLM serves or reloads (see save_checkpoint)."""
        save_checkpoint(self.lm, self.model_dir, Path(target), self.world, self.rank)

    def publish(self, server: "WeightServer") -> "Published":
        """The weights served from memory (one process): a snapshot copy, so training may go on."""
        if self.world > 1:
            raise TrainError("--weights-from memory needs a trainer of one process (it serves the weights itself)")
        return server.publish(self.lm.state_dict())

    def save_state(self, path: Path) -> None:
        """AdamW's moments and the schedule's clock, to resume a loop (one process)."""
        if self.rank == 0:
            tmp = Path(str(path) + ".tmp")
            torch.save({"opt": self.opt.state_dict(), "step": self.step}, tmp)
            os.replace(tmp, path)

    def load_state(self, path: Path) -> None:
        state = torch.load(path, map_location=self.device, weights_only=True)
        self.opt.load_state_dict(state["opt"])
        self.step = int(state["step"])


def train(calls: Sequence[Call], model_dir: str | os.PathLike, out_dir: str | os.PathLike,
          cfg: TrainConfig = TrainConfig(), progress: Progress | None = None,
          save: bool = True, session_rewards: Mapping[str, SessionReward] | None = None) -> TrainResult:
    """One training call (polar-train train): a Trainer used once, then its checkpoint."""
    if not any(c.reward is not None for c in calls):
        raise TrainError("no rewarded sessions to train on (set rewards with `polar-train reward`)")
    trainer = Trainer(model_dir, cfg)
    result = trainer.train_on(calls, out_dir, progress, session_rewards)
    out = Path(out_dir)
    if save:
        trainer.save(out / "checkpoint")
        result = replace(result, checkpoint=out / "checkpoint")
    if trainer.rank == 0:
        (out / "summary.json").write_text(json.dumps(result.summary(), indent=2))
    if trainer.world > 1 and torch.distributed.is_initialized():
        # ranks leave together: a rank whose gloo threads are still up at exit aborts
        # ("terminate called without an active exception", seen once under CI)
        torch.distributed.barrier()
        torch.distributed.destroy_process_group()
    return result


def _hold_gradients(policy) -> None:
    """For the step's rows: the weights stay gathered and the gradients local."""
    sharded = cast("FSDPModule", policy)   # fully_shard made it one
    sharded.set_reshard_after_forward(False)
    sharded.set_requires_gradient_sync(False)
    sharded.set_reshard_after_backward(False)


def _sync_gradients(policy, device) -> None:
    """Ranks run different numbers of rows (and nest them differently), so during a step
    FSDP2 keeps the weights gathered and the gradients local; every rank then ends with the
    same zero-loss backward, which reduce-scatters the accumulated gradients and reshards."""
    policy.set_requires_gradient_sync(True)
    policy.set_reshard_after_backward(True)
    one = torch.zeros(1, 1, dtype=torch.long, device=device)
    lp, _ = policy(one, one, None, None, torch.zeros(1, dtype=torch.long, device=device),
                   torch.zeros(1, dtype=torch.long, device=device), False)
    (lp.sum() * 0.0).backward()


def _all_reduce_metrics(sums: dict[str, float]) -> dict[str, float]:
    import torch.distributed as dist

    keys = METRIC_SUMS   # the same keys on every rank, even one that had no rows
    add = torch.tensor([sums.get(k, 0.0) for k in keys if not k.endswith(("_min", "_max"))], dtype=torch.float64)
    dist.all_reduce(add)
    lo = torch.tensor([sums.get(k, math.inf) for k in keys if k.endswith("_min")], dtype=torch.float64)
    hi = torch.tensor([sums.get(k, -math.inf) for k in keys if k.endswith("_max")], dtype=torch.float64)
    dist.all_reduce(lo, op=dist.ReduceOp.MIN)
    dist.all_reduce(hi, op=dist.ReduceOp.MAX)
    it_add, it_lo, it_hi = iter(add.tolist()), iter(lo.tolist()), iter(hi.tolist())
    out = {}
    for k in keys:
        out[k] = next(it_lo) if k.endswith("_min") else next(it_hi) if k.endswith("_max") else next(it_add)
    return out


def save_checkpoint(lm, model_dir, target: Path, world: int, rank: int) -> None:
    """save_pretrained + tokenizer + chat template: a directory vLLM serves or reloads."""
    state = None
    if world > 1:
        from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict
        state = get_model_state_dict(lm, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
    if rank != 0:
        return
    tmp = target.with_name(target.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    lm.save_pretrained(tmp, state_dict=state)
    src = Path(model_dir)
    for name in ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "vocab.json",
                 "merges.txt", "tokenizer.model", "chat_template.jinja", "chat_template.json",
                 "generation_config.json"):
        if (src / name).exists() and not (tmp / name).exists():
            shutil.copy2(src / name, tmp / name)
    shutil.rmtree(target, ignore_errors=True)
    tmp.rename(target)


# ---- read-only figures --------------------------------------------------------------------------

def logprob_parity(calls: Sequence[Call], model_dir, token_budget: int = 8192) -> dict:
    """Trainer logprobs (trie contexts = vLLM's) against what vLLM reported."""
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    lm = load_model(model_dir, device)
    check_vocabulary(lm, calls)
    lm.eval()
    built = build(calls, "trie")
    forest = merge(built.samples)
    runner = ForestRunner(forest, token_budget, device, lm.config._attn_implementation, lm.dtype)
    with torch.no_grad():
        lp = runner.run(TokenLogprobs(lm), None)
    diff = (lp - torch.tensor(forest.target_logprob)).abs()
    return {"tokens": int(diff.numel()), "mean_abs_diff": float(diff.mean()) if diff.numel() else 0.0,
            "p99_abs_diff": float(diff.quantile(0.99)) if diff.numel() else 0.0,
            "max_abs_diff": float(diff.max()) if diff.numel() else 0.0}
