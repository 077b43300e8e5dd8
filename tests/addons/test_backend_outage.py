"""The backend's failures are not the policy's (issue 31, section 3).

A session whose model calls failed because the backend was unavailable (refused connections,
timeouts, vLLM's 5xx: the gateway records each with its error_kind) is released and runs
again under a new name, never scored, however short the outage: a 1.5 s one slips between
the node's 2 s probes. Releases are bounded (max_releases), after which the sample fails
unscored, and the cause shows in the figures. Calls with no known policy version release
their session the same way."""

from __future__ import annotations

from collections import Counter

import sys
import time

import pytest

from polar_mitm.rollout import GatewayNode, NodeConfig, RolloutServer
from polar_mitm.rollout.node import release_cause
from polar_mitm.rollout.protocol import Group
from polar_mitm.rollout.rewards import release_causes, reward_records
from polar_mitm.rollout.runtime import LocalRuntime
from polar_mitm.rollout.scheduler import Scheduler
from polar_mitm.rollout.spec import parse_task
from polar_mitm.rollout.states import ReleaseCause, Session
from polar_mitm.cli.rollout import RunFigures
from polar_mitm.store import init_db, query
from polar_mitm.store import rollout_journal as journal
from polar_mitm.store.db import writing
from support.fake_vllm import FakeVLLM
from support.rollouts import Rollouts
from support import SUPPORT

HERE = SUPPORT   # the helper scripts the sessions run
FAKE = f"{sys.executable} {HERE / 'fake_harness.py'}"
KINDS = ", ".join(f"'{k}'" for k in journal.BACKEND_ERROR_KINDS)


@pytest.mark.parametrize("seconds,how", [(1.5, "refuse"), (6.0, "503")], ids=["1.5s-refused", "6s-503"])
def test_an_outage_releases_every_session_it_hit_and_every_sample_still_ends_with_its_reward(
        start_proxy, tmp_path, seconds, how):
    """8 samples, 4 harnesses at once, each making 4 model calls of 0.25 s through a real
    gateway (mitmdump). The backend goes away mid-run: for 1.5 s with its port closed (shorter
    than the node's 2 s probe), or for 6 s answering 503 (the probe pauses the node)."""
    with FakeVLLM(delay=0.25) as backend:
        proxy = start_proxy(backend.url)
        with Rollouts(proxy, tmp_path / "sessions", run_workers=4, backend_url=backend.url) as rollouts:
            server = rollouts.server
            server.submit({"task_id": "out", "instruction": "x", "harness": "command", "num_samples": 8,
                           "command": f"{FAKE} ok 4", "evaluator": "test -f result.txt"})
            # mid-run: calls answered already, harnesses making more
            deadline = time.monotonic() + 60
            while len(backend.bodies) < 6 and time.monotonic() < deadline:
                time.sleep(0.02)
            assert len(backend.bodies) >= 6, "the harnesses made no calls"
            backend.outage(seconds, how).join()
            assert server.wait(["out"], timeout=120)
            g = server.group("out")
            run = RunFigures(server, str(proxy.db), ["out"])
            reruns, released_line = run.rerun_reasons(), run.line()
    sessions = {s["session_id"]: s for s in g["sessions"] + g["attempts"]}
    _, hit = query(proxy.db, f"SELECT DISTINCT session_id FROM call_records WHERE error_kind IN ({KINDS})")
    hit_ids = {sid for (sid,) in hit}
    assert hit_ids, "the outage hit no session's calls"
    # every session whose calls hit the outage was released, unscored, naming the cause
    for sid in hit_ids:
        s = sessions[sid]
        assert s["state"] == Session.RELEASED and s["reward"] is None, s
        assert s["stats"]["release_cause"] == "backend_unavailable" and s["stats"]["backend_failed_calls"] >= 1
        assert s["reason"].startswith("backend unavailable: ") and "not the policy's doing" in s["reason"], s
    # released for the backend only (a probe's release included), and never scored
    released = [s for s in g["attempts"] if s["state"] == Session.RELEASED]
    assert released and all(s["reward"] is None for s in released)
    # for the backend, or for the weights it served, which the gateway could not vouch for
    # after it came back (a session that ran across the outage between two probes, or a rerun
    # that started the moment it was back): both the backend's doing, neither scored
    assert all(s["stats"]["release_cause"] in ("backend_unavailable", "version_unknown") for s in released)
    assert any(s["stats"]["release_cause"] == "backend_unavailable" for s in released)
    assert all(s["state"] == Session.RELEASED for s in g["attempts"]), g["attempts"]
    # every sample ends with the evaluator's reward, from a run the outage did not touch
    assert len(g["sessions"]) == 8
    assert all(s["state"] == Session.DONE and s["reward"] == 1.0 and s["session_id"] not in hit_ids
               for s in g["sessions"]), g["sessions"]
    _, failed = query(proxy.db, f"SELECT count(*) FROM call_records WHERE error_kind IN ({KINDS}) AND session_id IN "
                                "(SELECT session_id FROM rollout_sessions WHERE state <> 'released')")
    assert failed == [(0,)]
    # the node's database holds the 8 final rewards and nothing for a released attempt
    _, rewards = query(proxy.db, "SELECT session_id, reward FROM sessions WHERE reward IS NOT NULL ORDER BY 1")
    assert rewards == sorted((s["session_id"], 1.0) for s in g["sessions"])
    assert [s["session_id"] for s in reward_records(g)] == [s["session_id"] for s in g["sessions"]]
    # the figures say how many were released and why
    words = {"backend_unavailable": "backend unavailable", "version_unknown": "policy version unknown"}
    causes = Counter(words[s["stats"]["release_cause"]] for s in released)
    assert reruns == {f"released: {cause}": n for cause, n in causes.items()}
    assert f"released {len(released)} (backend unavailable {causes['backend unavailable']}" in released_line


