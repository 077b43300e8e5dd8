"""Bad values never crash a run (issue 31, sections 4 and 5): task files, the options of
`polar-train loop` and of the `polar-mitm` commands, the loop's own checks before anything
starts (workspaces, --model, tasks changed on resume, a finished run), a full disk, the
exit codes 130 and 143, pruned checkpoints, callbacks that do not arrive, and an iteration
with no model call or no learning signal: each gets one clear line, naming the problem."""

from __future__ import annotations

import errno
import json
import signal
import socket
import subprocess
import sys
from pathlib import Path

import pytest
from click.testing import CliRunner

from support.fake_vllm import FakeVLLM
from polar_mitm.cli.main import main as polar_mitm
from polar_mitm.loop.run import disk_full
from polar_mitm.loop.state import LoopState, prune
from polar_mitm.loop.steps import no_calls_error, no_signal_reason
from polar_mitm.rollout import RolloutServer, TaskError, parse_task
from polar_mitm.rollout.spec import task_from_json
from polar_mitm.cli.rollout import callback_line
from polar_mitm.stack.local import read_tasks
from polar_mitm.cli.train import main as polar_train
from support.procs import alive, token, until
from support import SUPPORT

HERE = SUPPORT   # the helper scripts the sessions run
FAKE = f"{sys.executable} {HERE / 'fake_harness.py'}"
TRAIN = str(Path(sys.executable).parent / "polar-train")


@pytest.fixture(autouse=True)
def _signals():
    """The commands install their own SIGINT and SIGTERM handlers (stop_on_sigterm): put
    pytest's back after each test."""
    saved = {s: signal.getsignal(s) for s in (signal.SIGINT, signal.SIGTERM)}
    yield
    for s, handler in saved.items():
        signal.signal(s, handler)


def _task(tid: str = "t", **kw) -> dict:
    return {"task_id": tid, "instruction": "x", "harness": "command", "command": "true", **kw}


def _write(path: Path, *tasks: dict) -> Path:
    path.write_text("".join(json.dumps(t) + "\n" for t in tasks))
    return path


def _model(path: Path) -> str:
    """What the loop checks of a --model before it starts: a directory with config.json and weights."""
    path.mkdir(parents=True)
    (path / "config.json").write_text("{}")
    (path / "model.safetensors").write_bytes(b"")
    return str(path)


def _invoke(main, *args: object):
    return CliRunner().invoke(main, [str(a) for a in args])


def _fails(result, message: str, code: int = 1) -> None:
    assert result.exit_code == code and message in result.output, result.output
    assert "Traceback" not in result.output
    assert isinstance(result.exception, SystemExit), result.exception   # click's error, no crash


# -- task files ---------------------------------------------------------------------------------
def test_an_empty_evaluator_or_command_is_refused():
    with pytest.raises(TaskError, match="t: evaluator must be a non-empty shell line, not ''"):
        parse_task(_task(evaluator=""))
    with pytest.raises(TaskError, match="t: evaluator must be a non-empty shell line, not '  '"):
        parse_task(_task(evaluator={"command": "  ", "timeout": 5}))
    with pytest.raises(TaskError, match="t: command must be a non-empty shell line, not ''"):
        parse_task(_task(command=""))
    with pytest.raises(TaskError, match="t: command must be a non-empty shell line"):
        parse_task(_task(harness="pi", command=" "))
    assert parse_task(_task(evaluator="true")).evaluator.command == "true"
    # a spec stored before these checks is read back as it was accepted (a server restarts)
    stored = task_from_json({**_task(command=""), "evaluator": {"command": "", "timeout": 5.0}})
    assert stored.command == "" and stored.evaluator.command == ""


def test_the_loop_refuses_an_empty_evaluator_or_command_before_anything_starts(tmp_path):
    for bad, message in [({"evaluator": ""}, "tasks.jsonl:2: b: evaluator must be a non-empty shell line"),
                         ({"command": ""}, "tasks.jsonl:2: b: command must be a non-empty shell line")]:
        tasks = _write(tmp_path / "tasks.jsonl", _task("a"), _task("b", **bad))
        out = tmp_path / "run"
        _fails(_invoke(polar_train, "loop", "--tasks", tasks, "--iterations", 1, "--out", out,
                       "--backend", "http://127.0.0.1:9", "--model", _model(tmp_path / f"m{len(message)}")), message)
        assert not (out / "rollouts.duckdb").exists()


