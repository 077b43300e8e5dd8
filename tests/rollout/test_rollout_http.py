"""The rollout server's HTTP API on FastAPI/uvicorn (issue 22, section 4): typed requests whose
errors name the field, errors mapped by exception type, a heartbeat waiting on the database
that holds up no other request, and uvicorn started and stopped in a thread of the process."""

from __future__ import annotations

import dataclasses
import socket
import threading
import time

import httpx
import pytest

from polar_mitm.rollout import RolloutServer
from polar_mitm.rollout.http_api import TaskIn
from polar_mitm.rollout.spec import TaskRequest
from polar_mitm.rollout.states import ORDER, TERMINAL, Session
from polar_mitm.store.journal_log import JournalLog


def _task(tid: str = "t", **kw) -> dict:
    return {"task_id": tid, "instruction": "x", "harness": "command", "command": "true", **kw}


@pytest.fixture
def server(tmp_path):
    s = RolloutServer(str(tmp_path / "r.duckdb")).start()
    yield s
    s.stop()


def _error(r: httpx.Response, status: int) -> str:
    assert r.status_code == status, r.text
    assert r.headers["content-type"] == "application/json"
    return r.json()["error"]["message"]


def test_requests_of_the_wrong_type_get_400_naming_the_field(server):
    u = server.url
    # a heartbeat: a wrong type in the load, a state no session has, a reward that is text
    r = httpx.post(f"{u}/nodes/heartbeat", json={"node_id": "n", "load": {"free": "lots"}, "active": [],
                                                  "events": [{"session_id": "t~0", "state": "finished"},
                                                             {"session_id": "t~1", "state": "done",
                                                              "reward": "high"}]})
    message = _error(r, 400)
    assert "load.free: Input should be a valid integer" in message
    assert "events.0.state: Input should be 'pending', 'assigned'" in message
    assert "events.1.reward: Input should be a valid number" in message
    assert [f["field"] for f in r.json()["error"]["fields"]] == ["load.free", "events.0.state", "events.1.reward"]
    assert "n" not in server.status()["nodes"]                      # nothing of it was taken
    assert "node_id: Field required" in _error(httpx.post(f"{u}/nodes/heartbeat", json={"load": {}}), 400)
    assert "active: Input should be a valid list" in _error(
        httpx.post(f"{u}/nodes/heartbeat", json={"node_id": "n", "active": "t~0"}), 400)
    # a task: its task_id, then the field
    message = _error(httpx.post(f"{u}/tasks", json=_task("t", num_samples="3", timeout=True)), 400)
    assert message == "t: num_samples: Input should be a valid integer; t: timeout: Input should be a valid number"
    assert _error(httpx.post(f"{u}/tasks", json=_task("t", evaluator={"command": "true", "timeout": "abc"})),
                  400) == "t: evaluator.timeout: Input should be a valid number"
    assert _error(httpx.post(f"{u}/tasks", json=_task("t", evaluator=5)), 400) \
        == "t: evaluator: must be a shell line, or an object with command and timeout"
    assert _error(httpx.post(f"{u}/tasks", json=_task("t", colour="red")), 400) \
        == "t: colour: Extra inputs are not permitted"
    # in a list, each task by its task_id (or its place, without one)
    message = _error(httpx.post(f"{u}/tasks", json=[_task("a"), _task("b", priority="high"), {"instruction": 1}]), 400)
    assert message == ("b: priority: Input should be a valid integer; tasks[2].task_id: Field required; "
                       "tasks[2].instruction: Input should be a valid string")
    # what fits the types is then checked as a task (spec.parse_task): same shape of answer
    assert _error(httpx.post(f"{u}/tasks", json=_task("t", timeout=-5)), 400) \
        == "t: timeout must be a positive number of seconds, not -5.0"
    assert server.task_views() == {}
    # the policy
    assert "version: Input should be a valid integer" in _error(
        httpx.post(f"{u}/policy", json={"version": "3", "checkpoint": "/c"}), 400)
    assert server.policy is None
    # not JSON, or no body
    assert _error(httpx.post(f"{u}/tasks", content=b'{"task_id": "t"', headers={"content-type": "application/json"}),
                  400).startswith("invalid JSON: ")
    assert "content-type: application/json" in _error(
        httpx.post(f"{u}/tasks", content=b"task_id=t", headers={"content-type": "application/x-www-form-urlencoded"}),
        415)
    assert _error(httpx.post(f"{u}/tasks", headers={"content-type": "application/json"}), 400) \
        == "a JSON body is required"
    assert "content-type: application/json" in _error(httpx.post(f"{u}/tasks"), 415)   # no body, no type
    assert _error(httpx.get(f"{u}/no/such/route"), 404) == "no route /no/such/route"