# -- bounded releases ---------------------------------------------------------------------------
def _beat(s: Scheduler, t: float, events=(), free: int = 0, active=()):
    return s.heartbeat({"node_id": "n", "load": {"free": free}, "active": list(active), "events": list(events)}, t)


def _release(s: Scheduler, t: float, cause: str) -> str:
    (a,) = _beat(s, t, free=1)[0].assign
    sid = a["session_id"]
    _beat(s, t + 0.1, [{"session_id": sid, "state": "run"}], active=[sid])
    _beat(s, t + 0.2, [{"session_id": sid, "state": "released", "reason": f"{cause} here",
                        "stats": {"release_cause": cause, "harness_output": "out"}}])
    return sid


def test_releases_for_the_backend_are_bounded_and_the_sample_then_fails_unscored():
    s = Scheduler(max_releases=3)
    s.submit(parse_task({"task_id": "t", "instruction": "x", "harness": "command", "command": "true",
                         "num_samples": 2}))
    # a stopped node's releases never count
    for i in range(4):
        _release(s, float(i), ReleaseCause.NODE_STOPPED)
    _release(s, 10.0, ReleaseCause.BACKEND_UNAVAILABLE)
    _release(s, 11.0, ReleaseCause.VERSION_UNKNOWN)
    last = _release(s, 12.0, ReleaseCause.BACKEND_UNAVAILABLE)   # the third for the backend's sake
    g: Group = s.group("t")
    cur = {x["sample"]: x for x in g["sessions"]}
    assert cur[0]["session_id"] == last and cur[0]["state"] == Session.FAILED and cur[0]["reward"] is None
    assert cur[0]["reason"] == "backend_unavailable here; released 3 times (backend unavailable): not scored"
    assert cur[0]["stats"]["unscored"] == "backend_unavailable" and cur[0]["stats"]["harness_output"] == "out"
    # no reward, not even on_failure "zero"'s 0.0; the other sample still runs
    assert reward_records(g, "zero") == [] and cur[1]["state"] == Session.PENDING
    assert release_causes([g]) == {"node stopped": 4, "backend unavailable": 1, "policy version unknown": 1}


