"""The judge wired into rollouts (issue 33, section 3): a task's `judge` scores each session's
transcript (its recorded calls, read from the database) on top of its evaluator's outcome,
alone on the node (single mode) or its group at once where groups settle (group mode,
judging.py); the judge's call and reasoning go with the reward. A judge that answers garbage
fails the evaluation: 0 under on_failure "zero", never 1.0."""

from __future__ import annotations

import json
import sys

from polar_mitm.rollout.judging import judge_groups
from polar_mitm.store import query
from support.fake_vllm import FakeVLLM
from support.judge_model import StandIn
from support.rollouts import Rollouts
from support import SUPPORT

HERE = SUPPORT   # the helper scripts the sessions run
FAKE = f"{sys.executable} {HERE / 'fake_harness.py'}"


def _run(start_proxy, tmp_path, tasks: list[dict]) -> tuple[dict, dict, str]:
    with FakeVLLM() as backend:
        proxy = start_proxy(backend.url)
        with Rollouts(proxy, tmp_path / "sessions", backend_url=backend.url) as rollouts:
            groups = rollouts.run(tasks, timeout=120)
            views = rollouts.server.task_views(t["task_id"] for t in tasks)
            specs = {tid: view.spec for tid, view in views.items()}
    return groups, specs, str(proxy.db)


def test_a_judge_scores_each_session_alone_or_its_group_at_once(start_proxy, tmp_path):
    good = StandIn(lambda body: 'Fine work.\n{"score": 4, "reasoning": "ran the tests"}')
    garbage = StandIn(lambda body: "I think it is pretty good!!")
    ranked = StandIn(lambda body: json.dumps({"scores": [
        {"id": "t1", "score": 5, "reasoning": "best"}, {"id": "t2", "score": 1, "reasoning": "worst"}]}))
    base = {"instruction": "write result.txt", "harness": "command", "num_samples": 2,
            "command": f"{FAKE} ok 1", "evaluator": "test -f result.txt"}
    try:
        groups, specs, db = _run(start_proxy, tmp_path, [
            {**base, "task_id": "single", "judge": {"rubric": "Did it write result.txt?", "endpoint": good.url}},
            {**base, "task_id": "garbage", "judge": {"rubric": "Did it?", "endpoint": garbage.url}},
            {**base, "task_id": "group", "judge": {"rubric": "Rank them.", "mode": "group", "endpoint": ranked.url}},
        ])
        # single: outcome 1.0 + 0.2 * 4 / 5, the call and reasoning kept
        for s in groups["single"]["sessions"]:
            assert s["state"] == "done" and abs(s["reward"] - 1.16) < 1e-9, s
            assert s["stats"]["judge"]["reasoning"] == "ran the tests" and s["stats"]["outcome"] == 1.0
            assert "Did it write result.txt?" in json.dumps(s["stats"]["judge"]["call"]["messages"])
        assert all("write result.txt" in json.dumps(r["messages"]) for r in good.requests)   # the transcript
        # garbage: a failed evaluation, 0 (on_failure zero), never 1.0
        for s in groups["garbage"]["sessions"]:
            assert s["state"] == "failed" and s["reward"] == 0.0 and s["reason"].startswith("judge: "), s
            assert s["stats"]["judge"]["call"]["answer"] == "I think it is pretty good!!"
        # group: unscored on the node, then ranked together where the group settled
        assert [s["reward"] for s in groups["group"]["sessions"]] == [None, None]
        lines = judge_groups(groups, specs, db, None)
        assert lines == ["group: judged as a group: 5, 1"] and len(ranked.requests) == 1
        assert [s["reward"] for s in groups["group"]["sessions"]] == [1.2, 1.04]
        assert groups["group"]["sessions"][0]["stats"]["judge"]["reasoning"] == "best"
    finally:
        for s in (good, garbage, ranked):
            s.close()
    # the judge's calls went to it directly: the proxy recorded only the harnesses' calls
    _, calls = query(db, "SELECT count(*) FROM call_records")
    assert calls == [(6,)]
    # the node stored the single-mode rewards with the judge's information
    _, stored = query(db, "SELECT reward, reward_info FROM sessions WHERE session_id LIKE 'single%'")
    assert len(stored) == 2 and all(abs(r - 1.16) < 1e-9 and "ran the tests" in str(i) for r, i in stored)
