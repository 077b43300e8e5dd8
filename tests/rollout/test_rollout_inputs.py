"""Bad input and dead parts get clear errors, and a stop is not a failure (issue 22, sections
2 and 3): evaluator timeouts, a task changed on rerun or given twice, a bad workspace or
git repo, a dead backend (at start, and a node that pauses while it is down), attempts that
a stop does not spend, concurrent callbacks, and the exit codes of `polar-mitm rollout`."""

from __future__ import annotations

import json
import signal
import socket
import subprocess
import sys
import threading
import time
from dataclasses import replace
from pathlib import Path

import click
import httpx
import pytest

from polar_mitm.stack import launch
from polar_mitm.rollout import GatewayNode, NodeConfig, RolloutServer, TaskError, parse_task
from polar_mitm.rollout.client import ServerClient, ServerError
from polar_mitm.rollout.runtime import LocalRuntime
from polar_mitm.rollout.spec import TaskChanged, TaskExists
from polar_mitm.stack.local import read_tasks
from polar_mitm.store import query
from support.procs import until
from support.callbacks import Callbacks
from support.fake_vllm import FakeVLLM
from support.git_repo import commit
from support import SUPPORT

HERE = SUPPORT   # the helper scripts the sessions run
FAKE = f"{sys.executable} {HERE / 'fake_harness.py'}"
POLAR = str(Path(sys.executable).parent / "polar-mitm")


def _task(tid: str = "t", **kw) -> dict:
    return {"task_id": tid, "instruction": "x", "harness": "command", "command": "true", **kw}


# -- the spec ----------------------------------------------------------------------------------
def test_timeouts_must_be_positive_numbers_of_seconds():
    for bad in ("abc", -5, 0, True, float("nan"), float("inf"), None, [1]):
        with pytest.raises(TaskError, match=r"t: evaluator\.timeout must be a positive number of seconds"):
            parse_task(_task(evaluator={"command": "true", "timeout": bad}))
        with pytest.raises(TaskError, match=r"t: timeout must be a positive number of seconds"):
            parse_task(_task(timeout=bad))
    assert parse_task(_task(evaluator={"command": "true", "timeout": 5})).evaluator.timeout == 5.0
    assert parse_task(_task(evaluator="true")).evaluator.timeout == 120.0


def test_a_task_id_twice_in_a_file_is_an_error_naming_both_lines(tmp_path):
    f = tmp_path / "tasks.jsonl"
    f.write_text("\n".join(json.dumps(t) for t in [_task("a"), _task("b"), _task("a", num_samples=3)]) + "\n")
    with pytest.raises(click.ClickException, match=r"tasks.jsonl:3: task_id a is on line 1 already"):
        read_tasks(str(f), None, None)
    f.write_text(json.dumps(_task("a", evaluator={"command": "true", "timeout": "abc"})) + "\n")
    with pytest.raises(click.ClickException, match=r"tasks.jsonl:1: a: evaluator\.timeout must be"):
        read_tasks(str(f), None, None)


# -- submission --------------------------------------------------------------------------------
def test_a_bad_workspace_or_git_repo_is_refused_at_submission(tmp_path):
    repo = tmp_path / "repo"
    head = commit(repo, {"a.txt": "a\n"}, "one")
    (tmp_path / "plain").mkdir()
    (tmp_path / "file").write_text("x")
    server = RolloutServer(str(tmp_path / "r.duckdb")).start()
    try:
        for ws, message in [
                (str(tmp_path / "nope"), f"w: workspace {tmp_path / 'nope'} does not exist"),
                (str(tmp_path / "file"), f"w: workspace {tmp_path / 'file'} is not a directory"),
                ({"git": str(tmp_path / "nope")}, f"w: workspace.git {tmp_path / 'nope'} does not exist"),
                ({"git": str(tmp_path / "plain")}, f"w: workspace.git {tmp_path / 'plain'} is not a git repository"),
                ({"git": str(repo), "commit": "0" * 40}, f"w: workspace.commit {'0' * 40} is not a commit of {repo}")]:
            with pytest.raises(TaskError) as e:
                server.submit(_task("w", workspace=ws))
            assert str(e.value) == message
            r = httpx.post(f"{server.url}/tasks", json=_task("w", workspace=ws))
            assert r.status_code == 400 and r.json()["error"]["message"] == message
        assert "w" not in server.task_views()                  # nothing of it was queued
        assert server.submit(_task("ok", workspace={"git": str(repo), "commit": head})) == ["ok~0"]
        assert server.submit(_task("dir", workspace=str(tmp_path / "plain"))) == ["dir~0"]
    finally:
        server.stop()
    # a server whose nodes hold the workspaces (not this machine) takes them unchecked
    elsewhere = RolloutServer(str(tmp_path / "e.duckdb"), check_workspaces=False).start()
    try:
        assert elsewhere.submit(_task("w", workspace="/only/on/the/nodes")) == ["w~0"]
    finally:
        elsewhere.stop()


