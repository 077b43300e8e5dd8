"""Rewards, from the server's settled outcomes to the databases, by one path: a session's
outcome (the server's group, or the node's own last report, which is what the server
settles) becomes a record (reward_record), and records are written per database
(write_rewards: store.training.set_rewards). The node stores its sessions' rewards once the
server settles them; `polar-mitm rollout` and the loop store every settled group's again
(store_settled), for a node killed in between has not. The upsert is idempotent, so the
second write changes nothing the first made.

on_failure is applied here only (failure_reward): the node's report of a failed session,
the group judge's failure (judging.py) and a failed sample the server settled without a
reward all ask it."""

from __future__ import annotations

from collections import Counter
from pathlib import Path
from typing import Any, Iterable, Mapping, Sequence, TypedDict

from ..store.training import set_rewards
from .protocol import Group, RewardRecord
from .spec import TaskRequest
from .states import RELEASE_CAUSE, UNSCORED, ReleaseCause, Session

FAILED = (Session.FAILED, Session.TIMED_OUT)     # outcomes without a reward of their own


class Outcome(TypedDict):
    """What a session's reward is decided from: its final report as the server settles it (a
    group's SessionResult is one; so is the node's last event of it)."""
    session_id: str
    state: Session
    reward: float | None
    reason: str | None
    stats: dict[str, Any] | None


class UnreachableDatabases(FileNotFoundError):
    """Databases that should get rewards are not on this machine's filesystem."""

    def __init__(self, paths: list[str]):
        super().__init__(f"databases not reachable from here: {', '.join(paths)}")
        self.paths = paths


def failure_reward(on_failure: str) -> float | None:
    """The reward of a session that failed (its harness, its evaluation, its judge): 0.0 under
    on_failure "zero" (its group keeps its size, and GRPO's baseline stays unbiased), None
    under "drop" (no reward: it is left out of its group)."""
    return 0.0 if on_failure == "zero" else None


def reward_record(outcome: Outcome, on_failure: str) -> RewardRecord | None:
    """Its record, or None where it has no reward: a failed one without a reward of its own
    scores failure_reward; one that failed for the backend's sake (released max_releases
    times: stats["unscored"]) never scores, nor one still unscored (a group judge's)."""
    stats = outcome["stats"] or {}
    if stats.get(UNSCORED):
        return None
    if outcome["reward"] is not None:
        info: dict[str, Any] = {"state": outcome["state"], "reason": outcome["reason"]}
        if stats.get("judge") is not None:   # the judge's call and reasoning, with the reward
            info["judge"] = stats["judge"]
        return {"session_id": outcome["session_id"], "reward": outcome["reward"], "info": info}
    reward = failure_reward(on_failure) if outcome["state"] in FAILED else None
    if reward is None:
        return None
    return {"session_id": outcome["session_id"], "reward": reward,
            "info": {"state": outcome["state"], "reason": f"{outcome['reason']} (on_failure: {on_failure})"}}


def reward_records(group: Group, on_failure: str = "zero") -> list[RewardRecord]:
    """One record per final session of the group with a reward (reward_record)."""
    return [r for s in group["sessions"] if (r := reward_record(s, on_failure)) is not None]


def settled_rewards(groups: Mapping[str, Group], specs: Mapping[str, TaskRequest], db: str | None,
                    node_dbs: Mapping[str, str] | None = None) -> dict[str, list[RewardRecord]]:
    """The groups' records (each under its task's on_failure), by the database that holds the
    session's calls: db (one database on one machine), else that of the node that ran it
    (node_dbs: node_id -> its database). A session that ran on no known node has no calls
    there, and is left out."""
    out: dict[str, list[RewardRecord]] = {}
    for tid, g in groups.items():
        ran_on = {s["session_id"]: s.get("node_id") for s in g["sessions"]}
        for r in reward_records(g, specs[tid].on_failure):
            target = db or (node_dbs or {}).get(ran_on[r["session_id"]] or "")
            if target is not None:
                out.setdefault(target, []).append(r)
    return out


def write_rewards(per_db: Mapping[str, Sequence[RewardRecord]], timeout: float = 120.0) -> list[str]:
    """Each database's records, stored (one transaction each); the databases written. Each is
    checked first: one not on this machine raises UnreachableDatabases, and nothing is written."""
    written = sorted(d for d, records in per_db.items() if records)
    missing = [d for d in written if not Path(d).exists()]
    if missing:
        raise UnreachableDatabases(missing)
    for d in written:
        set_rewards(d, per_db[d], timeout=timeout)
    return written


def store_settled(groups: Mapping[str, Group], specs: Mapping[str, TaskRequest], db: str | None,
                  node_dbs: Mapping[str, str] | None = None) -> list[str]:
    """The settled groups' rewards, stored where their calls are (settled_rewards); the
    databases written."""
    return write_rewards(settled_rewards(groups, specs, db, node_dbs))


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
