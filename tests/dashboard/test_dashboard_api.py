"""The dashboard's JSON API (`polar-mitm dashboard`, polar_mitm/dashboard/) on a database made by
a real rollout: a rollout server, a gateway node and the proxy (mitmdump) run an agent harness
of ours (one `bash` tool, a system prompt) against the scripted stand-in backend, which
answers the first turn with a call of the tool and the next with text. Its prompt token ids
render each message on its own, so the second prompt re-renders the first call's sampled
tokens differently (drift), and its logprobs differ token by token. The loop's iterations are
recorded with store.loop.record_iteration.

Checked: a session's turns (the system prompt too), its tool calls with their arguments as
recorded, every call with its tokens and logprobs aligned as stored, the drift located by
call; a group's samples with their rewards, attempt history and outputs; the runs rows with
their standard errors; compare by session and by policy version; the pages; the event stream
on the journal's and the call log's changes; and that no connection outlives a request."""

from __future__ import annotations

import json
import math
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path
from urllib.parse import quote

import httpx
import orjson
import pytest
from fastapi.testclient import TestClient

from support.fake_vllm import COMMAND, FakeVLLM
from support.agent_rollout import AgentRollout
from polar_mitm.stack import launch
from polar_mitm.dashboard import make_app
from polar_mitm.dashboard.live import Live
from polar_mitm.rollout.http_api import ThreadedUvicorn
from polar_mitm.store import init_db, query
from polar_mitm.store.calllog import LogAppender, log_dir
from polar_mitm.store.journal_log import JournalLog
from polar_mitm.store.loop import record_iteration

POLAR = str(Path(sys.executable).parent / "polar-mitm")
TASK = "fix@r1.0"      # a loop's task id: TASK@RUN.I (the routes take "@", "~" and ".")
SAMPLES = 3
REWARDS = {0: 1.0, 1: 0.5, 2: 0.25}

EVALUATOR = ('test -f polar_proof.txt || { echo 0; exit 0; }; '
             'case "$POLAR_SAMPLE" in 0) echo 1.0;; 1) echo 0.5;; *) echo 0.25;; esac')


class Drifting(FakeVLLM):
    """The scripted stand-in, with prompt ids that render message by message (a later prompt
    extends an earlier one, and re-renders its answer in its own way: drift) and a logprob
    of its own for each sampled token."""

    @staticmethod
    def prompt_ids(messages) -> list[int]:
        out: list[int] = []
        for m in messages:
            body = m.get("content") or orjson.dumps(m.get("tool_calls")).decode()
            out += list(f"<{m.get('role')}>{body}</>".encode())
        return out

    def answer(self, body: dict) -> dict:
        out = super().answer(body)
        n = len(out["choices"][0]["token_ids"])
        out["choices"][0]["logprobs"] = {"content": [{"token": "x", "logprob": -0.05 * (k + 1)} for k in range(n)]}
        return out


@pytest.fixture(scope="module")
def stack(tmp_path_factory):
    s = AgentRollout(tmp_path_factory.mktemp("dashboard-api"), Drifting(mode="scripted").up(), EVALUATOR)
    try:
        s.run({TASK: SAMPLES})
        for it, (mean, std, n) in enumerate([(0.5, 0.3, 9), (0.75, 0.2, 9)]):
            record_iteration(s.db, {"run_id": "r1", "iteration": it, "policy_version": it, "reward_mean": mean,
                                    "reward_std": std, "reward_n": n, "eval_reward_mean": mean - 0.1,
                                    "eval_reward_std": 0.4, "eval_reward_n": 5, "sessions_done": n,
                                    "sessions_failed": 0, "sessions_timed_out": 0, "calls": 2 * n, "tokens": 100,
                                    "stale_dropped": it, "rollout_s": 10.0, "train_s": 5.0, "sync_s": 1.0,
                                    "per_task": {"fix": {"mean": mean, "std": std, "n": n}}}, [])
        yield s
    finally:
        s.stop()