def test_a_task_file_that_is_not_utf8_names_its_file_and_line(tmp_path):
    tasks = tmp_path / "tasks.jsonl"
    tasks.write_bytes(json.dumps(_task("a")).encode() + b"\n" + b'{"task_id": "b", "instruction": "caf\xe9"}\n')
    with pytest.raises(Exception, match=r"tasks.jsonl:2: not UTF-8 text \(byte 0xe9 at column 37\)"):
        read_tasks(str(tasks), None, None)
    message = f"{tasks}:2: not UTF-8 text (byte 0xe9"
    _fails(_invoke(polar_train, "loop", "--tasks", tasks, "--iterations", 1, "--out", tmp_path / "run",
                   "--backend", "http://127.0.0.1:9", "--model", _model(tmp_path / "m")), message)
    # polar-mitm rollout reads task files the same way
    _fails(_invoke(polar_mitm, "rollout", tasks, "--db", tmp_path / "r.duckdb", "--backend", "http://127.0.0.1:9"),
           message)
    rewards = tmp_path / "rewards.jsonl"
    rewards.write_bytes(b'{"session_id": "a~0", "reward": 1}\n\xff\n')
    _fails(_invoke(polar_train, "reward", "--db", tmp_path / "r.duckdb", rewards), "rewards.jsonl:2: not UTF-8 text")


# -- options ------------------------------------------------------------------------------------
def test_bad_options_of_the_loop_are_usage_errors(tmp_path):
    tasks = _write(tmp_path / "tasks.jsonl", _task())
    base = ["loop", "--tasks", tasks, "--iterations", 1, "--out", tmp_path / "run"]
    cases = [
        (["--workers", 0], "Invalid value for '--workers': 0 is not in the range x>=1"),
        (["--max-tokens", -5], "Invalid value for '--max-tokens': -5 is not in the range x>=1"),
        (["--backend", "http://127.0.0.1:8000/v1"],
         "Invalid value for '--backend': 'http://127.0.0.1:8000/v1' has a path; give the server's root, "
         "http://127.0.0.1:8000"),
        (["--backend", "127.0.0.1:8000"], "'127.0.0.1:8000' is not an http(s) URL; give the server's root"),
        (["--backend", "http://127.0.0.1:99999"], "give the server's root"),
        (["--server", "http://127.0.0.1:8090/tasks"], "Invalid value for '--server': 'http://127.0.0.1:8090/tasks' "
                                                     "has a path"),
        (["--samples", 0], "Invalid value for '--samples': 0 is not in the range 1<=x<=1024"),
    ]
    for extra, message in cases:
        _fails(_invoke(polar_train, *base, *extra), message, code=2)
    assert not (tmp_path / "run").exists()


