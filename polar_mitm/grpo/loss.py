"""The GRPO objective on trained tokens. Pure torch functions with typed inputs; the
metrics come back from inside as sums, so micro-batches add up exactly.

Three policies meet here: vLLM's (rollout logprobs, what sampled the tokens), the
trainer's proximal one (the PPO "old" policy: the trainer's own weights at the start of
the training call, see train.py), and the current one. The PPO ratio is
current / proximal, clipped asymmetrically (clip-higher); the vLLM/trainer mismatch is
corrected by truncated importance sampling, w = min(proximal / rollout, cap).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from .config import LossConfig  # noqa: F401 - re-exported
from .results import LossSummary


@dataclass
class LossInputs:
    logprobs: torch.Tensor            # [N] current policy, with grad
    old_logprobs: torch.Tensor        # [N] proximal policy, no grad
    rollout_logprobs: torch.Tensor    # [N] what vLLM reported
    advantages: torch.Tensor          # [N] the session's advantage on each of its tokens
    weights: torch.Tensor             # [N] share of the step's loss (sums to 1 over the step)
    ref_logprobs: torch.Tensor | None = None   # [N] frozen reference, when kl_coef > 0


@dataclass
class LossOutput:
    loss: torch.Tensor
    metrics: dict[str, float]         # sums over these tokens; see summarize()


def grpo_loss(x: LossInputs, cfg: LossConfig) -> LossOutput:
    dt = torch.promote_types(x.logprobs.dtype, torch.float32)   # float32 at least, float64 in tests
    lp = x.logprobs.to(dt)
    old, roll = x.old_logprobs.to(dt).detach(), x.rollout_logprobs.to(dt)
    adv, w = x.advantages.to(dt), x.weights.to(dt)
    ratio = torch.exp(lp - old)
    clipped = ratio.clamp(1 - cfg.clip_low, 1 + cfg.clip_high)
    pg = -torch.minimum(ratio * adv, clipped * adv)
    tis = torch.exp(old - roll).clamp(max=cfg.tis_cap)
    per_token = tis * pg
    kl = torch.zeros_like(lp)
    if cfg.kl_coef > 0:
        if x.ref_logprobs is None:
            raise ValueError("kl_coef > 0 needs ref_logprobs")
        d = x.ref_logprobs.to(dt) - lp
        kl = torch.exp(d) - d - 1                     # k3: unbiased, always >= 0
        per_token = per_token + cfg.kl_coef * kl
    loss = (w * per_token).sum()
    with torch.no_grad():
        was_clipped = ((ratio * adv) > (clipped * adv)).float()
        n = float(lp.numel())
        metrics = {
            "tokens": n,
            "loss": float(loss),
            "clipped": float(was_clipped.sum()),
            "ratio_sum": float(ratio.sum()),
            "ratio_min": float(ratio.min()) if n else float("inf"),
            "ratio_max": float(ratio.max()) if n else float("-inf"),
            "tis_sum": float(tis.sum()),
            "tis_capped": float((torch.exp(old - roll) > cfg.tis_cap).float().sum()),
            "abs_diff_sum": float((lp.detach() - roll).abs().sum()),
            "kl_sum": float(kl.sum()),
        }
    return LossOutput(loss, metrics)


METRIC_SUMS = ("tokens", "loss", "clipped", "ratio_sum", "ratio_min", "ratio_max", "tis_sum", "tis_capped",
               "abs_diff_sum", "kl_sum")


def merge_metrics(total: dict[str, float], part: dict[str, float]) -> dict[str, float]:
    for k, v in part.items():
        if k.endswith("_min"):
            total[k] = min(total.get(k, float("inf")), v)
        elif k.endswith("_max"):
            total[k] = max(total.get(k, float("-inf")), v)
        else:
            total[k] = total.get(k, 0.0) + v
    return total


def summarize(total: dict[str, float]) -> LossSummary:
    """Sums -> means: clip fraction, mean ratio, mean |trainer - vLLM| logprob, ..."""
    n = max(total.get("tokens", 0.0), 1.0)
    return LossSummary(
        loss=total.get("loss", 0.0), tokens=total.get("tokens", 0.0),
        clip_frac=total.get("clipped", 0.0) / n, ratio_mean=total.get("ratio_sum", 0.0) / n,
        ratio_min=total.get("ratio_min", float("nan")), ratio_max=total.get("ratio_max", float("nan")),
        tis_mean=total.get("tis_sum", 0.0) / n, tis_capped_frac=total.get("tis_capped", 0.0) / n,
        logprob_abs_diff=total.get("abs_diff_sum", 0.0) / n, kl=total.get("kl_sum", 0.0) / n)
