"""The trainer's configuration, in one place: the defaults polar-train's options show and
use. No torch here, so the CLI reads them without importing it."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal, get_args

# The trajectory builders (trajectories.py): trie trains each token in the context vLLM
# sampled it in; prefix_merging (NVIDIA Polar) and per_request are there for comparison.
Builder = Literal["trie", "prefix_merging", "per_request"]
BUILDERS: tuple[Builder, ...] = get_args(Builder)
# How the loss is normalized (advantages.token_weights): every trained token counts the
# same, or every session.
Normalization = Literal["token", "session"]
NORMALIZATIONS: tuple[Normalization, ...] = get_args(Normalization)


@dataclass(frozen=True)
class AdvantageConfig:
    scale_std: bool = True        # divide by the group's reward std (GRPO); off = Dr. GRPO
    leave_one_out: bool = False   # baseline = mean of the *other* sessions (RLOO / Polar)
    eps: float = 1e-6


@dataclass(frozen=True)
class LossConfig:
    clip_low: float = 0.2
    clip_high: float = 0.28       # clip-higher (DAPO): room for rare tokens to grow
    tis_cap: float = 2.0          # truncated importance sampling for the vLLM/trainer gap
    kl_coef: float = 0.0          # k3 KL to a frozen reference; off by default


@dataclass(frozen=True)
class TrainConfig:
    builder: Builder = "trie"
    lr: float = 1e-6                  # Polar's default; tiny models move at 1e-5..1e-4
    weight_decay: float = 0.0
    betas: tuple[float, float] = (0.9, 0.98)
    epochs: int = 1                   # passes over the data
    groups_per_step: int = 0          # GRPO groups per optimizer step; 0 = all in one step
    token_budget: int = 8192          # tokens per micro-batch row
    max_grad_norm: float = 1.0
    normalization: Normalization = "token"
    advantage: AdvantageConfig = field(default_factory=AdvantageConfig)
    loss: LossConfig = field(default_factory=LossConfig)
    gradient_checkpointing: bool = False
    logprob_chunk: int = 1024         # trained positions per lm_head chunk
    temperature: float = 1.0          # vLLM reports raw (pre-temperature) logprobs by default
    warmup_steps: int = 0             # linear learning-rate warmup, in optimizer steps (a loop's, all told)
    dtype: str = "auto"               # auto: bf16 autocast on GPUs that have it, else float32
    seed: int = 0
