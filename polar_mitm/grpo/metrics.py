"""Training curves: the metrics JSONL, drawn as a PNG beside it."""

from __future__ import annotations

import json
from pathlib import Path
from types import TracebackType
from typing import IO

from .results import StepMetrics

PANELS = [("loss", "loss"), ("reward_mean", "reward mean"), ("clip_frac", "clip fraction"),
          ("logprob_abs_diff", "mean |trainer - vLLM| logprob"), ("grad_norm", "grad norm"),
          ("tokens_per_s", "forward tokens/s")]


class StepLog:
    """metrics.jsonl as a training call writes it: a line per optimizer step, flushed as
    it comes (a crash keeps the steps done). Only rank 0 writes one; the others hold a
    log that writes nothing."""

    def __init__(self, path: Path, write: bool):
        self.path = path
        self._file: IO[str] | None = open(path, "w") if write else None

    def write(self, m: StepMetrics) -> None:
        if self._file:
            self._file.write(json.dumps(m.as_dict()) + "\n")
            self._file.flush()

    def __enter__(self) -> StepLog:
        return self

    def __exit__(self, kind: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        if self._file:
            self._file.close()


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
