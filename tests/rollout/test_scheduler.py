"""The rollout server's scheduling on its own (rollout/scheduler.py): every transition driven
directly, with the time passed in: no threads, no HTTP, no database."""

from __future__ import annotations

from polar_mitm.rollout.scheduler import (CallbackDue, Noted, Scheduler, SessionMoved, SessionState, TaskMoved,
                                          TaskState)
from polar_mitm.rollout.spec import parse_task
from polar_mitm.rollout.states import TERMINAL, Callback, ServerEvent, Session, Task


def task(tid: str = "t", **kw):
    return parse_task({"task_id": tid, "instruction": "x", "harness": "command", "command": "true", **kw})


def beat(s: Scheduler, node: str, now: float, free: int = 0, active=(), events=(), **more):
    """A heartbeat, answered at once."""
    answer, effects = s.heartbeat({"node_id": node, "load": {"free": free}, "active": list(active),
                                   "events": list(events), **more}, now)
    s.answered(node, now)
    return answer, effects


def ev(sid: str, state: str, **kw) -> dict:
    return {"session_id": sid, "state": state, **kw}


def moved(effects) -> list[tuple[str, str, str | None]]:
    return [(e.session_id, e.state, e.detail) for e in effects if isinstance(e, SessionMoved)]


def noted(effects) -> list[tuple[str | None, str, str | None]]:
    return [(e.task_id, e.state, e.detail) for e in effects if isinstance(e, Noted)]


def states(s: Scheduler, tid: str) -> dict[str, str]:
    return {x["session_id"]: x["state"] for x in s.group(tid)["sessions"]}


def test_submit_makes_one_pending_session_per_sample_and_refuses_it_again():
    s = Scheduler()
    ids, effects = s.submit(task(num_samples=3))
    assert ids == ["t~0", "t~1", "t~2"]
    assert TaskMoved("t") in effects and moved(effects) == [(sid, "pending", None) for sid in ids]
    assert s.tasks["t"].state == Task.QUEUED and set(s.open) == set(ids)
    import pytest
    from polar_mitm.rollout.spec import TaskChanged, TaskExists
    with pytest.raises(TaskExists):
        s.submit(task(num_samples=3))
    with pytest.raises(TaskChanged, match="num_samples 3 -> 2"):
        s.submit(task(num_samples=2))


def test_leases_follow_free_places_then_priority_then_order():
    s = Scheduler()
    s.submit(task("low", num_samples=2))
    s.submit(task("high", num_samples=2, priority=5))
    answer, effects = beat(s, "busy", 1.0, free=0)
    assert answer.assign == [] and noted(effects) == [(None, ServerEvent.NODE_REGISTERED, None)]
    answer, effects = beat(s, "idle", 1.0, free=3)
    assert [a["session_id"] for a in answer.assign] == ["high~0", "high~1", "low~0"]
    assert answer.assign[0]["task"]["priority"] == 5 and answer.assign[0]["attempt"] == 1
    assert s.sessions["high~0"].state == Session.ASSIGNED and s.sessions["high~0"].node_id == "idle"
    assert s.sessions["high~0"].assigned_at == 1.0
    assert {TaskMoved("high"), TaskMoved("low")} <= set(effects)          # queued -> running
    assert s.tasks["high"].state == s.tasks["low"].state == Task.RUNNING
    assert s.sessions["low~1"].state == Session.PENDING


def test_a_session_goes_through_its_states_and_its_outcome_is_settled():
    s = Scheduler()
    s.submit(task(num_samples=2))
    beat(s, "n", 1.0, free=2)
    for state in ("init", "ready", "run", "post_run"):
        answer, effects = beat(s, "n", 2.0, active=["t~0", "t~1"], events=[ev("t~0", state), ev("t~1", state)])
        assert answer.settled == [] and moved(effects) == [("t~0", state, None), ("t~1", state, None)]
    # finish ok (a reward) and failed (a reason, no reward)
    done = ev("t~0", "done", reward=1.0, stats={"calls": 2})
    failed = ev("t~1", "failed", reason="harness exited with code 3")
    answer, effects = beat(s, "n", 3.0, events=[done, failed])
    assert answer.settled == ["t~0", "t~1"]
    a, b = s.sessions["t~0"], s.sessions["t~1"]
    assert (a.state, a.reward, a.stats) == (Session.DONE, 1.0, {"calls": 2})
    assert (b.state, b.reward, b.reason) == (Session.FAILED, None, "harness exited with code 3")
    assert s.tasks["t"].state == Task.DONE and ("t", Task.DONE, None) in noted(effects)
    assert s.live() == [] and s.open == {}
    # the same outcome again (the answer was lost) is settled again; another one never
    answer, _ = beat(s, "n", 4.0, events=[done])
    assert answer.settled == ["t~0"]
    answer, _ = beat(s, "n", 4.0, events=[ev("t~1", "done", reward=1.0)])
    assert answer.settled == [] and s.sessions["t~1"].state == Session.FAILED


