"""The records that cross from the store to the trainer, in one place. The store
(store/training.py) makes them from its rows; the trainer (grpo) reads them as they are.
Plain data: no torch and no duckdb here, so both sides import it."""

from __future__ import annotations

from dataclasses import dataclass
from typing import NamedTuple, Sequence

# A call recorded without a policy version (NULL: the gateway could not verify the weights that
# served it, or it had none yet). The store never hands such a call to the trainer.
UNKNOWN_VERSION = -1
# Which calls a session's reward covers: all of them, or its main loop's (the model it called
# most), a task's reward_covers (rollout/spec.py) that the store applies (store/training.py).
REWARD_COVERS = ("all", "main")


@dataclass(frozen=True, slots=True)
class Call:
    """One model call: vLLM sampled `tokens` (with `logprobs`) after exactly `prompt`."""
    session_id: str
    group: str                 # the GRPO group: the session's task, or the session itself
    seq: int
    prompt: Sequence[int]
    tokens: Sequence[int]
    logprobs: Sequence[float]
    finish_reason: str | None = None
    policy_version: int = UNKNOWN_VERSION   # the gateway's version that sampled it
    reward: float | None = None             # its session's
    db: str = ""                            # the database file it was read from


class SessionReward(NamedTuple):
    """A rewarded session's GRPO group and reward: every one of a group counts in its
    baseline, those with no trainable call included."""
    group: str
    reward: float


def policy_version_of(stored: str | int | None) -> int:
    """The stored column (an INTEGER; the gateway's integer as text before migration 10) as
    the record's int; NULL, or anything that is no integer, is UNKNOWN_VERSION."""
    if stored is None or isinstance(stored, bool):
        return UNKNOWN_VERSION
    try:
        return int(stored)
    except (TypeError, ValueError):
        return UNKNOWN_VERSION