def test_a_changed_task_is_refused_and_the_same_one_resumes(tmp_path):
    server = RolloutServer(str(tmp_path / "r.duckdb")).start()
    client = ServerClient(server.url)
    try:
        first = parse_task(_task("fix", evaluator="echo 1"))
        server.submit(first)
        with pytest.raises(TaskExists, match="task fix already exists"):
            server.submit(first)
        with pytest.raises(TaskChanged) as e:
            server.submit(replace(first, num_samples=3, evaluator=None))
        assert e.value.changes == ["num_samples 1 -> 3", "evaluator {'command': 'echo 1', 'timeout': 120.0} -> None"]
        assert "give the changed task a new task_id" in str(e.value)
        # over HTTP: the same task is 409 (the loop resumes it), a changed one 422
        r = httpx.post(f"{server.url}/tasks", json=_task("fix", evaluator="echo 1"))
        assert r.status_code == 409 and "already exists" in r.json()["error"]["message"]
        r = httpx.post(f"{server.url}/tasks", json=_task("fix", evaluator="echo 1", num_samples=3))
        assert r.status_code == 422 and r.json()["error"]["changed"] == ["num_samples 1 -> 3"]
        assert client.submit(first) is False                   # a loop's rerun: resumed
        with pytest.raises(ServerError, match="another spec"):
            client.submit(replace(first, num_samples=3))
        # a task_id twice in one request
        r = httpx.post(f"{server.url}/tasks", json=[_task("x"), _task("y"), _task("x")])
        assert r.status_code == 400 and r.json()["error"]["message"] == "task_id x given twice in one request"
        assert "x" not in server.task_views()
    finally:
        client.close()
        server.stop()
    # and after a restart, from the database
    server = RolloutServer(str(tmp_path / "r.duckdb")).start()
    try:
        with pytest.raises(TaskExists):
            server.submit(parse_task(_task("fix", evaluator="echo 1")))
        with pytest.raises(TaskChanged, match="num_samples 1 -> 2"):
            server.submit(parse_task(_task("fix", evaluator="echo 1", num_samples=2)))
    finally:
        server.stop()


# -- attempts ----------------------------------------------------------------------------------
def test_a_released_attempt_never_counts_as_a_failed_one(tmp_path):
    """A node that is stopped (or whose backend went down) hands its sessions back: they run
    again under a new name however often that happens. Only attempts a node failed (a lost
    node, here) count towards max_attempts."""
    server = RolloutServer(str(tmp_path / "r.duckdb"), node_timeout=0.5, max_attempts=3).start()

    def beat(node: str, events=(), free=0, active=()):
        return server.heartbeat({"node_id": node, "load": {"free": free}, "active": list(active),
                                 "events": list(events)})

    def run_once(node: str) -> str:
        (a,) = beat(node, free=1)["assign"]
        sid = a["session_id"]
        beat(node, [{"session_id": sid, "state": "run"}], active=[sid])
        return sid

    try:
        server.submit(_task("t"))
        for i in range(5):     # five stops in a row: more than max_attempts
            sid = run_once("n")
            beat("n", [{"session_id": sid, "state": "released", "reason": "node n stopped"}])
        g = server.group("t")
        assert [s["state"] for s in g["sessions"]] == ["pending"] and g["sessions"][0]["attempt"] == 6
        assert [(s["state"], s["reason"]) for s in g["attempts"]] == [("released", "node n stopped")] * 5
        for lost in range(3):  # now three lost nodes: those count
            sid = run_once(f"gone{lost}")
            assert until(lambda: {s["session_id"]: s["state"] for s in server.task_status("t")["sessions"]}[sid]
                         != "run", 10)
        g = server.group("t")
    finally:
        server.stop()
    (s,) = g["sessions"]
    assert s["state"] == "failed" and s["session_id"] == "t~0.r8"
    assert s["reason"].startswith("node gone2 lost: no heartbeat for ") and s["reason"].endswith("; 3 failed attempts")


