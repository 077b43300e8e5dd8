"""The records that cross from the store to the trainer, in one place. The store
(store/training.py) makes them from its rows; the trainer (grpo) reads them as they are.
Plain data: no torch and no duckdb here, so both sides import it."""

from __future__ import annotations

from dataclasses import dataclass
from typing import NamedTuple, Sequence

# A version not known: a call's policy_version NULL (the gateway could not verify the weights that
# served it, or it had none yet), or a token's entry NULL in token_versions (vLLM's tag was not
# one of ours, as after a restart). The store never hands over a call with no token of a known
# version, and a token of an unknown version is never trained (Call.trained).
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
    policy_version: int = UNKNOWN_VERSION   # the version the call started under
    reward: float | None = None             # its session's
    db: str = ""                            # the database file it was read from
    # Each sampled token's version, as vLLM reported it (UNKNOWN_VERSION: not known); None: every
    # token was sampled by policy_version. A sync in flight switches at a token, so within a call
    # the known ones never decrease (the older tokens are a prefix); the mask is per token all the same.
    token_versions: Sequence[int] | None = None
    # Tokens sampled by an older version are context only (the loop's --max-staleness); None: none.
    min_version: int | None = None

    def versions(self) -> Sequence[int]:
        """The version of each sampled token."""
        if self.token_versions is not None:
            return self.token_versions
        return [self.policy_version] * len(self.tokens)

    def trained(self) -> Sequence[int]:
        """The indices of the sampled tokens trained on, each with its own logprob. The others
        (of an unknown version, or older than min_version) stay in the sequence as context,
        with no loss and no share of the loss's normalization."""
        lowest = self.min_version
        if self.token_versions is None:   # one version for the whole call
            return range(len(self.tokens)) if lowest is None or self.policy_version >= lowest else range(0)
        floor = UNKNOWN_VERSION + 1 if lowest is None else max(lowest, UNKNOWN_VERSION + 1)
        return [j for j, v in enumerate(self.token_versions[:len(self.tokens)]) if v >= floor]


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
