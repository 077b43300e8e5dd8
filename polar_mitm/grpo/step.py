"""One optimizer step: its plan, its layout on this rank, and its forward and backward.

A step's sampled tokens are addressed two ways: by target (their order in the step's
forest, which is how the runner hands back logprobs) and by flat index (call i's token j
is offsets[i] + j over the whole training call, which is how advantages, weights and the
proximal and reference logprobs are kept). StepTargets maps the one to the other.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Callable, ContextManager, NamedTuple, Sequence

import torch

from ..trainer_input import Call
from .config import LossConfig, TrainConfig
from .loss import LossInputs, grpo_loss, merge_metrics
from .packing import merge
from .policy import ForestRunner
from .trajectories import BuildStats, Sample, build

Autocast = Callable[[], ContextManager]   # the trainer's autocast, or a disabled one


def split_for_rank(samples: Sequence[Sample], rank: int, world: int) -> list[Sample]:
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


class StepTargets(NamedTuple):
    """Per trained token of a step on this rank, in its forest's target order."""
    call_ids: torch.Tensor    # the token's call, as an index into the training call's calls
    flat: torch.Tensor        # the token's flat index
    rollout: torch.Tensor     # vLLM's logprob of it


class StepLayout(NamedTuple):
    """A step laid out for this rank: its forest's row plan, the targets, and the builder's
    counts. Built when the step runs and dropped when it is done: the plan takes a few
    hundred bytes of host memory per forward token."""
    runner: ForestRunner
    targets: StepTargets
    stats: BuildStats         # the builder's counts for the whole step (every rank's)


@dataclass(frozen=True, eq=False)
class StepPlan:
    """What one optimizer step trains on: its groups and their calls. Holding one costs
    nothing; `layout()` builds the forest and the row plan, afresh at each call."""
    groups: list[str]
    calls: list[Call]         # the step's calls
    call_idx: list[int]       # their indices into the training call's calls
    offsets: list[int]        # the flat index of each of the training call's calls' first token
    cfg: TrainConfig
    device: torch.device
    rank: int
    world: int
    attention: str            # the model's attention implementation (ForestRunner plans rows for it)
    dtype: torch.dtype

    def layout(self) -> StepLayout:
        built = build(self.calls, self.cfg.builder)
        forest = merge(split_for_rank(built.samples, self.rank, self.world))
        ci, off = self.call_idx, self.offsets
        targets = StepTargets(
            call_ids=torch.tensor([ci[c] for c in forest.target_call], dtype=torch.long),
            flat=torch.tensor([off[ci[c]] + j for c, j in zip(forest.target_call, forest.target_index)],
                              dtype=torch.long),
            rollout=torch.tensor(forest.target_logprob))
        runner = ForestRunner(forest, self.cfg.token_budget, self.device, self.attention, self.dtype)
        return StepLayout(runner, targets, built.stats)


def prepare_step(calls: Sequence[Call], call_idx: list[int], groups: list[str], offsets: list[int],
                 cfg: TrainConfig, device: torch.device, rank: int, world: int, attention: str = "sdpa",
                 dtype: torch.dtype = torch.float32) -> StepPlan:
    return StepPlan(groups, [calls[i] for i in call_idx], call_idx, offsets, cfg, device, rank, world,
                    attention, dtype)


def score_tokens(policy: torch.nn.Module, plans: Sequence[StepPlan], size: int, autocast: Autocast) -> torch.Tensor:
    """The policy's logprob of every trained token of these steps, by flat index (nan for
    the tokens of other steps), in one no-grad pass."""
    out = torch.full((size,), math.nan)
    with torch.no_grad(), autocast():
        for plan in plans:
            runner, targets, _ = plan.layout()
            out[targets.flat] = runner.run(policy, None).to(out.dtype).cpu()
    return out


class ProximalLogprobs:
    """The PPO "old" policy's logprob of every trained token, by flat index: the policy at
    the start of the training call. The tokens of steps after the first are scored up
    front (score_tokens); the first step's are scored as it trains them, by the policy
    whose weights have not moved yet, which saves a forward pass: `first_visit` keeps the
    logprobs of the tokens it has not seen before. nan: not scored yet."""

    def __init__(self, values: torch.Tensor):
        self.values = values

    @classmethod
    def unscored(cls, size: int, dtype: torch.dtype = torch.float32) -> ProximalLogprobs:
        return cls(torch.full((size,), math.nan, dtype=dtype))

    def first_visit(self, flat: torch.Tensor, logprobs: torch.Tensor) -> torch.Tensor:
        """The proximal logprobs of the tokens at `flat`, given the current policy's
        `logprobs` of them: the ones scored before are kept, the others take these."""
        values = self.values
        first = torch.isnan(values[flat])
        values[flat[first]] = logprobs.detach().to(values.dtype).cpu()[first]
        return values[flat]


@dataclass(frozen=True)
class StepInputs:
    """The objective's per-token inputs, shared by every step of a training call."""
    advantages: torch.Tensor            # per call: its session's advantage
    weights: torch.Tensor               # per flat token: its share of its step's loss
    proximal: ProximalLogprobs
    ref: torch.Tensor | None = None     # per flat token: the KL reference's logprob (kl_coef > 0)


@dataclass
class StepObjective:
    """The step's loss as the runner asks for it, row by row: `(logprobs, idx)` are a row's
    trained tokens' current logprobs and their indices among the step's targets. Sums the
    loss's metrics over the rows in `totals`."""
    targets: StepTargets
    inputs: StepInputs
    cfg: LossConfig
    world: int = 1
    totals: dict[str, float] = field(default_factory=dict)

    def __call__(self, logprobs: torch.Tensor, idx: torch.Tensor) -> torch.Tensor:
        t, x, dev = self.targets, self.inputs, logprobs.device
        flat = t.flat[idx]
        old = x.proximal.first_visit(flat, logprobs)
        out = grpo_loss(LossInputs(
            logprobs=logprobs, old_logprobs=old.to(dev), rollout_logprobs=t.rollout[idx].to(dev),
            advantages=x.advantages[t.call_ids[idx]].to(dev), weights=x.weights[flat].to(dev),
            ref_logprobs=x.ref[flat].to(dev) if x.ref is not None else None), self.cfg)
        merge_metrics(self.totals, out.metrics)
        return out.loss * self.world   # FSDP averages gradients over ranks; the objective is their sum


class StepRun(NamedTuple):
    """What a step's forward and backward leave besides the gradients."""
    sums: dict[str, float]    # the loss's metric sums over this rank's tokens (loss.summarize)
    stats: BuildStats


def run_step(policy: torch.nn.Module, plan: StepPlan, inputs: StepInputs, cfg: LossConfig, autocast: Autocast,
             world: int = 1) -> StepRun:
    """Forward and backward every row of the step; the gradients accumulate, the caller steps."""
    layout = plan.layout()   # built now, dropped when the step is done
    objective = StepObjective(layout.targets, inputs, cfg, world)
    with autocast():
        layout.runner.run(policy, objective)
    return StepRun(objective.totals, layout.stats)