@pytest.fixture(scope="module")
def client(stack):
    with TestClient(make_app([stack.db])) as c:
        yield c


def _recorded(db: str, sid: str) -> list[tuple]:
    _, rows = query(db, "SELECT seq, token_ids, logprobs, response_json, policy_version, finish_reason "
                        "FROM session_calls(?) ORDER BY seq", [sid])
    return rows


# -- the API ----------------------------------------------------------------------------------------
def test_a_session_shows_its_turns_tool_calls_tokens_and_drift_as_recorded(stack, client):
    sid = f"{TASK}~0"
    r = client.get(f"/api/sessions/{quote(sid)}")
    assert r.status_code == 200, r.text
    d = r.json()
    assert d["session_id"] == sid and d["task_id"] == TASK and d["base_task"] == "fix" and d["run_id"] == "r1"
    assert d["state"] == "done" and d["reward"] == 1.0 and d["eval_output"].strip() == "1.0"
    assert f"$ {COMMAND}" in d["harness_output"]
    # the conversation as the model saw it: system prompt, user, the tool call, its result, the answer
    roles = [t["role"] for t in d["turns"]]
    assert roles == ["system", "user", "assistant", "tool", "assistant"], roles
    assert "careful agent" in d["turns"][0]["text"]
    recorded = _recorded(stack.db, sid)
    calls = [tc["function"] for *_, resp, _, _ in recorded[:1]
             for tc in json.loads(resp)["choices"][0]["message"]["tool_calls"]]
    assert [(c["name"], c["arguments"]) for c in calls] == [("bash", json.dumps({"command": COMMAND},
                                                                                  separators=(",", ":")))]
    shown = d["turns"][2]["tool_calls"]
    assert [(c["name"], c["arguments"]) for c in shown] == [(c["name"], c["arguments"]) for c in calls]
    assert "polar-tool-ok" in d["turns"][3]["text"] and d["turns"][3]["name"] == "bash"
    assert [t.get("call_seq") for t in d["turns"] if t["role"] == "assistant"] == [1, 2]
    assert [t["name"] for t in d["tools"]] == ["bash"]
    # every call, its tokens and logprobs aligned as stored
    assert [c["seq"] for c in d["calls"]] == [r[0] for r in recorded] == [1, 2]
    for c, (seq, ids, lps, _, version, finish) in zip(d["calls"], recorded):
        assert [t[0] for t in c["tokens"]] == list(ids)
        assert all(abs(t[2] - lp) < 1e-6 for t, lp in zip(c["tokens"], lps)) and len(lps) == len(ids)
        assert abs(c["tokens"][1][2] - (-0.10)) < 1e-6        # the stand-in's -0.05 * (k + 1)
        assert c["policy_version"] == version == 0 and c["finish_reason"] == finish
        assert c["latency"]["total_ms"] > 0 and c["latency"]["backend_ms"] >= 0 and c["prompt_len"] > 0
    assert d["calls"][0]["finish_reason"] == "tool_calls"
    # the second prompt re-renders the first call's answer: drift, located by call
    assert len(d["drift"]) == 1, d["drift"]
    drift = d["drift"][0]
    assert drift["call_seq"] == 1 and drift["later_seq"] == 2 and 0 <= drift["at"] < len(d["calls"][0]["tokens"])
    assert d["calls"][0]["drift"] == d["calls"][1]["drift"] == [drift]
    assert sorted(d["siblings"]) == [f"{TASK}~1", f"{TASK}~2"]