def test_bad_options_of_the_polar_mitm_commands_are_usage_errors(tmp_path):
    tasks = _write(tmp_path / "tasks.jsonl", _task())
    busy = socket.create_server(("127.0.0.1", 0))
    used = busy.getsockname()[1]
    db = tmp_path / "r.duckdb"
    try:
        cases = [
            (["rollout", tasks, "--workers", 0], "Invalid value for '--workers': 0 is not in the range x>=1"),
            (["rollout", tasks, "--max-tokens", -5], "Invalid value for '--max-tokens': -5 is not in the range"),
            (["rollout", tasks, "--backend", "http://127.0.0.1:8000/v1"], "has a path; give the server's root, "
                                                                          "http://127.0.0.1:8000"),
            (["rollout", tasks, "--port", 70000], "Invalid value for '--port': 70000 is not in the range 0<=x<=65535"),
            (["rollout", tasks, "--db", db, "--port", used], f"Invalid value for '--port': port {used} on 127.0.0.1 "
                                                             "is in use"),
            (["rollout", tasks, "--db", tmp_path], f"Invalid value for '--db': {tmp_path} is a directory"),
            (["rollout", tasks, "--db", db, "--model", tmp_path / "gone"],
             f"Invalid value for '--model': {tmp_path / 'gone'} does not exist"),
            (["node", "--server", "http://127.0.0.1:1", "--backend", "http://127.0.0.1:2", "--workers", 0],
             "Invalid value for '--workers': 0 is not in the range x>=1"),
            (["node", "--server", "http://127.0.0.1:1", "--backend", "http://127.0.0.1:2/v1"],
             "Invalid value for '--backend'"),
            (["node", "--server", "http://127.0.0.1:1", "--backend", "http://127.0.0.1:2", "--max-tokens", -5],
             "Invalid value for '--max-tokens': -5 is not in the range x>=0"),
            (["node", "--server", "http://127.0.0.1:1", "--backend", "http://127.0.0.1:2", "--db", db,
              "--proxy-port", used], f"Invalid value for '--proxy-port': port {used} on 127.0.0.1 is in use"),
            (["node", "--server", "http://127.0.0.1:1", "--backend", "http://127.0.0.1:2", "--db", tmp_path],
             "is a directory"),
            (["rollout-server", "--db", db, "--port", used], f"port {used} on 127.0.0.1 is in use"),
            (["rollout-server", "--db", db, "--port", -1], "Invalid value for '--port': -1 is not in the range"),
            (["rollout-server", "--db", tmp_path], "is a directory"),
            (["up", "--db", db, "--port", 0], "Invalid value for '--port': 0 is not in the range 1<=x<=65535"),
            (["up", "--db", db, "--port", used, "--backend", "http://127.0.0.1:2"], f"port {used} on 127.0.0.1 is in use"),
            (["up", "--db", db, "--port", launch_free(), "--reverse-port", used, "--backend", "http://127.0.0.1:2"],
             f"Invalid value for '--reverse-port': port {used} on 127.0.0.1 is in use"),
            (["up", "--db", tmp_path], "is a directory"),
            (["up", "--db", db, "--backend", "http://127.0.0.1:2/v1"], "has a path"),
            (["demo", "--backend", "http://127.0.0.1:2/v1"], "has a path"),
            (["demo", "--max-tokens", -5], "Invalid value for '--max-tokens'"),
            (["demo", "--sdk", "--db", tmp_path], "is a directory"),
        ]
        for args, message in cases:
            _fails(_invoke(polar_mitm, *args), message, code=2)
    finally:
        busy.close()
    assert not db.exists()


def launch_free() -> int:
    from polar_mitm.stack import launch
    return launch.free_port()


# -- the loop's checks before it starts ----------------------------------------------------------
def test_the_loop_checks_workspaces_and_model_before_it_starts_or_syncs(tmp_path):
    """Nothing starts, and a shared --backend is never synced to a bad path."""
    model = _model(tmp_path / "model")
    (tmp_path / "empty").mkdir()
    (tmp_path / "noweights").mkdir()
    (tmp_path / "noweights" / "config.json").write_text("{}")
    ok = _write(tmp_path / "ok.jsonl", _task())
    gone = _write(tmp_path / "gone.jsonl", _task("t", workspace=str(tmp_path / "gone")))
    with FakeVLLM() as fake:
        cases = [
            (gone, model, f"t: workspace {tmp_path / 'gone'} does not exist"),
            (ok, tmp_path / "nomodel", f"--model: {tmp_path / 'nomodel'} does not exist"),
            (ok, tmp_path / "empty", f"--model: {tmp_path / 'empty'} is not a Hugging Face model directory: "
                                     "it has no config.json"),
            (ok, tmp_path / "noweights", "has no weights (no *.safetensors nor *.bin file)"),
            (ok, ok, "is not a directory"),
        ]
        for tasks, m, message in cases:
            _fails(_invoke(polar_train, "loop", "--tasks", tasks, "--iterations", 1, "--out", tmp_path / "run",
                           "--backend", fake.url, "--model", m), message)
        assert fake.control == [] and fake.reloads == []     # never synced
    assert not (tmp_path / "run" / "rollouts.duckdb").exists()