def test_a_timed_out_harness_is_an_outcome_with_its_reward():
    s = Scheduler()
    s.submit(task())
    beat(s, "n", 1.0, free=1)
    answer, _ = beat(s, "n", 2.0, events=[ev("t~0", "timed_out", reward=0.0, reason="harness timed out after 3s")])
    assert answer.settled == ["t~0"]
    assert (s.sessions["t~0"].state, s.sessions["t~0"].reward) == (Session.TIMED_OUT, 0.0)
    assert s.tasks["t"].state == Task.DONE


def test_reports_from_another_node_or_of_unknown_sessions_are_stale():
    s = Scheduler()
    s.submit(task())
    beat(s, "a", 1.0, free=1)
    answer, effects = beat(s, "b", 2.0, events=[ev("t~0", "done", reward=1.0), ev("nope~0", "run")],
                           active=["t~0"])
    assert answer.settled == [] and moved(effects) == [] and s.sessions["t~0"].state == Session.ASSIGNED
    assert answer.cancel == ["t~0"]           # b holds what it was never given: it cancels it
    _, effects = beat(s, "a", 2.0, active=["t~0"], events=[ev("t~0", "finished")])
    assert moved(effects) == []               # not a state


def test_a_session_its_node_no_longer_holds_runs_again():
    """Not started (assigned, init, ready): again under its name; started: a new attempt
    TASK~i.r2, counted as lost. Only after the node has been heard since it got it."""
    s = Scheduler()
    s.submit(task(num_samples=2))
    beat(s, "n", 1.0, free=2)
    beat(s, "n", 2.0, active=["t~0", "t~1"], events=[ev("t~1", "run")])
    answer, effects = beat(s, "n", 3.0, active=[])       # a restarted node: holds neither
    assert moved(effects) == [("t~0", "pending", "node n no longer holds it"),
                              ("t~1", "lost", "node n no longer holds it"),
                              ("t~1.r2", "pending", "retry of t~1")]
    assert s.sessions["t~0"].node_id is None
    assert [a["session_id"] for a in answer.assign] == []          # free 0
    answer, _ = beat(s, "n", 4.0, free=2)
    assert [(a["session_id"], a["attempt"]) for a in answer.assign] == [("t~0", 1), ("t~1.r2", 2)]
    g = s.group("t")
    assert [x["session_id"] for x in g["sessions"]] == ["t~0", "t~1.r2"]
    assert [(x["session_id"], x["state"]) for x in g["attempts"]] == [("t~1", "lost")]


def test_a_session_given_in_this_very_heartbeat_is_not_missing_from_it():
    s = Scheduler()
    s.submit(task())
    beat(s, "n", 1.0)                  # registered at 1.0
    beat(s, "n", 2.0, free=1)          # t~0 assigned at 2.0, after the node was last heard (1.0)
    _, effects = beat(s, "n", 2.0, active=[])
    assert moved(effects) == [] and s.sessions["t~0"].state == Session.ASSIGNED


def test_a_released_attempt_runs_again_and_never_counts_as_failed():
    s = Scheduler(max_attempts=2)
    s.submit(task())
    for attempt in range(1, 5):
        (a,) = beat(s, "n", float(attempt), free=1)[0].assign
        sid = a["session_id"]
        beat(s, "n", attempt + 0.5, active=[sid], events=[ev(sid, "run")])
        answer, effects = beat(s, "n", attempt + 0.7, events=[ev(sid, "released", reason="node n stopped")])
        assert answer.settled == [] and ("released", "node n stopped") in [(m[1], m[2]) for m in moved(effects)]
    (cur,) = s.group("t")["sessions"]
    assert (cur["session_id"], cur["state"], cur["attempt"]) == ("t~0.r5", "pending", 5)
    # released before any harness ran: back in the queue under the same name
    s.submit(task("u"))
    assert [a["session_id"] for a in beat(s, "n", 10.0, free=2)[0].assign] == ["t~0.r5", "u~0"]
    _, effects = beat(s, "n", 11.0, events=[ev("u~0", "released", reason="node n stopped")])
    assert moved(effects) == [("u~0", "pending", "node n stopped")]