def test_a_group_shows_every_sample_with_reward_attempts_and_outputs(stack, client):
    d = client.get(f"/api/groups/{quote(TASK)}").json()
    assert d["task_id"] == TASK and d["state"] == "done" and (d["run_id"], d["iteration"]) == ("r1", 0)
    assert d["spec"]["num_samples"] == SAMPLES
    _, rows = query(stack.db, "SELECT session_id, reward FROM rollout_sessions WHERE task_id = ? ORDER BY 1", [TASK])
    assert [(s["session_id"], s["reward"]) for s in d["samples"]] == rows
    assert {s["sample"]: s["reward"] for s in d["samples"]} == REWARDS
    for s in d["samples"]:
        assert s["state"] == "done" and s["current"] and s["attempt"] == 1
        assert s["calls"]["calls"] == 2 and s["calls"]["completion_tokens"] > 0 and s["calls"]["versions"] == [0]
        assert [e["state"] for e in s["events"]] == ["pending", "assigned", "init", "ready", "run", "post_run", "done"]
        assert s["eval_output"].strip() == str(REWARDS[s["sample"]]) and "polar-tool-ok" in s["harness_output"]
    mean = sum(REWARDS.values()) / 3
    std = math.sqrt(sum((r - mean) ** 2 for r in REWARDS.values()) / 3)
    assert abs(d["reward"]["mean"] - mean) < 1e-9 and abs(d["reward"]["se"] - std / math.sqrt(2)) < 1e-9
    # the list: the task, its base task, run and iteration, its figures
    groups = {g["task_id"]: g for g in client.get("/api/groups").json()["groups"]}
    g = groups[TASK]
    assert (g["base_task"], g["run_id"], g["iteration"], g["held_out"]) == ("fix", "r1", 0, False)
    assert g["by_state"] == {"done": SAMPLES} and g["rewarded"] == SAMPLES and abs(g["reward_mean"] - mean) < 1e-9
    assert g["calls"]["calls"] == 2 * SAMPLES and g["db"] == stack.db
    assert client.get(f"/api/groups/{quote('no-such-task')}").status_code == 404
    assert client.get(f"/api/sessions/{quote(TASK + '~9')}").status_code == 404


def test_runs_rows_carry_standard_errors_and_the_live_state(stack, client):
    d = client.get("/api/runs").json()
    (f,) = d["dbs"]
    assert f["db"] == stack.db and f["error"] is None
    (run,) = f["runs"]
    assert run["run_id"] == "r1" and [it["iteration"] for it in run["iterations"]] == [0, 1]
    it0 = run["iterations"][0]
    assert abs(it0["reward_se"] - 0.3 / math.sqrt(8)) < 1e-12 and abs(it0["eval_reward_se"] - 0.4 / 2) < 1e-12
    assert it0["per_task"] == {"fix": {"mean": 0.5, "std": 0.3, "n": 9}} and it0["stale_dropped"] == 0
    assert (it0["rollout_s"], it0["train_s"], it0["sync_s"], it0["policy_version"]) == (10.0, 5.0, 1.0, 0)
    assert d["live"]["sessions_by_state"].get("done", 0) >= SAMPLES
    live = {(x["run_id"], x["iteration"], x["held_out"]): x for x in d["live"]["iterations"]}
    assert live[("r1", 0, False)]["sessions_by_state"] == {"done": SAMPLES}


def test_compare_two_sessions_and_a_task_by_policy_version(stack, client):
    a, b = f"{TASK}~0", f"{TASK}~1"
    d = client.get(f"/api/compare?a={quote(a)}&b={quote(b)}").json()
    assert d["a"]["session_id"] == a and d["b"]["session_id"] == b
    assert d["b"]["turns"][2]["tool_calls"][0]["name"] == "bash"
    d = client.get("/api/compare?task=fix").json()
    assert d["task"] == "fix" and [v["policy_version"] for v in d["versions"]] == [0]
    assert sorted(s["session_id"] for s in d["versions"][0]["sessions"]) == [f"{TASK}~{i}" for i in range(SAMPLES)]
    assert client.get("/api/compare").status_code == 400