def test_a_task_changed_on_resume_is_an_error_that_names_it(tmp_path):
    """The run's journal holds each task as this run submitted it (TASK@RUN.I): a rerun with
    another spec stops before anything starts, naming the task and the change."""
    out = tmp_path / "run"
    out.mkdir()
    LoopState(run_id="abc123", completed=1).save(out)
    server = RolloutServer(str(out / "rollouts.duckdb"), check_workspaces=False).start()
    try:
        for it in (0, 1):
            server.submit(parse_task(_task(f"a@abc123.{it}", num_samples=2)))
            server.submit(parse_task(_task(f"b@abc123.{it}", num_samples=2)))
            server.submit(parse_task(_task(f"h@abc123.{it}.eval", num_samples=2)))
        server.submit(parse_task(_task("a@other1.0", num_samples=5)))   # another run's: not compared
    finally:
        server.stop()
    tasks = _write(tmp_path / "tasks.jsonl", _task("a", num_samples=2), _task("b", num_samples=3, command="false"))
    held = _write(tmp_path / "held.jsonl", _task("h", num_samples=2, evaluator="echo 1"))
    with FakeVLLM() as fake:
        r = _invoke(polar_train, "loop", "--tasks", tasks, "--eval-tasks", held, "--iterations", 3, "--out", out,
                    "--backend", fake.url, "--model", _model(tmp_path / "model"))
        _fails(r, "tasks changed since this run started: b: num_samples 2 -> 3; command 'true' -> 'false' | "
                  "h (held out): evaluator None -> {'command': 'echo 1', 'timeout': 120.0}; a run's tasks are fixed: "
                  f"put {tasks} back as it was, or start a new run with another --out than {out}")
        assert fake.control == []


def test_a_finished_loop_starts_nothing_and_leaves_the_backend_alone(tmp_path):
    out = tmp_path / "run"
    out.mkdir()
    LoopState(run_id="abc123", completed=2, version=2, checkpoint=str(out / "checkpoints" / "v2")).save(out)
    tasks = _write(tmp_path / "tasks.jsonl", _task())
    with FakeVLLM() as fake:
        r = _invoke(polar_train, "loop", "--tasks", tasks, "--iterations", 2, "--out", out, "--backend", fake.url)
        assert r.exit_code == 0, r.output
        assert f"{out}: 2 iterations done already (--iterations 2); nothing to run" in r.output
        assert "iter ver  reward" in r.output     # the table
        assert fake.control == [] and fake.reloads == [] and fake.bodies == []
    assert not (out / "work").exists()


def test_a_full_disk_is_one_line(tmp_path, monkeypatch):
    def full(self, out):
        raise OSError(errno.ENOSPC, "No space left on device", str(out / "loop.json.tmp"))

    monkeypatch.setattr(LoopState, "save", full)
    tasks = _write(tmp_path / "tasks.jsonl", _task())
    r = _invoke(polar_train, "loop", "--tasks", tasks, "--iterations", 1, "--out", tmp_path / "run",
                "--backend", "http://127.0.0.1:9", "--model", _model(tmp_path / "model"))
    _fails(r, f"Error: no space left on the device of {tmp_path / 'run' / 'loop.json.tmp'} ([Errno 28] No space "
              "left on device: ")
    assert "free some space and rerun the same command to resume" in r.output
    assert len(r.output.strip().splitlines()) == 1
    # what the libraries raise on a full disk: DuckDB's and safetensors' messages, torch's failed write
    assert disk_full(RuntimeError('IO Error: Could not write file "x.wal": No space left on device'), tmp_path)
    assert disk_full(OSError(errno.EDQUOT, "Disk quota exceeded"), tmp_path)
    assert not disk_full(RuntimeError("file write failed"), tmp_path)   # with space left: not the disk
    assert not disk_full(ValueError("bad"), tmp_path)


# -- checkpoints on disk --------------------------------------------------------------------------
def test_loop_json_lists_the_checkpoints_on_disk_after_pruning(tmp_path):
    out = tmp_path / "run"
    for v in (1, 2, 3, 4):
        (out / "checkpoints" / f"v{v}").mkdir(parents=True)
    (out / "trainer").mkdir()
    for v in (3, 4):
        (out / "trainer" / f"v{v}.pt").write_bytes(b"")
    ckpts = [str(out / "checkpoints" / f"v{v}") for v in (2, 3, 4)]   # v1: a kill -9 after its state save
    state = LoopState(run_id="r", completed=4, version=4, checkpoint=ckpts[-1], checkpoints=list(ckpts),
                      trainer_state=str(out / "trainer" / "v4.pt"))
    prune(state, 2, out)
    on_disk = sorted(str(p) for p in (out / "checkpoints").iterdir())
    assert state.checkpoints == on_disk == ckpts[1:]
    assert LoopState.load(out).checkpoints == on_disk      # saved: loop.json says what is there
    assert [p.name for p in (out / "trainer").iterdir()] == ["v4.pt"]


# -- no calls, no signal ------------------------------------------------------------------------
def _s(sid, state="done", reward=None, reason=None, **stats):
    return {"session_id": sid, "state": state, "reward": reward, "reason": reason, "node_id": "n",
            "stats": stats or None}


