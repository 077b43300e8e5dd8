"""Group-relative advantages and the per-token weights that normalize the loss. Plain
Python: both depend only on the calls and rewards, never on the builder, so the three
builders optimize one objective."""

from __future__ import annotations

import math
from collections import defaultdict
from typing import Mapping, NamedTuple, Sequence

from ..trainer_input import Call
from .config import NORMALIZATIONS, AdvantageConfig, Normalization


class GroupStats(NamedTuple):
    n: int
    mean: float
    std: float      # the population std: GRPO's, which every reward of the group defines


def group_stats(values: Sequence[float]) -> GroupStats:
    """n, mean and population std of a non-empty group of rewards (or advantages). Any
    finite values give finite figures: past _LARGE they are computed scaled by the largest
    magnitude (1e200 squared overflowed: OverflowError, and every rerun read it again). A
    nan or inf among them gives nan, never an exception."""
    n = len(values)
    if not all(map(math.isfinite, values)):
        return GroupStats(n, math.nan, math.nan)
    scale = max(map(abs, values))
    if scale > _LARGE:
        scaled = group_stats([x / scale for x in values])
        return GroupStats(n, scaled.mean * scale, scaled.std * scale)
    mean = sum(values) / n
    return GroupStats(n, mean, math.sqrt(sum((x - mean) ** 2 for x in values) / n))


_LARGE = 1e100   # values up to this: their squares and sums stay far from float's 1.8e308


def no_signal(stats: GroupStats, eps: float = AdvantageConfig.eps) -> bool:
    """A group whose rewards are all equal (or that has a single session) carries no
    signal: its advantages are exactly zero and the trainer leaves it out."""
    return stats.n < 2 or stats.std <= eps * max(1.0, abs(stats.mean))


def group_advantages(rewards: Mapping[str, float], group_of: Mapping[str, str],
                     cfg: AdvantageConfig = AdvantageConfig()) -> dict[str, float]:
    """Session -> advantage; zero for every session of a group with no signal."""
    groups: dict[str, list[str]] = defaultdict(list)
    for s in rewards:
        groups[group_of[s]].append(s)
    out = {}
    for members in groups.values():
        r = [float(rewards[s]) for s in members]
        stats = group_stats(r)
        if no_signal(stats, cfg.eps):
            out.update({s: 0.0 for s in members})
            continue
        n, mean, std = stats
        for s, x in zip(members, r):
            a = (x - (sum(r) - x) / (n - 1)) if cfg.leave_one_out else x - mean
            out[s] = a / (std + cfg.eps) if cfg.scale_std else a
    return out


def token_weights(calls: Sequence[Call], normalization: Normalization = "token") -> list[list[float]]:
    """Per call, per sampled token: its weight in the step's loss (they sum to 1 over the
    trained tokens; a token that is context only, Call.trained, weighs 0).
    token: every trained token counts the same; session: every session counts the same,
    spread over its trained tokens."""
    if normalization not in NORMALIZATIONS:
        raise ValueError(f"normalization must be one of {NORMALIZATIONS}")
    trained = [c.trained() for c in calls]
    if normalization == "token":
        total = sum(len(t) for t in trained) or 1
        return [_spread(len(c.tokens), t, 1.0 / total) for c, t in zip(calls, trained)]
    per_session: dict[str, int] = defaultdict(int)
    for c, t in zip(calls, trained):
        per_session[c.session_id] += len(t)
    n_sessions = sum(1 for n in per_session.values() if n) or 1
    return [_spread(len(c.tokens), t, 1.0 / (n_sessions * per_session[c.session_id]) if t else 0.0)
            for c, t in zip(calls, trained)]


def _spread(n: int, trained: Sequence[int], weight: float) -> list[float]:
    """n tokens' weights: `weight` on the trained ones, 0 on the others."""
    if len(trained) == n:
        return [weight] * n
    out = [0.0] * n
    for j in trained:
        out[j] = weight
    return out
