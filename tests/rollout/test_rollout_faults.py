"""Rollout server and gateway node under faults: hangs, crashes, a killed server, a dead node,
early stop, cancels and a flaky callback. The harness is tests/support/fake_harness.py (model calls
through the proxy in regular mode, like a CLI); the backend is the scripted stand-in."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest

from polar_mitm.stack import launch
from polar_mitm.rollout import GatewayNode, NodeConfig, RolloutServer, TaskError, parse_task
from polar_mitm.rollout.rewards import reward_records
from polar_mitm.rollout.runtime import LocalRuntime
from polar_mitm.rollout.spec import parse_reward
from polar_mitm.store import query
from support.procs import alive as _alive, token as _token, until as _until
from support.callbacks import Callbacks
from support.fake_vllm import FakeVLLM
from support.git_repo import commit
from support.rollouts import Rollouts
from support import SUPPORT

HERE = SUPPORT   # the helper scripts the sessions run
FAKE = f"{sys.executable} {HERE / 'fake_harness.py'}"
POLAR = str(Path(sys.executable).parent / "polar-mitm")


@pytest.fixture
def stack(start_proxy, tmp_path):
    """A proxy over the scripted backend, a rollout server on its database and one node."""
    with FakeVLLM("scripted") as backend:
        proxy = start_proxy(backend.url)
        with Rollouts(proxy, tmp_path / "sessions", server_options={"callback_backoff": 0.05}) as rollouts:
            yield proxy, rollouts.server, rollouts.node


def test_a_hanging_harness_is_killed_at_its_timeout_keeps_its_calls_and_scores_zero(stack):
    proxy, server, _ = stack
    server.submit({"task_id": "hang", "instruction": "x", "harness": "command", "timeout": 3,
                   "command": f"{FAKE} hang 2", "evaluator": "echo 1.0"})
    t0 = time.monotonic()
    assert server.wait(["hang"], timeout=60)
    assert time.monotonic() - t0 < 20
    s = server.group("hang")["sessions"][0]
    assert s["state"] == "timed_out" and s["reward"] == 0.0 and "timed out after 3s" in s["reason"]
    assert s["stats"]["calls"] == 2                      # what it did before the timeout stays
    _, rows = query(proxy.db, "SELECT count(*) FROM call_records WHERE session_id = 'hang~0' AND error IS NULL")
    assert rows == [(2,)]
    # stored once the server settled it (the node's next heartbeat answer)
    assert _until(lambda: query(proxy.db, "SELECT reward FROM sessions WHERE session_id = 'hang~0'")[1] == [(0.0,)], 10)
    out = subprocess.run(["pgrep", "-f", "fake_harness.py hang"], capture_output=True, text=True)
    assert out.stdout == "", "the harness outlived its timeout"


def test_a_crashing_harness_is_recorded_as_failed_and_follows_on_failure(stack):
    proxy, server, _ = stack
    # on_failure "zero" (the default) scores it 0: its group keeps its size; "drop" leaves it out
    server.submit({"task_id": "crash", "instruction": "x", "harness": "command",
                   "command": f"{FAKE} crash 1", "evaluator": "echo 1.0"})
    server.submit({"task_id": "crash-drop", "instruction": "x", "harness": "command", "on_failure": "drop",
                   "command": f"{FAKE} crash 1", "evaluator": "echo 1.0"})
    assert server.wait(["crash", "crash-drop"], timeout=60)
    s = server.group("crash")["sessions"][0]
    assert s["state"] == "failed" and s["reward"] == 0.0
    assert "exited with code 3" in s["reason"] and "fake harness crashed" in s["reason"]
    assert server.group("crash-drop")["sessions"][0]["reward"] is None
    _, rows = query(proxy.db, "SELECT state, reason FROM rollout_sessions WHERE session_id = 'crash~0'")
    assert rows[0][0] == "failed" and "code 3" in rows[0][1]
    sql = "SELECT session_id, reward FROM sessions WHERE session_id LIKE 'crash%' ORDER BY 1"
    assert _until(lambda: ("crash~0", 0.0) in query(proxy.db, sql)[1], 10)
    assert all(r is None for sid, r in query(proxy.db, sql)[1] if sid.startswith("crash-drop"))
    # the node stored what `rollout` and the loop store from the server's group: one path
    (record,) = reward_records(server.group("crash"), "zero")
    _, rows = query(proxy.db, "SELECT reward, reward_info FROM sessions WHERE session_id = 'crash~0'")
    assert [(r, json.loads(info)) for r, info in rows] == [(record["reward"], record["info"])]


def test_scored_group_reaches_the_callback_after_retries_and_rewards_are_stored(stack):
    proxy, server, _ = stack
    cb = Callbacks(fail=2)
    try:
        server.submit({"task_id": "grp", "instruction": "x", "harness": "command", "num_samples": 3,
                       "command": f"{FAKE} ok 1",
                       "evaluator": "test -f result.txt && echo $((${POLAR_SESSION#grp~} + 1)).5",
                       "callback_url": cb.url, "metadata": {"split": "train"}})
        assert server.wait(["grp"], timeout=60)
        assert len(cb.groups) == 1 and cb.posts == 3
        g = cb.groups[0]
        assert g["task_id"] == "grp" and g["state"] == "done" and g["metadata"] == {"split": "train"}
        assert sorted((s["session_id"], s["reward"]) for s in g["sessions"]) == \
            [("grp~0", 1.5), ("grp~1", 2.5), ("grp~2", 3.5)]
        _, rows = query(proxy.db, "SELECT callback_state, callback_tries FROM rollout_tasks WHERE task_id = 'grp'")
        assert rows == [("sent", 3)]
        sql = "SELECT session_id, reward FROM sessions WHERE task_id = 'grp' ORDER BY 1"
        assert _until(lambda: query(proxy.db, sql)[1] == [("grp~0", 1.5), ("grp~1", 2.5), ("grp~2", 3.5)], 10)
    finally:
        cb.close()


def test_early_stop_cancels_the_stragglers(tmp_path):
    server = RolloutServer(str(tmp_path / "r.duckdb")).start()
    # four RUN slots: all four samples run at once, whatever order set-up finishes in
    node = GatewayNode(NodeConfig(server_url=server.url, proxy_port=1, ca_path="", init_workers=4, run_workers=4,
                                  heartbeat_s=0.1), runtime=LocalRuntime(tmp_path / "s")).start()
    try:
        # samples 0 and 1 finish at once; 2 and 3 would run for a minute
        cmd = 'case "$POLAR_SESSION" in *~0|*~1) ' + FAKE + ' ok 0;; *) ' + FAKE + ' slow:60 0;; esac'
        server.submit({"task_id": "early", "instruction": "x", "harness": "command", "num_samples": 4,
                       "early_stop": 2, "command": cmd, "evaluator": "echo 1"})
        t0 = time.monotonic()
        assert server.wait(["early"], timeout=90)
        assert time.monotonic() - t0 < 30
    finally:
        node.stop()
        server.stop()
    states = {s["session_id"]: s["state"] for s in server.group("early")["sessions"]}
    assert states == {"early~0": "done", "early~1": "done", "early~2": "cancelled", "early~3": "cancelled"}
    assert server.task_status("early")["state"] == "done"


def test_cancel_a_task_over_http(stack):
    _, server, _ = stack
    r = httpx.post(f"{server.url}/tasks", json={"task_id": "long", "instruction": "x", "harness": "command",
                                                "num_samples": 2, "command": f"{FAKE} slow:60 0"})
    assert r.status_code == 202 and r.json()["tasks"][0]["sessions"] == ["long~0", "long~1"]
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline and httpx.get(f"{server.url}/status").json()["sessions"].get("run", 0) < 2:
        time.sleep(0.1)
    assert httpx.post(f"{server.url}/tasks/long/cancel", json={}).json()["cancelled"]
    assert server.wait(["long"], timeout=30)
    st = httpx.get(f"{server.url}/tasks/long").json()
    assert st["state"] == "cancelled" and {s["state"] for s in st["sessions"]} == {"cancelled"}


def test_http_api_answers_bad_requests_clearly(stack):
    _, server, _ = stack
    r = httpx.post(f"{server.url}/tasks", json={"task_id": "a~b", "instruction": "x"})
    assert r.status_code == 400 and "task_id" in r.json()["error"]["message"]
    r = httpx.post(f"{server.url}/tasks", json={"task_id": "t", "instruction": "x", "harness": "vim"})
    assert r.status_code == 400 and "harness" in r.json()["error"]["message"]
    r = httpx.post(f"{server.url}/tasks", content=b"{nope", headers={"content-type": "application/json"})
    assert r.status_code == 400 and "invalid JSON" in r.json()["error"]["message"]
    ok = {"task_id": "dup", "instruction": "x", "harness": "command", "command": "true"}
    assert httpx.post(f"{server.url}/tasks", json=ok).status_code == 202
    r = httpx.post(f"{server.url}/tasks", json=ok)
    assert r.status_code == 409 and "already exists" in r.json()["error"]["message"]
    assert httpx.get(f"{server.url}/tasks/nope").status_code == 404


def test_task_requests_are_validated():
    t = parse_task({"task_id": "t1", "instruction": "fix it", "workspace": {"git": "/r", "commit": "abc"},
                    "evaluator": "pytest -q"}, harness="codex", samples=8)
    assert t.harness == "codex" and t.num_samples == 8 and t.session_ids()[-1] == "t1~7"
    assert t.workspace.commit == "abc" and t.evaluator.command == "pytest -q"
    for bad, word in [({"instruction": "x"}, "task_id"), ({"task_id": "t"}, "instruction"),
                      ({"task_id": "t", "instruction": "x", "num_samples": 0}, "num_samples"),
                      ({"task_id": "t", "instruction": "x", "early_stop": 3}, "early_stop"),
                      ({"task_id": "t", "instruction": "x", "workspace": {"commit": "a"}}, "commit"),
                      ({"task_id": "t", "instruction": "x", "harness": "command"}, "command"),
                      ({"task_id": "t", "instruction": "x", "on_failure": "retry"}, "on_failure"),
                      ({"task_id": "t", "instruction": "x", "colour": 1}, "unknown")]:
        with pytest.raises(TaskError, match=word):
            parse_task(bad)
    assert parse_reward("running tests\n0.75\n", 1) == 0.75
    assert parse_reward("3 passed\n", 0) == 1.0 and parse_reward("1 failed\n", 1) == 0.0
    for bad in ("nan", "inf", "-inf"):   # a failed evaluation, not a reward of 1.0
        with pytest.raises(TaskError):
            parse_reward(f"{bad}\n", 0)


def test_teardown_ends_processes_that_left_the_group(tmp_path):
    from polar_mitm.rollout.spec import Workspace
    seconds = _token()   # an argument no other process has
    box = LocalRuntime(tmp_path / "s").prepare("t~0", Workspace())
    r = box.run(["/bin/sh", "-c", f"setsid sleep {seconds} & echo started"], {"PATH": os.environ["PATH"]}, 10, "h")
    assert r.exit_code == 0 and "started" in r.output_tail
    # SIGKILLed by the run; a process in uninterruptible sleep (paging in on a busy CI
    # disk) dies when it wakes, so allow it that long, never longer
    assert _until(lambda: not _alive(f"sleep {seconds}"), 10), "a setsid child of the harness survived the run"
    box.teardown()
    assert not box.root.exists()


def _start_server(db: Path, port: int, log: Path) -> subprocess.Popen:
    proc = subprocess.Popen([POLAR, "rollout-server", "--db", str(db), "--port", str(port), "--node-timeout", "3"],
                            stdout=open(log, "ab"), stderr=subprocess.STDOUT)
    launch.wait_port(port, None, timeout=60)
    return proc


def _wait(pred, timeout: float, what: str):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        got = pred()
        if got:
            return got
        time.sleep(0.1)
    raise AssertionError(f"timed out waiting for {what}")


def test_killing_the_rollout_server_mid_task_loses_no_session(tmp_path):
    db, port = tmp_path / "r.duckdb", launch.free_port()
    url = f"http://127.0.0.1:{port}"
    server = _start_server(db, port, tmp_path / "server.log")
    node = GatewayNode(NodeConfig(server_url=url, proxy_port=1, ca_path="", init_workers=2, run_workers=2,
                                  heartbeat_s=0.1), runtime=LocalRuntime(tmp_path / "s")).start()
    try:
        r = httpx.post(f"{url}/tasks", json={"task_id": "crashy", "instruction": "x", "harness": "command",
                                             "num_samples": 6, "command": f"{FAKE} slow:1.5 0",
                                             "evaluator": "test -f result.txt"})
        assert r.status_code == 202
        _wait(lambda: httpx.get(f"{url}/status").json()["sessions"].get("run", 0) >= 2, 30, "two sessions running")
        server.send_signal(signal.SIGKILL)
        server.wait()
        time.sleep(1.0)              # the node keeps running and keeps its reports
        server = _start_server(db, port, tmp_path / "server.log")

        def finished():
            st = httpx.get(f"{url}/tasks/crashy").json()
            return st if st["state"] == "done" else None
        st = _wait(finished, 60, "the task to finish after the restart")
    finally:
        node.stop()
        server.send_signal(signal.SIGTERM)
        server.wait(timeout=30)
    latest = {s["sample"]: s for s in st["sessions"] if "." not in s["session_id"].rsplit("~", 1)[1]}
    assert sorted(latest) == list(range(6))
    assert all(s["state"] == "done" and s["reward"] == 1.0 for s in latest.values()), st
    _, rows = query(db, "SELECT count(*), count(DISTINCT sample), min(state), max(state) FROM rollout_sessions "
                        "WHERE task_id = 'crashy' AND state = 'done'")
    assert rows == [(6, 6, "done", "done")]
    _, rows = query(db, "SELECT count(*) FROM rollout_events WHERE detail LIKE 'server restarted%'")
    assert rows[0][0] >= 1    # the sessions in flight at the kill were resumed, and say so


def _processes_under(root) -> list[int]:
    """Processes whose working directory lies under root."""
    out = []
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            if os.readlink(f"/proc/{pid}/cwd").startswith(str(root)):
                out.append(int(pid))
        except OSError:
            pass
    return out


def _spare_node_finishes(server: RolloutServer, sessions: Path, task_id: str, **cfg) -> dict:
    """A node started now (the task's first node gone) runs what is left of the task, and
    stops; the task's group."""
    node = GatewayNode(NodeConfig(server_url=server.url, proxy_port=1, ca_path="", heartbeat_s=0.1, **cfg),
                       runtime=LocalRuntime(sessions)).start()
    try:
        assert server.wait([task_id], timeout=60)
        return server.group(task_id)
    finally:
        node.stop()


def test_a_dead_node_is_detected_and_its_sessions_rescheduled(tmp_path):
    db = tmp_path / "r.duckdb"
    server = RolloutServer(str(db), node_timeout=2.0).start()
    script = (f"import time,sys; sys.path.insert(0, {str(HERE)!r});"
              "from polar_mitm.rollout import GatewayNode, NodeConfig;"
              "from polar_mitm.rollout.runtime import LocalRuntime;"
              f"GatewayNode(NodeConfig(server_url={server.url!r}, proxy_port=1, ca_path='', node_id='doomed',"
              f" init_workers=2, run_workers=2, heartbeat_s=0.1), runtime=LocalRuntime({str(tmp_path / 'd')!r})).start();"
              "time.sleep(600)")
    doomed = subprocess.Popen([sys.executable, "-c", script])
    try:
        server.submit({"task_id": "nd", "instruction": "x", "harness": "command", "num_samples": 2,
                       "command": f"{FAKE} slow:2 0", "evaluator": "test -f result.txt"})
        _wait(lambda: server.status()["sessions"].get("run", 0) == 2, 30, "both sessions running on the node")
        doomed.send_signal(signal.SIGKILL)
        doomed.wait()
        _wait(lambda: server.status()["nodes"]["doomed"]["lost"], 10, "the node to be declared lost")
        # its harnesses (and their network bridges) die with it, as no teardown will come
        _wait(lambda: not _processes_under(tmp_path / "d"), 10, "the dead node's sandboxes to end")
        g = _spare_node_finishes(server, tmp_path / "s", "nd", node_id="spare")
    finally:
        server.stop()
        if doomed.poll() is None:
            doomed.kill()
    assert [(s["session_id"], s["state"], s["node_id"], s["reward"]) for s in g["sessions"]] == \
        [("nd~0.r2", "done", "spare", 1.0), ("nd~1.r2", "done", "spare", 1.0)]
    assert {(s["session_id"], s["state"]) for s in g["attempts"]} == {("nd~0", "lost"), ("nd~1", "lost")}
    assert all("node doomed lost: no heartbeat" in s["reason"] for s in g["attempts"])
    _, rows = query(db, "SELECT count(*) FROM rollout_events WHERE state = 'node_lost' AND node_id = 'doomed'")
    assert rows == [(1,)]


def test_an_isolated_session_reaches_the_proxy_and_nothing_else(stack, tmp_path):
    from polar_mitm.rollout.runtime import unshare_argv
    if unshare_argv() is None:
        pytest.skip("this machine does not allow network namespaces (unshare -n): sessions share its network")
    proxy, server, _ = stack
    import socket
    outside = socket.create_server(("127.0.0.1", 0))      # a listener on the node's own loopback
    probe = tmp_path / "ws" / "probe.py"      # in the workspace: the sandbox sees no more of the node
    probe.parent.mkdir()
    probe.write_text(
        "import socket, sys\n"
        "def tcp(port):\n"
        "    try:\n"
        "        socket.create_connection(('127.0.0.1', port), timeout=2).close(); return 'open'\n"
        "    except OSError as e: return type(e).__name__\n"
        "def dns():\n"
        "    try:\n"
        "        socket.getaddrinfo('example.com', 443); return 'resolved'\n"
        "    except OSError as e: return type(e).__name__\n"
        f"print('outside', tcp({outside.getsockname()[1]}), 'proxy', tcp({proxy.port}), 'dns', dns())\n")
    server.submit({"task_id": "iso", "instruction": "x", "harness": "command", "timeout": 60,
                   "workspace": str(probe.parent), "command": f"{sys.executable} probe.py > probe.txt && {FAKE} ok 1",
                   "evaluator": "cat probe.txt"})
    try:
        assert server.wait(["iso"], timeout=60)
    finally:
        outside.close()
    s = server.group("iso")["sessions"][0]
    assert s["state"] == "done" and s["stats"]["network"] == "isolated", s
    assert s["stats"]["calls"] == 1                           # the model call went through
    _, rows = query(proxy.db, "SELECT count(*) FROM call_records WHERE session_id = 'iso~0'")
    assert rows == [(1,)]
    assert s["stats"]["eval_output"].split() == \
        ["outside", "ConnectionRefusedError", "proxy", "open", "dns", "gaierror"], s["stats"]


def test_a_node_that_stops_hands_its_sessions_back(tmp_path):
    server = RolloutServer(str(tmp_path / "r.duckdb")).start()
    cfg = dict(server_url=server.url, proxy_port=1, ca_path="", init_workers=1, run_workers=1, heartbeat_s=0.1)
    first = GatewayNode(NodeConfig(node_id="first", **cfg), runtime=LocalRuntime(tmp_path / "a")).start()
    try:
        server.submit({"task_id": "handback", "instruction": "x", "harness": "command", "num_samples": 3,
                       "command": f"{FAKE} slow:1 0", "evaluator": "test -f result.txt"})
        _wait(lambda: server.status()["sessions"].get("run", 0) == 1, 30, "a session running")
        first.stop()
        st = server.status()["sessions"]
        assert st.get("pending") == 3 and not set(st) - {"pending", "lost"}, st   # all back in the queue
        g = _spare_node_finishes(server, tmp_path / "b", "handback", node_id="second", init_workers=1,
                                 run_workers=1)
    finally:
        server.stop()
    assert all(s["state"] == "done" and s["node_id"] == "second" and s["reward"] == 1.0 for s in g["sessions"])
    # the one that had started running is a new attempt; the others never ran and keep their names
    assert sorted(s["session_id"] for s in g["sessions"]) == ["handback~0.r2", "handback~1", "handback~2"]


def test_scheduling_follows_load_and_priority(tmp_path):
    """The server's side of the heartbeat protocol, driven directly: a node gets at most as
    many sessions as it has free places, higher priority first."""
    server = RolloutServer(str(tmp_path / "r.duckdb")).start()
    try:
        server.submit({"task_id": "low", "instruction": "x", "harness": "command", "command": "true",
                       "num_samples": 2})
        server.submit({"task_id": "high", "instruction": "x", "harness": "command", "command": "true",
                       "num_samples": 2, "priority": 5})
        busy = server.heartbeat({"node_id": "busy", "load": {"free": 0}, "active": [], "events": []})
        assert busy == {"assign": [], "cancel": [], "settled": [], "policy": None}
        got = server.heartbeat({"node_id": "idle", "load": {"free": 3}, "active": [], "events": []})
        assert [a["session_id"] for a in got["assign"]] == ["high~0", "high~1", "low~0"]
        assert got["assign"][0]["task"]["priority"] == 5
        # a node that reports a session it was never given is told to cancel it
        got = server.heartbeat({"node_id": "busy", "load": {"free": 0}, "active": ["high~0"], "events": []})
        assert got["cancel"] == ["high~0"]
        # the policy every node should serve goes out in the answers; what a node serves comes back
        target = server.set_policy(3, "/ckpt/3")
        got = server.heartbeat({"node_id": "busy", "load": {"free": 0}, "active": [], "events": [],
                                "policy": {"target": target["id"], "version": 3, "error": None}, "db": "/n.duckdb"})
        assert got["policy"] == target and target["version"] == 3 and not target["asleep"]
        assert server.policy_status()["nodes"]["busy"] == {"lost": False, "db": "/n.duckdb", "policy": {
            "target": target["id"], "version": 3, "error": None}}
        # a node's outcome of a session is settled (its reward may be stored) once the server has it,
        # and again when the node asks again; never for a session the server moved on from
        done = {"session_id": "high~0", "state": "done", "reward": 1.0}
        holds = ["high~1", "low~0"]
        got = server.heartbeat({"node_id": "idle", "load": {"free": 0}, "active": holds, "events": [done]})
        assert got["settled"] == ["high~0"]
        got = server.heartbeat({"node_id": "idle", "load": {"free": 0}, "active": holds, "events": [done]})
        assert got["settled"] == ["high~0"]
        got = server.heartbeat({"node_id": "busy", "load": {"free": 0}, "active": [], "events": [
            {"session_id": "high~1", "state": "done", "reward": 1.0}]})
        assert got["settled"] == []
    finally:
        server.stop()
    _, rows = query(tmp_path / "r.duckdb", "SELECT session_id, state, node_id FROM rollout_sessions ORDER BY 1")
    assert rows == [("high~0", "done", "idle"), ("high~1", "assigned", "idle"),
                    ("low~0", "assigned", "idle"), ("low~1", "pending", None)]


def test_heartbeats_look_only_through_unfinished_sessions(tmp_path):
    """A long run finishes sessions by the hundred thousand: a heartbeat must not scan them
    all. Finished ones leave the server's open set; a retry is a new, open session."""
    server = RolloutServer(str(tmp_path / "r.duckdb")).start()
    try:
        for t in range(30):
            server.submit({"task_id": f"t{t}", "instruction": "x", "harness": "command", "command": "true",
                           "num_samples": 4})
        got = server.heartbeat({"node_id": "n", "load": {"free": 1000}, "active": [], "events": []})
        ids = [a["session_id"] for a in got["assign"]]
        assert len(ids) == 120 and len(server.scheduler.live()) == 120
        done = [{"session_id": sid, "state": "done", "reward": 1.0} for sid in ids[:-1]]
        server.heartbeat({"node_id": "n", "load": {"free": 0}, "active": ids[-1:], "events": done})
        server.heartbeat({"node_id": "n", "load": {"free": 0}, "active": [], "events": [
            {"session_id": ids[-1], "state": "run"}]})
        assert [s.session_id for s in server.scheduler.live()] == [ids[-1]] and len(server.scheduler.open) == 1
        assert len(server.scheduler.sessions) == 120 and server.status()["sessions"] == {"run": 1, "done": 119}
        assert server.task_status("t29")["sessions"][3]["state"] == "run"
    finally:
        server.stop()


def test_a_git_workspace_is_checked_out_at_its_commit(tmp_path):
    from polar_mitm.rollout.spec import Workspace
    repo = tmp_path / "repo"
    first = commit(repo, {"app.py": "v1\n"}, "one")
    commit(repo, {"app.py": "v2\n"}, "two")
    rt = LocalRuntime(tmp_path / "s")
    box = rt.prepare("g~0", Workspace(git=str(repo), commit=first))
    assert (box.workdir / "app.py").read_text() == "v1\n"
    (box.workdir / "app.py").write_text("changed by the harness\n")
    assert (repo / "app.py").read_text() == "v2\n"          # the session's copy is its own
    box.teardown()
    from polar_mitm.rollout.runtime import SetupError
    with pytest.raises(SetupError, match="checkout"):
        rt.prepare("g~1", Workspace(git=str(repo), commit="0" * 40))


def test_a_reward_is_stored_only_once_the_server_settles_the_outcome(tmp_path):
    """A node stores a session's reward only after the server has taken its outcome as the
    sample's (durably). An outcome the server does not take (it moved on: the session was
    retried under a new name) leaves no reward, so a group never holds more rewarded
    sessions than samples, even in the database the node writes."""
    from polar_mitm.rollout.scheduler import Scheduler
    from polar_mitm.store import init_db

    db = str(tmp_path / "r.duckdb")
    init_db(db)

    class MovedOn(Scheduler):
        def _apply(self, node_id, ev):
            if ev.get("session_id") == "r~0" and ev.get("state") == "done":
                return False   # as after a restart that had already given r~0 up
            return super()._apply(node_id, ev)

    server = RolloutServer(db, scheduler=MovedOn()).start()
    node = GatewayNode(NodeConfig(server_url=server.url, proxy_port=1, ca_path="", db=db, heartbeat_s=0.1),
                       runtime=LocalRuntime(tmp_path / "s")).start()
    try:
        server.submit({"task_id": "r", "instruction": "x", "harness": "command", "command": "true",
                       "num_samples": 2, "evaluator": "echo 0.5"})
        assert server.wait(["r"], timeout=60)
        assert sorted(s["session_id"] for s in server.group("r")["sessions"]) == ["r~0.r2", "r~1"]
    finally:
        node.stop()
        server.stop()
    _, rows = query(db, "SELECT session_id, reward FROM sessions ORDER BY 1")
    assert rows == [("r~0.r2", 0.5), ("r~1", 0.5)]


def test_a_sessions_command_dies_with_the_node_and_starts_without_fork(tmp_path):
    """The harness dies when the node does (PDEATHSIG, set by setpriv before it execs), and
    Popen gets no preexec_fn: one would make it fork, copying a large node's page tables
    while holding the GIL (20-100 ms per session start in a loop's process)."""
    seconds = _token()
    node = subprocess.Popen([sys.executable, "-c", f"""
import os, subprocess, sys, time
from pathlib import Path
from polar_mitm.rollout.runtime import LocalRuntime
from polar_mitm.rollout.spec import Workspace
seen = []
real = subprocess.Popen.__init__
def spy(self, *a, **kw):
    seen.append(kw.get("preexec_fn"))
    real(self, *a, **kw)
subprocess.Popen.__init__ = spy
box = LocalRuntime(Path({str(tmp_path / 's')!r})).prepare("t~0", Workspace())
import threading
threading.Thread(target=box.run, args=(["sleep", "{seconds}"], {{"PATH": os.environ["PATH"]}}, 60, "h"),
                 daemon=True).start()
time.sleep(1.0)
print("preexec", seen[-1], flush=True)
time.sleep(60)
"""], stdout=subprocess.PIPE, text=True, cwd=Path(__file__).parents[2])
    try:
        line = node.stdout.readline()
        assert line.strip() == "preexec None", line
        assert _until(lambda: _alive(f"sleep {seconds}"), 10), "the session's command did not start"
        node.kill()
        node.wait()
        assert _until(lambda: not _alive(f"sleep {seconds}"), 10), "the session's command outlived its node"
    finally:
        node.kill()