def _g(tid, *sessions):
    return {"task_id": tid, "state": "done", "metadata": {}, "sessions": list(sessions), "attempts": []}


def test_an_iteration_without_calls_names_the_cause_and_shows_an_output():
    sessions = [_s("a~0", reward=0.0, calls=0, eval_output="0\n"),
                _s("a~1", "failed", 0.0, "harness exited with code 5", calls=0,
                   harness_output="curl: (5) Could not resolve proxy: x\n", eval_output="")]
    msg = no_calls_error(1, sessions, {"command"})
    first, *rest = msg.splitlines()
    assert first == ("iteration 2: no session made a model call (2 sessions, 0 calls), so the loop cannot learn: "
                     "the harness could not reach the gateway's proxy (or the model), or it failed before its first "
                     "call; for the command harness, check that its HTTP client uses $HTTPS_PROXY (and trusts the "
                     "CA in $SSL_CERT_FILE)")
    assert rest == ["a~1 failed (harness exited with code 5); its harness's output, last lines:",
                    "  | curl: (5) Could not resolve proxy: x"]
    # without the harness's output: the evaluator's, else the session's reason
    msg = no_calls_error(0, [_s("a~0", reward=0.0, eval_output="no file\n")], {"pi"})
    assert "HTTPS_PROXY" not in msg and msg.endswith("a~0 done; its evaluator's output, last lines:\n  | no file")
    msg = no_calls_error(0, [_s("a~0", "failed", 0.0, "harness exited with code 2: boom")], {"pi"})
    assert msg.endswith("a~0 failed; its reason, last lines:\n  | harness exited with code 2: boom")


def test_an_iteration_without_learning_signal_says_which_case():
    assert no_signal_reason({"a": _g("a", _s("a~0", "failed", 0.0, "harness exited with code 3: crash"),
                                      _s("a~1", "timed_out", 0.0, "harness timed out after 5s"))}) == (
        "every session failed (1 failed, 1 timed_out); a~0: harness exited with code 3: crash")
    assert no_signal_reason({"a": _g("a", _s("a~0", reward=1.0), _s("a~1", reward=1.0)),
                              "b": _g("b", _s("b~0", reward=0.0), _s("b~1", reward=0.0))}) == (
        "every group's rewards are equal (rewards 0, 1 in 2 groups): GRPO's advantage is zero; tasks that the "
        "policy sometimes solves (or more samples) give it a signal")
    assert "no session has a reward" in no_signal_reason({"a": _g("a", _s("a~0"), _s("a~1"))})
    assert "no group has two rewarded sessions" in no_signal_reason({"a": _g("a", _s("a~0", reward=1.0))})
    assert no_signal_reason({"a": _g("a", _s("a~0", reward=1.0), _s("a~1", reward=1.0)),
                              "b": _g("b", _s("b~0", reward=0.0), _s("b~1", reward=1.0))}) is None


# -- callbacks ------------------------------------------------------------------------------------
def test_rollout_says_which_callbacks_it_waits_for(tmp_path):
    dead = f"http://127.0.0.1:{launch_free()}/groups"
    server = RolloutServer(str(tmp_path / "r.duckdb"), callback_tries=3, callback_backoff=0.5,
                           callback_timeout=2.0).start()
    try:
        server.submit(_task("a", callback_url=dead))
        assert callback_line(server, ["a"]) is None      # not settled: nothing to say yet
        got = server.heartbeat({"node_id": "n", "load": {"free": 1}, "active": [], "events": []})
        server.heartbeat({"node_id": "n", "load": {"free": 0}, "active": [], "events": [
            {"session_id": a["session_id"], "state": "done", "reward": 1.0} for a in got["assign"]]})
        seen: list[str] = []

        def second_try_failed() -> bool:
            line = callback_line(server, ["a"])
            if line:
                seen.append(line)
            return bool(line) and "try 2 of 3 failed" in line

        assert until(second_try_failed, 10), seen
        line = seen[-1]
        assert line.startswith(f"waiting for 1 callback(s) to {dead}: try 2 of 3 failed (")
        assert ", next in " in line and "; gives up within 3s" in line   # one more try, of 2 s at most
        assert server.wait(["a"], timeout=10)
        assert callback_line(server, ["a"]) is None
    finally:
        server.stop()