def test_every_page_is_the_one_app_and_its_files_are_served(stack, client):
    for path in ("/", "/groups", f"/groups/{quote(TASK)}", f"/sessions/{quote(TASK + '~0')}", "/compare",
                 f"/compare?a={quote(TASK + '~0')}&b={quote(TASK + '~1')}"):
        r = client.get(path)
        assert r.status_code == 200 and "text/html" in r.headers["content-type"], path
        assert "/static/app.js" in r.text and "http://" not in r.text and "https://" not in r.text
    for name in ("app.js", "style.css"):
        r = client.get(f"/static/{name}")
        assert r.status_code == 200 and "http://" not in r.text.replace("http://www.w3.org/2000/svg", "")
    assert client.get("/favicon.ico").status_code == 200


def test_answers_are_read_once_per_generation_and_no_connection_outlives_a_request(stack, client):
    cache = client.app.state.cache
    client.get("/api/groups")
    before = cache.reads
    for _ in range(5):
        client.get("/api/groups")
    # read again at most once per generation, and at most once per MIN_REFRESH_S while the
    # rollout server's files keep changing: five answers in well under that, one read at most
    assert cache.reads - before <= 1
    # no open file of the database, and no read request left behind
    db = os.path.realpath(stack.db)
    held = [os.readlink(f"/proc/self/fd/{fd}") for fd in os.listdir("/proc/self/fd")
            if os.path.exists(f"/proc/self/fd/{fd}")]
    assert not [p for p in held if p in (db, db + ".wal")], held
    readers = Path(f"{stack.db}.readers")
    mine = [p.name for p in readers.iterdir() if p.name.startswith(f"{os.getpid()}-")] if readers.exists() else []
    assert mine == []


# -- live -------------------------------------------------------------------------------------------
def test_the_generation_moves_with_the_journal_and_the_call_log_never_the_database(tmp_path):
    db = tmp_path / "other.duckdb"
    init_db(db)
    live = Live([str(db)], None, calls_every_s=0)
    assert not live.poll()
    log = JournalLog(db, 0)
    log.append({"tasks": [], "sessions": [], "events": [{"at_us": 1, "task_id": "t", "session_id": None,
                                                           "state": "queued", "node_id": None, "detail": None}]})
    assert live.poll() and live.generation == 2 and not live.poll()
    appender = LogAppender(log_dir(db))
    assert live.poll() and live.generation == 3      # a new call log segment
    appender.close()
    log.close()


def test_a_call_log_change_alone_moves_the_generation_at_most_once_per_calls_every_s(tmp_path):
    """A rollout's calls change the call log every moment: alone, they move the generation (and
    so the open pages' reads, and the loader's hand-overs) once per calls_every_s; a state
    change (the journal) counts at once."""
    db = tmp_path / "calls.duckdb"
    init_db(db)
    live = Live([str(db)], None, calls_every_s=0.5)
    live._moved -= 1.0                                   # the last move was a while ago
    appender = LogAppender(log_dir(db))
    assert live.poll() and live.generation == 2         # the first change counts at once
    appender.close()
    second = LogAppender(log_dir(db))
    assert not live.poll()                              # another one within 0.5 s waits
    time.sleep(0.6)
    assert live.poll() and live.generation == 3 and not live.poll()   # and then counts
    log = JournalLog(db, 0)
    log.append({"tasks": [], "sessions": [], "events": [{"at_us": 1, "task_id": "t", "session_id": None,
                                                           "state": "queued", "node_id": None, "detail": None}]})
    assert live.poll() and live.generation == 4         # a state change at once
    second.close()
    log.close()