# -- calls of no known policy version ---------------------------------------------------------------
def _insert_calls(db: str, rows: list[tuple]) -> None:
    """(call_id, session_id, seq, error, error_kind, policy_version) into call_records."""
    with writing(db) as con:
        con.executemany("INSERT INTO call_records_tail (call_id, session_id, seq, error, error_kind, policy_version) "
                        "VALUES (?, ?, ?, ?, ?, ?)", rows)


def test_call_stats_count_the_backends_failures_and_unknown_versions(tmp_path):
    db = str(tmp_path / "n.duckdb")
    init_db(db)
    _insert_calls(db, [("a1", "a", 1, None, None, 2), ("a2", "a", 2, "bad request", "invalid_request", None),
                       ("a3", "a", 3, "gave up", "abandoned", 2),
                       ("b1", "b", 1, None, None, 2), ("b2", "b", 2, "refused", "overloaded", None),
                       ("b3", "b", 3, "engine crashed", "backend_error", None), ("b4", "b", 4, "slow", "timeout", None),
                       ("c1", "c", 1, None, None, None), ("c2", "c", 2, None, None, 3)])
    a, b, c = (journal.call_stats(db, sid) for sid in "abc")
    # the request's own errors and a harness that gave up are the policy's
    assert (a["calls"], a["failed_calls"], a["backend_failed_calls"], a["unknown_version_calls"]) == (3, 2, 0, 0)
    assert release_cause(a) is None
    assert (b["backend_failed_calls"], b["backend_error_kinds"]) == (3, ["backend_error", "overloaded", "timeout"])
    assert release_cause(b) == (ReleaseCause.BACKEND_UNAVAILABLE, "backend unavailable: 3 of its 4 model calls "
                                "failed on the model backend (backend_error, overloaded, timeout)")
    assert c["unknown_version_calls"] == 1
    cause, why = release_cause(c)
    assert cause == ReleaseCause.VERSION_UNKNOWN and why.startswith("policy version unknown: 1 of its 2 model calls")


def test_a_session_with_calls_of_unknown_version_is_released_before_it_is_scored(tmp_path):
    """The node reads the session's calls before the evaluator: one of no known version (the
    gateway could not verify the weights that served it) releases it, however the harness
    ended (here: it failed, which would otherwise score 0.0). The retry runs clean."""
    node_db = str(tmp_path / "n.duckdb")
    init_db(node_db)
    _insert_calls(node_db, [("v1", "v~0", 1, None, None, None)])
    server = RolloutServer(str(tmp_path / "r.duckdb")).start()
    node = GatewayNode(NodeConfig(server_url=server.url, proxy_port=1, ca_path="", db=node_db, heartbeat_s=0.1,
                                  init_workers=1, run_workers=1),
                       runtime=LocalRuntime(tmp_path / "s")).start()
    try:
        server.submit({"task_id": "v", "instruction": "x", "harness": "command", "evaluator": "echo 0.5",
                       "command": 'test "$POLAR_SESSION" != "v~0"'})   # the first attempt fails
        assert server.wait(["v"], timeout=60)
        g = server.group("v")
    finally:
        node.stop()
        server.stop()
    (a,) = g["attempts"]
    assert a["session_id"] == "v~0" and a["state"] == Session.RELEASED and a["reward"] is None
    assert a["stats"]["release_cause"] == "version_unknown" and a["reason"].startswith("policy version unknown: ")
    (s,) = g["sessions"]
    assert (s["session_id"], s["state"], s["reward"]) == ("v~0.r2", Session.DONE, 0.5)
    _, rows = query(node_db, "SELECT session_id, reward FROM sessions WHERE reward IS NOT NULL")
    assert rows == [("v~0.r2", 0.5)]
