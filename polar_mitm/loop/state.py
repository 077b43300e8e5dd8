"""What the loop keeps between processes: OUT/loop.json (LoopState), written after each
iteration's sync, and the checkpoints and trainer states it names (prune)."""

from __future__ import annotations

import json
import os
import secrets
import shutil
from dataclasses import asdict, dataclass, field
from pathlib import Path

import click


class LoopError(click.ClickException):
    pass


@dataclass(frozen=True)
class Saved:
    """A trained iteration's weights (served as the next version) and the trainer's state."""
    checkpoint: Path
    trainer_state: Path


@dataclass
class LoopState:
    run_id: str
    completed: int = 0                    # iterations done (trained and synced)
    version: int = 0                      # the policy version vLLM serves
    checkpoint: str | None = None         # its weights (None: the initial model)
    trainer_state: str | None = None      # AdamW and the schedule's clock after `completed`
    checkpoints: list[str] = field(default_factory=list)

    @staticmethod
    def path(out: Path) -> Path:
        return out / "loop.json"

    @classmethod
    def load(cls, out: Path) -> "LoopState | None":
        try:
            return cls(**json.loads(cls.path(out).read_text()))
        except FileNotFoundError:
            return None

    @classmethod
    def new(cls, out: Path) -> "LoopState":
        """A new run, saved at once: a rerun after a kill resumes this run's task ids."""
        state = cls(run_id=secrets.token_hex(3))
        state.save(out)
        return state

    def save(self, out: Path) -> None:
        tmp = self.path(out).with_suffix(".json.tmp")
        tmp.write_text(json.dumps(asdict(self), indent=2))
        os.replace(tmp, self.path(out))

    def publish(self, saved: Saved) -> None:
        """The next version serves saved's weights (loop.json is written by prune)."""
        self.version += 1
        self.checkpoint, self.trainer_state = str(saved.checkpoint), str(saved.trainer_state)
        self.checkpoints.append(str(saved.checkpoint))


def prune(state: LoopState, keep: int, out: Path) -> None:
    """Save the state with the last `keep` checkpoints (and the one served, always), then
    delete the others, and of the trainer states all but the one loop.json names: a resume
    reads no other, and each is AdamW's two moments, twice the fp32 weights (~1 GB for the
    default model). loop.json never lists a checkpoint that is gone, whenever a kill -9
    comes: one it no longer lists goes at the next prune (so does a save a kill cut short)."""
    while len(state.checkpoints) > max(keep, 1) and state.checkpoints[0] != state.checkpoint:
        state.checkpoints.pop(0)
    state.save(out)
    kept = {str(Path(p).resolve()) for p in [*state.checkpoints, state.checkpoint or ""] if p}
    folder = out / "checkpoints"
    for p in sorted(folder.iterdir()) if folder.is_dir() else []:
        if str(p.resolve()) not in kept:
            shutil.rmtree(p, ignore_errors=True)
    if state.trainer_state:
        current = Path(state.trainer_state)
        for p in current.parent.iterdir():   # older versions, and a save a kill cut short
            if p.name != current.name:
                p.unlink(missing_ok=True)
    # the trainer's per-iteration files (metrics.jsonl, metrics.png) of the last `keep`
    # iterations: every step's metrics are in loop_steps, and a run of days stays bounded
    steps = out / "iterations"
    for p in sorted(steps.iterdir()) if steps.is_dir() else []:
        if p.name.isdigit() and int(p.name) < state.completed - max(keep, 1):
            shutil.rmtree(p, ignore_errors=True)
