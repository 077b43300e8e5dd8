"""A judge in group mode (judge.py, as ART's RULER): a task's settled group is scored in one
call, its sessions ranked against each other, and each final session's reward becomes its
evaluator's outcome (stats["outcome"], which the node kept) combined with its score. Run where
the groups settle and the database is at hand: `polar-mitm rollout` and `polar-train loop`,
before they store the rewards. A node scores alone the tasks whose judge is in single mode."""

from __future__ import annotations

import os
from typing import Mapping

from .judge import JudgeError, combine, judge_group, judge_transcript, parse_judge
from .protocol import Group
from .rewards import failure_reward
from .spec import TaskRequest
from .states import Session


def judge_groups(groups: Mapping[str, Group], specs: Mapping[str, TaskRequest], db: str | os.PathLike | None,
                 backend_url: str | None) -> list[str]:
    """Each group whose task's judge is in group mode, scored (its sessions' rewards set, in
    place, with the judge's call and reasoning in their stats). A group the judge fails on
    is a failed evaluation for each of its sessions: 0 under on_failure "zero", unscored under
    "drop", never 1.0. Returns one line per group scored or failed."""
    lines = []
    for tid, g in groups.items():
        spec = specs[tid]
        judge = parse_judge(spec.judge) if spec.judge is not None else None
        if judge is None or judge.mode != "group":
            continue
        done = [s for s in g["sessions"] if s["state"] == Session.DONE]
        if not done:
            continue
        try:
            transcripts = [judge_transcript(db, s["session_id"], spec.instruction) for s in done]
            verdicts = judge_group(judge, transcripts, backend_url)
        except JudgeError as e:
            for s in done:
                s["reward"] = failure_reward(spec.on_failure)
                s["reason"] = f"judge: {e}"
                s["stats"] = {**(s.get("stats") or {}), "judge": {"error": str(e), "call": e.call}}
            lines.append(f"{tid}: the judge failed on the group ({e})")
            continue
        for s in done:
            v = verdicts[s["session_id"]]
            stats = s.get("stats") or {}
            outcome = stats.get("outcome")
            s["reward"] = combine(outcome if isinstance(outcome, (int, float)) else None, v.score, judge)
            s["stats"] = {**stats, "judge": v.info()}
        lines.append(f"{tid}: judged as a group: " + ", ".join(f"{verdicts[s['session_id']].score:g}" for s in done))
    return lines
