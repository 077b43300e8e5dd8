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
"""

from __future__ import annotations

import json
import logging
import math
import os
import shutil
import time
from dataclasses import asdict
from pathlib import Path
from typing import TYPE_CHECKING, Callable, Mapping, Sequence, cast

import torch

from ..trainer_input import Call, SessionReward
from .advantages import group_advantages, group_stats, token_weights
from .config import BUILDERS, AdvantageConfig, LossConfig, TrainConfig  # noqa: F401 - re-exported
from .loss import METRIC_SUMS, LossInputs, grpo_loss, merge_metrics, summarize
from .packing import merge
from .policy import ForestRunner, TokenLogprobs
from .trajectories import build

if TYPE_CHECKING:
    from torch.distributed.fsdp import FSDPModule

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


def split_for_rank(samples, rank: int, world: int):
    """Whole samples per rank, balanced by forward tokens (largest first)."""
    if world == 1:
        return list(samples)
    loads = [0] * world
    mine = []
    for i in sorted(range(len(samples)), key=lambda i: -len(samples[i])):
        r = loads.index(min(loads))
        loads[r] += len(samples[i])
        if r == rank:
            mine.append(samples[i])
    return mine


# ---- one step -----------------------------------------------------------------------------

class StepData:
    """What one optimizer step trains on, laid out for this rank. Planned lazily: each read
    of `runner` builds the step's forest and row plan, which live only while it runs (a
    few hundred bytes of host memory per forward token); what is kept is per trained
    token: call_ids, flat and rollout, in the forest's target order."""

    def __init__(self, groups: list[str], calls: Sequence[Call], call_idx: list[int], offsets: list[int],
                 cfg: TrainConfig, device, rank: int, world: int, attention: str, dtype: torch.dtype):
        self.groups = groups
        self._calls, self._call_idx, self._offsets = [calls[i] for i in call_idx], call_idx, offsets
        self._cfg, self._device, self._rank, self._world = cfg, device, rank, world
        self._attention, self._dtype = attention, dtype
        self._targets: tuple[torch.Tensor, torch.Tensor, torch.Tensor, dict] | None = None

    @property
    def runner(self) -> ForestRunner:
        return ForestRunner(self._forest(), self._cfg.token_budget, self._device, self._attention, self._dtype)

    def _forest(self):
        built = build(self._calls, self._cfg.builder)
        forest = merge(split_for_rank(built.samples, self._rank, self._world))
        if self._targets is None:
            ci, off = self._call_idx, self._offsets
            self._targets = (
                torch.tensor([ci[c] for c in forest.target_call], dtype=torch.long),
                torch.tensor([off[ci[c]] + j for c, j in zip(forest.target_call, forest.target_index)],
                             dtype=torch.long),
                torch.tensor(forest.target_logprob), built.stats.as_dict())
        return forest

    def _target(self, i: int):
        if self._targets is None:
            self._forest()   # sets them
        assert self._targets is not None
        return self._targets[i]

    call_ids = property(lambda self: self._target(0), doc="per forest target: call index")
    flat = property(lambda self: self._target(1), doc="per forest target: index into the flat (call, j) arrays")
    rollout = property(lambda self: self._target(2), doc="per forest target: vLLM's logprob")
    stats = property(lambda self: self._target(3), doc="the builder's counts (BuildStats)")


def prepare_step(calls: Sequence[Call], call_idx: list[int], groups: list[str], offsets: list[int],
                 cfg: TrainConfig, device, rank: int, world: int, attention: str = "sdpa",
                 dtype: torch.dtype = torch.float32) -> StepData:
    return StepData(groups, calls, call_idx, offsets, cfg, device, rank, world, attention, dtype)


