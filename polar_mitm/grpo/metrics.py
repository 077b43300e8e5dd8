"""Training curves: the metrics JSONL, drawn as a PNG beside it."""

from __future__ import annotations

import json
from pathlib import Path

PANELS = [("loss", "loss"), ("reward_mean", "reward mean"), ("clip_frac", "clip fraction"),
          ("logprob_abs_diff", "mean |trainer - vLLM| logprob"), ("grad_norm", "grad norm"),
          ("tokens_per_s", "forward tokens/s")]


def read(path: str | Path) -> list[dict]:
    return [json.loads(line) for line in Path(path).read_text().splitlines() if line.strip()]


def plot(jsonl: str | Path, png: str | Path) -> Path:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = read(jsonl)
    fig, axes = plt.subplots(2, 3, figsize=(12, 6), constrained_layout=True)
    steps = [r["step"] for r in rows]
    for ax, (key, title) in zip(axes.flat, PANELS):
        ax.plot(steps, [r.get(key, float("nan")) for r in rows], marker="o", ms=3)
        ax.set_title(title, fontsize=10)
        ax.set_xlabel("step")
        ax.grid(alpha=0.3)
    fig.savefig(png, dpi=100)
    plt.close(fig)
    return Path(png)