def test_errors_are_mapped_by_type_and_answers_are_typed(server):
    u = server.url
    r = httpx.post(f"{u}/tasks", json=_task("t", num_samples=2))
    assert r.status_code == 202 and r.json() == {"tasks": [{"task_id": "t", "sessions": ["t~0", "t~1"]}]}
    assert _error(httpx.post(f"{u}/tasks", json=_task("t", num_samples=2)), 409) == "task t already exists"
    r = httpx.post(f"{u}/tasks", json=_task("t", num_samples=3))
    assert _error(r, 422).startswith("task t already exists with another spec")
    assert r.json()["error"]["changed"] == ["num_samples 2 -> 3"]
    assert _error(httpx.get(f"{u}/tasks/nope"), 404) == "no such task: nope"
    assert _error(httpx.get(f"{u}/tasks/nope/group"), 404) == "no such task: nope"
    assert _error(httpx.post(f"{u}/groups", json={"task_ids": ["t", "x", "y"]}), 404) == "no such task(s): x, y"
    r = httpx.post(f"{u}/tasks/nope/cancel", headers={"content-type": "application/json"})   # no body: no reason
    assert r.status_code == 404 and r.json() == {"task_id": "nope", "cancelled": False}
    assert httpx.get(f"{u}/tasks").json() == {"tasks": [{"task_id": "t", "state": "queued"}]}
    # a node: registered, given work, its outcome settled
    beat = {"node_id": "n", "load": {"free": 1, "slots": 4}, "active": [], "events": []}
    reply = httpx.post(f"{u}/nodes/heartbeat", json=beat).json()
    assert [a["session_id"] for a in reply["assign"]] == ["t~0"] and reply["assign"][0]["task"]["task_id"] == "t"
    assert reply["cancel"] == [] and reply["settled"] == [] and reply["policy"] is None
    done = {"session_id": "t~0", "state": "done", "reward": 1, "at": time.time(), "stats": {"calls": 2}}
    reply = httpx.post(f"{u}/nodes/heartbeat", json={**beat, "load": {"free": 0}, "events": [done]}).json()
    assert reply["settled"] == ["t~0"]
    session = httpx.get(f"{u}/tasks/t").json()["sessions"][0]
    assert session == {"session_id": "t~0", "sample": 0, "attempt": 1, "state": "done", "node_id": "n",
                       "reward": 1.0, "reason": None, "stats": {"calls": 2}}
    assert server.task_status("t")["sessions"][0]["state"] is Session.DONE
    status = httpx.get(f"{u}/status").json()
    assert status["sessions"] == {"pending": 1, "done": 1} and status["nodes"]["n"]["free"] == 0
    target = httpx.post(f"{u}/policy", json={"version": 2, "checkpoint": "/ckpt"}).json()
    assert set(target) == {"id", "version", "checkpoint", "asleep", "pull"} and target["asleep"] is False
    assert httpx.get(f"{u}/policy").json()["target"] == target
    schema = httpx.get(f"{u}/openapi.json").json()
    assert {"/tasks", "/nodes/heartbeat", "/policy", "/groups", "/status"} <= set(schema["paths"])
    assert {"TaskIn", "Heartbeat", "SessionEvent", "HeartbeatReply"} <= set(schema["components"]["schemas"])


def test_the_state_names_are_the_enum_and_tasks_fit_their_model():
    assert [str(s) for s in ORDER] == ["pending", "assigned", "init", "ready", "run", "post_run", "done",
                                       "timed_out", "failed", "cancelled", "lost", "released"]
    assert "released" in TERMINAL and Session("lost") is Session.LOST
    # every field of a task can come in over HTTP
    # (but files: the server fills it, shipped_files.py)
    assert set(TaskIn.model_fields) == {f.name for f in dataclasses.fields(TaskRequest)} - {"files"}