def test_the_reaper_declares_a_silent_node_lost_and_its_sessions_run_again_as_new_attempts():
    s = Scheduler(node_timeout=10.0, max_attempts=2)
    s.submit(task(num_samples=2))
    beat(s, "n", 0.0, free=2)
    beat(s, "n", 1.0, active=["t~0", "t~1"], events=[ev("t~0", "run")])   # t~1 never started
    assert s.reap(10.9) == []                       # not yet
    s.nodes["n"].in_flight = 1                      # a node waiting on our answer is alive
    assert s.reap(100.0) == []
    s.nodes["n"].in_flight = 0
    effects = s.reap(11.0)
    reason = "node n lost: no heartbeat for 10s"
    assert noted(effects) == [(None, ServerEvent.NODE_LOST, reason)] and s.nodes["n"].lost
    # a lost node may still run it: a new name even for the one that never started
    assert moved(effects) == [("t~0", "lost", reason), ("t~0.r2", "pending", "retry of t~0"),
                              ("t~1", "lost", reason), ("t~1.r2", "pending", "retry of t~1")]
    assert s.reap(50.0) == []                       # once
    # it comes back; a second loss of the same samples: max_attempts (2) lost, the samples fail
    _, effects = beat(s, "n", 60.0, free=2)
    assert noted(effects) == [(None, ServerEvent.NODE_RETURNED, None)] and not s.nodes["n"].lost
    effects = s.reap(75.0)
    assert states(s, "t") == {"t~0.r2": "failed", "t~1.r2": "failed"}
    assert s.sessions["t~0.r2"].reason == "node n lost: no heartbeat for 15s; 2 failed attempts"
    assert s.tasks["t"].state == Task.DONE and ("t", Task.DONE, None) in noted(effects)


def test_cancel_stops_pending_sessions_at_once_and_the_rest_through_their_nodes():
    s = Scheduler()
    s.submit(task(num_samples=3))
    beat(s, "n", 1.0, free=2)
    beat(s, "n", 2.0, active=["t~0", "t~1"], events=[ev("t~0", "run")])
    found, effects = s.cancel("t", "enough")
    assert found and noted(effects) == [("t", ServerEvent.STOPPING, "enough")]
    assert moved(effects) == [("t~2", "cancelled", "enough")] and s.tasks["t"].state == Task.RUNNING
    answer, _ = beat(s, "n", 3.0, free=5, active=["t~0", "t~1"])
    assert sorted(answer.cancel) == ["t~0", "t~1"] and answer.assign == []
    # the node's cancelled report; and one it no longer holds ends cancelled too, not retried
    _, effects = beat(s, "n", 4.0, active=["t~1"], events=[ev("t~0", "cancelled", reason="cancelled")])
    _, effects = beat(s, "n", 5.0, active=[])
    assert moved(effects) == [("t~1", "cancelled", "enough")]
    assert s.tasks["t"].state == Task.CANCELLED and ("t", Task.CANCELLED, "enough") in noted(effects)
    assert s.cancel("t", "again") == (True, [])          # settled: nothing to do
    assert s.cancel("nope", "x") == (False, [])


def test_a_lost_node_of_a_stopping_task_ends_its_sessions_cancelled():
    s = Scheduler(node_timeout=5.0)
    s.submit(task())
    beat(s, "n", 0.0, free=1)
    s.cancel("t", "stop it")
    effects = s.reap(6.0)
    assert moved(effects) == [("t~0", "cancelled", "stop it")] and s.tasks["t"].state == Task.CANCELLED


def test_early_stop_cancels_the_stragglers_and_the_task_ends_done():
    s = Scheduler()
    s.submit(task(num_samples=4, early_stop=2))
    beat(s, "n", 1.0, free=3)
    answer, effects = beat(s, "n", 2.0, active=["t~2"],
                           events=[ev("t~0", "done", reward=1.0), ev("t~1", "done", reward=0.0)])
    reason = "early stop: 2 of 4 sessions finished"
    assert answer.settled == ["t~0", "t~1"] and answer.cancel == ["t~2"]
    assert ("t", ServerEvent.STOPPING, reason) in noted(effects)
    assert ("t~3", "cancelled", reason) in moved(effects)      # pending: at once
    beat(s, "n", 3.0, events=[ev("t~2", "cancelled", reason="cancelled")])
    assert s.tasks["t"].state == Task.DONE and s.tasks["t"].cancel_reason == reason


