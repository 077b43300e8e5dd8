"""Rewards, from the server's settled groups to the databases, by one path (rollout/rewards.py):
on_failure decides a failed session's reward in one place, and each reward goes to the
database of the node that ran the session (the node, `rollout` and the loop all write so)."""

from __future__ import annotations

import json

import pytest

from polar_mitm.rollout.protocol import Group, SessionResult
from polar_mitm.rollout.rewards import (UnreachableDatabases, failure_reward, reward_record, reward_records,
                                        settled_rewards, store_settled)
from polar_mitm.rollout.runtime import LocalRuntime, SetupError
from polar_mitm.rollout.spec import parse_task
from polar_mitm.rollout.states import UNSCORED, Session, Task
from polar_mitm.store.db import init_db, query
from support.fake_vllm import FakeVLLM
from support.rollouts import Rollouts


def _session(sid: str, state: Session, reward: float | None, node: str | None = "a", reason: str | None = None,
             stats: dict | None = None) -> SessionResult:
    return SessionResult(session_id=sid, sample=int(sid.split("~")[1][0]), attempt=1, state=state, node_id=node,
                         reward=reward, reason=reason, stats=stats)


def _group(task_id: str, *sessions: SessionResult) -> Group:
    return Group(task_id=task_id, state=Task.DONE, metadata={}, sessions=list(sessions), attempts=[])


def test_on_failure_decides_the_reward_of_a_failed_session_alone():
    assert failure_reward("zero") == 0.0 and failure_reward("drop") is None
    crashed = _session("t~0", Session.FAILED, None, reason="harness exited with code 3")
    assert reward_record(crashed, "zero") == {"session_id": "t~0", "reward": 0.0, "info": {
        "state": Session.FAILED, "reason": "harness exited with code 3 (on_failure: zero)"}}
    assert reward_record(crashed, "drop") is None
    # a reward of its own is kept as it is (its node asked failure_reward already), with the judge's reasoning
    judged = _session("t~1", Session.DONE, 0.75, stats={"judge": {"score": 3}})
    assert reward_record(judged, "drop") == {"session_id": "t~1", "reward": 0.75, "info": {
        "state": Session.DONE, "reason": None, "judge": {"score": 3}}}
    # the backend's failures are never scored, nor a session a group judge has not scored yet
    assert reward_record(_session("t~2", Session.FAILED, 0.0, stats={UNSCORED: "backend_unavailable"}), "zero") is None
    assert reward_record(_session("t~3", Session.DONE, None), "zero") is None
    g = _group("t", crashed, judged)
    assert [r["session_id"] for r in reward_records(g, "zero")] == ["t~0", "t~1"]
    assert [r["session_id"] for r in reward_records(g, "drop")] == ["t~1"]


def test_settled_groups_reach_the_database_of_the_node_that_ran_each_session(tmp_path):
    a, b = str(tmp_path / "a.duckdb"), str(tmp_path / "b.duckdb")
    init_db(a)
    init_db(b)
    groups = {"t": _group("t", _session("t~0", Session.DONE, 1.0, node="a"),
                          _session("t~1", Session.TIMED_OUT, 0.0, node="b"),
                          _session("t~2", Session.FAILED, None, node=None, reason="3 failed attempts")),
              "d": _group("d", _session("d~0", Session.FAILED, None, node="b", reason="crashed"))}
    specs = {"t": parse_task({"task_id": "t", "instruction": "x"}),
             "d": parse_task({"task_id": "d", "instruction": "x", "on_failure": "drop"})}
    per_db = settled_rewards(groups, specs, None, {"a": a, "b": b})
    # t~2 never ran on a node: it has no calls anywhere; d~0's task drops its failures
    assert {d: [r["session_id"] for r in rs] for d, rs in per_db.items()} == {a: ["t~0"], b: ["t~1"]}
    # one database on one machine: every reward goes there
    assert [r["session_id"] for r in settled_rewards(groups, specs, a)[a]] == ["t~0", "t~1", "t~2"]

    assert store_settled(groups, specs, None, {"a": a, "b": b}) == [a, b]
    sql = "SELECT session_id, task_id, reward, reward_info->>'state' FROM sessions ORDER BY 1"
    assert query(a, sql)[1] == [("t~0", "t", 1.0, "done")]
    assert query(b, sql)[1] == [("t~1", "t", 0.0, "timed_out")]

    # a database not on this machine: nothing is written, and the error names it
    gone = str(tmp_path / "elsewhere.duckdb")
    groups["t"]["sessions"][0]["reward"] = 0.5
    with pytest.raises(UnreachableDatabases, match="elsewhere.duckdb") as e:
        store_settled(groups, specs, None, {"a": a, "b": gone})
    assert e.value.paths == [gone] and query(a, sql)[1] == [("t~0", "t", 1.0, "done")]


class _NoSetUp(LocalRuntime):
    def prepare(self, session_id, *args, **kwargs):
        raise SetupError("the image is not there")


def test_the_node_stores_the_reward_the_servers_group_gives_a_session_that_could_not_be_set_up(start_proxy,
                                                                                                 tmp_path):
    with FakeVLLM() as backend:
        proxy = start_proxy(backend.url)
        with Rollouts(proxy, _NoSetUp(tmp_path / "sessions")) as rollouts:
            groups = rollouts.run([{"task_id": "t", "instruction": "x", "harness": "command", "command": "true"},
                                   {"task_id": "d", "instruction": "x", "harness": "command", "command": "true",
                                    "on_failure": "drop"}], timeout=60)
    # stored by the node alone (nothing else wrote here), as the group's record says
    (record,) = reward_records(groups["t"], "zero")
    assert record["reward"] == 0.0 and "set-up failed: the image is not there" in record["info"]["reason"]
    _, rows = query(str(proxy.db), "SELECT session_id, reward, reward_info FROM sessions WHERE reward IS NOT NULL")
    assert [(sid, r, json.loads(info)) for sid, r, info in rows] == [("t~0", 0.0, record["info"])]