def run_step(policy, step: StepData, adv: torch.Tensor, weights: torch.Tensor, proximal: torch.Tensor,
             cfg: TrainConfig, ref: torch.Tensor | None, autocast, world: int = 1) -> dict:
    """Forward and backward every row of the step; gradients accumulate; returns metric sums."""
    totals: dict[str, float] = {}

    def loss_fn(lp: torch.Tensor, idx: torch.Tensor) -> torch.Tensor:
        flat = step.flat[idx]
        first = torch.isnan(proximal[flat])          # first time this token is scored
        proximal[flat[first]] = lp.detach().to(proximal.dtype).cpu()[first]
        dev = lp.device
        out = grpo_loss(LossInputs(
            logprobs=lp, old_logprobs=proximal[flat].to(dev), rollout_logprobs=step.rollout[idx].to(dev),
            advantages=adv[step.call_ids[idx]].to(dev), weights=weights[flat].to(dev),
            ref_logprobs=ref[flat].to(dev) if ref is not None else None), cfg.loss)
        merge_metrics(totals, out.metrics)
        return out.loss * world   # FSDP averages gradients over ranks; the objective is their sum

    runner = step.runner   # built now, dropped when the step is done
    with autocast():
        runner.run(policy, loss_fn)
    return totals


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

    def train_on(self, calls: Sequence[Call], out_dir: str | os.PathLike,
                 progress: Callable[[int, int, dict], None] | None = None,
                 session_rewards: Mapping[str, SessionReward] | None = None) -> dict:
        """Optimizer steps on these calls' GRPO groups (cfg.epochs passes); writes
        metrics.jsonl and metrics.png into out_dir. Returns a summary with every step's
        metrics. session_rewards (session -> (group, reward)): every rewarded session of the
        groups, those with no trainable call included, so each group's baseline counts them."""
        cfg, rank, world, device = self.cfg, self.rank, self.world, self.device
        rewards = {c.session_id: c.reward for c in calls if c.reward is not None}
        group_of = {c.session_id: c.group for c in calls}
        for sid, (group, reward) in (session_rewards or {}).items():
            rewards.setdefault(sid, reward)
            group_of.setdefault(sid, group)
        calls = [c for c in calls if c.session_id in rewards]
        if not calls:
            raise TrainError("no rewarded sessions to train on (set rewards with `polar-train reward`)")
        check_vocabulary(self.lm, calls)
        policy, autocast = self.policy, self.autocast
        out = Path(out_dir)

        # data: advantages and weights depend on the calls only, never on the builder -----------
        adv_by_session = group_advantages(rewards, group_of, cfg.advantage)
        # A group whose advantages are all zero (equal rewards) has no signal: it would cost a
        # forward and backward and dilute the per-token normalization, so it is left out.
        signal = {group_of[s] for s, a in adv_by_session.items() if a != 0.0}
        all_groups = {c.group for c in calls}
        zero_groups = len(all_groups - signal)
        calls = [c for c in calls if c.group in signal]
        if not calls:
            logger.warning("polar-train: all %d groups have equal rewards: nothing to learn from", len(all_groups))
            raise TrainError(f"every group's rewards are equal ({len(all_groups)} groups): no advantage to train on")
        groups = sorted(signal & all_groups)
        adv = torch.tensor([adv_by_session[c.session_id] for c in calls], dtype=torch.float32)
        offsets = [0]
        for c in calls:
            offsets.append(offsets[-1] + len(c.tokens))
        per_step = cfg.groups_per_step or len(groups)
        step_groups = [groups[i:i + per_step] for i in range(0, len(groups), per_step)]
        steps = []
        weights = torch.zeros(offsets[-1], dtype=torch.float64)
        for gs in step_groups:
            idx = [i for i, c in enumerate(calls) if c.group in set(gs)]
            for i, w in zip(idx, token_weights([calls[i] for i in idx], cfg.normalization)):
                weights[offsets[i]:offsets[i] + len(w)] = torch.tensor(w, dtype=torch.float64)
            steps.append(prepare_step(calls, idx, gs, offsets, cfg, device, rank, world, self.attention,
                                      self.lm.dtype))
        # The PPO "old" policy is the one at the start of this call, as for PPO minibatches:
        # the first step's tokens take it on their first visit (the weights have not moved
        # yet); later steps' tokens are scored now, so their ratios, and the clip, act.
        proximal = torch.full((offsets[-1],), float("nan"))
        if len(steps) > 1:
            with torch.no_grad(), autocast():
                for s in steps[1:]:
                    proximal[s.flat] = s.runner.run(policy, None).to(proximal.dtype).cpu()
        ref = None
        if self.ref_policy is not None:
            ref = torch.full((offsets[-1],), float("nan"))
            with torch.no_grad(), autocast():
                for s in steps:
                    ref[s.flat] = s.runner.run(self.ref_policy, None).to(ref.dtype).cpu()

        # loop ----------------------------------------------------------------------------------
        out.mkdir(parents=True, exist_ok=True)
        metrics_path = out / "metrics.jsonl"
        log = open(metrics_path, "w") if rank == 0 else None
        total_steps = cfg.epochs * len(steps)
        history = []
        reward_stats = group_stats(list(rewards.values()))
        n = 0
        for epoch in range(cfg.epochs):
            for s in steps:
                t0 = time.perf_counter()
                for param_group in self.opt.param_groups:
                    param_group["lr"] = self.lr_now()
                self.opt.zero_grad(set_to_none=True)
                if world > 1:   # gather once per step, sync once at its end (see _sync_gradients)
                    sharded = cast("FSDPModule", policy)   # fully_shard made it one
                    sharded.set_reshard_after_forward(False)
                    sharded.set_requires_gradient_sync(False)
                    sharded.set_reshard_after_backward(False)
                sums = run_step(policy, s, adv, weights, proximal, cfg, ref, autocast, world)
                if world > 1:
                    _sync_gradients(policy, device)
                    sums = _all_reduce_metrics(sums)
                grad_norm = float(torch.nn.utils.clip_grad_norm_(policy.parameters(), cfg.max_grad_norm))
                lr = self.opt.param_groups[0]["lr"]
                self.opt.step()
                self.step += 1
                n += 1
                m = summarize(sums)
                sess_adv = [adv_by_session[x] for x in adv_by_session if group_of[x] in set(s.groups)]
                adv_stats = group_stats(sess_adv)
                m.update(step=n, global_step=self.step, lr=lr, epoch=epoch, groups=len(s.groups),
                         zero_adv_groups=zero_groups,
                         grad_norm=grad_norm, reward_mean=reward_stats.mean, reward_std=reward_stats.std,
                         adv_mean=adv_stats.mean, adv_std=adv_stats.std,
                         adv_min=min(sess_adv), adv_max=max(sess_adv),
                         seconds=time.perf_counter() - t0, forward_tokens=s.stats["forward_tokens"])
                m["tokens_per_s"] = m["forward_tokens"] / max(m["seconds"], 1e-9)
                history.append(m)
                if log:
                    log.write(json.dumps(m) + "\n")
                    log.flush()
                if progress:
                    progress(n, total_steps, m)
        if log:
            log.close()
        if rank == 0:
            from .metrics import plot
            plot(metrics_path, out / "metrics.png")
        return {"steps": n, "calls": len(calls), "sessions": len(rewards), "groups": len(groups),
                "zero_adv_groups": zero_groups,
                "builder": cfg.builder, "config": _jsonable(asdict(cfg)), "last": history[-1] if history else {},
                "history": history, "build": [s.stats for s in steps]}

    def save(self, target: Path) -> None:
        """The weights as a directory vLLM serves or reloads (see save_checkpoint)."""
        save_checkpoint(self.lm, self.model_dir, Path(target), self.world, self.rank)

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
          cfg: TrainConfig = TrainConfig(), progress: Callable[[int, int, dict], None] | None = None,
          save: bool = True, session_rewards: Mapping[str, SessionReward] | None = None) -> dict:
    """One training call (polar-train train): a Trainer used once, then its checkpoint."""
    if not any(c.reward is not None for c in calls):
        raise TrainError("no rewarded sessions to train on (set rewards with `polar-train reward`)")
    trainer = Trainer(model_dir, cfg)
    summary = trainer.train_on(calls, out_dir, progress, session_rewards)
    out = Path(out_dir)
    if save:
        trainer.save(out / "checkpoint")
    if trainer.rank == 0:
        (out / "summary.json").write_text(json.dumps({k: v for k, v in summary.items() if k != "history"},
                                                     indent=2))
    if trainer.world > 1 and torch.distributed.is_initialized():
        # ranks leave together: a rank whose gloo threads are still up at exit aborts
        # ("terminate called without an active exception", seen once under CI)
        torch.distributed.barrier()
        torch.distributed.destroy_process_group()
    return summary


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


def _jsonable(x):
    return json.loads(json.dumps(x, default=str))


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
