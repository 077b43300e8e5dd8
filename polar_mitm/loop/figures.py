"""The loop's figures as it prints and draws them: one line per iteration, the table of a
run's iterations, the held-out reward's rise with its standard error, and loop.png."""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from pathlib import Path

from ..store.loop import IterationRow, standard_error

__all__ = ["Rise", "held_out_rise", "iteration_line", "iteration_table", "plot_loop", "standard_error"]


def _f(x, spec=".3f") -> str:
    return "-" if x is None else format(x, spec)


def iteration_line(r: IterationRow) -> str:
    return (f"iteration {r['iteration'] + 1} (policy v{r['policy_version']}): reward {_f(r['reward_mean'])} "
            f"+- {_f(r['reward_std'])}, held-out {_f(r['eval_reward_mean'])}; {r['calls']} calls"
            f"{_tokens_part(r)}, loss {_f(r.get('loss'), '+.4f')}; rollouts {r['rollout_s']:.0f}s, "
            f"training {r['train_s']:.0f}s, sync {r['sync_s']:.1f}s" + _released_part(r))


def _tokens_part(r: IterationRow) -> str:
    """" (4310 tokens, 12.5% stale)": the sampled tokens trained, and the share of all those
    read that --max-staleness left as context only (and of an unknown version, if any)."""
    if r.get("stale_tokens") is None:
        return ""
    stale, unknown = r["stale_tokens"], r.get("unknown_version_tokens") or 0
    read = r["tokens"] + stale + unknown
    out = f" ({r['tokens']} tokens, {100 * stale / read if read else 0:.1f}% stale"
    return out + (f", {unknown} of an unknown version)" if unknown else ")")


def _released_part(r: IterationRow) -> str:
    """"; 3 sessions ran again (backend unavailable 2, policy version unknown 1)": the
    attempts whose outcome was not the policy's, so they were run again, unscored."""
    why = r.get("released_why") or {}
    if not r.get("sessions_released"):
        return ""
    return (f"; {r['sessions_released']} session(s) ran again ("
            + ", ".join(f"{k} {v}" for k, v in sorted(why.items())) + ")")


def iteration_table(rows: list[dict]) -> str:
    head = (f"{'iter':>4} {'ver':>3} {'reward':>7} {'std':>6} {'held-out':>8} {'done':>4} {'fail':>4} "
            f"{'t/o':>4} {'calls':>5} {'tokens':>7} {'loss':>8} {'clip':>6} {'|dlp|':>6} {'rollout s':>9} "
            f"{'train s':>7} {'sync s':>6}")
    lines = [head, "-" * len(head)]
    for r in rows:
        lines.append(f"{r['iteration'] + 1:>4} {r['policy_version']:>3} {_f(r['reward_mean']):>7} "
                     f"{_f(r['reward_std']):>6} {_f(r['eval_reward_mean']):>8} {r['sessions_done']:>4} "
                     f"{r['sessions_failed']:>4} {r['sessions_timed_out']:>4} {r['calls']:>5} {r['tokens']:>7} "
                     f"{_f(r['loss'], '+.4f'):>8} {_f(r['clip_frac']):>6} {_f(r['logprob_abs_diff']):>6} "
                     f"{r['rollout_s']:>9.0f} {r['train_s']:>7.0f} {r['sync_s']:>6.1f}")
    tasks = sorted({t for r in rows for t in json.loads(r["per_task"] or "{}")})
    if tasks:
        lines.append("reward per task: " + "; ".join(
            f"{t} " + " ".join(_f(json.loads(r["per_task"]).get(t, {}).get("mean"), ".2f") for r in rows)
            for t in tasks))
    return "\n".join(lines)


@dataclass(frozen=True)
class Rise:
    """The held-out reward from the first iteration to the last, with its standard error
    (the two means' errors combined, samples taken as independent: the same tasks at both
    ends, so the tasks' own spread, which cancels in the difference, only makes it larger)."""
    first: int
    last: int
    before: float
    after: float
    se: float

    @property
    def rise(self) -> float:
        return self.after - self.before

    @property
    def errors(self) -> float:
        return self.rise / self.se if self.se > 0 else math.inf if self.rise > 0 else 0.0

    def line(self) -> str:
        return (f"held-out reward {self.before:.3f} at iteration {self.first} -> {self.after:.3f} at iteration "
                f"{self.last}: {self.rise:+.3f} +- {self.se:.3f} (standard error), {self.errors:+.1f} standard errors")


def held_out_rise(rows: list[dict]) -> Rise | None:
    """None without held-out figures at two iterations (or from a database before they had n)."""
    held = [r for r in rows if r.get("eval_reward_mean") is not None]
    if len(held) < 2:
        return None
    a, b = held[0], held[-1]
    se_a, se_b = (standard_error(r.get("eval_reward_std"), r.get("eval_reward_n")) for r in (a, b))
    if se_a is None or se_b is None:
        return None
    return Rise(a["iteration"] + 1, b["iteration"] + 1, a["eval_reward_mean"], b["eval_reward_mean"],
                math.sqrt(se_a ** 2 + se_b ** 2))


def plot_loop(rows: list[dict], path: Path) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    its = [r["iteration"] + 1 for r in rows]
    fig, (a, b) = plt.subplots(1, 2, figsize=(10, 3.6))
    # error bars: the mean's standard error (not the rewards' spread)
    a.errorbar(its, [r["reward_mean"] for r in rows],
               yerr=[standard_error(r["reward_std"], r.get("reward_n")) or 0 for r in rows],
               marker="o", capsize=3, label="training tasks")
    held = [r for r in rows if r["eval_reward_mean"] is not None]   # --eval-every: some iterations
    if held:
        a.errorbar([r["iteration"] + 1 for r in held], [r["eval_reward_mean"] for r in held],
                   yerr=[standard_error(r.get("eval_reward_std"), r.get("eval_reward_n")) or 0 for r in held],
                   marker="s", capsize=3, label="held-out tasks")
    a.set(xlabel="iteration", ylabel="mean reward (+- standard error)", title="reward")
    a.legend()
    b.plot(its, [r["loss"] for r in rows], marker="o")
    b.set(xlabel="iteration", ylabel="loss", title="GRPO loss (last step)")
    for ax in (a, b):
        ax.set_xticks(its)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