def test_the_event_stream_announces_changes_while_a_rollout_runs(stack):
    app = make_app([stack.db], poll_s=0.2, calls_every_s=0.5)
    server = ThreadedUvicorn(app, "127.0.0.1", 0, name="dashboard-test")
    server.start()
    events: list[tuple[str, int]] = []
    stop = threading.Event()

    def listen() -> None:
        with httpx.Client(timeout=30) as c, c.stream("GET", f"http://127.0.0.1:{server.port}/api/stream") as r:
            assert r.headers["content-type"].startswith("text/event-stream")
            kind = None
            for line in r.iter_lines():
                if line.startswith("event: "):
                    kind = line[7:]
                elif line.startswith("data: ") and kind:
                    events.append((kind, json.loads(line[6:])["generation"]))
                if stop.is_set():
                    return
    t = threading.Thread(target=listen, daemon=True)
    t.start()
    try:
        deadline = time.monotonic() + 10
        while not events and time.monotonic() < deadline:
            time.sleep(0.05)
        assert events and events[0][0] == "hello"
        start = events[0][1]
        stack.run({"more@r1.1": 1})             # the journal and the call log change
        deadline = time.monotonic() + 10
        while not [e for e in events if e[0] == "change"] and time.monotonic() < deadline:
            time.sleep(0.05)
        changes = [g for kind, g in events if kind == "change"]
        assert changes and changes[0] > start and changes == sorted(changes), events
        # the new task is in the answers read after the change
        with httpx.Client(timeout=30) as c:
            d = c.get(f"http://127.0.0.1:{server.port}/api/groups").json()
        assert d["generation"] > start and "more@r1.1" in {g["task_id"] for g in d["groups"]}
    finally:
        stop.set()
        from polar_mitm.dashboard.app import close_streams
        close_streams(app)
        server.stop()
        t.join(10)


# -- the command ------------------------------------------------------------------------------------
@pytest.mark.parametrize("sig,code", [(signal.SIGINT, 130), (signal.SIGTERM, 143)])
def test_the_command_serves_until_interrupted(stack, sig, code, tmp_path):
    port = launch.free_port()
    proc = subprocess.Popen([POLAR, "dashboard", "--db", stack.db, "--port", str(port)], stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True)
    try:
        line = proc.stdout.readline()
        assert f"http://127.0.0.1:{port}/" in line, line + proc.stdout.read() if proc.poll() is not None else line
        assert httpx.get(f"http://127.0.0.1:{port}/api/groups", timeout=30).status_code == 200
        proc.send_signal(sig)
        assert proc.wait(20) == code
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


def test_drift_is_found_as_the_trainer_finds_it_without_comparing_every_pair():
    """data._drift (each call against its longest strict-prefix call only) finds exactly what
    grpo.calls.drift_events finds, on synthetic sessions with drift, side calls, retries,
    sub-agents and compaction."""
    import random

    from polar_mitm.dashboard.data import _drift
    from polar_mitm.grpo.calls import drift_events
    from polar_mitm.grpo.synthetic import Shape, group

    shape = Shape(sessions=3, turns=12, shared=300, drifts=3, side_calls=2, retries=1, subagents=1, compactions=1)
    for seed in range(5):
        calls = group("t", shape, random.Random(seed))
        for sid in {c.session_id for c in calls}:
            mine = [c for c in calls if c.session_id == sid]
            assert sorted(_drift(mine)) == sorted((d.call, d.later, d.at, d.tokens) for d in drift_events(mine))