def test_a_slow_heartbeat_holds_up_no_other_request(tmp_path, monkeypatch):
    """Heartbeats wait for their state to be saved; while the disk is slow, the rest of the API
    answers at once (the handlers run in worker threads, the event loop stays free)."""
    server = RolloutServer(str(tmp_path / "r.duckdb"), flush_s=60.0).start()
    real, slow = JournalLog.append, threading.Event()

    def slow_save(log, batch):
        if slow.is_set():
            time.sleep(3.0)
        return real(log, batch)

    monkeypatch.setattr(JournalLog, "append", slow_save)
    answers: dict[str, float] = {}
    try:
        server.submit(_task("t", num_samples=4))
        slow.set()

        def beat(node: str) -> None:
            r = httpx.post(f"{server.url}/nodes/heartbeat", timeout=60,
                           json={"node_id": node, "load": {"free": 1}, "active": [], "events": []})
            assert r.status_code == 200
            answers[node] = time.monotonic()

        beats = [threading.Thread(target=beat, args=(f"n{i}",)) for i in range(4)]
        t0 = time.monotonic()
        for b in beats:
            b.start()
        until_in = time.monotonic() + 10
        while len(server.status()["nodes"]) < 4 and time.monotonic() < until_in:
            time.sleep(0.01)
        assert len(server.status()["nodes"]) == 4          # all four are in, waiting on the database
        for path in ("/status", "/policy", "/tasks", "/tasks/t", "/tasks/t/group"):
            r = httpx.get(f"{server.url}{path}", timeout=10)
            assert r.status_code == 200
        r = httpx.post(f"{server.url}/policy", json={"version": 1, "checkpoint": "/c"}, timeout=10)
        assert r.status_code == 200
        others = time.monotonic()
        assert not answers and others - t0 < 2.5            # answered while every heartbeat still waits
        for b in beats:
            b.join(timeout=60)
        assert len(answers) == 4 and min(answers.values()) - t0 >= 2.5
    finally:
        slow.clear()
        server.stop()


def test_a_heartbeat_not_saved_is_503_and_the_node_retries(tmp_path, monkeypatch):
    server = RolloutServer(str(tmp_path / "r.duckdb"), flush_s=60.0).start()
    real, broken = JournalLog.append, threading.Event()

    def save(log, batch):
        if broken.is_set():
            raise OSError("disk full")
        return real(log, batch)

    monkeypatch.setattr(JournalLog, "append", save)
    try:
        server.submit(_task("t"))
        broken.set()
        body = {"node_id": "n", "load": {"free": 1}, "active": [], "events": []}
        r = httpx.post(f"{server.url}/nodes/heartbeat", json=body)
        assert _error(r, 503) == "state not saved: disk full"
        broken.clear()
        r = httpx.post(f"{server.url}/nodes/heartbeat", json={**body, "active": ["t~0"], "load": {"free": 0}})
        assert r.status_code == 200
    finally:
        broken.clear()
        server.stop()


def test_port_0_is_any_free_port_known_before_start_and_stop_frees_it(tmp_path):
    server = RolloutServer(str(tmp_path / "r.duckdb"))
    port = int(server.url.rsplit(":", 1)[1])
    assert port > 0 and server.url == f"http://127.0.0.1:{port}"
    server.start()
    assert httpx.get(f"{server.url}/status").status_code == 200
    # keep-alive connections do not hold up stop()
    with httpx.Client() as c:
        assert c.get(f"{server.url}/status").status_code == 200
        t0 = time.monotonic()
        server.stop()
        assert time.monotonic() - t0 < 3.0
    with pytest.raises(ConnectionRefusedError):
        socket.create_connection(("127.0.0.1", port), timeout=2).close()
    # the same port again, at once (a restarted server)
    again = RolloutServer(str(tmp_path / "r.duckdb"), port=port).start()
    try:
        assert httpx.get(f"{again.url}/status").status_code == 200
    finally:
        again.stop()


def test_answers_do_not_wait_on_delayed_acks(server):
    """Nodes beat every 0.1-0.5 s: an answer takes about a millisecond, not the 40 ms of a
    delayed ACK (the server's sockets have TCP_NODELAY)."""
    beat = {"node_id": "n", "load": {"free": 0}, "active": [], "events": []}
    took = []
    with httpx.Client(trust_env=False) as c:
        for _ in range(40):
            t0 = time.monotonic()
            assert c.post(f"{server.url}/nodes/heartbeat", json=beat).status_code == 200
            took.append(time.monotonic() - t0)
    assert sorted(took)[len(took) // 2] < 0.02, took