def test_a_cancel_goes_on_after_a_restart_with_its_reason(tmp_path):
    """A task cancelled while its sessions run on a node: the server restarts before the node
    reports them stopped. The restarted server still tells the node to cancel them, and the
    task ends cancelled, for the reason given."""
    db = str(tmp_path / "r.duckdb")
    beat = {"node_id": "n", "load": {"free": 0}, "events": []}
    server = RolloutServer(db).start()
    try:
        server.submit(_task("t", num_samples=2))
        server.heartbeat({**beat, "load": {"free": 2}, "active": []})
        server.heartbeat({**beat, "active": ["t~0", "t~1"], "events": [{"session_id": "t~0", "state": "run"}]})
        assert server.cancel("t", "the run was stopped")
    finally:
        server.stop()
    server = RolloutServer(db).start()
    try:
        assert server.task_views(["t"])["t"].cancel_reason == "the run was stopped"
        got = server.heartbeat({**beat, "active": ["t~0", "t~1"]})
        assert sorted(got["cancel"]) == ["t~0", "t~1"]
        server.heartbeat({**beat, "active": [], "events": [
            {"session_id": "t~0", "state": "cancelled", "reason": "cancelled"},
            {"session_id": "t~1", "state": "cancelled", "reason": "cancelled"}]})
        assert server.wait(["t"], timeout=10)
        assert server.task_status("t")["state"] == "cancelled"
    finally:
        server.stop()
    _, rows = query(db, "SELECT state, detail FROM rollout_events WHERE task_id = 't' AND session_id IS NULL "
                        "ORDER BY event_at")
    assert rows == [("stopping", "the run was stopped"), ("cancelled", "the run was stopped")]


# -- the backend -------------------------------------------------------------------------------
def test_a_node_pauses_while_its_backend_is_down(tmp_path):
    backend = FakeVLLM().up()      # taken down (its port closed) and brought back below
    backend.down()
    server = RolloutServer(str(tmp_path / "r.duckdb")).start()
    node = GatewayNode(NodeConfig(server_url=server.url, proxy_port=1, ca_path="", heartbeat_s=0.1, init_workers=1,
                                  run_workers=1, backend_url=backend.url, backend_probe_s=0.2),
                       runtime=LocalRuntime(tmp_path / "s")).start()
    try:
        # down at start: the node takes no work, and says why
        server.submit(_task("a", command=f"{FAKE} ok 0", evaluator="test -f result.txt"))
        time.sleep(1.5)
        st = server.status()
        assert st["sessions"] == {"pending": 1}
        assert "the model backend at " + backend.url + " does not answer" in st["nodes"][node.cfg.node_id]["paused"]
        backend.up()
        assert server.wait(["a"], timeout=30)
        assert server.group("a")["sessions"][0]["state"] == "done"
        assert "paused" not in server.status()["nodes"][node.cfg.node_id]
        # down while a harness runs: handed back (not failed), run again once it is back
        server.submit(_task("b", command=f"{FAKE} slow:2 0", evaluator="test -f result.txt"))
        assert until(lambda: server.status()["sessions"].get("run") == 1, 30)
        backend.down()
        assert until(lambda: node.backend_error is not None, 10)
        # the harness (2 s) ends while the backend is down: a loaded machine may take longer
        until(lambda: server.status()["sessions"].get("run") is None, 30)
        st = server.status()["sessions"]
        assert st.get("failed") is None and st.get("run") is None, st
        backend.up()
        assert server.wait(["b"], timeout=30)
        g = server.group("b")
    finally:
        node.stop()
        server.stop()
        backend.down()
    assert [(s["session_id"], s["state"], s["reward"]) for s in g["sessions"]] == [("b~0.r2", "done", 1.0)]
    (a,) = g["attempts"]
    assert a["state"] == "released" and "the model backend went down while it ran" in a["reason"]