def test_what_the_rollout_server_has_not_folded_yet_is_shown_from_its_journal(tmp_path):
    """A running server's state is in its journal log first (folded into the tables every
    30 s): the pages read it over the tables, outputs included."""
    db = tmp_path / "fresh.duckdb"
    init_db(db)
    log = JournalLog(db, 0)
    log.append({"tasks": [{"task_id": "t@r.0", "order": 0, "spec": {"num_samples": 2, "instruction": "do it"},
                           "state": "running", "priority": 0, "callback_state": None, "callback_tries": 0,
                           "cancel_reason": None}],
                "sessions": [{"session_id": f"t@r.0~{i}", "task_id": "t@r.0", "sample": i, "attempt": 1,
                              "state": ["run", "done"][i], "node_id": "n1", "reward": [None, 0.5][i], "reason": None,
                              "stats": {"harness_output": "out", "eval_output": "0.5\n"} if i else None}
                             for i in range(2)],
                "events": [{"at_us": 1_000_000, "task_id": "t@r.0", "session_id": "t@r.0~1", "state": "done",
                            "node_id": "n1", "detail": None}]})
    try:
        with TestClient(make_app([str(db)])) as c:
            runs = c.get("/api/runs").json()
            assert runs["live"]["sessions_by_state"] == {"run": 1, "done": 1}
            assert runs["live"]["tasks_by_state"] == {"running": 1}
            (g,) = c.get("/api/groups").json()["groups"]
            assert (g["task_id"], g["state"], g["samples"], g["by_state"], g["reward_mean"]) == \
                ("t@r.0", "running", 2, {"run": 1, "done": 1}, 0.5)
            d = c.get(f"/api/groups/{quote('t@r.0')}").json()
            assert [(s["state"], s["reward"], s["eval_output"]) for s in d["samples"]] == \
                [("run", None, None), ("done", 0.5, "0.5\n")]
            assert d["samples"][1]["events"][0]["state"] == "done"
            s = c.get(f"/api/sessions/{quote('t@r.0~1')}").json()
            assert (s["state"], s["reward"], s["eval_output"], s["calls"]) == ("done", 0.5, "0.5\n", [])
            assert s["instruction"] == "do it" and s["siblings"] == ["t@r.0~0"]
    finally:
        log.close()


def test_several_files_each_row_says_which(stack, tmp_path):
    """A second file (another node's) that knows nothing of the task: every list names its
    file, and a group or a session is found wherever it is."""
    other = tmp_path / "node2.duckdb"
    init_db(other)
    with TestClient(make_app([str(other), stack.db])) as c:
        runs = c.get("/api/runs").json()
        assert [f["db"] for f in runs["dbs"]] == [str(other), stack.db]
        groups = {g["task_id"]: g for g in c.get("/api/groups").json()["groups"]}
        assert groups[TASK]["db"] == stack.db
        d = c.get(f"/api/groups/{quote(TASK)}").json()
        assert d["db"] == stack.db and all(s["db"] == stack.db for s in d["samples"])
        s = c.get(f"/api/sessions/{quote(TASK + '~0')}").json()
        assert s["db"] == stack.db and len(s["calls"]) == 2


def test_an_older_loops_rows_get_their_standard_errors():
    """A loop_iterations row from before reward_n, eval_reward_std and eval_reward_n (NULL):
    n from per_task (else sessions_done), the held-out std and n from the server's sessions
    of the iteration's held-out tasks when their mean is the row's; else unknown."""
    from polar_mitm.store.dashboard import _iteration

    row = {"run_id": "r", "iteration": 0, "reward_mean": 0.25, "reward_std": 0.25, "reward_n": None,
           "eval_reward_mean": 0.125, "eval_reward_std": None, "eval_reward_n": None, "sessions_done": 16,
           "per_task": json.dumps({"a": {"mean": 0.25, "std": 0.25, "n": 4}, "b": {"mean": 0.25, "std": 0.25, "n": 5}})}
    it = _iteration(row, [0.5, 0.0, 0.0, 0.0])
    assert (it["reward_n"], it["reward_n_from"]) == (9, "per_task") and abs(it["reward_se"] - 0.25 / math.sqrt(8)) < 1e-12
    std = math.sqrt((0.375 ** 2 + 3 * 0.125 ** 2) / 4)
    assert (it["eval_reward_n"], it["eval_reward_n_from"]) == (4, "sessions")
    assert abs(it["eval_reward_se"] - std / math.sqrt(3)) < 1e-12
    it = _iteration({**row, "per_task": None}, [1.0, 1.0])        # another mean: not these sessions
    assert (it["reward_n"], it["reward_n_from"]) == (16, "sessions_done") and it["eval_reward_se"] is None
    it = _iteration({**row, "reward_n": 3, "eval_reward_std": 0.2, "eval_reward_n": 5}, [0.0])   # as stored
    assert "reward_n_from" not in it and abs(it["reward_se"] - 0.25 / math.sqrt(2)) < 1e-12
    assert abs(it["eval_reward_se"] - 0.1) < 1e-12
