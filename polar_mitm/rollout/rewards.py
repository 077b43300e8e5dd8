"""A scored group's rewards as records to store (store.training.set_rewards): the server's
group is the record of which attempt is each sample's and what it scored. Nodes store the
same rewards once the server settles them, but a node killed in between has not."""

from __future__ import annotations

from collections import Counter
from typing import Iterable

from .protocol import Group, RewardRecord
from .states import RELEASE_CAUSE, UNSCORED, ReleaseCause, Session

FAILED = (Session.FAILED, Session.TIMED_OUT)     # outcomes without a reward of their own


def reward_records(group: Group, on_failure: str = "zero") -> list[RewardRecord]:
    """One record per final session with a reward; a failed one scores 0 under on_failure
    "zero" (its group keeps its size) and is left out under "drop". One that failed for the
    backend's sake (released max_releases times: stats["unscored"]) is always left out."""
    out: list[RewardRecord] = []
    for s in group["sessions"]:
        if (s.get("stats") or {}).get(UNSCORED):
            continue
        if s["reward"] is not None:
            info = {"state": s["state"], "reason": s["reason"]}
            judge = (s.get("stats") or {}).get("judge")
            if judge is not None:   # the judge's call and reasoning, with the reward
                info["judge"] = judge
            out.append({"session_id": s["session_id"], "reward": s["reward"], "info": info})
        elif s["state"] in FAILED and on_failure == "zero":
            out.append({"session_id": s["session_id"], "reward": 0.0,
                        "info": {"state": s["state"], "reason": f"{s['reason']} (on_failure: zero)"}})
    return out


def complete_fraction(group: Group) -> float:
    """The share of its samples that ended done with a reward of their own (0 for none)."""
    finals = group["sessions"]
    if not finals:
        return 0.0
    scored = [s for s in finals if s["state"] == Session.DONE and s["reward"] is not None
              and not (s.get("stats") or {}).get(UNSCORED)]
    return len(scored) / len(finals)


def incomplete(group: Group, min_fraction: float) -> str | None:
    """Why the group is left out of training (None: it trains): fewer of its samples than
    min_fraction ended with a reward of their own (a task's min_complete_fraction)."""
    got = complete_fraction(group)
    if min_fraction <= 0.0 or got >= min_fraction:
        return None
    n = len(group["sessions"])
    return (f"{round(got * n)} of its {n} samples ended with a reward of their own, below its "
            f"min_complete_fraction {min_fraction:g}")


def release_causes(groups: Iterable[Group]) -> Counter[str]:
    """How many attempts of these groups were released, by cause (ReleaseCause's label:
    backend unavailable, policy version unknown, node stopped; "other" when a release named
    none)."""
    out: Counter[str] = Counter()
    for g in groups:
        for s in g["attempts"] + g["sessions"]:
            if s["state"] == Session.RELEASED:
                raw = (s.get("stats") or {}).get(RELEASE_CAUSE)
                out[ReleaseCause(raw).label if raw in set(ReleaseCause) else "other"] += 1
    return out
