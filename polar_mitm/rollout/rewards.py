"""A scored group's rewards as records to store (store.training.set_rewards): the server's
group is the record of which attempt is each sample's and what it scored. Nodes store the
same rewards once the server settles them, but a node killed in between has not."""

from __future__ import annotations

from .protocol import Group, RewardRecord
from .states import Session

FAILED = (Session.FAILED, Session.TIMED_OUT)     # outcomes without a reward of their own


def reward_records(group: Group, on_failure: str = "zero") -> list[RewardRecord]:
    """One record per final session with a reward; a failed one scores 0 under on_failure
    "zero" (its group keeps its size) and is left out under "drop"."""
    out: list[RewardRecord] = []
    for s in group["sessions"]:
        if s["reward"] is not None:
            out.append({"session_id": s["session_id"], "reward": s["reward"],
                        "info": {"state": s["state"], "reason": s["reason"]}})
        elif s["state"] in FAILED and on_failure == "zero":
            out.append({"session_id": s["session_id"], "reward": 0.0,
                        "info": {"state": s["state"], "reason": f"{s['reason']} (on_failure: zero)"}})
    return out