def test_a_settled_task_with_a_callback_posts_it_and_retries_with_backoff_until_given_up():
    s = Scheduler(callback_tries=3, callback_backoff=0.5)
    s.submit(task(callback_url="http://cb/groups"))
    beat(s, "n", 1.0, free=1)
    _, effects = beat(s, "n", 2.0, events=[ev("t~0", "done", reward=1.0)])
    assert CallbackDue("t", 0) in effects and s.tasks["t"].callback_state == Callback.PENDING
    effects = s.callback_result("t", 0, False, "HTTP 500")
    assert CallbackDue("t", 1, 0.5) in effects and noted(effects) == [("t", ServerEvent.CALLBACK_FAILED, "HTTP 500")]
    assert CallbackDue("t", 2, 1.0) in s.callback_result("t", 1, False, "HTTP 500")
    effects = s.callback_result("t", 2, False, "HTTP 500")
    assert not [e for e in effects if isinstance(e, CallbackDue)] and TaskMoved("t") in effects
    assert (s.tasks["t"].callback_state, s.tasks["t"].callback_tries) == (Callback.FAILED, 3)
    s.submit(task("ok", callback_url="http://cb/groups"))
    effects = s.callback_result("ok", 0, True, None)
    assert s.tasks["ok"].callback_state == Callback.SENT and noted(effects) == [("ok", ServerEvent.CALLBACK_SENT, None)]


def test_restore_resumes_sessions_on_nodes_and_a_stopping_task_keeps_stopping():
    spec = task(num_samples=2, callback_url="http://cb/groups")
    s = Scheduler()
    tasks = [TaskState(spec, 0, Task.RUNNING, cancel_reason="cancelled by request"),
             TaskState(task("cb"), 1, Task.DONE, Callback.PENDING, 2)]
    sessions = [SessionState("t~0", "t", 0, 1, Session.RUN, "n"), SessionState("t~1", "t", 1, 1, Session.CANCELLED)]
    effects = s.restore(tasks, sessions, 100.0)
    assert CallbackDue("cb", 0) in effects
    assert moved(effects) == [("t~0", "run", "server restarted; waiting for its node to report")]
    assert s.nodes["n"].last_seen == 100.0 and s.open == {"t~0": s.sessions["t~0"]}
    assert s.sessions["t~0"].cancel and not s.sessions["t~1"].cancel
    answer, _ = beat(s, "n", 101.0, active=["t~0"])
    assert answer.cancel == ["t~0"]
    beat(s, "n", 102.0, events=[ev("t~0", "cancelled", reason="cancelled")])
    assert s.tasks["t"].state == Task.CANCELLED


def test_views_status_and_policies():
    s = Scheduler()
    s.submit(task(num_samples=2, metadata={"split": "train"}))
    beat(s, "n", 1.0, free=1, policy={"target": "p1", "version": 3, "error": None}, db="/n.duckdb")
    beat(s, "n", 2.0, events=[ev("t~0", "done", reward=0.5)])
    st = s.status(3.5)
    assert st["sessions"] == {"pending": 1, "done": 1} and st["rewards"] == {"n": 1, "mean": 0.5}
    assert st["tasks"]["running"] == 1 and st["nodes"]["n"]["seen_s_ago"] == 1.5
    assert s.node_policies() == {"n": {"lost": False, "db": "/n.duckdb",
                                       "policy": {"target": "p1", "version": 3, "error": None}}}
    assert s.task_list() == [{"task_id": "t", "state": "running"}]
    g = s.group("t")
    assert g["metadata"] == {"split": "train"} and g["sessions"][0] == {
        "session_id": "t~0", "sample": 0, "attempt": 1, "state": "done", "node_id": "n", "reward": 0.5,
        "reason": None, "stats": None}
    assert s.task_status("nope") is None and len(s.task_status("t")["sessions"]) == 2
    assert all(state in TERMINAL for state in ("done", "lost", "released"))


def test_the_scheduler_reads_no_clock_and_does_no_io():
    """Its time comes in as arguments; threads, the journal and HTTP are the server's."""
    import ast
    from pathlib import Path

    import polar_mitm.rollout.scheduler as mod
    tree = ast.parse(Path(mod.__file__).read_text())
    imported = {a.name.split(".")[0] for n in ast.walk(tree) if isinstance(n, ast.Import) for a in n.names}
    imported |= {(n.module or "").split(".")[0] for n in ast.walk(tree) if isinstance(n, ast.ImportFrom) and not n.level}
    assert not imported & {"time", "threading", "httpx", "socket", "duckdb", "os", "subprocess", "fastapi",
                           "uvicorn", "asyncio", "datetime"}, imported
