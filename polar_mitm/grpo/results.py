"""What training reports: the loss's figures, each optimizer step's metrics, and a
training call's result. Plain data without torch, so the loop, the CLI and the trackers
read them without loading it."""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, Callable, NamedTuple

from .config import Builder, TrainConfig
from .trajectories import BuildStats


@dataclass(frozen=True)
class LossSummary:
    """The objective over a step's trained tokens (loss.summarize): means of the metric sums."""
    loss: float
    tokens: float
    clip_frac: float
    ratio_mean: float
    ratio_min: float
    ratio_max: float
    tis_mean: float
    tis_capped_frac: float
    logprob_abs_diff: float    # mean |trainer - vLLM| logprob
    kl: float


@dataclass(frozen=True)
class StepMetrics(LossSummary):
    """One optimizer step: a line of metrics.jsonl and a row of the loop's loop_steps, its
    fields in that order (the loss's first)."""
    step: int                  # 1-based, within this training call
    global_step: int           # the trainer's optimizer steps so far, this one included
    lr: float
    epoch: int
    groups: int                # GRPO groups this step trained
    zero_adv_groups: int       # the training call's groups left out (equal rewards)
    grad_norm: float           # before clipping
    reward_mean: float         # over the training call's rewarded sessions
    reward_std: float
    adv_mean: float            # over this step's groups' sessions
    adv_std: float
    adv_min: float
    adv_max: float
    seconds: float
    forward_tokens: int        # what the builder laid out for this step (all ranks)
    tokens_per_s: float

    def as_dict(self) -> dict[str, Any]:
        """The JSON row (metrics.jsonl, loop_steps, the trackers)."""
        return asdict(self)


class StepResult(NamedTuple):
    """An optimizer step done: its metrics and what the builder laid out for it."""
    metrics: StepMetrics
    build: BuildStats


# (steps done, steps in all, the step just done): the CLI's and the loop's progress bars
Progress = Callable[[int, int, StepMetrics], None]


@dataclass(frozen=True)
class TrainResult:
    """A training call (Trainer.train_on): what it trained on and every step's metrics."""
    calls: int                 # calls trained: those of the groups with an advantage
    sessions: int              # rewarded sessions, those with no trainable call included
    groups: int                # groups trained
    zero_adv_groups: int       # groups left out: their rewards are all equal
    config: TrainConfig
    history: list[StepMetrics]
    build: list[BuildStats]    # per planned step, the builder's counts
    metrics_path: Path         # metrics.jsonl (rank 0 writes it, and metrics.png beside it)
    checkpoint: Path | None = None   # where `train` saved the weights; None: not saved

    @property
    def steps(self) -> int:
        return len(self.history)

    @property
    def builder(self) -> Builder:
        return self.config.builder

    @property
    def last(self) -> StepMetrics | None:
        return self.history[-1] if self.history else None

    def summary(self) -> dict[str, Any]:
        """summary.json: everything but the history, as JSON."""
        return {"steps": self.steps, "calls": self.calls, "sessions": self.sessions, "groups": self.groups,
                "zero_adv_groups": self.zero_adv_groups, "builder": self.builder,
                "config": json.loads(json.dumps(asdict(self.config), default=str)),
                "last": self.last.as_dict() if self.last else {}, "build": [b.as_dict() for b in self.build]}