# -- callbacks ---------------------------------------------------------------------------------
def test_callbacks_are_sent_concurrently_each_with_its_own_retries(tmp_path):
    hang = socket.create_server(("127.0.0.1", 0), backlog=16)   # takes connections, never answers
    ok = Callbacks()
    server = RolloutServer(str(tmp_path / "r.duckdb"), callback_timeout=2.0, callback_tries=3,
                           callback_backoff=0.05).start()
    try:
        server.submit(_task("stuck", callback_url=f"http://127.0.0.1:{hang.getsockname()[1]}/groups"))
        server.submit(_task("quick", callback_url=ok.url))
        got = server.heartbeat({"node_id": "n", "load": {"free": 2}, "active": [], "events": []})
        ids = [a["session_id"] for a in got["assign"]]
        assert ids == ["stuck~0", "quick~0"]
        t0 = time.monotonic()
        server.heartbeat({"node_id": "n", "load": {"free": 0}, "active": [], "events": [
            {"session_id": sid, "state": "done", "reward": 1.0} for sid in ids]})
        assert until(lambda: "quick" in ok.arrived, 10)
        assert ok.arrived["quick"] - t0 < 1.5       # not after the stuck one's 2 s timeouts
        assert server.wait(["stuck", "quick"], timeout=30)
        took = time.monotonic() - t0
    finally:
        server.stop()
        ok.close()
        hang.close()
    assert 5.5 < took < 15     # three tries of 2 s each
    _, rows = query(tmp_path / "r.duckdb", "SELECT task_id, callback_state, callback_tries FROM rollout_tasks ORDER BY 1")
    assert rows == [("quick", "sent", 1), ("stuck", "failed", 3)]
    _, rows = query(tmp_path / "r.duckdb", "SELECT count(*) FROM rollout_events WHERE task_id = 'stuck' "
                                           "AND state = 'callback_failed' AND detail IS NOT NULL")
    assert rows == [(3,)]


# -- polar-mitm rollout ------------------------------------------------------------------------
class Rollout:
    """`polar-mitm rollout` in the background, its output collected line by line."""

    def __init__(self, *args):
        self.p = subprocess.Popen([POLAR, "rollout", *map(str, args)], stdout=subprocess.PIPE,
                                  stderr=subprocess.STDOUT, text=True)
        self.lines: list[str] = []
        threading.Thread(target=self._read, daemon=True).start()

    def _read(self):
        for line in self.p.stdout:
            self.lines.append(line)

    @property
    def out(self) -> str:
        return "".join(self.lines)

    def wait_for(self, text: str, timeout: float = 60) -> None:
        assert until(lambda: text in self.out or self.p.poll() is not None, timeout) and text in self.out, self.out

    def wait(self, timeout: float = 120) -> int:
        rc = self.p.wait(timeout)
        time.sleep(0.1)
        return rc


def _run(*args, timeout: float = 120) -> subprocess.CompletedProcess:
    return subprocess.run([POLAR, "rollout", *map(str, args)], capture_output=True, text=True, timeout=timeout)