# -- the loop against stand-ins: no calls, no signal, Ctrl-C and SIGTERM ------------------------------
class _Loop:
    """`polar-train loop` with a tiny model and a vLLM stand-in, as a child process."""

    def __init__(self, tmp_path: Path, fake: FakeVLLM, command: str, evaluator: str, iterations: int = 1):
        from support.grpo_data import tiny_model_dir
        self.out = tmp_path / "run"
        tasks = _write(tmp_path / "tasks.jsonl", *[{**_task(t, command=command, evaluator=evaluator), "timeout": 60}
                                                   for t in ("a", "b")])
        model = tmp_path / "model"
        if not model.exists():
            tiny_model_dir(model)
        self.argv = [TRAIN, "loop", "--tasks", str(tasks), "--iterations", str(iterations), "--out", str(self.out),
                     "--samples", "2", "--backend", fake.url, "--model", str(model), "--lr", "1e-3",
                     "--token-budget", "256", "--workers", "2", "--max-tokens", "8"]

    def run(self, timeout: float = 300) -> subprocess.CompletedProcess:
        return subprocess.run(self.argv, capture_output=True, text=True, timeout=timeout)


def test_an_iteration_without_model_calls_stops_the_loop(tmp_path):
    """The harness never reaches the proxy (here: it crashes first): the loop stops with the
    likely cause and the output of one session, and stops what it started."""
    with FakeVLLM() as fake:
        loop = _Loop(tmp_path, fake, f"{FAKE} crash 0", "echo $POLAR_SAMPLE", iterations=3)
        r = loop.run()
    assert r.returncode == 1, r.stdout + r.stderr
    assert ("Error: iteration 1: no session made a model call (4 sessions, 0 calls), so the loop cannot learn: "
            "the harness could not reach the gateway's proxy") in r.stderr
    assert "check that its HTTP client uses $HTTPS_PROXY" in r.stderr
    assert "fake harness crashed" in r.stderr and "Traceback" not in r.stderr
    assert "polar-train reward" not in r.stdout + r.stderr
    assert json.loads((loop.out / "loop.json").read_text())["completed"] == 0
    assert until(lambda: not alive(str(loop.out)), 30), alive(str(loop.out))


def test_an_iteration_with_equal_rewards_says_so_and_goes_on(tmp_path):
    """A warning each iteration, and the loop goes on; a resume with the same task file is no
    changed task (the journal's specs, through HTTP, equal the file's)."""
    with FakeVLLM() as fake:
        loop = _Loop(tmp_path, fake, f"{FAKE} ok 1", "echo 1", iterations=1)
        first = loop.run()
        assert first.returncode == 0, first.stdout + first.stderr
        loop.argv[loop.argv.index("--iterations") + 1] = "2"
        second = loop.run()
    assert second.returncode == 0, second.stdout + second.stderr
    for it, r in ((1, first), (2, second)):
        assert (f"iteration {it}: nothing trained, no learning signal: every group's rewards are equal (rewards 1 "
                "in 2 groups): GRPO's advantage is zero") in r.stdout, r.stdout
        assert "polar-train reward" not in r.stdout + r.stderr
    assert json.loads((loop.out / "loop.json").read_text())["completed"] == 2


@pytest.mark.parametrize("sig,code,said", [(signal.SIGINT, 130, "Ctrl-C"), (signal.SIGTERM, 143, "SIGTERM")])
def test_the_loop_exits_130_on_ctrl_c_and_143_on_sigterm(tmp_path, sig, code, said):
    mark = token()
    with FakeVLLM() as fake:
        loop = _Loop(tmp_path, fake, f"{FAKE} slow:{mark} 1", "echo $POLAR_SAMPLE")
        p = subprocess.Popen(loop.argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                             start_new_session=True)
        try:
            assert until(lambda: alive(mark) or p.poll() is not None, 120), "no harness started"
            assert p.poll() is None
            p.send_signal(sig)
            stdout, stderr = p.communicate(timeout=60)
        finally:
            if p.poll() is None:
                p.kill()
    assert p.returncode == code, stdout + stderr
    assert (f"interrupted ({said}): the loop stopped; rerun the same command to resume from {loop.out}"
            in stderr.splitlines()), stderr
    assert "Aborted!" not in stderr and "Traceback" not in stderr
    # what it started stopped with it: vLLM stand-in aside, the proxy, the node and its harnesses
    assert until(lambda: not alive(str(loop.out)) and not alive(mark), 30), (alive(str(loop.out)), alive(mark))