def test_rollout_refuses_bad_input_and_a_dead_backend_before_anything_starts(tmp_path):
    dead = f"http://127.0.0.1:{launch.free_port()}"
    db = tmp_path / "r.duckdb"
    tasks = tmp_path / "tasks.jsonl"
    cases = [
        ([_task("a"), _task("a")], dead, "tasks.jsonl:2: task_id a is on line 1 already"),
        ([_task("a", evaluator={"command": "true", "timeout": "abc"})], dead,
         "tasks.jsonl:1: a: evaluator.timeout must be a positive number of seconds, not 'abc'"),
        ([_task("a", evaluator={"command": "true", "timeout": -5})], dead,
         "a: evaluator.timeout must be a positive number of seconds, not -5"),
        ([_task("a", workspace=str(tmp_path / "gone"))], dead, f"a: workspace {tmp_path / 'gone'} does not exist"),
        ([_task("a", workspace={"git": str(tmp_path)})], dead, f"a: workspace.git {tmp_path} is not a git repository"),
        ([_task("a")], dead, f"the model backend at {dead} does not answer"),
    ]
    for lines, backend, message in cases:
        tasks.write_text("\n".join(json.dumps(t) for t in lines) + "\n")
        t0 = time.monotonic()
        out = _run(tasks, "--db", db, "--backend", backend)
        assert out.returncode == 1 and message in out.stderr, (message, out.stdout, out.stderr)
        assert time.monotonic() - t0 < 30
        assert not db.exists() and not (tmp_path / ".r.duckdb.rollout").exists()   # nothing started
    # a gateway node too refuses to start on a backend that does not answer
    out = subprocess.run([POLAR, "node", "--server", "http://127.0.0.1:1", "--backend", dead,
                          "--db", str(tmp_path / "node.duckdb")], capture_output=True, text=True, timeout=60)
    assert out.returncode == 1 and f"the model backend at {dead} does not answer" in out.stderr, out.stderr
    assert not (tmp_path / "node.duckdb").exists()


def test_rollout_exit_codes_and_interrupts_that_spend_no_attempts(tmp_path):
    """Ctrl-C and SIGTERM exit 130 and 143 and hand the running session back; three of them
    (max_attempts is 3) and the rerun still runs the sample, to a reward. A changed task on
    rerun is an error (or resumed as stored with --on-changed keep); failed sessions exit 3."""
    ws = tmp_path / "ws"
    ws.mkdir()
    db = tmp_path / "r.duckdb"
    tasks = tmp_path / "tasks.jsonl"
    # it runs until the workspace has GO (a sandbox sees its workspace only)
    task = _task("stop", workspace=str(ws), evaluator="test -f result.txt",
                 command=f"if test -f GO; then {FAKE} ok 1; else {FAKE} slow:120 1; fi")
    tasks.write_text(json.dumps(task) + "\n")
    with FakeVLLM("scripted") as backend:
        for sig, code in [(signal.SIGINT, 130), (signal.SIGTERM, 143), (signal.SIGINT, 130)]:
            r = Rollout(tasks, "--db", db, "--backend", backend.url)
            try:
                r.wait_for("sessions: run 1")
                r.p.send_signal(sig)
                assert r.wait() == code, r.out
            finally:
                r.p.kill()
            said = "SIGTERM" if sig == signal.SIGTERM else "Ctrl-C"
            assert f"interrupted ({said}): sessions in flight were stopped" in r.out
        (ws / "GO").write_text("")
        out = _run(tasks, "--db", db, "--backend", backend.url)
        assert out.returncode == 0, out.stdout + out.stderr
        assert "stop: already in" in out.stdout and "resuming it" in out.stdout
        _, rows = query(db, "SELECT session_id, state, reward FROM rollout_sessions ORDER BY attempt")
        assert rows == [("stop~0", "released", None), ("stop~0.r2", "released", None),
                        ("stop~0.r3", "released", None), ("stop~0.r4", "done", 1.0)]

        # a changed task on rerun: an error that says what changed, before anything starts
        tasks.write_text(json.dumps({**task, "num_samples": 3}) + "\n")
        out = _run(tasks, "--db", db, "--backend", backend.url)
        assert out.returncode == 1
        assert "stop: already in" in out.stderr and "num_samples 1 -> 3" in out.stderr
        assert "--on-changed keep" in out.stderr
        out = _run(tasks, "--db", db, "--backend", backend.url, "--on-changed", "keep")
        assert out.returncode == 0, out.stdout + out.stderr
        assert "resuming the stored one" in out.stderr
        _, rows = query(db, "SELECT count(*) FROM rollout_sessions WHERE task_id = 'stop'")
        assert rows == [(4,)]                              # the stored task, as it was

        # sessions that failed: exit 3
        tasks.write_text(json.dumps(_task("crash", command=f"{FAKE} crash 0")) + "\n")
        out = _run(tasks, "--db", db, "--backend", backend.url)
        assert out.returncode == 3, out.stdout + out.stderr
        assert "1 session(s) failed" in out.stderr and "exited with code 3" in out.stdout
